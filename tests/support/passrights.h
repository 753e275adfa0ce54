// SO_PASSRIGHTS (Linux 6.16 on): whether this kernel can refuse descriptors
// at the sender, for tests whose outcome depends on it. No gtest here: the
// fuzz drivers use it too.
#pragma once

#include <sys/socket.h>

#include "core/scm_rights.h"
#include "shoal/core/unique_fd.h"

namespace shoal::testing {

using shoal::detail::so_passrights;

/// Whether this kernel has SO_PASSRIGHTS.
inline bool kernel_refuses_descriptors() {
  const unique_fd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int value = 0;
  socklen_t length = sizeof value;
  return ::getsockopt(probe.get(), SOL_SOCKET, so_passrights, &value, &length) == 0;
}

}  // namespace shoal::testing
