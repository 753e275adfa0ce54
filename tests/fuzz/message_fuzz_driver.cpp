// Runs the message fuzz target without libFuzzer, in every build: the seed
// programs (each must end as it says), every file of the corpus folders
// given, and seeded random inputs (seeds with bytes changed, and random
// bytes); then checks that no descriptor leaked. Prints a GoogleTest-style
// summary so a run that did nothing shows.
//   shoal_message_fuzz_driver [random inputs] [corpus folder or file]...
//   shoal_message_fuzz_driver --write-corpus FOLDER   (writes the seeds)
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
#include "fuzz/receive_program.h"
#include "fuzz/seed_programs.h"

namespace {

namespace fs = std::filesystem;
using shoal::fuzz::seed_program;

using shoal::fuzz::open_fds;
using shoal::fuzz::read_file;

int write_corpus(const fs::path &folder) {
  fs::create_directories(folder);
  for (const seed_program &s : shoal::fuzz::seed_programs()) {
    std::ofstream out(folder / s.name, std::ios::binary);
    out.write(reinterpret_cast<const char *>(s.bytes.data()), static_cast<std::streamsize>(s.bytes.size()));
  }
  std::printf("wrote %zu seed programs to %s\n", shoal::fuzz::seed_programs().size(), folder.c_str());
  return 0;
}

// A seed with a few bytes changed, cut or extended, or random bytes.
std::vector<std::uint8_t> random_input(std::mt19937 &rng, const std::vector<seed_program> &seeds) {
  std::vector<std::uint8_t> input;
  if (rng() % 2 == 0) {
    input = seeds[rng() % seeds.size()].bytes;
    if (input.size() > 4096) input.resize(4096);
    const int changes = 1 + static_cast<int>(rng() % 4);
    for (int c = 0; c < changes && !input.empty(); ++c)
      input[rng() % input.size()] = static_cast<std::uint8_t>(rng() % 8 == 0 ? rng() : rng() % 6);
    if (rng() % 4 == 0) input.resize(rng() % (input.size() + 1));
    if (rng() % 4 == 0) input.push_back(static_cast<std::uint8_t>(rng()));
  } else {
    input.resize(rng() % 400);
    for (auto &b : input) b = static_cast<std::uint8_t>(rng() % 3 == 0 ? rng() : rng() % 12);
  }
  return input;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc == 3 && std::strcmp(argv[1], "--write-corpus") == 0) return write_corpus(argv[2]);
  const int random_inputs = argc > 1 ? std::atoi(argv[1]) : 2000;
  const std::vector<seed_program> seeds = shoal::fuzz::seed_programs();
  (void)shoal::fuzz::receive_program({});  // the receiver's world opens its own descriptors once
  const std::size_t before = open_fds();

  int failed = 0;
  std::size_t storages = 0, runs = 0;
  for (const seed_program &s : seeds) {
    const auto got = shoal::fuzz::receive_program(s.bytes);
    const bool ok = got.storages == s.storages && got.notes == s.notes && got.end.find(s.end) != std::string::npos;
    if (!ok) {
      std::printf(
          "[  FAILED  ] seed %s: %zu storages, %zu notes, ended "
          "\"%s\"; expected %zu, %zu, \"%s\"\n",
          s.name.c_str(), got.storages, got.notes, got.end.c_str(), s.storages, s.notes, s.end.c_str());
      ++failed;
    }
    storages += got.storages;
    ++runs;
  }
  std::size_t corpus_files = 0;
  for (const auto &f : shoal::fuzz::corpus_files(argc, argv, 2)) {
    storages += shoal::fuzz::receive_program(read_file(f)).storages;
    ++corpus_files;
    ++runs;
  }
  std::mt19937 rng(20261123);
  for (int i = 0; i < random_inputs; ++i) {
    storages += shoal::fuzz::receive_program(random_input(rng, seeds)).storages;
    ++runs;
  }

  const std::size_t after = open_fds();
  if (after != before) {
    std::printf("[  FAILED  ] descriptors before %zu, after %zu\n", before, after);
    ++failed;
  }
  std::printf(
      "[==========] %zu fuzz inputs ran (%zu seeds, %zu corpus files, "
      "%d random); %zu storages built and touched.\n",
      runs, seeds.size(), corpus_files, random_inputs, storages);
  std::printf("[  %s  ]\n", failed == 0 ? "PASSED" : "FAILED");
  return failed == 0 ? 0 : 1;
}
