// The channel: UNIX stream sockets between processes of one machine, with
// each peer's credentials checked and every message validated.
//
// A listener binds a filesystem path, inside a directory that only its owner
// may enter ($XDG_RUNTIME_DIR is the recommended one: channel_address::
// in_runtime_dir), or an abstract name, which has no file and no permission bits:
// there the credential check is the only guard. Each connection reads its
// peer's pid, uid and gid (SO_PEERCRED) when it is made, on both sides, and
// refuses a uid that the access policy does not allow. The kernel records that
// pid at the peer's connect() (or listen(), socketpair()); the process identity
// (pid and start time) is read from /proc when the connection is made here. A
// peer that handed its socket to another process and exited in between, its
// pid taken by a new process meanwhile, is named as that new process (the uid
// check is the kernel's and stays exact); one whose pid is free is refused as
// exited. Only AF_UNIX stream
// sockets are ever created or adopted: nothing here speaks TCP.
//
// Wire form, in host byte order (both ends share one machine). Frames travel
// in batches; a batch goes out in one system call with the descriptors of its
// frames (SCM_RIGHTS) and is padded with zero bytes to min_batch_bytes:
//   batch: magic "SHOL" (4 bytes) | version u16 (frame_version) | frame count u16
//          | body bytes u32 | the frames | zero padding            (body: all after the header)
//   frame: type u16 | descriptors u16 (0 or 1) | payload bytes u32 | payload
// The descriptors that came with a batch go, in order, to its frames that
// say they carry one. The padding lets a receiver read a small batch whole in
// one call without reading past it. receive() checks all of it; a malformed
// batch gives protocol_error and closes that connection, and nothing else.
//
// A side that calls start_ring() sends its later frames through a ring in
// shared memory instead (src/channel/shared_ring.h has its layout): the
// socket then carries the ring's two descriptors once, frames with a descriptor
// or too large for the ring, and wake-ups for a receiver that is not
// spinning. Frame types 0xFFF0 to 0xFFF2 are the channel's own for this.
//
// In a fork() child, every listener's and connection's socket the parent had
// (and one a connect, an accept or a greeting was working on; a fork waits
// for a socket shoal is opening to be registered) is replaced at once by a
// socket whose peer is gone, under the same descriptor number: the parent's
// peers see end of stream when the parent closes its end or exits, and an
// abstract name is unbound then, however long the child lives; the child's
// copies read as closed connections (connection_closed). Connect anew there.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shoal/core/process_identity.h"
#include "shoal/core/unique_fd.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::detail {
class __attribute__((visibility("hidden"))) fork_released_socket;  // hidden: the library's own
}  // namespace shoal::detail

namespace shoal::channel {

/// The wire layout version this build speaks.
inline constexpr std::uint16_t frame_version = 2;
/// Bytes before a batch's frames: magic, version, frame count, body bytes.
inline constexpr std::size_t batch_header_bytes = 12;
/// Bytes before a frame's payload: type, descriptor count, payload bytes.
inline constexpr std::size_t frame_header_bytes = 8;
/// Every batch is padded to at least this many bytes.
inline constexpr std::size_t min_batch_bytes = 256;
/// The most frames, and descriptors, one batch may carry.
inline constexpr std::size_t max_batch_frames = 64;
inline constexpr std::size_t max_batch_descriptors = 16;
/// A sender packs frames into one batch while their payloads add up to at
/// most this (a larger frame goes alone).
inline constexpr std::size_t batch_packing_bytes = 16 * 1024;
/// The frame types a connection keeps to itself (start_ring); send() and
/// post() refuse them.
inline constexpr std::uint16_t first_reserved_frame_type = 0xFFF0;
inline constexpr std::uint16_t last_reserved_frame_type = 0xFFF2;

/// Where a listener listens: a socket file or an abstract name.
///
/// A value type (not thread-safe to modify). Invariant: the name is not
/// empty, has no NUL byte and fits in sockaddr_un; a path is absolute and
/// names a file, not a directory.
class channel_address {
 public:
  /// A socket file at `path` (absolute, at most 107 bytes). The listener
  /// creates its directory with mode 0700, or checks that it is one;
  /// in_runtime_dir() gives the recommended place.
  /// Throws invalid_argument when `path` cannot be a socket file's path.
  [[nodiscard]] static channel_address at_path(std::string path);
  /// `name` (a file name, no '/') in $XDG_RUNTIME_DIR, the recommended
  /// home of a channel's socket: a directory of this user's own, mode 0700,
  /// that the system removes at logout. Without $XDG_RUNTIME_DIR (or when it
  /// is not absolute), in /tmp/shoal-<euid>, which the listener creates with
  /// mode 0700 and removes when it goes (another user who made that
  /// directory first gets the listener refused, never connected to). Both
  /// ends must see the same environment. Reads the environment: not safe
  /// against a concurrent setenv. Throws invalid_argument when `name` is
  /// empty, "." or "..", or holds a '/', or the path is too long.
  [[nodiscard]] static channel_address in_runtime_dir(const std::string& name);
  /// A name in the abstract socket namespace of this network namespace (at
  /// most 107 bytes): no file to clean up and no permission bits, so any
  /// process on the machine may connect and the access policy alone decides.
  /// Throws invalid_argument when `name` is empty, too long or holds a NUL.
  [[nodiscard]] static channel_address abstract(std::string name);

  [[nodiscard]] bool is_abstract() const noexcept { return abstract_; }
  /// The path, or the abstract name without the NUL the kernel puts first.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// For messages: the path, or "@name" for an abstract name.
  [[nodiscard]] std::string to_string() const;

  friend bool operator==(const channel_address&, const channel_address&) = default;

 private:
  channel_address(std::string name, bool abstract) : name_(std::move(name)), abstract_(abstract) {}

  std::string name_;
  bool abstract_ = false;
};

/// Which users may be at the other end of a connection. The process's own
/// effective uid is always allowed; `allowed_uids` adds others, and
/// `allowed_gids` admits any peer whose (effective, as SO_PEERCRED reports it)
/// gid is listed.
struct access_policy {
  std::vector<uid_t> allowed_uids;
  std::vector<gid_t> allowed_gids;

  /// Whether a peer running as `uid` is allowed by its uid alone.
  [[nodiscard]] bool allows(uid_t uid) const noexcept;
  /// Whether a peer running as `uid` with group `gid` is allowed.
  [[nodiscard]] bool allows(uid_t uid, gid_t gid) const noexcept;
};

/// Who is at the other end, as the kernel recorded it when the connection was
/// made (the process that called connect, listen or socketpair).
struct peer_credentials {
  process_identity process;
  uid_t uid = 0;
  gid_t gid = 0;
};

/// One frame to send: `fd` >= 0 passes a copy of that descriptor (the
/// caller keeps its own).
struct outgoing_frame {
  std::uint16_t type = 0;
  std::span<const std::byte> payload;
  int fd = -1;
};

/// One received frame.
struct frame {
  std::uint16_t type = 0;
  std::vector<std::byte> payload;
  /// The descriptor sent with the frame, if any: the peer's choice of file,
  /// so unique_fd::from_peer (closed on the closer threads until a check
  /// calls mark_safe_to_close()).
  unique_fd fd;
};

class listener;
namespace detail {
class __attribute__((visibility("hidden"))) private_directory;  // hidden: the library's own
}  // namespace detail

/// One end of a connected channel.
///
/// Thread-safety: send(), post() and flush() may be called from several
/// threads at once (each call's frames go out whole, never interleaved with
/// another call's, in the order the calls take the connection's send lock:
/// one thread's calls in the order it makes them), and so may receive()
/// (each frame goes to one caller); sends and receives run in parallel. peer(),
/// max_payload() and native_handle() never change. Moving or destroying a
/// connection must not overlap any other call on it.
/// Invariants: the peer's uid was allowed by the access policy when the
/// connection was made. Once a send or receive fails (protocol_error,
/// connection_closed, or any other error, since the stream may then be out of
/// step) the connection is broken: the socket is shut down both ways, so the
/// peer sees end of stream and a blocked receive() returns, and every later
/// send or receive throws connection_closed. The exceptions are a
/// timeout_error before any byte moved (nothing arrived within
/// receive_for's deadline; a send found no room at all before its own) and
/// a send() refused before any byte went because it passed a descriptor to
/// a peer that takes none (protocol_error; SO_PASSRIGHTS off at its end,
/// Linux 6.16 on): the stream is still in step and the connection stays
/// usable. A timeout in the
/// middle of a batch, a peer that sent part of one and stalls or stopped
/// reading part-way, breaks it. The descriptor itself is closed
/// only by the destructor, so native_handle() never names a reused descriptor;
/// it drops whatever post() still queued, closing its copies of descriptors
/// (the peer sees end of stream where those frames would have been).
/// A moved-from connection may only be destroyed or assigned to.
class connection {
 public:
  static constexpr std::size_t default_max_payload = 64 * 1024;
  /// How long connect() waits for the listener's backlog unless told.
  static constexpr std::chrono::milliseconds default_connect_timeout = std::chrono::seconds(60);
  /// How long adopt_pair_end waits for the other end's credentials unless told.
  static constexpr std::chrono::milliseconds default_pair_greeting_timeout = std::chrono::seconds(60);

  /// Connects to the listener at `address` and checks the server's uid
  /// against `policy`. Frames received carry at most `max_payload` bytes.
  /// Waits up to `timeout` for room in the listener's backlog (a server that
  /// stopped accepting). Throws connection_closed when no one listens there
  /// (or the server exited at once), peer_refused when the server's uid is
  /// not allowed, timeout_error when the backlog stayed full, backend_error
  /// when the system refuses.
  [[nodiscard]] static connection connect(const channel_address& address, const access_policy& policy,
                                          std::size_t max_payload = default_max_payload,
                                          std::chrono::milliseconds timeout = default_connect_timeout);

  /// Takes a connected AF_UNIX stream socket (say, a socketpair end a child
  /// process inherited) and checks its peer's uid against `policy`. For a
  /// socketpair the kernel records the creator as the peer of both ends, so
  /// the end the creator keeps names the creator itself. Throws
  /// invalid_argument when `connected_socket` is not a connected AF_UNIX
  /// stream socket, peer_refused or connection_closed as connect() does; the
  /// socket is closed whenever it throws.
  [[nodiscard]] static connection adopt(unique_fd connected_socket, const access_policy& policy,
                                        std::size_t max_payload = default_max_payload);

  /// adopt() for one end of a socketpair shared with another process (say,
  /// a child started with it): SO_PEERCRED would name the pair's creator on
  /// both ends, so instead each end sends its credentials, which the kernel
  /// checks (SCM_CREDENTIALS), and reads the other's. Both ends must call
  /// this; it waits for the other end's credentials up to `timeout` (a child
  /// that imports much before it adopts its end needs a longer one). Throws
  /// as adopt() does, protocol_error when the other end sends anything else
  /// first, and timeout_error when its credentials have not come in time.
  [[nodiscard]] static connection adopt_pair_end(unique_fd socket_pair_end, const access_policy& policy,
                                                 std::size_t max_payload = default_max_payload,
                                                 std::chrono::milliseconds timeout = default_pair_greeting_timeout);

  connection(connection&& other) noexcept;
  connection& operator=(connection&& other) noexcept;
  /// Shuts the socket down (the peer sees the hang-up at once) and closes
  /// it: with any bytes still unread (a peer's descriptors may be queued
  /// there, and would be closed with it), on the closer threads.
  ~connection();

  /// Sends one frame of `type` with `payload` and, when `fd` >= 0, a copy of
  /// `fd` (the caller keeps its own). Bytes post() queued go first. Blocks
  /// until all of it is sent, or
  /// until the send timeout (set_send_timeout) passes: then timeout_error,
  /// and the connection is broken unless nothing of this call had gone.
  /// Throws connection_closed when the peer is gone or the connection is broken;
  /// protocol_error when a descriptor was to go to a peer that takes none
  /// (refuse_descriptors there; the connection stays usable when nothing of
  /// this call had gone, and is closed otherwise); invalid_argument when the payload does not fit a frame (4 GiB less the
  /// headers) or `fd` is not an open descriptor (nothing is sent and the
  /// connection stays usable); backend_error when the system refuses.
  void send(std::uint16_t type, std::span<const std::byte> payload, int fd = -1);

  /// Sends every later frame of this side through a ring of `bytes` in
  /// shared memory (rounded up to a power of two from 4 KiB to 64 MiB): a
  /// sealed memfd whose descriptor goes to the peer now, on the socket. A
  /// frame then reaches a receiver that is spinning (set_receive_spin)
  /// without a system call on either side; one that is not is woken through
  /// the socket, so native_handle() keeps its meaning. Frames with a
  /// descriptor, or over a quarter of the ring, still go on the socket, in
  /// their place in the order. The peer must be a connection of this
  /// version that called allow_peer_ring() (others refuse the ring's frame
  /// with protocol_error and close the connection). A full ring makes send()
  /// wait for the peer to read, like a full socket. Returns false, having
  /// started nothing, when the peer has hung up already: what it sent before
  /// is still there to receive, so the connection is not closed (a later
  /// send meets the same end). Throws invalid_argument when a ring was
  /// started already or post() was used (a ring is for send() alone);
  /// otherwise as send() does.
  bool start_ring(std::size_t bytes);

  /// Lets the peer send through a ring of its own (its start_ring()): this
  /// side then maps the memory the peer names, of up to `max_bytes` (a
  /// larger ring is a protocol_error; rings hold a power of two of at most
  /// max_ring_bytes), and checks all it reads there. Until called, a peer's
  /// ring is a protocol_error, so a server takes no memory from clients that
  /// did not ask for it. Call it before the peer's ring can arrive (say,
  /// before the first receive). The bound matters for a peer of another
  /// user: a page of its ring that it never allocated would be allocated by
  /// this side's first read of it, and charged to this process's memory
  /// cgroup (a peer of this process's user whose ring lacks a page is
  /// refused: the system tells of its pages only to their owner's user).
  void allow_peer_ring(std::size_t max_bytes = max_ring_bytes);
  /// The smallest and the largest ring a connection makes or takes.
  static constexpr std::size_t min_ring_bytes = 4096;
  static constexpr std::size_t max_ring_bytes = std::size_t{64} << 20;

  /// Takes no descriptor from the peer from now on: a batch that brings one
  /// is a protocol_error, and the descriptors are never installed here
  /// (SO_PASSCRED is turned off: no control message is read at all), so a
  /// peer that should never send one cannot fill this process's descriptor
  /// table with descriptors kept while its batch stalls, nor make it close a
  /// file of its own (which would drop its POSIX locks). From Linux 6.16 on,
  /// the kernel refuses them at the peer's send (SO_PASSRIGHTS off: its
  /// sendmsg fails with EPERM, a shoal peer's send() with protocol_error);
  /// before, the kernel closes them in the read, on the reading thread,
  /// where a peer's socket set to linger would hold it (see
  /// unique_fd::from_peer). Descriptors queued before this call still
  /// come (listener::refuse_descriptors leaves none). A peer's ring
  /// (allow_peer_ring) comes as a descriptor too. Call it before the first
  /// receive.
  void refuse_descriptors();

  /// Sends `frames` in order, packed into as few batches as the limits allow
  /// (max_batch_frames, max_batch_descriptors, batch_packing_bytes), each
  /// batch one sendmsg (more only when the socket takes part of it): a
  /// receiver reads a batch of at most min_batch_bytes with one call too.
  /// Throws as send() does; when a descriptor is not open or a payload is
  /// too large, nothing is sent.
  void send(std::span<const outgoing_frame> frames);

  /// send() that never waits for the peer, for a server that must not be
  /// held up by a client that stops reading: what the socket takes now goes,
  /// and the rest is queued — with copies of the descriptors not yet sent,
  /// each going with its own batch's first byte and closed, once sent or
  /// dropped, on the closer thread — and goes out, after
  /// everything queued before it and before anything sent later, on later
  /// flush() calls (or a send(), which writes the queue out first). Poll
  /// native_handle() for POLLOUT while unsent_bytes() > 0. The queue has no
  /// bound of its own: the caller holds a peer to one (unsent_bytes(),
  /// unsent_since()). Throws as send() does, never timeout_error; waits only
  /// for another thread's send or post on this connection, without a
  /// deadline (a blocking send() holds the lock up to its send timeout).
  /// invalid_argument once start_ring() was called.
  void post(std::span<const outgoing_frame> frames);
  /// post() of one frame.
  void post(std::uint16_t type, std::span<const std::byte> payload, int fd = -1);

  /// Writes what the socket takes of the queued bytes now, in order, without
  /// waiting; returns unsent_bytes() after. Throws as send() does (the
  /// connection is broken then), never timeout_error.
  std::size_t flush();

  /// Bytes post() queued that the socket has not taken yet. Readable from
  /// any thread.
  [[nodiscard]] std::size_t unsent_bytes() const;
  /// When the oldest frames still queued were posted (their post() call);
  /// nullopt while nothing is queued. It moves on only when those frames
  /// have gone whole, so a peer that reads part of them, slowly, does not
  /// reset it: a server holds each answer to a deadline with it. Readable
  /// from any thread; it and unsent_bytes() are read one at a time, and
  /// another thread's post or flush may come between the two reads.
  [[nodiscard]] std::optional<std::chrono::steady_clock::time_point> unsent_since() const;

  /// Receives one frame, blocking until it arrives. Throws protocol_error
  /// when the peer sent something malformed (a wrong magic or version, a
  /// frame shorter than its header, a payload over max_payload(), more than
  /// one descriptor), saying what was wrong and what was expected;
  /// connection_closed when the peer closed the connection or it is broken;
  /// backend_error when the system refuses. Any descriptor that came with a
  /// refused frame is closed.
  [[nodiscard]] frame receive();
  /// receive(), but gives up after `timeout` (zero: only what has already
  /// arrived): timeout_error. The connection stays usable when no byte of
  /// the next batch had come, and when the deadline had passed before the
  /// call read any (a zero timeout): what came of a batch then is kept, and
  /// the next receive picks it up. When the deadline passes while the call
  /// waits for the rest of a batch (a peer that stalls mid-batch), the stream
  /// is out of step and the connection is broken. Waiting for another
  /// thread's receive counts against the timeout.
  [[nodiscard]] frame receive_for(std::chrono::milliseconds timeout);

  /// receive() without waiting, for a reader that polls many connections:
  /// reads what has arrived and returns the next frame when a whole batch is
  /// in (or frames of one already read are pending); nullopt when the rest
  /// of the batch has not come yet — the part that came is kept, and a later
  /// try_receive() or receive() goes on from there — or when another
  /// thread's receive holds the connection. A peer that stalls mid-batch is
  /// never waited for here: incomplete_since() says since when to hold it to
  /// a deadline. Throws as receive() does, never timeout_error.
  [[nodiscard]] std::optional<frame> try_receive();
  /// try_receive(), but when nothing has come it polls the peer's ring for
  /// up to `spin` without sleeping, the sender told meanwhile that it need
  /// not wake this side (as receive() spins, set_receive_spin): for a reader
  /// that sleeps on native_handle() in slices of its own (to handle signals
  /// or a close) and wants the ring's latency. Without a ring it is
  /// try_receive(). Never waits for the socket.
  [[nodiscard]] std::optional<frame> try_receive(std::chrono::nanoseconds spin);

  /// When try_receive() read the start of the batch it has not read whole
  /// yet, or nullopt when it holds no such part. Readable from any thread.
  [[nodiscard]] std::optional<std::chrono::steady_clock::time_point> incomplete_since() const;

  /// Frames that came in a batch already read and that receive() has not
  /// returned yet, plus one while the peer's ring holds entries: while it
  /// is not zero, receive() from an honest peer returns at once, and
  /// native_handle() need not poll readable. (A ring entry may mark a frame
  /// that comes on the socket, which an honest peer sends first; one that
  /// never sends it holds receive() until its deadline. With a peer you do
  /// not trust, drain with try_receive() or receive_for().)
  [[nodiscard]] std::size_t pending() const;

  /// receive() first polls for up to `spin` without sleeping before it
  /// blocks: lower latency for a busy CPU core. Zero (the default) never
  /// spins.
  void set_receive_spin(std::chrono::nanoseconds spin);

  /// Every later send() gives up when it has not gone out whole within
  /// `timeout` of its call (waiting for another thread's send included),
  /// throwing timeout_error: a peer that stops reading cannot hold a sender
  /// forever. Zero (the default) waits without a deadline.
  void set_send_timeout(std::chrono::milliseconds timeout);

  [[nodiscard]] const peer_credentials& peer() const noexcept;
  /// The largest payload receive() accepts.
  [[nodiscard]] std::size_t max_payload() const noexcept;
  /// The socket, for poll(): when pending() is zero, readable when a frame
  /// or end of stream waits. With the peer's ring (start_ring) it may also be
  /// readable for a wake-up whose frames a spinning receive() already took:
  /// try_receive() then returns nullopt. Reading or writing it directly
  /// would put the stream out of step.
  [[nodiscard]] int native_handle() const noexcept;
  /// Whether an earlier failure closed this connection.
  [[nodiscard]] bool broken() const;

 private:
  friend class listener;
  struct __attribute__((visibility("hidden"))) state;  // hidden: the library's own

  explicit connection(std::unique_ptr<state> s) noexcept;
  /// Reads the peer's credentials from `socket` and checks them; `side` names
  /// the caller in error messages.
  static connection identify_peer(unique_fd socket, const access_policy& policy, std::size_t max_payload,
                                  const std::string& side);
  /// Checks `credentials` against `policy` and identifies the process.
  static connection checked_peer(unique_fd socket, const ucred& credentials, const access_policy& policy,
                                 std::size_t max_payload, const std::string& side);
  state& usable(const char* operation) const;
  frame receive_until(std::optional<std::chrono::steady_clock::time_point> until);
  template <class Read>
  static bool refill(state& s, Read read);
  static frame next_unread(state& s);
  /// try_receive()'s work, under the receive lock.
  static std::optional<frame> take_ready(state& s);
  // Runs `body(started)` with send()'s error rules (the caller holds the
  // send lock): `started` says whether any of the call's bytes may have gone.
  template <class Body>
  static void sending(state& s, const char* operation, Body body);

  std::unique_ptr<state> state_;
};

/// A listening socket that hands out checked connections.
///
/// Thread-safety: accept() and accept_for() may be called from several
/// threads at once; each pending connection goes to one of them.
/// Construction and destruction must not overlap other calls.
/// Invariants: a path's directory belongs to this process's uid and has no
/// group or other permission bits, and is the directory the socket was
/// bound in: it is opened once, checked through that descriptor and bound
/// through it (/proc/self/fd/<n>/<name>, so /proc must be mounted), so that
/// renaming directories in its parent cannot move the socket elsewhere. The
/// destructor removes the socket file unless another file has taken its
/// place, then the directory if this listener created it and it is empty.
class listener {
 public:
  /// Listens at `address`; accepted connections follow `policy` and receive
  /// payloads of at most `max_payload` bytes. For a path, the directory is
  /// created with mode 0700 when missing (its parent must exist; the
  /// directory and the socket file's name, as /proc/self/fd/<n>/<name>, must
  /// fit sockaddr_un), and a
  /// leftover socket file that no one listens on is replaced. To tell whether
  /// a listener is there, it connects a datagram socket, which the kernel
  /// refuses for its type where a stream socket is bound: a live listener
  /// sees no connection. Listeners starting at one path take turns
  /// (an flock on `.<name>.lock` beside the socket file, held from that check
  /// to listen() and removed after): one never takes another's socket, bound
  /// and not yet listening, for a leftover, and of several starting over a
  /// leftover one starts; a lock another process holds past 2 s (stopped,
  /// or hostile: one of this uid) is a timeout_error. Throws os_error with
  /// code EADDRINUSE when the address is in use; invalid_argument when the
  /// directory is not this uid's own 0700 directory or a file that is not a
  /// socket is in the way; backend_error when the system refuses.
  listener(const channel_address& address, access_policy policy,
           std::size_t max_payload = connection::default_max_payload);
  listener(const listener&) = delete;
  listener& operator=(const listener&) = delete;
  /// Removes the socket file (a path's), when it is still this listener's
  /// own and this is the process that made the listener: a child forked
  /// since, ending, leaves the parent's socket where it is; so is it left
  /// when another process holds the start lock past 2 s (a later listener
  /// replaces it as a leftover). In the process
  /// that made it, connections still waiting to be accepted are refused,
  /// closed on the closer threads (they may hold a peer's descriptors).
  ~listener();

  /// Waits for the next connection and checks its peer. A connection whose
  /// process exited before it could be identified (a client that gave up
  /// at once) is closed and the wait goes on. Throws
  /// peer_refused when the peer's uid is not allowed (its socket is closed;
  /// the listener keeps working); backend_error when the system refuses (out
  /// of descriptors, say).
  [[nodiscard]] connection accept();
  /// As accept(), but gives up after `timeout` and returns nullopt (also
  /// when the time runs out while it closes a connection of a process gone).
  [[nodiscard]] std::optional<connection> accept_for(std::chrono::milliseconds timeout);

  /// For a server none of whose peers sends descriptors: from Linux 6.16
  /// on, connections made from now on refuse them in the kernel from their
  /// first byte (SO_PASSRIGHTS off, which they inherit: a peer's sendmsg
  /// with one fails), even before accept(). Each accepted connection still
  /// needs connection::refuse_descriptors (older kernels, and the reads).
  /// Call it before peers connect.
  void refuse_descriptors();

  /// Removes from this listener's directory the socket files that listeners
  /// killed before they could clean up (SIGKILL) left, of a server that
  /// names its sockets `<prefix><pid>-<rest>.sock` (the Python Consumer:
  /// shoal-<pid>-<hex>.sock): named for a pid that no longer runs, sockets
  /// of this uid (links are not followed), at least 10 s old (a younger one
  /// may be a listener's between bind and listen), with no one listening. Anything
  /// else, and an entry that cannot be judged (its start lock held past 2 s
  /// included), is left. Returns how many it
  /// removed; 0 for an abstract name. backend_error when the directory
  /// cannot be read.
  std::size_t remove_abandoned_sockets(std::string_view prefix) const;

  [[nodiscard]] const channel_address& address() const noexcept { return address_; }
  /// The listening socket, for poll(): readable when a connection waits.
  [[nodiscard]] int native_handle() const noexcept { return socket_.get(); }

 private:
  using deadline = std::optional<std::chrono::steady_clock::time_point>;
  std::optional<connection> accept_until(deadline until);

  channel_address address_;
  access_policy policy_;
  std::size_t max_payload_;
  std::unique_ptr<detail::private_directory> directory_;  // a path's directory, opened once; null for an abstract name
  std::string file_name_;                                 // the socket file's name in it
  unique_fd socket_;
  // Replaced by a closed peer's socket in a fork() child, so that an abstract
  // name is unbound once this process closes it; declared after the socket:
  // released first.
  std::unique_ptr<shoal::detail::fork_released_socket> released_in_children_;
  // The socket file's identity, so the destructor removes only its own file.
  dev_t file_device_ = 0;
  ino_t file_inode_ = 0;
  pid_t owner_pid_ = 0;  // the process that made it, which alone removes its file and drops who waits
};

}  // namespace shoal::channel

#pragma GCC visibility pop
