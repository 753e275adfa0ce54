// Descriptors whose last close waits as long as their maker likes, as a
// hostile peer would pass them: a TCP socket set to linger with data its
// peer never reads, and a unix socket whose own queue holds the last
// reference to one (closing it closes that one too, whatever was done to
// its own options first).
#pragma once

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "support/descriptors.h"
#include "support/fd_transport.h"
#include "shoal/core/unique_fd.h"

namespace shoal::testing {

// A TCP socket (`client`) whose close lingers `seconds`: its peer (`server`,
// never read, kept open) advertises no room and data waits in its send buffer.
struct lingering_socket {
  unique_fd listening, server, client;
  explicit lingering_socket(int seconds) {
    listening.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof at;
    const int small = 4096;
    EXPECT_EQ(::setsockopt(listening.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
    EXPECT_EQ(::bind(listening.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    EXPECT_EQ(::listen(listening.get(), 1), 0);
    EXPECT_EQ(::getsockname(listening.get(), reinterpret_cast<sockaddr*>(&at), &length), 0);
    client.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    EXPECT_EQ(::setsockopt(client.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
    EXPECT_EQ(::connect(client.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    server.reset(::accept4(listening.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ::fcntl(client.get(), F_SETFL, O_NONBLOCK);
    const std::vector<char> junk(4096);
    while (::send(client.get(), junk.data(), junk.size(), MSG_NOSIGNAL) > 0) {
    }
    const linger on{1, seconds};
    EXPECT_EQ(::setsockopt(client.get(), SOL_SOCKET, SO_LINGER, &on, sizeof on), 0);
  }
};

// `holder`: a unix socket whose receive queue holds the last reference to a
// socket lingering `seconds`. Turning off the holder's own linger changes
// nothing: its close waits out the inner one's.
struct socket_holding_a_lingering_one {
  lingering_socket inner;
  socket_pair pair;
  unique_fd& holder = pair.b;
  explicit socket_holding_a_lingering_one(int seconds) : inner(seconds) {
    const std::byte one{1};
    send_message(pair.a.get(), std::span(&one, 1), inner.client.get());
    inner.client.reset();  // the message in holder's queue holds the last reference now
  }
};

/// `count` closes of `owner`'s (a peer's uid, with no other descriptor
/// waiting: at most max_closes_per_owner) handed to the closer and begun,
/// each held `seconds` by a lingering socket; what holds them lives as long
/// as the returned sockets.
inline std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held_closes(std::uint32_t owner,
                                                                                 std::size_t count, int seconds) {
  using namespace std::chrono_literals;
  std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held;
  for (std::size_t i = 0; i < count; ++i) held.push_back(std::make_unique<socket_holding_a_lingering_one>(seconds));
  // Made first, handed after: the owner's queue starts its clock at the first
  // hand-over, and a slow build must not spend its 100 ms making sockets.
  std::vector<int> numbers;
  for (auto& h : held) {
    numbers.push_back(h->holder.get());
    unique_fd::from_peer(h->holder.release(), owner).reset();
  }
  // A descriptor leaves the table when its close begins: until then it
  // still counts as waiting (a closer thread may not have started yet).
  const auto until = std::chrono::steady_clock::now() + 5s;
  for (const int fd : numbers) {
    while (::fcntl(fd, F_GETFD) != -1 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
    EXPECT_EQ(::fcntl(fd, F_GETFD), -1) << "a held close did not begin within 5 s";
  }
  return held;
}

/// Runs `drop`, which drops the last reference to a lingering close (its
/// own EXPECTs say what it should raise), and checks that it returned within
/// 1 s, `waited` otherwise, while the close itself, on the closer threads,
/// took the linger's time (or the test would show nothing).
template <class Drop>
void expect_returns_while_the_close_lingers(Drop drop, const char* waited) {
  using namespace std::chrono_literals;
  const auto start = std::chrono::steady_clock::now();
  drop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << waited;
  wait_for_the_closer();
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms) << "the close did not linger: this test shows nothing";
}

}  // namespace shoal::testing
