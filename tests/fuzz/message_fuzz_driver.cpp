// Runs the message fuzz target on seeded random inputs, built from valid
// frame headers with random payloads, and checks no descriptor leaks.
// Prints a GoogleTest-style summary so a run that did nothing shows.
//   shoal_message_fuzz_driver [inputs]
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const int inputs = argc > 1 ? std::atoi(argv[1]) : 3000;
  std::mt19937 rng(20261122);
  LLVMFuzzerTestOneInput(nullptr, 0);  // the receiver's world opens its own descriptors once
  const std::size_t before = open_fds();
  for (int i = 0; i < inputs; ++i) {
    std::vector<std::uint8_t> input;
    const int frames = 1 + static_cast<int>(rng() % 6);
    for (int f = 0; f < frames; ++f) {
      const std::size_t length = rng() % 160;
      input.push_back(static_cast<std::uint8_t>(rng() % 10));
      input.push_back(static_cast<std::uint8_t>(rng() % 2));
      input.push_back(static_cast<std::uint8_t>(length));
      input.push_back(0);
      // Mostly small numbers: ids, counts and flags that pass the first checks.
      for (std::size_t b = 0; b < length; ++b) input.push_back(static_cast<std::uint8_t>(rng() % 4 == 0 ? rng() : rng() % 3));
    }
    LLVMFuzzerTestOneInput(input.data(), input.size());
  }
  const std::size_t after = open_fds();
  const bool ok = after == before;
  std::printf("[==========] %d fuzz inputs ran.\n[  %s  ] descriptors before %zu, after %zu\n", inputs,
              ok ? "PASSED" : "FAILED", before, after);
  return ok ? 0 : 1;
}
