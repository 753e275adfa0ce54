#include "shoal/channel/channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <thread>

#include "channel/credentials_exchange.h"
#include "channel/frame_batch.h"
#include "channel/frames_ahead.h"
#include "channel/private_directory.h"
#include "channel/send_queue.h"
#include "channel/shared_ring.h"
#include "core/deadline.h"
#include "core/descriptor_closer.h"
#include "core/fork_epoch.h"
#include "core/fork_released_sockets.h"
#include "core/scm_rights.h"
#include "shoal/channel/listener_test_hook.h"
#include "shoal/core/error.h"

namespace shoal::channel {

using detail::socket_address;

namespace {

// sun_path holds the name and its terminating NUL (paths) or leading NUL (abstract names).
constexpr std::size_t max_name_bytes = sizeof(sockaddr_un::sun_path) - 1;

std::string errno_text() { return std::strerror(errno); }

// Off, a peer's sendmsg with descriptors fails (EPERM): none is ever queued
// on `socket`, where the kernel would close a refused one on the receiving
// thread. Kernels without the option (ENOPROTOOPT) leave the refusal to the
// reads.
void refuse_descriptors_in_kernel(int socket) {
  const int off = 0;
  if (::setsockopt(socket, SOL_SOCKET, shoal::detail::so_passrights, &off, sizeof off) == 0 || errno == ENOPROTOOPT) {
    return;
  }
  throw os_error{errno, "setsockopt(SO_PASSRIGHTS)"};
}

// Connections not yet accepted may hold a peer's descriptors, which closing
// the listener would close on this thread (see unique_fd::from_peer): no
// more are let in (shutdown), and those waiting go to the closer threads.
// Whether all went; if not (no descriptor free to accept one), the listener
// itself must go there.
bool hand_waiting_connections_to_closer(int listening) noexcept {
  if (listening < 0) return true;
  ::shutdown(listening, SHUT_RDWR);
  for (;;) {
    const int waiting = ::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC);  // the listener does not block
    if (waiting >= 0) {
      shoal::detail::close_off_thread(waiting, shoal::detail::peer_uid_of(waiting));
    } else if (errno != EINTR && errno != ECONNABORTED) {
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
  }
}

socket_address to_socket_address(const channel_address& where) {
  socket_address out;
  out.address.sun_family = AF_UNIX;
  const std::string& name = where.name();
  char* path = out.address.sun_path;
  if (where.is_abstract()) ++path;  // abstract names start with a NUL
  std::memcpy(path, name.data(), name.size());
  out.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return out;
}

unique_fd new_unix_socket(int flags) {
  unique_fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | flags, 0));
  if (!s) throw os_error{errno, "socket(AF_UNIX)"};
  return s;
}

void check_name(const std::string& name, const char* kind) {
  if (name.empty()) throw invalid_argument(std::string("channel_address: an empty ") + kind);
  if (name.size() > max_name_bytes) {
    throw invalid_argument(std::string("channel_address: the ") + kind + " \"" + name + "\" has " +
                           std::to_string(name.size()) + " bytes; a UNIX socket address holds at most " +
                           std::to_string(max_name_bytes));
  }
  if (name.find('\0') != std::string::npos) {
    throw invalid_argument(std::string("channel_address: the ") + kind + " holds a NUL byte");
  }
}

// A mutex whose lock can give up at a deadline. Built on an atomic flag and
// a condition variable, not std::timed_mutex, whose timed lock
// (pthread_mutex_clocklock) ThreadSanitizer does not see. Uncontended, a
// lock and an unlock are one atomic exchange and two stores: no mutex.
// A waiter counts itself before it tries the flag; the unlock clears the
// flag before it reads the count (both sequentially consistent), so either
// the waiter's try sees the flag clear or the unlock sees the waiter.
class deadline_mutex {
 public:
  void lock() {
    if (try_lock()) return;
    std::unique_lock lock(mutex_);
    waiters_.fetch_add(1);
    freed_.wait(lock, [this] { return try_lock(); });
    waiters_.fetch_sub(1);
  }
  bool try_lock() { return !held_.exchange(true); }
  bool try_lock_until(std::chrono::steady_clock::time_point until) {
    if (try_lock()) return true;
    std::unique_lock lock(mutex_);
    waiters_.fetch_add(1);
    const bool locked = freed_.wait_until(lock, until, [this] { return try_lock(); });
    waiters_.fetch_sub(1);
    return locked;
  }
  // Reads its members after the flag is down: the lock may not be destroyed
  // while another thread could still be unlocking it (the connection's
  // contract: no call overlaps its destruction).
  void unlock() {
    held_.store(false);
    if (waiters_.load() == 0) return;
    const std::lock_guard lock(mutex_);  // a waiter is between its try and its wait, or waiting
    freed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable freed_;
  std::atomic<bool> held_{false};
  std::atomic<int> waiters_{0};
};

std::function<void(const std::string&)>& between_bind_and_listen() {
  static std::function<void(const std::string&)> hook;
  return hook;
}

[[noreturn]] void throw_in_use(const channel_address& where) {
  throw os_error{EADDRINUSE, "listener",
                 where.to_string() + " is already in use by a listening process; stop that process or choose another address"};
}

}  // namespace

// channel_address ------------------------------------------------------------

channel_address channel_address::at_path(std::string path) {
  check_name(path, "path");
  if (path.front() != '/') {
    throw invalid_argument("channel_address: the path \"" + path +
                           "\" is relative; give an absolute path so that both ends name the same file");
  }
  if (path.back() == '/') {
    throw invalid_argument("channel_address: the path \"" + path + "\" names a directory; add the socket file's name");
  }
  return {std::move(path), false};
}

channel_address channel_address::in_runtime_dir(const std::string& name) {
  // "." and ".." name the directory or its parent, no file in it.
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    throw invalid_argument("channel_address::in_runtime_dir: \"" + name +
                           "\" is not a file name (empty, '.', '..', or holds a '/')");
  }
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  const std::string directory =
      runtime != nullptr && runtime[0] == '/' ? runtime : "/tmp/shoal-" + std::to_string(::geteuid());
  return at_path(directory + "/" + name);
}

channel_address channel_address::abstract(std::string name) {
  check_name(name, "abstract name");
  return {std::move(name), true};
}

std::string channel_address::to_string() const { return abstract_ ? "@" + name_ : name_; }

bool access_policy::allows(uid_t uid) const noexcept {
  return uid == ::geteuid() || std::find(allowed_uids.begin(), allowed_uids.end(), uid) != allowed_uids.end();
}

bool access_policy::allows(uid_t uid, gid_t gid) const noexcept {
  return allows(uid) || std::find(allowed_gids.begin(), allowed_gids.end(), gid) != allowed_gids.end();
}

// connection -----------------------------------------------------------------

struct connection::state {
  unique_fd socket;
  shoal::detail::fork_epoch made;  // shutdown() in a fork() child would end the parent's connection
  // Replaced by a closed peer's socket in a fork() child, so the peer sees
  // this end close when this process does; declared after the socket:
  // released first.
  std::optional<shoal::detail::fork_released_socket> released_in_children;
  peer_credentials peer;
  std::size_t max_payload = 0;
  std::atomic<std::int64_t> spin_ns{0};          // how long receive polls before it blocks
  std::atomic<std::int64_t> send_timeout_ns{0};  // zero: sends wait without a deadline
  deadline_mutex send_mutex;
  std::vector<std::byte> send_buffer;  // guarded by send_mutex
  detail::send_queue unsent;           // what post() queued; guarded by send_mutex
  // unsent.bytes() and unsent.oldest_post() (steady clock, ns; 0 while
  // empty), readable without the lock; each is stored on its own.
  std::atomic<std::size_t> unsent_bytes{0};
  std::atomic<std::int64_t> unsent_since_ns{0};
  deadline_mutex receive_mutex;
  // Guarded by receive_mutex: the batch being read, and the frames of the last one not yet returned.
  detail::partial_batch partial;
  std::deque<frame> unread;
  std::atomic<std::size_t> pending{0};  // unread.size(), readable without the lock
  // When the first bytes of `partial` came (steady clock, ns); 0 while it holds nothing.
  std::atomic<std::int64_t> partial_since_ns{0};
  // This side's ring once start_ring() made it, and whether post() was ever
  // used (then no ring); guarded by send_mutex.
  std::unique_ptr<detail::ring_writer> out_ring;
  bool posted = false;
  // The peer's ring once its announce came (guarded by receive_mutex;
  // pending() looks through in_ring_view); the frames that came on the
  // socket after it, each waiting for its marker; whether a marker was taken
  // whose frame has not come whole yet.
  std::unique_ptr<detail::ring_reader> in_ring;
  std::atomic<const detail::ring_reader*> in_ring_view{nullptr};
  std::atomic<std::size_t> peer_ring_max{0};  // allow_peer_ring()'s bound; 0: no ring taken
  detail::frames_ahead_of_markers socket_frames;
  std::atomic<bool> marker_taken{false};  // pending() reads it
  mutable std::mutex broken_mutex;
  std::string broken_reason;  // empty while usable; guarded by broken_mutex
  std::atomic<bool> is_broken{false};  // set once broken_reason is, for a check without the lock

  // The socket is marked a peer's from its connect or accept on: until it is
  // known empty, a peer's descriptors may be queued on it, and closing it
  // would close them in this thread (see unique_fd::from_peer). Shut down
  // first, so that no more come (the peer sees the hang-up at once), it is
  // closed here only when no byte waits; else on the closer threads. In a
  // fork() child it is a placeholder, or the parent's still open: no last close.
  ~state() {
    if (!socket) return;
    if (made.forked_since()) {
      socket.mark_safe_to_close();
      return;
    }
    ::shutdown(socket.get(), SHUT_RDWR);
    if (detail::nothing_queued_to_read(socket.get())) socket.mark_safe_to_close();
  }
  state() = default;
  state(const state&) = delete;
  state& operator=(const state&) = delete;

  void break_with(const std::string& reason) {
    const std::lock_guard lock(broken_mutex);
    if (!broken_reason.empty()) return;
    broken_reason = reason;
    is_broken.store(true, std::memory_order_release);
    ::shutdown(socket.get(), SHUT_RDWR);
  }

  // Locks `m` by `until`, or throws timeout_error naming `operation`.
  std::unique_lock<deadline_mutex> lock_by(deadline_mutex& m, detail::deadline until, const char* operation) const {
    std::unique_lock lock(m, std::defer_lock);
    if (!until) {
      lock.lock();
    } else if (!lock.try_lock_until(*until)) {
      throw timeout_error(std::string("connection::") + operation + " with pid " + std::to_string(peer.process.pid) +
                          ": the deadline passed while another thread's " + operation + " held the connection");
    }
    return lock;
  }

  // Publishes what unsent holds after an operation on it, thrown or not.
  // Under send_mutex.
  void note_unsent() noexcept {
    unsent_bytes.store(unsent.bytes(), std::memory_order_relaxed);
    const auto oldest = unsent.oldest_post();
    unsent_since_ns.store(
        oldest ? std::chrono::duration_cast<std::chrono::nanoseconds>(oldest->time_since_epoch()).count() : 0,
        std::memory_order_relaxed);
  }

  // note_unsent() when it leaves scope, however it leaves.
  class noting_unsent {
   public:
    explicit noting_unsent(state& s) : s_(s) {}
    noting_unsent(const noting_unsent&) = delete;
    noting_unsent& operator=(const noting_unsent&) = delete;
    ~noting_unsent() { s_.note_unsent(); }

   private:
    state& s_;
  };

  void throw_if_broken(const char* operation) const {
    if (!is_broken.load(std::memory_order_acquire)) return;
    const std::lock_guard lock(broken_mutex);
    if (broken_reason.empty()) return;
    throw connection_closed(std::string("connection::") + operation + ": the connection with pid " +
                            std::to_string(peer.process.pid) + " was closed after an earlier failure: " +
                            broken_reason);
  }
};

connection::connection(std::unique_ptr<state> s) noexcept : state_(std::move(s)) {}
connection::connection(connection&& other) noexcept = default;
connection& connection::operator=(connection&& other) noexcept = default;
connection::~connection() = default;

connection connection::identify_peer(unique_fd socket, const access_policy& policy, std::size_t max_payload,
                                     const std::string& side) {
  socket = unique_fd::from_peer(socket.release());  // connected: the peer may have queued descriptors (state::~state)
  ucred credentials{};
  socklen_t length = sizeof credentials;
  if (::getsockopt(socket.get(), SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    const int code = errno;
    ::shutdown(socket.get(), SHUT_RDWR);  // the peer sees the hang-up now, not when the closer gets to it
    throw os_error{code, "getsockopt(SO_PEERCRED)"};
  }
  return checked_peer(std::move(socket), credentials, policy, max_payload, side);
}

connection connection::checked_peer(unique_fd socket, const ucred& credentials, const access_policy& policy,
                                    std::size_t max_payload, const std::string& side) {
  // Owned (and registered for fork() children) before the checks, which may
  // take a while (/proc): a throw releases the registration, then closes it.
  auto s = std::make_unique<state>();
  s->socket = unique_fd::from_peer(socket.release(), credentials.uid);
  s->partial.peer_uid = credentials.uid;
  s->released_in_children.emplace(s->socket.get());
  // An out-of-band byte (unix sockets have them from Linux 5.15 on) is read
  // in line, so a descriptor sent with one comes to read_some, which refuses
  // it, rather than being dropped by the read that passes it, in this thread.
  const int on = 1;
  if (::setsockopt(s->socket.get(), SOL_SOCKET, SO_OOBINLINE, &on, sizeof on) != 0) {
    throw os_error{errno, "setsockopt(SO_OOBINLINE)"};
  }
  const std::string who = "pid " + std::to_string(credentials.pid) + " (uid " + std::to_string(credentials.uid) +
                          ", gid " + std::to_string(credentials.gid) + ")";
  if (!policy.allows(credentials.uid, credentials.gid)) {
    throw peer_refused(side + ": refused " + who + ": uid " + std::to_string(credentials.uid) +
                       " is neither this process's uid " + std::to_string(::geteuid()) +
                       " nor on the access policy's allow-list, nor is gid " + std::to_string(credentials.gid) +
                       "; add it to access_policy::allowed_uids (or its group to allowed_gids) to admit it");
  }
  // Looked up at once, while the peer most likely still runs: the kernel
  // reuses a pid only after handing out the others up to pid_max.
  const std::optional<process_identity> process = identify_process(credentials.pid);
  if (!process) throw connection_closed(side + ": the peer " + who + " exited before it could be identified");
  s->peer = {*process, credentials.uid, credentials.gid};
  s->max_payload = max_payload;
  return connection(std::move(s));
}

connection connection::connect(const channel_address& address, const access_policy& policy, std::size_t max_payload,
                               std::chrono::milliseconds timeout) {
  unique_fd s;
  // Registered from its opening on (a fork() cannot come between), while
  // the connect may wait (a full backlog), until the connection's own
  // registration took over.
  const shoal::detail::fork_released_socket while_connecting([&] {
    s = new_unix_socket(0);
    return s.get();
  });
  const socket_address target = to_socket_address(address);
  const auto until = shoal::detail::deadline_after(shoal::detail::channel_timeout(timeout));
  int rc;
  // An interrupted UNIX connect left nothing behind; try again. So does one
  // whose send timeout ran out a little early (the kernel counts it in
  // ticks): it gives up only once the whole timeout has passed.
  do {
    // A UNIX connect waits for room in the listener's backlog for as long
    // as the socket's send timeout (0: for ever): at most what is left.
    const auto left = std::max(std::chrono::ceil<std::chrono::microseconds>(until - std::chrono::steady_clock::now()),
                               std::chrono::microseconds(1));
    const timeval wait{static_cast<time_t>(left.count() / 1'000'000), static_cast<suseconds_t>(left.count() % 1'000'000)};
    if (::setsockopt(s.get(), SOL_SOCKET, SO_SNDTIMEO, &wait, sizeof wait) != 0) {
      throw os_error{errno, "setsockopt(SO_SNDTIMEO)"};
    }
    rc = ::connect(s.get(), reinterpret_cast<const sockaddr*>(&target.address), target.length);
  } while (rc != 0 && (errno == EINTR || errno == EAGAIN) && std::chrono::steady_clock::now() < until);
  if (rc != 0) {
    if (errno == ECONNREFUSED || errno == ENOENT) {
      throw connection_closed("connection::connect: no one listens at " + address.to_string() + "; start the server first",
                              connection_closed::no_listener_tag{});
    }
    if (errno == EAGAIN || errno == EINTR) {
      throw timeout_error("connection::connect: the listener at " + address.to_string() +
                          " took no connection within " + std::to_string(shoal::detail::channel_timeout(timeout).count()) +
                          " ms (its backlog stayed full: a server that stopped accepting)");
    }
    throw os_error{errno, "connect(" + address.to_string() + ")"};
  }
  s = unique_fd::from_peer(s.release());  // connected: the peer may have queued descriptors (state::~state)
  const timeval none{};
  if (::setsockopt(s.get(), SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none) != 0) {
    const int code = errno;
    ::shutdown(s.get(), SHUT_RDWR);  // the peer sees the hang-up now, not when the closer gets to it
    throw os_error{code, "setsockopt(SO_SNDTIMEO)"};
  }
  return identify_peer(std::move(s), policy, max_payload, "connection::connect to " + address.to_string());
}

namespace {

// A socket handed in may be non-blocking (asyncio's, a SOCK_NONBLOCK pair) or
// carry timeouts: sends then end in EAGAIN when the peer reads slowly, which
// would break the connection. The channel waits with deadlines of its own.
void make_blocking(int socket) {
  const int flags = ::fcntl(socket, F_GETFL);
  if (flags < 0) throw os_error{errno, "fcntl(F_GETFL)"};
  if ((flags & O_NONBLOCK) != 0 && ::fcntl(socket, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    throw os_error{errno, "fcntl(F_SETFL)"};
  }
  const timeval none{};
  for (const int option : {SO_SNDTIMEO, SO_RCVTIMEO}) {
    if (::setsockopt(socket, SOL_SOCKET, option, &none, sizeof none) != 0) throw os_error{errno, "setsockopt"};
  }
}

}  // namespace

connection connection::adopt(unique_fd connected_socket, const access_policy& policy, std::size_t max_payload) {
  if (!connected_socket) throw invalid_argument("connection::adopt: no socket was given");
  int domain = 0, type = 0;
  socklen_t length = sizeof domain;
  if (::getsockopt(connected_socket.get(), SOL_SOCKET, SO_DOMAIN, &domain, &length) != 0) {
    throw invalid_argument("connection::adopt: descriptor " + std::to_string(connected_socket.get()) +
                           " is not a socket (" + errno_text() + ")");
  }
  length = sizeof type;
  if (::getsockopt(connected_socket.get(), SOL_SOCKET, SO_TYPE, &type, &length) != 0) {
    throw os_error{errno, "getsockopt(SO_TYPE)"};
  }
  if (domain != AF_UNIX || type != SOCK_STREAM) {
    throw invalid_argument("connection::adopt: the socket is of domain " + std::to_string(domain) + " and type " +
                           std::to_string(type) + "; a channel is an AF_UNIX stream socket and nothing else");
  }
  sockaddr_un peer_address{};
  length = sizeof peer_address;
  if (::getpeername(connected_socket.get(), reinterpret_cast<sockaddr*>(&peer_address), &length) != 0) {
    if (errno == ENOTCONN) throw invalid_argument("connection::adopt: the socket is not connected");
    throw os_error{errno, "getpeername"};
  }
  make_blocking(connected_socket.get());
  return identify_peer(std::move(connected_socket), policy, max_payload, "connection::adopt");
}

connection connection::adopt_pair_end(unique_fd socket_pair_end, const access_policy& policy, std::size_t max_payload,
                                      std::chrono::milliseconds timeout) {
  const auto until = shoal::detail::deadline_after(shoal::detail::channel_timeout(timeout));
  // adopt() checks the socket's kind; its SO_PEERCRED answer is replaced.
  connection checked = adopt(std::move(socket_pair_end), policy, max_payload);
  // `checked` keeps the socket registered for fork() children while the
  // greeting waits (it may take seconds) and until checked_peer registered
  // it again.
  // A refused greeting leaves the socket with `checked`, whose end shuts it
  // down and closes it as a connection's (anything queued: off this thread).
  std::optional<uid_t> sender;
  ucred theirs{};
  try {
    theirs = detail::exchange_credentials(checked.state_->socket.get(), until, sender);
  } catch (...) {
    // What waits on the socket is its writer's, to be charged to it, not to the pair's maker.
    if (sender) checked.state_->socket = unique_fd::from_peer(checked.state_->socket.release(), *sender);
    throw;
  }
  unique_fd socket = std::move(checked.state_->socket);
  return checked_peer(std::move(socket), theirs, policy, max_payload, "connection::adopt_pair_end");
}

connection::state& connection::usable(const char* operation) const {
  if (!state_) throw invalid_argument(std::string("connection::") + operation + ": the connection was moved from");
  return *state_;
}

void connection::send(std::uint16_t type, std::span<const std::byte> payload, int fd) {
  const outgoing_frame one{type, payload, fd};
  send(std::span(&one, 1));
}

namespace {

// Throws invalid_argument, naming `operation`, when a frame cannot be sent.
void check_outgoing(std::span<const outgoing_frame> frames, const char* operation) {
  for (const outgoing_frame& f : frames) {
    if (f.payload.size() > UINT32_MAX - batch_header_bytes - frame_header_bytes) {
      throw invalid_argument(std::string("connection::") + operation + ": a payload of " +
                             std::to_string(f.payload.size()) +
                             " bytes does not fit in one frame (4 GiB less the headers)");
    }
    if (f.type >= first_reserved_frame_type && f.type <= last_reserved_frame_type) {
      throw invalid_argument(std::string("connection::") + operation + ": frame type " + std::to_string(f.type) +
                             " is one the channel keeps for itself (" + std::to_string(first_reserved_frame_type) +
                             ".." + std::to_string(last_reserved_frame_type) + ")");
    }
    if (f.fd >= 0 && ::fcntl(f.fd, F_GETFD) == -1) {
      throw invalid_argument(std::string("connection::") + operation + ": descriptor " + std::to_string(f.fd) +
                             " is not open");
    }
  }
}

}  // namespace

template <class Body>
void connection::sending(state& s, const char* operation, Body body) {
  const auto to = [&] { return std::string("connection::") + operation + " to pid " + std::to_string(s.peer.process.pid) + ": "; };
  bool started = false;  // some of this call's bytes may have gone
  try {
    body(started);
  } catch (const detail::timeout_mid_batch& e) {
    const timeout_error late(to() + e.what() + "; the connection is closed");
    s.break_with(late.what());
    throw late;
  } catch (const timeout_error& e) {
    if (!started) throw timeout_error(to() + e.what() + "; nothing was sent and the connection stays usable");
    // Some of this call's frames went and the rest never will: the receiver would see half of it.
    const timeout_error late(to() + e.what() + " after part of this call's frames went; the connection is closed");
    s.break_with(late.what());
    throw late;
  } catch (const connection_closed& e) {
    const connection_closed closed(to() + e.what(), started);
    s.break_with(closed.what());
    throw closed;
  } catch (const detail::descriptors_refused& e) {
    if (!started) throw protocol_error(to() + e.what() + "; the connection stays usable");
    const protocol_error late(to() + e.what() + " after part of this call's frames went; the connection is closed");
    s.break_with(late.what());
    throw late;
  } catch (const std::exception& e) {  // part of a batch may have gone: the stream is out of step
    s.break_with(e.what());
    throw;
  }
}

namespace {

detail::deadline send_deadline(const std::atomic<std::int64_t>& timeout_ns) {
  const auto timeout = std::chrono::nanoseconds(timeout_ns.load(std::memory_order_relaxed));
  if (timeout.count() <= 0) return std::nullopt;
  return std::chrono::steady_clock::now() + timeout;
}

// Sends `frames` in batches on `socket`.
void send_on_socket(int socket, std::span<const outgoing_frame> frames, std::vector<std::byte>& buffer,
                    detail::deadline until, bool& started) {
  while (!frames.empty()) {
    const std::size_t count = detail::frames_in_next_batch(frames);
    detail::send_batch(socket, frames.first(count), buffer, until);
    started = true;
    frames = frames.subspan(count);
  }
}

// Waits until `ring` has `bytes` of room: yields a while, then sleeps on the
// socket a millisecond at a time, so a peer that hangs up ends the wait.
void wait_for_room(int socket, detail::ring_writer& ring, std::size_t bytes, detail::deadline until) {
  for (int round = 0; ring.room() < bytes; round = std::min(round + 1, 64)) {  // counts to the sleeps, no further
    const auto now = std::chrono::steady_clock::now();
    if (until && now >= *until) throw timeout_error("the deadline passed while the peer's ring was full");
    if (round < 64) {
      std::this_thread::yield();
      continue;
    }
    int wait_ms = 1;
    if (until) wait_ms = static_cast<int>(std::clamp<std::int64_t>(
                   std::chrono::ceil<std::chrono::milliseconds>(*until - now).count(), 0, 1));
    pollfd hangup{socket, 0, 0};  // no events asked: poll reports only a hang-up or an error
    if (::poll(&hangup, 1, wait_ms) > 0 && (hangup.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) {
      throw connection_closed(
          "the connection ended while the peer's ring was full (the peer hung up, or this side closed it)");
    }
  }
}

// Sends `frames` through `ring`, in order: an entry for each frame, and for
// a frame that cannot be one (a descriptor, or too large), a marker, its
// frame going on the socket first. Socket frames go a batch at a time, each
// batch's markers published before the next batch is sent, so a receiver
// never holds more than two batches of frames waiting for their markers.
// After each publish a wake-up goes unless the peer needs none.
void send_through_ring(int socket, detail::ring_writer& ring, std::span<const outgoing_frame> frames,
                       std::vector<std::byte>& buffer, detail::deadline until, bool& started) {
  const auto on_socket = [&](const outgoing_frame& f) { return f.fd >= 0 || !ring.fits_inline(f.payload.size()); };
  const outgoing_frame wake{detail::ring_wake_type, {}, -1};
  const auto publish = [&] {
    const bool wanted = ring.publish();
    started = true;
    if (!wanted) return;
    ring.count_wake();
    send_on_socket(socket, std::span(&wake, 1), buffer, until, started);
  };
  const auto write = [&](const outgoing_frame& f, bool marker) {
    const std::size_t bytes = detail::ring_entry_bytes(marker ? 0 : f.payload.size());
    if (ring.room() < bytes) {
      if (ring.unpublished()) publish();  // the peer reads what is there, making room
      wait_for_room(socket, ring, bytes, until);
    }
    ring.write(f.type, marker ? std::span<const std::byte>() : f.payload, marker);
  };
  try {
    while (!frames.empty()) {
      if (!on_socket(frames.front())) {
        write(frames.front(), false);
        frames = frames.subspan(1);
        continue;
      }
      std::size_t run = 1;
      while (run < frames.size() && on_socket(frames[run])) ++run;
      const std::size_t count = detail::frames_in_next_batch(frames.first(run));
      detail::send_batch(socket, frames.first(count), buffer, until);
      started = true;
      for (const outgoing_frame& f : frames.first(count)) write(f, true);
      publish();
      frames = frames.subspan(count);
    }
    if (ring.unpublished()) publish();
  } catch (...) {
    ring.discard_unpublished();
    throw;
  }
}

}  // namespace

void connection::send(std::span<const outgoing_frame> frames) {
  state& s = usable("send");
  check_outgoing(frames, "send");
  const detail::deadline until = send_deadline(s.send_timeout_ns);
  const auto lock = s.lock_by(s.send_mutex, until, "send");
  s.throw_if_broken("send");
  sending(s, "send", [&](bool& started) {
    if (s.unsent.bytes() > 0) {  // what post() queued goes first
      const state::noting_unsent noting{s};
      if (!s.unsent.drain(s.socket.get(), until)) {
        throw timeout_error("the deadline passed while " + std::to_string(s.unsent.bytes()) +
                            " bytes posted earlier waited for the peer to read them");
      }
    }
    if (s.out_ring) {
      send_through_ring(s.socket.get(), *s.out_ring, frames, s.send_buffer, until, started);
    } else {
      send_on_socket(s.socket.get(), frames, s.send_buffer, until, started);
    }
  });
}

bool connection::start_ring(std::size_t bytes) {
  state& s = usable("start_ring");
  const detail::deadline until = send_deadline(s.send_timeout_ns);
  const auto lock = s.lock_by(s.send_mutex, until, "start_ring");
  s.throw_if_broken("start_ring");
  if (s.out_ring) throw invalid_argument("connection::start_ring: this side already sends through a ring");
  if (s.posted) {
    throw invalid_argument("connection::start_ring: post() was used on this connection; a ring serves send() alone");
  }
  auto ring = std::make_unique<detail::ring_writer>(bytes);
  const std::uint64_t capacity = ring->capacity();
  std::byte payload[sizeof capacity];
  std::memcpy(payload, &capacity, sizeof capacity);
  // One batch: the receiver takes the ring from the two frames together.
  const std::array<outgoing_frame, 2> announce{outgoing_frame{detail::ring_announce_type, payload, ring->ring_fd()},
                                               outgoing_frame{detail::ring_fields_type, {}, ring->fields_fd()}};
  try {
    bool started = false;
    send_on_socket(s.socket.get(), announce, s.send_buffer, until, started);
  } catch (const connection_closed&) {
    // The peer hung up: it reads nothing more, but what it sent before is
    // still to be received, so the connection is not closed here (a later
    // send meets the same end and closes it).
    return false;
  } catch (...) {
    sending(s, "start_ring", [](bool&) { throw; });  // send()'s rules for every other failure
  }
  s.out_ring = std::move(ring);
  return true;
}

static_assert(connection::min_ring_bytes == detail::min_ring_capacity);
static_assert(connection::max_ring_bytes == detail::max_ring_capacity);

void connection::allow_peer_ring(std::size_t max_bytes) {
  state& s = usable("allow_peer_ring");
  if (max_bytes < detail::min_ring_capacity) {
    throw invalid_argument("connection::allow_peer_ring: max_bytes " + std::to_string(max_bytes) +
                           " is below the smallest ring, " + std::to_string(detail::min_ring_capacity) + " bytes");
  }
  s.peer_ring_max.store(max_bytes, std::memory_order_relaxed);
}

void connection::refuse_descriptors() {
  state& s = usable("refuse_descriptors");
  const std::lock_guard lock(s.receive_mutex);
  // With no room for a control message, credentials (SO_PASSCRED) would cut
  // every read short (MSG_CTRUNC), refused as if a descriptor had come.
  const int off = 0;
  if (::setsockopt(s.socket.get(), SOL_SOCKET, SO_PASSCRED, &off, sizeof off) != 0) {
    throw os_error{errno, "setsockopt(SO_PASSCRED)"};
  }
  refuse_descriptors_in_kernel(s.socket.get());
  s.partial.most_descriptors = 0;
}

void connection::post(std::uint16_t type, std::span<const std::byte> payload, int fd) {
  const outgoing_frame one{type, payload, fd};
  post(std::span(&one, 1));
}

void connection::post(std::span<const outgoing_frame> frames) {
  state& s = usable("post");
  check_outgoing(frames, "post");
  const std::lock_guard lock(s.send_mutex);
  s.throw_if_broken("post");
  if (s.out_ring) {
    throw invalid_argument("connection::post: this side sends through a ring (start_ring); use send()");
  }
  s.posted = true;
  const state::noting_unsent noting{s};
  try {
    while (!frames.empty()) {
      const std::size_t count = detail::frames_in_next_batch(frames);
      const std::vector<int> descriptors = detail::encode_batch(frames.first(count), s.send_buffer);
      s.unsent.post(s.socket.get(), s.send_buffer, descriptors);
      frames = frames.subspan(count);
    }
  } catch (const connection_closed& e) {
    const connection_closed closed("connection::post to pid " + std::to_string(s.peer.process.pid) + ": " + e.what());
    s.break_with(closed.what());
    throw closed;
  } catch (const detail::descriptors_refused& e) {  // frames queued before it may have gone: out of step
    const protocol_error refused("connection::post to pid " + std::to_string(s.peer.process.pid) + ": " + e.what() +
                                 "; the connection is closed");
    s.break_with(refused.what());
    throw refused;
  } catch (const std::exception& e) {  // part of a batch may have gone: the stream is out of step
    s.break_with(e.what());
    throw;
  }
}

std::size_t connection::flush() {
  state& s = usable("flush");
  const std::lock_guard lock(s.send_mutex);
  s.throw_if_broken("flush");
  const state::noting_unsent noting{s};
  try {
    s.unsent.flush(s.socket.get());
  } catch (const connection_closed& e) {
    const connection_closed closed("connection::flush to pid " + std::to_string(s.peer.process.pid) + ": " + e.what());
    s.break_with(closed.what());
    throw closed;
  } catch (const detail::descriptors_refused& e) {  // frames queued before it may have gone: out of step
    const protocol_error refused("connection::flush to pid " + std::to_string(s.peer.process.pid) + ": " + e.what() +
                                 "; the connection is closed");
    s.break_with(refused.what());
    throw refused;
  } catch (const std::exception& e) {
    s.break_with(e.what());
    throw;
  }
  return s.unsent.bytes();
}

std::size_t connection::unsent_bytes() const {
  return usable("unsent_bytes").unsent_bytes.load(std::memory_order_relaxed);
}

std::optional<std::chrono::steady_clock::time_point> connection::unsent_since() const {
  const std::int64_t ns = usable("unsent_since").unsent_since_ns.load(std::memory_order_relaxed);
  if (ns == 0) return std::nullopt;
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::nanoseconds(ns)));
}

void connection::set_receive_spin(std::chrono::nanoseconds spin) {
  usable("set_receive_spin").spin_ns.store(shoal::detail::channel_spin(spin).count(), std::memory_order_relaxed);
}

void connection::set_send_timeout(std::chrono::milliseconds timeout) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(shoal::detail::channel_timeout(timeout));
  usable("set_send_timeout").send_timeout_ns.store(ns.count(), std::memory_order_relaxed);
}

frame connection::receive() { return receive_until(std::nullopt); }

frame connection::receive_for(std::chrono::milliseconds timeout) {
  return receive_until(std::chrono::steady_clock::now() + shoal::detail::channel_timeout(timeout));
}

// Reads the next batch into s.unread with `read` (which returns false when
// the batch is not whole yet); on failure the connection is broken, except
// for a timeout before any byte came. Under s.receive_mutex.
template <class Read>
bool connection::refill(state& s, Read read) {
  const auto from = [&] { return "connection::receive from pid " + std::to_string(s.peer.process.pid); };
  // Whatever read() did, partial_since_ns says after it whether a batch is part-read, and since when.
  struct note_partial {
    state& s;
    ~note_partial() {
      if (!s.partial.started()) {
        s.partial_since_ns.store(0, std::memory_order_relaxed);
      } else if (s.partial_since_ns.load(std::memory_order_relaxed) == 0) {
        const auto now = std::chrono::steady_clock::now().time_since_epoch();
        s.partial_since_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(),
                                 std::memory_order_relaxed);
      }
    }
  };
  try {
    const note_partial noted{s};
    return read();
  } catch (const detail::timeout_mid_batch& e) {
    const timeout_error late(from() + ": " + e.what() + "; the connection is closed");
    s.break_with(late.what());
    throw late;
  } catch (const timeout_error& e) {
    throw timeout_error(from() + ": " + e.what() + "; nothing was read and the connection stays usable");
  } catch (const protocol_error& e) {
    const protocol_error refused(from() + ": " + e.what());
    s.break_with(refused.what());
    throw refused;
  } catch (const connection_closed& e) {
    const connection_closed closed(from() + ": " + e.what());
    s.break_with(closed.what());
    throw closed;
  } catch (const std::exception& e) {
    s.break_with(e.what());
    throw;
  }
}

frame connection::next_unread(state& s) {
  frame next = std::move(s.unread.front());
  s.unread.pop_front();
  s.pending.store(s.unread.size(), std::memory_order_release);
  return next;
}

namespace {

// What the receive side keeps of a connection's state, for the helpers below.
struct receive_side {
  std::size_t peer_ring_max;  // 0: no ring taken
  std::deque<frame>& unread;
  std::unique_ptr<detail::ring_reader>& in_ring;
  std::atomic<const detail::ring_reader*>& in_ring_view;
  detail::frames_ahead_of_markers& socket_frames;
  std::atomic<bool>& marker_taken;
  std::size_t max_payload;
};

// Reads no more than this many batches in one try_receive, so that a peer
// sending wake-ups without end cannot hold it.
constexpr int max_batches_per_try = 64;

// Files the frames of a batch read from the socket: before the peer's ring
// they are the stream; its announce brings the ring; after it, wake-ups are
// dropped and the rest wait for their markers.
void route(receive_side r, std::vector<frame> batch) {
  for (std::size_t i = 0; i < batch.size(); ++i) {
    frame& f = batch[i];
    if (f.type == detail::ring_announce_type) {
      if (r.peer_ring_max == 0) {
        throw protocol_error(
            "the peer announced a shared-memory ring, which this connection's protocol does not use "
            "(allow_peer_ring): it is likely an endpoint of another protocol, such as a sharing peer");
      }
      if (r.in_ring) throw protocol_error("a second ring announced; a connection has one each way");
      std::uint64_t capacity = 0;
      if (f.payload.size() != sizeof capacity) throw protocol_error("a ring announce of " + std::to_string(f.payload.size()) + " bytes; it holds 8");
      std::memcpy(&capacity, f.payload.data(), sizeof capacity);
      if (capacity > r.peer_ring_max) {
        throw protocol_error("the peer announced a ring of " + std::to_string(capacity) + " bytes, over the " +
                             std::to_string(r.peer_ring_max) + " this side takes (allow_peer_ring; for a sharing peer, max_peer_ring_bytes)");
      }
      if (i + 1 == batch.size() || batch[i + 1].type != detail::ring_fields_type || !batch[i + 1].payload.empty()) {
        throw protocol_error(
            "a ring announce without its fields file in the frame after it, in the same batch (a shoal from "
            "before 2026-12-04 sends none: run the same shoal version at both ends)");
      }
      frame& fields = batch[++i];
      r.in_ring = std::make_unique<detail::ring_reader>(std::move(f.fd), std::move(fields.fd), capacity);
      r.in_ring_view.store(r.in_ring.get(), std::memory_order_release);
    } else if (f.type == detail::ring_fields_type) {
      throw protocol_error("a ring's fields file without its announce before it");
    } else if (f.type == detail::ring_wake_type) {
      if (!r.in_ring) throw protocol_error("a ring wake-up before any ring was announced");
      if (!f.payload.empty() || f.fd) throw protocol_error("a ring wake-up that carries a payload or a descriptor");
      r.in_ring->note_wake();
    } else if (r.in_ring) {
      r.socket_frames.push(std::move(f), r.max_payload);
    } else {
      r.unread.push_back(std::move(f));
    }
  }
}

// The next frame in the ring's order, if it has come: a marker's frame is
// the next one that came on the socket. `read_more` reads and routes one
// more batch, false when none is whole yet.
template <class ReadMore>
std::optional<frame> next_in_ring(receive_side r, ReadMore read_more) {
  for (;;) {
    if (!r.marker_taken.load(std::memory_order_relaxed)) {
      std::optional<detail::ring_entry> e = r.in_ring->take(r.max_payload);
      if (!e) return std::nullopt;
      if (e->type >= first_reserved_frame_type && e->type <= last_reserved_frame_type) {
        throw protocol_error("a ring entry of the channel's own frame type " + std::to_string(e->type));
      }
      if (!e->on_socket) return frame{e->type, std::move(e->payload), {}};
      r.marker_taken.store(true, std::memory_order_relaxed);
    }
    if (!r.socket_frames.empty()) {
      r.marker_taken.store(false, std::memory_order_relaxed);
      return r.socket_frames.pop();
    }
    if (!read_more()) return std::nullopt;
  }
}

// Reads off the socket the wake-ups sent for frames already taken from the
// ring, as far as they have come whole, so that the socket is not left
// readable with nothing to read.
// Only once the ring is empty: a read before then could take in socket
// frames well ahead of their markers. The end of the stream met here is
// left for the next call, which meets it again, so the frame just taken
// is returned.
template <class ReadReady>
void drop_owed_wakes(receive_side r, ReadReady read_ready) {
  try {
    for (int batches = 0; batches < max_batches_per_try && !r.marker_taken.load(std::memory_order_relaxed) &&
                          !r.in_ring->has_entries() &&
                          r.in_ring->wakes_owed() && read_ready();
         ++batches) {
    }
  } catch (const connection_closed&) {  // NOLINT(bugprone-empty-catch): met again by the next read
  }
}

// Tells the core that this thread is spinning.
inline void spin_pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls the ring without sleeping for up to `spin` (no later than
// `deadline`), telling the sender it need not wake this side meanwhile;
// true when entries came. Then the flag stays up until the caller has
// taken them (a sender seeing it down before the head moves would send a
// wake-up for nothing); the caller lowers it before it returns.
bool spin_on_ring(detail::ring_reader& ring, std::chrono::nanoseconds spin, const detail::deadline& deadline) {
  if (spin.count() <= 0) return ring.has_entries();
  ring.set_spinning(true);
  auto until = std::chrono::steady_clock::now() + shoal::detail::channel_spin(spin);
  if (deadline && *deadline < until) until = *deadline;
  bool came = false;
  for (unsigned round = 0; !(came = ring.has_entries()); ++round) {
    spin_pause();
    if (round % 16 == 0 && std::chrono::steady_clock::now() >= until) break;
  }
  if (came) return true;
  ring.set_spinning(false);
  // A publish after the flag went down wakes this side; one before it is seen here.
  return ring.has_entries();
}

// However a receive leaves, the sender is told it no longer spins.
struct lowers_spinning {
  const std::unique_ptr<detail::ring_reader>& ring;
  ~lowers_spinning() {
    if (ring) ring->set_spinning(false);
  }
};

}  // namespace

frame connection::receive_until(std::optional<std::chrono::steady_clock::time_point> until) {
  state& s = usable("receive");
  const auto lock = s.lock_by(s.receive_mutex, until, "receive");
  s.throw_if_broken("receive");
  const receive_side r{s.peer_ring_max.load(std::memory_order_relaxed), s.unread, s.in_ring, s.in_ring_view,
                       s.socket_frames, s.marker_taken, s.max_payload};
  const auto spin = std::chrono::nanoseconds(s.spin_ns.load(std::memory_order_relaxed));
  int reads_past_deadline = 0;
  const auto read_one = [&](std::chrono::nanoseconds socket_spin) {
    // Past the deadline (a zero timeout, or one the ring's spin used up) a
    // read takes only what has come whole, keeping a batch that came in part
    // for the next call, and only so many batches: a peer that keeps sending
    // wake-ups must not keep a receive past its own.
    if (until && std::chrono::steady_clock::now() >= *until) {
      std::optional<std::vector<frame>> batch;
      if (reads_past_deadline++ < max_batches_per_try) {
        batch = detail::read_batch_if_ready(s.socket.get(), s.max_payload, s.partial);
      }
      if (!batch) throw timeout_error("the deadline passed while the peer sent no whole batch");
      route(r, std::move(*batch));
      return true;
    }
    route(r, detail::read_batch(s.socket.get(), s.max_payload, socket_spin, until, s.partial));
    return true;
  };
  const auto read_ready = [&] {
    std::optional<std::vector<frame>> batch = detail::read_batch_if_ready(s.socket.get(), s.max_payload, s.partial);
    if (!batch) return false;
    route(r, std::move(*batch));
    return true;
  };
  std::optional<frame> from_ring;
  const lowers_spinning lowered{s.in_ring};
  (void)refill(s, [&] {
    while (s.unread.empty()) {
      if (!s.in_ring) {
        read_one(spin);
      } else if ((from_ring = next_in_ring(r, [&] { return read_one({}); }))) {
        drop_owed_wakes(r, read_ready);
        return true;
      } else if (!spin_on_ring(*s.in_ring, spin, until)) {
        read_one({});  // a wake-up, a frame with a descriptor, or the end
      }
    }
    return true;
  });
  if (from_ring) return std::move(*from_ring);
  s.pending.store(s.unread.size(), std::memory_order_release);
  return next_unread(s);
}

std::optional<frame> connection::try_receive() {
  state& s = usable("try_receive");
  const std::unique_lock lock(s.receive_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return std::nullopt;  // another thread is receiving
  s.throw_if_broken("receive");
  return take_ready(s);
}

std::optional<frame> connection::try_receive(std::chrono::nanoseconds spin) {
  state& s = usable("try_receive");
  const std::unique_lock lock(s.receive_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return std::nullopt;  // another thread is receiving
  s.throw_if_broken("receive");
  std::optional<frame> f = take_ready(s);
  if (f || spin.count() <= 0 || !s.in_ring) return f;
  const lowers_spinning lowered{s.in_ring};
  if (!spin_on_ring(*s.in_ring, spin, std::nullopt)) return std::nullopt;
  return take_ready(s);  // what came, with the flag still up (lowered on return)
}

std::optional<frame> connection::take_ready(state& s) {
  const receive_side r{s.peer_ring_max.load(std::memory_order_relaxed), s.unread, s.in_ring, s.in_ring_view,
                       s.socket_frames, s.marker_taken, s.max_payload};
  // At most max_batches_per_try batches a call, wherever they are read.
  int batches = 0;
  const auto read_ready = [&] {
    if (batches == max_batches_per_try) return false;
    std::optional<std::vector<frame>> batch = detail::read_batch_if_ready(s.socket.get(), s.max_payload, s.partial);
    if (!batch) return false;
    ++batches;
    route(r, std::move(*batch));
    return true;
  };
  std::optional<frame> from_ring;
  const bool whole = refill(s, [&] {
    while (s.unread.empty()) {
      if (s.in_ring && (from_ring = next_in_ring(r, read_ready))) {
        drop_owed_wakes(r, read_ready);
        return true;
      }
      // The ring is empty, or a marker's frame is not whole yet: take in
      // what the socket has (wake-ups, frames, the end) and look again.
      if (!read_ready()) return false;
    }
    return true;
  });
  if (from_ring) return std::move(*from_ring);
  s.pending.store(s.unread.size(), std::memory_order_release);
  if (!whole) return std::nullopt;
  return next_unread(s);
}

std::optional<std::chrono::steady_clock::time_point> connection::incomplete_since() const {
  const std::int64_t ns = usable("incomplete_since").partial_since_ns.load(std::memory_order_relaxed);
  if (ns == 0) return std::nullopt;
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::nanoseconds(ns)));
}

std::size_t connection::pending() const {
  const state& s = usable("pending");
  const detail::ring_reader* ring = s.in_ring_view.load(std::memory_order_acquire);
  // Entries behind a marker whose frame has not come wait for the socket,
  // which is readable once it does.
  const bool ring_ready =
      ring != nullptr && !s.marker_taken.load(std::memory_order_relaxed) && ring->seems_to_have_entries();
  return s.pending.load(std::memory_order_acquire) + (ring_ready ? 1 : 0);
}

const peer_credentials& connection::peer() const noexcept { return state_->peer; }
std::size_t connection::max_payload() const noexcept { return state_->max_payload; }
int connection::native_handle() const noexcept { return state_->socket.get(); }

bool connection::broken() const {
  const std::lock_guard lock(state_->broken_mutex);
  return !state_->broken_reason.empty();
}

// listener -------------------------------------------------------------------

void test_hook::set_between_bind_and_listen(std::function<void(const std::string& address)> hook) {
  between_bind_and_listen() = std::move(hook);
}

listener::listener(const channel_address& address, access_policy policy, std::size_t max_payload)
    : address_(address), policy_(std::move(policy)), max_payload_(max_payload) {
  if (!address_.is_abstract()) {
    const std::string& path = address_.name();
    const std::size_t slash = path.rfind('/');
    directory_ = std::make_unique<detail::private_directory>(slash == 0 ? "/" : path.substr(0, slash));
    file_name_ = path.substr(slash + 1);
  }
  // Non-blocking, so that a connection another thread took first cannot
  // leave accept() blocked after poll() said one was waiting.
  released_in_children_ = std::make_unique<shoal::detail::fork_released_socket>([&] {
    socket_ = new_unix_socket(SOCK_NONBLOCK);
    return socket_.get();
  });
  // A path is bound through the directory's descriptor: the one checked.
  const socket_address local = directory_ ? directory_->address_of(file_name_) : to_socket_address(address_);
  const auto bind_here = [&] {
    return ::bind(socket_.get(), reinterpret_cast<const sockaddr*>(&local.address), local.length);
  };
  // Choice: a lock beside the socket file, held from the look for a stale
  // file to listen(). Where the look is a stream connect (someone_listens'
  // second question), one between another listener's bind and listen is
  // refused as at a dead one's file, so without it this one would take a
  // live socket for stale and replace it. Binding a temporary name and
  // link()ing it into place keeps the name atomically, but not the window
  // between a stale file's probe and its removal, which the lock closes too.
  std::optional<detail::start_lock> starting;
  if (directory_) starting.emplace(*directory_, file_name_);
  if (bind_here() != 0) {
    if (errno != EADDRINUSE) throw os_error{errno, "bind(" + address_.to_string() + ")"};
    if (!directory_ || directory_->someone_listens(file_name_)) throw_in_use(address_);
    // A socket file no one listens on is left from a process that died.
    directory_->remove(file_name_);
    if (bind_here() != 0) {
      if (errno == EADDRINUSE) throw_in_use(address_);
      throw os_error{errno, "bind(" + address_.to_string() + ")"};
    }
  }
  if (directory_) {
    const std::optional<struct stat> st = directory_->entry(file_name_);
    if (!st) throw backend_error("fstatat(" + address_.name() + ")", "the socket file was removed as it was made");
    file_device_ = st->st_dev;
    file_inode_ = st->st_ino;
  }
  owner_pid_ = ::getpid();
  if (between_bind_and_listen()) between_bind_and_listen()(address_.to_string());
  if (::listen(socket_.get(), SOMAXCONN) != 0) {
    throw os_error{errno, "listen(" + address_.to_string() + ")"};
  }
}

listener::~listener() {
  // A forked child shares the socket with its parent, which still listens.
  if (::getpid() != owner_pid_) return;
  if (!hand_waiting_connections_to_closer(socket_.get())) socket_ = unique_fd::from_peer(socket_.release());
  if (!directory_) return;
  try {
    const detail::start_lock starting(*directory_, file_name_);  // no listener replaces the file meanwhile
    const std::optional<struct stat> st = directory_->entry(file_name_);
    if (st && st->st_dev == file_device_ && st->st_ino == file_inode_) directory_->remove(file_name_);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor cannot report (the lock may find no memory); the file stays
  }
}

connection listener::accept() { return *accept_until(std::nullopt); }

std::optional<connection> listener::accept_for(std::chrono::milliseconds timeout) {
  return accept_until(std::chrono::steady_clock::now() + shoal::detail::channel_timeout(timeout));
}

void listener::refuse_descriptors() { refuse_descriptors_in_kernel(socket_.get()); }

std::optional<connection> listener::accept_until(deadline until) {
  for (;;) {
    int timeout_ms = -1;
    if (until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - std::chrono::steady_clock::now());
      timeout_ms = static_cast<int>(std::clamp<std::chrono::milliseconds::rep>(left.count(), 0, INT_MAX));
    }
    pollfd waiting{socket_.get(), POLLIN, 0};
    const int ready = ::poll(&waiting, 1, timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      throw os_error{errno, "poll"};
    }
    if (ready == 0) return std::nullopt;
    if (shoal::detail::closer_holds_accepts()) {  // the connection waits in the kernel's queue meanwhile
      if (until && std::chrono::steady_clock::now() >= *until) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    // Registered for fork() children from its opening on, until the
    // connection's own registration took over; a peer's from the start (the
    // peer may have queued descriptors), so that running out of memory
    // before identify_peer leaves its close to the closer too.
    unique_fd accepted;
    const shoal::detail::fork_released_socket while_identifying([&] {
      accepted = unique_fd::from_peer(::accept4(socket_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      return accepted.get();
    });
    if (!accepted) {
      // Another thread took it, a signal came, or the peer gave up: wait again.
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) continue;
      throw os_error{errno, "accept4(" + address_.to_string() + ")"};
    }
    try {
      return connection::identify_peer(std::move(accepted), policy_, max_payload_, "listener at " + address_.to_string());
    } catch (const connection_closed&) {
      // Its process is gone (a listener's check that someone listens, a
      // client that gave up): no server should end for it. Wait for the next.
      if (until && std::chrono::steady_clock::now() >= *until) return std::nullopt;
    }
  }
}

}  // namespace shoal::channel
