#include "channel/frame_batch.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "core/deadline.h"
#include "core/descriptor_closer.h"
#include "core/scm_rights.h"
#include "shoal/core/error.h"

namespace shoal::channel::detail {

using shoal::detail::attach_descriptors;
using shoal::detail::descriptor_space;
using shoal::detail::take_descriptors;

namespace {

constexpr std::array<std::byte, 4> batch_magic{std::byte{'S'}, std::byte{'H'}, std::byte{'O'}, std::byte{'L'}};

template <class T>
void put(std::vector<std::byte>& out, std::size_t at, T value) {
  std::memcpy(out.data() + at, &value, sizeof value);  // host byte order: both ends share one machine
}

template <class T>
T get(const std::vector<std::byte>& in, std::size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof value);
  return value;
}

[[noreturn]] void throw_socket_error(const char* call) {
  const int error = errno;
  if (error == EPIPE || error == ECONNRESET) throw connection_closed(std::string(call) + ": the peer closed the connection");
  throw os_error{error, call};
}

// throw_socket_error() for the call that would have passed `descriptors`
// with a batch's first byte. EPERM there is the peer's SO_PASSRIGHTS off.
[[noreturn]] void throw_first_send_error(const char* call, std::span<const int> descriptors) {
  if (errno == EPERM && !descriptors.empty()) {
    throw descriptors_refused(std::string(call) + ": the peer takes no descriptors (SO_PASSRIGHTS is off at its "
                              "end: an endpoint of a protocol that passes none, or one that refuses them) and " +
                              std::to_string(descriptors.size()) + " were to go; nothing of the batch went");
  }
  throw_socket_error(call);
}

std::string hex_bytes(std::span<const std::byte> bytes) {
  std::string out;
  char text[4];
  for (std::byte b : bytes) {
    std::snprintf(text, sizeof text, "%02x", static_cast<unsigned>(b));
    out += out.empty() ? "" : " ";
    out += text;
  }
  return out;
}

// Waits until `socket` has `events` (or an error or hang-up, which the next
// call reports) or `until` passes; then throws the timeout `started` calls for.
void wait_for_socket(int socket, short events, std::chrono::steady_clock::time_point until, bool started,
                     const char* waiting_for) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd waiting{socket, events, 0};
    const int ready =
        ::poll(&waiting, 1, static_cast<int>(std::min<std::chrono::milliseconds::rep>(left.count(), INT_MAX)));
    if (ready > 0) return;
    if (ready < 0 && errno != EINTR) throw os_error{errno, "poll"};
  }
  if (started) {
    throw timeout_mid_batch(std::string("the deadline passed in the middle of a batch, waiting for the peer to ") +
                            waiting_for + ": the stream is out of step");
  }
  throw timeout_error(std::string("the deadline passed waiting for the peer to ") + waiting_for);
}

// While the closers are backlogged for this peer's uid (it holds its own
// closes and its descriptors pile up in this process's table, or the peers
// together passed the process-wide limit), no new batch is begun from a peer
// that may send descriptors: it could install more. A batch begun is read on
// (at most 16 more). A connection that takes none installs none.
bool closers_hold_new_batches(std::uint32_t peer_uid, std::size_t most_descriptors, bool batch_started) noexcept {
  return !batch_started && most_descriptors > 0 && shoal::detail::closer_backlogged(peer_uid);
}

// Whether the peer on `socket` has hung up with nothing left to read (no
// descriptor installed to find out).
bool hung_up_with_nothing_queued(int socket) noexcept {
  pollfd hang_up{socket, POLLRDHUP, 0};
  if (::poll(&hang_up, 1, 0) <= 0 || (hang_up.revents & (POLLRDHUP | POLLHUP)) == 0) return false;
  return nothing_queued_to_read(socket);
}

// Waits, in short sleeps, until the closers no longer hold new batches;
// throws timeout_error (nothing read: the connection stays usable) once
// `until` passes, and connection_closed once the peer has hung up with
// nothing queued (what the read would say, were it not held).
void wait_for_the_closers(int socket, std::uint32_t peer_uid, std::size_t most_descriptors, deadline until) {
  while (closers_hold_new_batches(peer_uid, most_descriptors, false)) {
    if (hung_up_with_nothing_queued(socket)) {
      throw connection_closed("the peer closed the connection (seen while reads waited for the closer threads to "
                              "close the descriptors peers sent)");
    }
    if (until && std::chrono::steady_clock::now() >= *until) {
      throw timeout_error("the deadline passed before the next batch was read: more than " +
                          std::to_string(shoal::detail::closer_owner_backlog_limit()) +
                          " descriptors from peers of uid " + std::to_string(peer_uid) + " (or more than " +
                          std::to_string(shoal::detail::closer_backlog_limit()) +
                          " from all peers) wait to be closed (a peer holds their closes: a socket set to linger, a "
                          "FUSE file), and no batch that may bring more is begun until they are");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Waits until `socket` reports `events` (or a hang-up or error), without a deadline.
void wait_for_socket(int socket, short events) {
  for (;;) {
    pollfd waiting{socket, events, 0};
    const int ready = ::poll(&waiting, 1, -1);
    if (ready > 0) return;
    if (ready < 0 && errno != EINTR) throw os_error{errno, "poll"};
  }
}

// How read_some waits for bytes: `spin` > 0: tries without sleeping until
// it has passed, then waits in poll (until `until`, when there is one);
// `only_ready`: never waits, and returns 0 when the socket has nothing.
struct read_wait {
  std::chrono::nanoseconds spin{0};
  deadline until;
  bool only_ready = false;
};

// One recvmsg of at most `bytes`, keeping every descriptor that came with it
// (at most `most_descriptors` in the whole batch: more is a protocol error).
std::size_t read_some(int socket, std::byte* into, std::size_t bytes, const read_wait& wait,
                      std::vector<unique_fd>& descriptors, std::size_t most_descriptors, std::uint32_t peer_uid,
                      bool batch_started) {
  const auto spin = wait.spin;
  const auto& until = wait.until;
  iovec part{into, bytes};
  // Room for every descriptor one message can carry, and for credentials in
  // case the socket has SO_PASSCRED on: the kernel would close those that
  // did not fit in this thread (a peer's lingering socket could hold it),
  // where those taken past the batch's are refused below and closed on the
  // closer threads. A connection that takes none (SO_PASSCRED off:
  // refuse_descriptors) has no room at all, so the kernel installs none: a
  // descriptor installed and then closed would drop this process's POSIX
  // locks on its file (from Linux 6.16 on the kernel refuses them at the
  // peer's send; before, it closes them here).
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * shoal::detail::max_descriptors_per_message) +
                                CMSG_SPACE(sizeof(ucred))];
  most_descriptors = std::min(most_descriptors, max_batch_descriptors);
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  header.msg_control = control;
  header.msg_controllen = most_descriptors == 0 ? 0 : sizeof control;
  const auto spin_until = std::chrono::steady_clock::now() + shoal::detail::channel_spin(spin);
  // Non-blocking calls, between polls once spinning is over: never parked in
  // recvmsg, so that the closers' hold on new batches (checked before the
  // batch began) is checked again after each wait; a read parked past it
  // could install a whole message's descriptors once the hold had begun.
  ssize_t got;
  for (;;) {
    got = ::recvmsg(socket, &header, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (got >= 0) break;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) throw_socket_error("recvmsg");
    if (wait.only_ready) return 0;
    const auto now = std::chrono::steady_clock::now();
    if (now < spin_until && (!until || now < *until)) continue;  // still spinning
    if (until) {
      wait_for_socket(socket, POLLIN, *until, batch_started, batch_started ? "send the rest of it" : "send a batch");
    } else {
      wait_for_socket(socket, POLLIN);
    }
    if (closers_hold_new_batches(peer_uid, most_descriptors, batch_started)) {
      wait_for_the_closers(socket, peer_uid, most_descriptors, until);
    }
  }
  take_descriptors(header, descriptors, peer_uid);
  if (most_descriptors == 0 && ((header.msg_flags & MSG_CTRUNC) != 0 || !descriptors.empty())) {
    throw protocol_error("a batch came with a descriptor, and this connection takes none (the kernel closed it)");
  }
  if (descriptors.size() > most_descriptors) {
    throw protocol_error("a batch came with more than " + std::to_string(most_descriptors) + " descriptors");
  }
  if ((header.msg_flags & MSG_CTRUNC) != 0) {
    throw protocol_error("a batch came with descriptors and this process has no descriptor free to take them "
                         "(the kernel closed them)");
  }
  if (got == 0) {
    throw connection_closed(batch_started ? "recvmsg: the peer closed the connection in the middle of a batch"
                                          : "recvmsg: the peer closed the connection");
  }
  return static_cast<std::size_t>(got);
}

// Checks the batch header at the start of `buffer` and returns the batch's
// whole size (header, frames, padding).
std::size_t checked_batch_size(const std::vector<std::byte>& buffer, std::size_t max_payload) {
  if (!std::equal(batch_magic.begin(), batch_magic.end(), buffer.begin())) {
    if (std::equal(batch_magic.begin(), batch_magic.end(), buffer.begin() + 4)) {  // version 1: a length, then the magic
      throw protocol_error("the peer speaks frame version 1; this build speaks version " + std::to_string(frame_version) +
                           ": run the same shoal version at both ends");
    }
    throw protocol_error("the batch starts with bytes " + hex_bytes(std::span(buffer).first(4)) +
                         ", not the magic \"SHOL\" (53 48 4f 4c): the peer does not speak shoal's channel protocol");
  }
  const auto version = get<std::uint16_t>(buffer, 4);
  if (version != frame_version) {
    throw protocol_error("the peer speaks frame version " + std::to_string(version) + "; this build speaks version " +
                         std::to_string(frame_version) + ": run the same shoal version at both ends");
  }
  const auto frames = get<std::uint16_t>(buffer, 6);
  if (frames == 0 || frames > max_batch_frames) {
    throw protocol_error("a batch of " + std::to_string(frames) + " frames; a batch holds 1 to " +
                         std::to_string(max_batch_frames));
  }
  const auto body = get<std::uint32_t>(buffer, 8);
  if (body > max_batch_body(max_payload)) {
    throw protocol_error("a batch of " + std::to_string(body) + " bytes after its header is over the " +
                         std::to_string(max_batch_body(max_payload)) + "-byte limit (frames of at most " +
                         std::to_string(max_payload) + " payload bytes)");
  }
  const std::size_t size = batch_header_bytes + body;
  if (size < min_batch_bytes) {
    throw protocol_error("a batch of " + std::to_string(size) + " bytes is shorter than the " +
                         std::to_string(min_batch_bytes) + "-byte minimum that every batch is padded to");
  }
  return size;
}

// Splits a whole, header-checked batch into frames and hands them the
// descriptors in order.
std::vector<frame> split_frames(const std::vector<std::byte>& batch, std::size_t max_payload,
                                std::vector<unique_fd>& descriptors) {
  const auto count = get<std::uint16_t>(batch, 6);
  std::vector<frame> frames(count);
  std::size_t at = batch_header_bytes, claimed = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (batch.size() - at < frame_header_bytes) {
      throw protocol_error("frame " + std::to_string(i) + " of " + std::to_string(count) +
                           " runs past the end of its batch");
    }
    frames[i].type = get<std::uint16_t>(batch, at);
    const auto carries = get<std::uint16_t>(batch, at + 2);
    const auto length = get<std::uint32_t>(batch, at + 4);
    at += frame_header_bytes;
    if (carries > 1) {
      throw protocol_error("frame " + std::to_string(i) + " says it carries " + std::to_string(carries) +
                           " descriptors; a frame carries at most one");
    }
    if (length > max_payload) {
      throw protocol_error("frame " + std::to_string(i) + " has " + std::to_string(length) +
                           " payload bytes, over the " + std::to_string(max_payload) + "-byte limit");
    }
    if (batch.size() - at < length) {
      throw protocol_error("frame " + std::to_string(i) + " of " + std::to_string(count) +
                           " runs past the end of its batch");
    }
    frames[i].payload.assign(batch.begin() + static_cast<std::ptrdiff_t>(at),
                             batch.begin() + static_cast<std::ptrdiff_t>(at + length));
    at += length;
    if (carries == 1) {
      if (claimed == descriptors.size()) {
        throw protocol_error("the batch's frames claim more descriptors than the " +
                             std::to_string(descriptors.size()) + " that came with it");
      }
      frames[i].fd = std::move(descriptors[claimed++]);
    }
  }
  if (claimed != descriptors.size()) {
    throw protocol_error("the batch came with " + std::to_string(descriptors.size()) + " descriptors and its frames claim " +
                         std::to_string(claimed));
  }
  // OR-ed whole, with no early exit, so that the compiler vectorizes it:
  // most batches are mostly padding.
  std::byte padding{0};
  for (std::size_t i = at; i < batch.size(); ++i) padding |= batch[i];
  if (padding != std::byte{0}) {
    throw protocol_error("the padding after the batch's last frame is not all zero bytes");
  }
  return frames;
}

}  // namespace

std::size_t max_batch_body(std::size_t max_payload) noexcept {
  // One frame of max_payload, or a packed batch, with every frame header and the padding.
  const std::size_t largest_frame = std::min<std::size_t>(std::max(max_payload, batch_packing_bytes), UINT32_MAX);
  return largest_frame + max_batch_frames * frame_header_bytes + min_batch_bytes;
}

std::size_t frames_in_next_batch(std::span<const outgoing_frame> frames) noexcept {
  std::size_t count = 0, descriptors = 0, payload = 0;
  for (const outgoing_frame& f : frames) {
    const std::size_t more_descriptors = descriptors + (f.fd >= 0 ? 1 : 0);
    const bool fits = count < max_batch_frames && more_descriptors <= max_batch_descriptors &&
                      payload + f.payload.size() <= batch_packing_bytes;
    if (count > 0 && !fits) break;
    ++count;
    descriptors = more_descriptors;
    payload += f.payload.size();
  }
  return count;
}

std::vector<int> encode_batch(std::span<const outgoing_frame> frames, std::vector<std::byte>& out) {
  const auto carrying = std::count_if(frames.begin(), frames.end(), [](const outgoing_frame& f) { return f.fd >= 0; });
  if (frames.empty() || frames.size() > max_batch_frames || static_cast<std::size_t>(carrying) > max_batch_descriptors) {
    throw invalid_argument("encode_batch: " + std::to_string(frames.size()) + " frames with " + std::to_string(carrying) +
                           " descriptors; a batch holds 1 to " + std::to_string(max_batch_frames) + " frames and at most " +
                           std::to_string(max_batch_descriptors) + " descriptors (frames_in_next_batch says how many)");
  }
  std::size_t body = 0;
  for (const outgoing_frame& f : frames) body += frame_header_bytes + f.payload.size();
  const std::size_t size = std::max(batch_header_bytes + body, min_batch_bytes);
  out.assign(size, std::byte{0});  // zero: the padding
  std::memcpy(out.data(), batch_magic.data(), batch_magic.size());
  put(out, 4, frame_version);
  put(out, 6, static_cast<std::uint16_t>(frames.size()));
  put(out, 8, static_cast<std::uint32_t>(size - batch_header_bytes));
  std::vector<int> descriptors;
  std::size_t at = batch_header_bytes;
  for (const outgoing_frame& f : frames) {
    put(out, at, f.type);
    put(out, at + 2, static_cast<std::uint16_t>(f.fd >= 0 ? 1 : 0));
    put(out, at + 4, static_cast<std::uint32_t>(f.payload.size()));
    if (!f.payload.empty()) std::memcpy(out.data() + at + frame_header_bytes, f.payload.data(), f.payload.size());
    at += frame_header_bytes + f.payload.size();
    if (f.fd >= 0) descriptors.push_back(f.fd);
  }
  return descriptors;
}

bool nothing_queued_to_read(int socket) noexcept {
  int queued = 0;
  return ::ioctl(socket, SIOCINQ, &queued) == 0 && queued == 0;
}

void send_batch(int socket, std::span<const outgoing_frame> frames, std::vector<std::byte>& out, deadline until) {
  const std::vector<int> descriptors = encode_batch(frames, out);
  iovec part{out.data(), out.size()};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  descriptor_space<max_batch_descriptors> control;
  attach_descriptors(header, descriptors, control.bytes);
  // A stream socket may take part of it; the descriptors go with the first byte.
  const int flags = until ? MSG_NOSIGNAL | MSG_DONTWAIT : MSG_NOSIGNAL;
  for (std::size_t done = 0; done < out.size();) {
    const ssize_t sent = done == 0 ? ::sendmsg(socket, &header, flags)
                                   : ::send(socket, out.data() + done, out.size() - done, flags);
    if (sent >= 0) {
      done += static_cast<std::size_t>(sent);
      continue;
    }
    if (errno == EINTR) continue;
    if (until && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_for_socket(socket, POLLOUT, *until, done > 0, "read what was sent to it");
      continue;
    }
    if (done == 0) throw_first_send_error("sendmsg", descriptors);
    throw_socket_error("send");
  }
}

std::size_t write_ready(int socket, std::span<const std::byte> bytes, std::span<const int> descriptors) {
  iovec part{const_cast<std::byte*>(bytes.data()), bytes.size()};  // NOLINT(cppcoreguidelines-pro-type-const-cast): sendmsg only reads it
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  descriptor_space<max_batch_descriptors> control;
  attach_descriptors(header, descriptors, control.bytes);
  for (;;) {
    const ssize_t sent = ::sendmsg(socket, &header, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent >= 0) return static_cast<std::size_t>(sent);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    throw_first_send_error("sendmsg", descriptors);
  }
}

void partial_batch::clear() noexcept {
  got = 0;
  size = 0;
  descriptors.clear();
}

namespace {

// Reads toward the end of the batch in `p` with `read(into, bytes,
// batch_started)`, which returns how many bytes it read (0: none are there
// now); whether the batch is whole. Never more than min_batch_bytes before
// the header is known: every batch is at least that long, so no read
// reaches into the next one.
template <class Read>
bool assemble(partial_batch& p, std::size_t max_payload, Read read) {
  if (p.got == 0) p.bytes.resize(min_batch_bytes);
  while (p.size == 0) {
    const std::size_t got = read(p.bytes.data() + p.got, min_batch_bytes - p.got, p.got > 0);
    if (got == 0) return false;
    p.got += got;
    if (p.got >= batch_header_bytes) {
      p.size = checked_batch_size(p.bytes, max_payload);
      p.bytes.resize(p.size);
    }
  }
  while (p.got < p.size) {
    const std::size_t got = read(p.bytes.data() + p.got, p.size - p.got, true);
    if (got == 0) return false;
    p.got += got;
  }
  return true;
}

std::vector<frame> take_frames(partial_batch& p, std::size_t max_payload) {
  std::vector<frame> frames = split_frames(p.bytes, max_payload, p.descriptors);
  p.clear();
  return frames;
}

}  // namespace

std::vector<frame> read_batch(int socket, std::size_t max_payload, std::chrono::nanoseconds spin, deadline until,
                              partial_batch& partial) {
  try {
    (void)assemble(partial, max_payload, [&](std::byte* into, std::size_t bytes, bool started) {
      if (closers_hold_new_batches(partial.peer_uid, partial.most_descriptors, started)) {
        wait_for_the_closers(socket, partial.peer_uid, partial.most_descriptors, until);
      }
      // Only the batch's first read spins.
      return read_some(socket, into, bytes, {started ? std::chrono::nanoseconds(0) : spin, until}, partial.descriptors,
                       partial.most_descriptors, partial.peer_uid, started);
    });
    return take_frames(partial, max_payload);
  } catch (...) {
    partial.clear();
    throw;
  }
}

std::optional<std::vector<frame>> read_batch_if_ready(int socket, std::size_t max_payload, partial_batch& partial) {
  try {
    const bool whole = assemble(partial, max_payload, [&](std::byte* into, std::size_t bytes, bool started) {
      if (closers_hold_new_batches(partial.peer_uid, partial.most_descriptors, started)) {
        return std::size_t{0};  // as if nothing had come
      }
      return read_some(socket, into, bytes, {{}, std::nullopt, true}, partial.descriptors, partial.most_descriptors,
                       partial.peer_uid, started);
    });
    if (!whole) return std::nullopt;
    return take_frames(partial, max_payload);
  } catch (...) {
    partial.clear();
    throw;
  }
}

}  // namespace shoal::channel::detail
