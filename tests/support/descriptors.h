// Descriptor helpers shared by the tests: a connected socket pair, and how
// many descriptors this process has open (to prove none leaked) once the
// closer thread has closed what it was handed.
#pragma once

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
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

/// Lowers this process's soft descriptor limit to at most `most` while it
/// lives (the closer's limits follow it), and puts it back after.
class lowered_descriptor_limit {
 public:
  explicit lowered_descriptor_limit(rlim_t most) {
    EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &saved_), 0);
    rlimit low = saved_;
    low.rlim_cur = std::min(saved_.rlim_cur, most);
    EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  }
  ~lowered_descriptor_limit() { EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &saved_), 0); }
  lowered_descriptor_limit(const lowered_descriptor_limit&) = delete;
  lowered_descriptor_limit& operator=(const lowered_descriptor_limit&) = delete;

 private:
  rlimit saved_{};
};

/// Waits until every close handed to the closer thread so far is done (a
/// peer's descriptors close there); a test failure after 30 s.
void wait_for_the_closer();

/// Descriptors open in this process, counted after wait_for_the_closer().
std::size_t open_descriptor_count();

}  // namespace shoal::testing
