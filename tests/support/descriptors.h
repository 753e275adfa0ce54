// Descriptor helpers shared by the tests: a connected socket pair, and how
// many descriptors this process has open (to prove none leaked) once the
// closer thread has closed what it was handed.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstddef>

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

/// Waits until every close handed to the closer thread so far is done (a
/// peer's descriptors close there); a test failure after 30 s.
void wait_for_the_closer();

/// Descriptors open in this process, counted after wait_for_the_closer().
std::size_t open_descriptor_count();

}  // namespace shoal::testing
