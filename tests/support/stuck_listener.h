// A server that stopped accepting: a UNIX listening socket whose backlog one
// connection already fills, so the next connect waits for room.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <string>

#include "shoal/core/unique_fd.h"

namespace shoal::testing {

class stuck_listener {
 public:
  explicit stuck_listener(const std::string& path) {
    sockaddr_un at{};
    at.sun_family = AF_UNIX;
    path.copy(at.sun_path, sizeof at.sun_path - 1);
    EXPECT_EQ(::bind(server_.get(), reinterpret_cast<const sockaddr*>(&at), sizeof at), 0);
    EXPECT_EQ(::listen(server_.get(), 0), 0);
    EXPECT_EQ(::connect(filler_.get(), reinterpret_cast<const sockaddr*>(&at), sizeof at), 0);
  }
  /// Accepts one connection: room for a connect still waiting (a test
  /// failing), so that it ends.
  void make_room() const { ::close(::accept(server_.get(), nullptr, nullptr)); }

 private:
  unique_fd server_{::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  unique_fd filler_{::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
};

}  // namespace shoal::testing
