#include "support/fd_transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/scm_rights.h"
#include "shoal/core/error.h"

namespace shoal::testing {

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
  shoal::detail::descriptor_space<1> control;
  if (fd >= 0) shoal::detail::attach_descriptors(header, std::span(&fd, 1), control.bytes);
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

message receive_message(int socket, std::size_t max_payload) {
  message out;
  std::uint32_t length = 0;
  iovec part{&length, sizeof length};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  shoal::detail::descriptor_space<4> control;
  header.msg_control = control.bytes;
  header.msg_controllen = sizeof control.bytes;
  ssize_t got;
  do {
    got = ::recvmsg(socket, &header, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got == 0) throw connection_closed("recvmsg: the peer closed the connection");
  if (got < 0) fail("recvmsg");

  // Take ownership of every descriptor that came, so none leaks on error.
  std::vector<unique_fd> received;
  shoal::detail::take_descriptors(header, received, shoal::detail::peer_uid_of(socket));
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

}  // namespace shoal::testing
