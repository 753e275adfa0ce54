#include "channel/credentials_exchange.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/scm_rights.h"
#include "shoal/core/error.h"

namespace shoal::channel::detail {

namespace {

constexpr std::array<char, 8> greeting{'S', 'H', 'O', 'L', 'C', 'R', 'E', 'D'};

[[noreturn]] void fail(const char* call) {
  if (errno == EPIPE || errno == ECONNRESET) {
    throw connection_closed(std::string(call) + ": the other end closed the socket before it introduced itself");
  }
  throw os_error{errno, call};
}

void set_passcred(int socket, int on) {
  if (::setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0) fail("setsockopt(SO_PASSCRED)");
}

void send_greeting(int socket) {
  const ucred mine{::getpid(), ::geteuid(), ::getegid()};
  alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(ucred))> control{};
  iovec part{const_cast<char*>(greeting.data()), greeting.size()};
  msghdr m{};
  m.msg_iov = &part;
  m.msg_iovlen = 1;
  m.msg_control = control.data();
  m.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_CREDENTIALS;
  c->cmsg_len = CMSG_LEN(sizeof(ucred));
  std::memcpy(CMSG_DATA(c), &mine, sizeof mine);
  ssize_t sent;
  do {
    sent = ::sendmsg(socket, &m, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) fail("sendmsg");
  if (static_cast<std::size_t>(sent) != greeting.size()) throw backend_error("sendmsg", "the greeting went out in part");
}

// Waits until `socket` is readable (or hung up), or throws timeout_error
// once `until` has passed.
void wait_readable(int socket, std::chrono::steady_clock::time_point until) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      pollfd now{socket, POLLIN, 0};
      if (::poll(&now, 1, 0) > 0) return;  // come already: a zero timeout still takes it
      throw timeout_error("the other end of the socketpair did not introduce itself in time (a process that never "
                          "calls connection::adopt_pair_end, or one that started late: give a longer timeout)");
    }
    pollfd p{socket, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 1000 * 60 * 60)));
    if (ready > 0) return;
    if (ready < 0 && errno != EINTR) fail("poll");
  }
}

ucred receive_greeting(int socket, std::chrono::steady_clock::time_point until, std::optional<uid_t>& sender_uid) {
  std::array<char, greeting.size()> got{};
  std::size_t have = 0;
  bool found = false;
  std::vector<unique_fd> descriptors;  // never part of a greeting: owned here so each is closed
  ucred theirs{};
  while (have < got.size()) {
    // Room for every descriptor a message can carry: those that did not fit
    // the kernel would close in this thread (see read_some).
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(ucred)) +
                                          CMSG_SPACE(sizeof(int) * shoal::detail::max_descriptors_per_message)>
        control{};
    iovec part{got.data() + have, got.size() - have};
    msghdr m{};
    m.msg_iov = &part;
    m.msg_iovlen = 1;
    m.msg_control = control.data();
    m.msg_controllen = control.size();
    wait_readable(socket, until);
    const ssize_t n = ::recvmsg(socket, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n < 0) fail("recvmsg");
    // The kernel's word on who sent this very message: a socketpair's own
    // peer credentials name the process that made the pair, which may not
    // be the one writing to it.
    std::optional<ucred> sender;
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
        sender.emplace();
        std::memcpy(&*sender, CMSG_DATA(c), sizeof *sender);
      }
    }
    if (sender) sender_uid = sender->uid;
    shoal::detail::take_descriptors(m, descriptors, sender ? sender->uid : shoal::detail::peer_uid_of(socket));
    // Refused at the first read that brings any: each further read could
    // install a message's worth more.
    if (!descriptors.empty() || (m.msg_flags & MSG_CTRUNC) != 0) {
      throw protocol_error("socketpair greeting: descriptors came with it; a greeting carries credentials only");
    }
    if (n == 0) throw connection_closed("recvmsg: the other end closed the socket before it introduced itself");
    if (sender && have == 0) {
      theirs = *sender;
      found = true;
    }
    have += static_cast<std::size_t>(n);
  }
  if (got != greeting || !found) {
    throw protocol_error("socketpair greeting: the other end did not introduce itself (expected \"SHOLCRED\" with its "
                         "credentials); both ends must be adopted with connection::adopt_pair_end");
  }
  return theirs;
}

}  // namespace

ucred exchange_credentials(int socket, std::chrono::steady_clock::time_point until, std::optional<uid_t>& sender) {
  set_passcred(socket, 1);
  send_greeting(socket);
  const ucred theirs = receive_greeting(socket, until, sender);
  set_passcred(socket, 0);
  return theirs;
}

}  // namespace shoal::channel::detail
