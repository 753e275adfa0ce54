// Runs the lending fuzz target without libFuzzer, in every build: the seeds
// (each must end as it says), every file of the corpus folders given, and
// seeded random inputs (seeds with bytes changed, and random bytes); then
// checks that no descriptor leaked. Prints a GoogleTest-style summary so a
// run that did nothing shows.
//   shoal_lending_fuzz_driver [random inputs] [corpus folder or file]...
//   shoal_lending_fuzz_driver --write-corpus FOLDER   (writes the seeds)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fuzz/driver_files.h"
#include "fuzz/lending_seeds.h"
#include "fuzz/lending_target.h"

namespace {

namespace fs = std::filesystem;
using shoal::fuzz::lending_seed;

using shoal::fuzz::open_fds;
using shoal::fuzz::read_file;

int write_corpus(const fs::path &folder) {
  fs::create_directories(folder);
  const auto seeds = shoal::fuzz::lending_seeds();
  for (const lending_seed &s : seeds) {
    std::ofstream out(folder / s.name, std::ios::binary);
    out.write(reinterpret_cast<const char *>(s.bytes.data()), static_cast<std::streamsize>(s.bytes.size()));
  }
  std::printf("wrote %zu lending seeds to %s\n", seeds.size(), folder.c_str());
  return 0;
}

// A seed with a few bytes changed, cut or extended, or random bytes.
std::vector<std::uint8_t> random_input(std::mt19937 &rng, const std::vector<lending_seed> &seeds) {
  std::vector<std::uint8_t> input;
  if (rng() % 2 == 0) {
    input = seeds[rng() % seeds.size()].bytes;
    const int changes = 1 + static_cast<int>(rng() % 4);
    for (int c = 0; c < changes && input.size() > 1; ++c)
      input[1 + rng() % (input.size() - 1)] = static_cast<std::uint8_t>(rng() % 4 == 0 ? rng() : rng() % 12);
    if (rng() % 4 == 0) input.resize(1 + rng() % input.size());
    if (rng() % 4 == 0) input.push_back(static_cast<std::uint8_t>(rng()));
  } else {
    input.resize(1 + rng() % 200);
    for (auto &b : input) b = static_cast<std::uint8_t>(rng() % 3 == 0 ? rng() : rng() % 12);
  }
  return input;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc == 3 && std::strcmp(argv[1], "--write-corpus") == 0) return write_corpus(argv[2]);
  const int random_inputs = argc > 1 ? std::atoi(argv[1]) : 1000;
  const std::vector<lending_seed> seeds = shoal::fuzz::lending_seeds();
  // The first run of each side opens what lives as long as the process (the host device's threads).
  for (const lending_seed &s : seeds) (void)shoal::fuzz::run_lending_input(s.bytes);
  const std::size_t before = open_fds();

  int failed = 0;
  std::size_t regions = 0, runs = 0;
  for (const lending_seed &s : seeds) {
    const auto got = shoal::fuzz::run_lending_input(s.bytes);
    if (got.regions != s.regions || got.end.find(s.end) == std::string::npos) {
      std::printf("[  FAILED  ] seed %s: %zu regions, ended \"%s\"; expected %zu, \"%s\"\n", s.name.c_str(),
                  got.regions, got.end.c_str(), s.regions, s.end.c_str());
      ++failed;
    }
    regions += got.regions;
    ++runs;
  }
  std::size_t corpus_files = 0;
  for (const auto &f : shoal::fuzz::corpus_files(argc, argv, 2)) {
    regions += shoal::fuzz::run_lending_input(read_file(f)).regions;
    ++corpus_files;
    ++runs;
  }
  std::mt19937 rng(20261124);
  for (int i = 0; i < random_inputs; ++i) {
    regions += shoal::fuzz::run_lending_input(random_input(rng, seeds)).regions;
    ++runs;
  }

  const std::size_t after = open_fds();
  if (after != before) {
    std::printf("[  FAILED  ] descriptors before %zu, after %zu\n", before, after);
    ++failed;
  }
  std::printf("[==========] %zu lending fuzz inputs ran (%zu seeds, %zu corpus files, %d random); %zu regions lent, "
              "decoded or borrowed.\n",
              runs, seeds.size(), corpus_files, random_inputs, regions);
  std::printf("[  %s  ]\n", failed == 0 ? "PASSED" : "FAILED");
  return failed == 0 ? 0 : 1;
}
