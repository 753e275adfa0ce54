#include "shoal/ipc/fd_transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "shoal/error.h"

namespace shoal::ipc {

namespace {

[[noreturn]] void fail(const char* call) {
  if (errno == EPIPE || errno == ECONNRESET) throw connection_closed(std::string(call) + ": the peer closed the connection");
  throw backend_error(call, std::strerror(errno));
}

void send_all(int socket, const std::byte* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t sent = ::send(socket, data, bytes, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      fail("send");
    }
    data += sent;
    bytes -= static_cast<std::size_t>(sent);
  }
}

void receive_all(int socket, std::byte* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t got = ::recv(socket, data, bytes, 0);
    if (got == 0) throw connection_closed("recv: the peer closed the connection in the middle of a message");
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("recv");
    }
    data += got;
    bytes -= static_cast<std::size_t>(got);
  }
}

}  // namespace

void send_message(int socket, std::span<const std::byte> payload, int fd) {
  if (payload.size() > UINT32_MAX) throw invalid_argument("send_message: payload of " + std::to_string(payload.size()) + " bytes is over 4 GiB");
  std::uint32_t length = static_cast<std::uint32_t>(payload.size());
  iovec parts[2] = {{&length, sizeof length}, {const_cast<std::byte*>(payload.data()), payload.size()}};
  msghdr header{};
  header.msg_iov = parts;
  header.msg_iovlen = payload.empty() ? 1 : 2;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))]{};
  if (fd >= 0) {
    header.msg_control = control;
    header.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ssize_t sent;
  do {
    sent = ::sendmsg(socket, &header, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) fail("sendmsg");
  // A stream socket may take part of it; the descriptor went with the first byte.
  const std::size_t total = sizeof length + payload.size();
  auto done = static_cast<std::size_t>(sent);
  if (done < sizeof length) {
    send_all(socket, reinterpret_cast<const std::byte*>(&length) + done, sizeof length - done);
    done = sizeof length;
  }
  send_all(socket, payload.data() + (done - sizeof length), total - done);
}

message receive_message(int socket, std::size_t max_payload, std::chrono::nanoseconds spin) {
  message out;
  std::uint32_t length = 0;
  iovec part{&length, sizeof length};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)]{};
  header.msg_control = control;
  header.msg_controllen = sizeof control;
  ssize_t got;
  // Spinning reads without waiting (no extra poll call); then a blocking read.
  const auto spin_until = std::chrono::steady_clock::now() + spin;
  int flags = spin.count() > 0 ? MSG_CMSG_CLOEXEC | MSG_DONTWAIT : MSG_CMSG_CLOEXEC;
  for (;;) {
    got = ::recvmsg(socket, &header, flags);
    if (got >= 0) break;
    if (errno == EINTR) continue;
    const bool would_block = errno == EAGAIN || errno == EWOULDBLOCK;
    if (!would_block || (flags & MSG_DONTWAIT) == 0) break;
    if (std::chrono::steady_clock::now() >= spin_until) flags &= ~MSG_DONTWAIT;  // spun enough: block
  }
  if (got == 0) throw connection_closed("recvmsg: the peer closed the connection");
  if (got < 0) fail("recvmsg");

  // Take ownership of every descriptor that came, so none leaks on error.
  std::vector<unique_fd> received;
  for (cmsghdr* c = CMSG_FIRSTHDR(&header); c != nullptr; c = CMSG_NXTHDR(&header, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      received.emplace_back(fd);
    }
  }
  if ((header.msg_flags & MSG_CTRUNC) != 0 || received.size() > 1) {
    throw invalid_argument("receive_message: more than one file descriptor came with a message");
  }
  if (static_cast<std::size_t>(got) < sizeof length) {
    receive_all(socket, reinterpret_cast<std::byte*>(&length) + got, sizeof length - static_cast<std::size_t>(got));
  }
  if (length > max_payload) {
    throw invalid_argument("receive_message: a message of " + std::to_string(length) + " bytes is over the " +
                           std::to_string(max_payload) + "-byte limit");
  }
  out.payload.resize(length);
  receive_all(socket, out.payload.data(), length);
  if (!received.empty()) out.fd = std::move(received.front());
  return out;
}

}  // namespace shoal::ipc
