// What both fuzz drivers (message_fuzz_driver.cpp, lending_fuzz_driver.cpp)
// read from the file system: the descriptors this process holds (nothing may
// leak across the inputs), an input file's bytes, and the corpus files named
// on the command line (folders and files).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "core/descriptor_closer.h"

namespace shoal::fuzz {

// Counted once the closer thread has closed what it was handed (a peer's
// descriptors close there).
inline std::size_t open_fds() {
  (void)shoal::detail::off_thread_closes_done_within(std::chrono::seconds(30));
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

inline std::vector<std::uint8_t> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The files of argv[first..argc): each folder's entries, or the file itself.
inline std::vector<std::filesystem::path> corpus_files(int argc, char** argv, int first) {
  std::vector<std::filesystem::path> files;
  for (int i = first; i < argc; ++i) {
    if (std::filesystem::is_directory(argv[i])) {
      for (const auto& e : std::filesystem::directory_iterator(argv[i])) files.push_back(e.path());
    } else {
      files.emplace_back(argv[i]);
    }
  }
  return files;
}

}  // namespace shoal::fuzz
