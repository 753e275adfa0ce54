// Descriptor helpers shared by the tests: a connected socket pair, and how
// many descriptors this process has open (to prove none leaked).
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstddef>
#include <filesystem>

#include "shoal/core/unique_fd.h"

namespace shoal::testing {

struct socket_pair {
  socket_pair() {
    int ends[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends), 0);
    a.reset(ends[0]);
    b.reset(ends[1]);
  }
  unique_fd a, b;
};

inline std::size_t open_descriptor_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

}  // namespace shoal::testing
