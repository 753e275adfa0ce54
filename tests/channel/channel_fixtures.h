// What the channel tests share: payload text, fresh addresses, raw sockets
// and batches built without the library (so the tests pin the wire format),
// and the bodies of forked peers.
//
// Child bodies run only async-signal-safe calls (socket, connect, read,
// write, setresuid, _exit); exit statuses name the step that failed.
#pragma once

#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/channel/channel.h"
#include "shoal/core/unique_fd.h"
#include "support/descriptors.h"
#include "support/passrights.h"
#include "support/processes.h"

namespace shoal::testing {

inline constexpr uid_t nobody = 65534;

inline std::vector<std::byte> bytes_of(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

inline std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

/// An abstract address no other test in this process uses.
inline channel::channel_address fresh_abstract_name() {
  static std::atomic<int> counter{0};
  return channel::channel_address::abstract("shoal-channel-test-" + std::to_string(::getpid()) + "-" +
                                            std::to_string(counter++));
}

// Built independently of the library, so the tests pin the address format.
struct raw_address {
  sockaddr_un address{};
  socklen_t length = 0;
};

inline raw_address raw_address_of(const channel::channel_address& where) {
  raw_address out;
  out.address.sun_family = AF_UNIX;
  const std::size_t skip = where.is_abstract() ? 1 : 0;
  std::memcpy(out.address.sun_path + skip, where.name().data(), where.name().size());
  out.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + where.name().size());
  return out;
}

inline unique_fd raw_connect(const channel::channel_address& where) {
  unique_fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const raw_address target = raw_address_of(where);
  EXPECT_EQ(::connect(s.get(), reinterpret_cast<const sockaddr*>(&target.address), target.length), 0)
      << std::strerror(errno);
  return s;
}

// Writes `bytes` as one sendmsg with `fds` attached (SCM_RIGHTS).
/// One sendmsg of `bytes` with `fds`: 0 when it all went, else its errno.
inline int send_raw(int socket, const std::vector<std::byte>& bytes, const std::vector<int>& fds = {}, int flags = 0) {
  iovec part{const_cast<std::byte*>(bytes.data()), bytes.size()};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    header.msg_control = control.data();
    header.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const ssize_t sent = ::sendmsg(socket, &header, MSG_NOSIGNAL | flags);
  if (sent < 0) return errno;
  return static_cast<std::size_t>(sent) == bytes.size() ? 0 : EMSGSIZE;
}

inline void write_raw(int socket, const std::vector<std::byte>& bytes, const std::vector<int>& fds = {}) {
  const int error = send_raw(socket, bytes, fds);
  ASSERT_EQ(error, 0) << std::strerror(error);
}

/// Lets descriptors reach `socket` again, as kernels before 6.16 do whatever
/// refuse_descriptors asks: the reads' own refusal is what stands then.
inline void allow_descriptors_in_kernel(int socket) {
  const int on = 1;
  if (::setsockopt(socket, SOL_SOCKET, so_passrights, &on, sizeof on) != 0) {
    ASSERT_EQ(errno, ENOPROTOOPT) << std::strerror(errno);
  }
}

struct raw_frame {
  std::uint16_t type = 0;
  std::vector<std::byte> payload;
  std::uint16_t descriptors = 0;  // what the frame says it carries
};

// A batch as the wire layout documents it, built without the library: the
// header, the frames, then zero bytes up to `padded_to`.
inline std::vector<std::byte> raw_batch(std::string_view magic, std::uint16_t version,
                                        const std::vector<raw_frame>& frames, std::size_t padded_to = 256) {
  std::vector<std::byte> out(12);
  std::memcpy(out.data(), magic.data(), 4);
  const auto count = static_cast<std::uint16_t>(frames.size());
  std::memcpy(out.data() + 4, &version, 2);
  std::memcpy(out.data() + 6, &count, 2);
  for (const raw_frame& f : frames) {
    const auto length = static_cast<std::uint32_t>(f.payload.size());
    std::byte header[8];
    std::memcpy(header, &f.type, 2);
    std::memcpy(header + 2, &f.descriptors, 2);
    std::memcpy(header + 4, &length, 4);
    out.insert(out.end(), header, header + 8);
    out.insert(out.end(), f.payload.begin(), f.payload.end());
  }
  if (out.size() < padded_to) out.resize(padded_to);
  const auto body = static_cast<std::uint32_t>(out.size() - 12);
  std::memcpy(out.data() + 8, &body, 4);
  return out;
}

inline std::chrono::nanoseconds thread_cpu_time() {
  timespec t{};
  EXPECT_EQ(::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t), 0);
  return std::chrono::seconds(t.tv_sec) + std::chrono::nanoseconds(t.tv_nsec);
}

// True when the other end has closed: a read gives end of stream.
inline bool reads_end_of_stream(int socket) {
  char c;
  return ::recv(socket, &c, 1, 0) == 0;
}

// Child bodies (async-signal-safe). Exit statuses name the step that failed.

inline int become_nobody() {
  if (::setresgid(nobody, nobody, nobody) != 0 || ::setresuid(nobody, nobody, nobody) != 0) return 2;
  return 0;
}

// Connects and holds the connection until the other side closes it.
inline int connect_and_hold(const raw_address& target) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (s < 0) return 3;
  if (::connect(s, reinterpret_cast<const sockaddr*>(&target.address), target.length) != 0) return 4;
  char c;
  while (::read(s, &c, 1) > 0) {
  }
  return 0;
}

// Listens, tells the parent through `ready`, accepts one connection and holds
// it until the other side closes it.
inline int listen_and_hold(const raw_address& local, int ready) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (s < 0) return 3;
  if (::bind(s, reinterpret_cast<const sockaddr*>(&local.address), local.length) != 0) return 5;
  if (::listen(s, 1) != 0) return 6;
  if (::write(ready, "r", 1) != 1) return 7;
  const int accepted = ::accept(s, nullptr, nullptr);
  if (accepted < 0) return 8;
  char c;
  while (::read(accepted, &c, 1) > 0) {
  }
  return 0;
}

}  // namespace shoal::testing
