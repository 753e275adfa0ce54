// Typed errors thrown by every shoal layer.
//
// Each message says what was asked, what was found, and what to do about it.
// Library code never calls exit() or abort() on a recoverable error: it throws
// one of these. All types are immutable after construction and safe to share
// between threads.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal {

/// Base of every error shoal throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The caller passed something the operation cannot accept: a zero size, a
/// pointer shoal did not hand out, a handle that was already closed, a
/// malformed message. Nothing was changed.
class invalid_argument : public error {
 public:
  using error::error;
};

/// The device (or the configured limit) cannot provide the memory asked for.
class out_of_memory : public error {
 public:
  out_of_memory(const std::string& what, std::size_t requested_bytes)
      : error(what), requested_bytes_(requested_bytes) {}
  /// Bytes the failed request asked for.
  [[nodiscard]] std::size_t requested_bytes() const noexcept { return requested_bytes_; }

 private:
  std::size_t requested_bytes_;
};

/// The requested backend or device does not exist here: no CUDA driver, no
/// CUDA device, an ordinal past the device count, or a build without CUDA.
class device_unavailable : public error {
 public:
  using error::error;
};

/// A call into the device runtime or the operating system failed. `call()`
/// names the call, `detail()` holds its own error text (CUDA's error string,
/// or strerror(errno)).
class backend_error : public error {
 public:
  backend_error(std::string call, std::string detail);
  [[nodiscard]] const std::string& call() const noexcept { return call_; }
  [[nodiscard]] const std::string& detail() const noexcept { return detail_; }

 private:
  std::string call_;
  std::string detail_;
};

/// A call into the operating system failed with `code()`, an errno value.
/// `detail()` is its strerror text, or a fuller account of the same condition
/// (an address already in use, a parent directory that does not exist).
/// The code comes first so that `throw os_error{errno, "open(" + path + ")"}`
/// reads errno before the call's name is built: a braced list is evaluated
/// left to right.
class os_error : public backend_error {
 public:
  os_error(int code, std::string call);
  os_error(int code, std::string call, std::string detail);
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// Work enqueued on a stream failed after the call that enqueued it returned
/// (a host task threw, a kernel faulted). Reported by the next synchronize
/// or query; on CUDA a kernel fault also by any later call, which CUDA
/// fails with it for the rest of the process (the message says to restart).
class stream_error : public error {
 public:
  using error::error;
};

/// A stream-ordering rule was broken: memory was about to be handed out
/// while a stream could still use it. Reported by the allocator's debug mode.
class ordering_violation : public error {
 public:
  using error::error;
};

/// An internal invariant of shoal's own state does not hold: a bug in shoal
/// (or memory corrupted from outside). `invariant()` names the one broken;
/// the message says where (segment, block) and what was found. Reported by
/// caching_allocator::check_invariants.
class invariant_violation : public error {
 public:
  invariant_violation(std::string invariant, const std::string& what)
      : error(what), invariant_(std::move(invariant)) {}
  [[nodiscard]] const std::string& invariant() const noexcept { return invariant_; }

 private:
  std::string invariant_;
};

/// The process at the other end of a connection closed it or died.
class connection_closed : public error {
 public:
  using error::error;
  /// A send that met the end: `part_sent` when some of that send had gone
  /// (a frame the peer may still read), as a send to a shared ring publishes
  /// an entry before the wake-up that then fails.
  connection_closed(const std::string& what, bool part_sent) : error(what), part_sent_(part_sent) {}
  /// Tag of a connect that found no one listening at the address.
  struct no_listener_tag {};
  connection_closed(const std::string& what, no_listener_tag) : error(what), no_listener_(true) {}
  /// Whether the send that threw this had put part of its frames out.
  [[nodiscard]] bool part_sent() const noexcept { return part_sent_; }
  /// Whether a connect found no one listening (nothing was ever connected),
  /// rather than a peer that closed a connection.
  [[nodiscard]] bool no_listener() const noexcept { return no_listener_; }

 private:
  bool part_sent_ = false;
  bool no_listener_ = false;
};

/// A wait ran past its deadline: no message came in time, the peer stopped
/// reading what was sent to it, or a wait within this process (a transfer
/// engine's batch or room, a borrower's call queued behind another) ended.
/// The operation that throws it says whether its connection, if any, is
/// still usable.
class timeout_error : public error {
 public:
  using error::error;
};

/// Another process sent something the protocol does not allow: a bad
/// header, an unknown message, a field out of range. The connection it came
/// on is closed; nothing else is affected.
class protocol_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

/// A peer was refused: its credentials (uid) are neither the owner's nor on
/// the allow-list, it is not the process it claims to be, or it was revoked;
/// or a lender refused this borrower (turned away, or past its quota).
class peer_refused : public error {
 public:
  using error::error;
};

/// Memory's content is not what the caller expected: a published region's
/// content hash is not the one asked for (another model, or another
/// version of it), or another uid than the one asked for published it.
/// Nothing was mapped.
class content_mismatch : public error {
 public:
  using error::error;
};

}  // namespace shoal

#pragma GCC visibility pop
