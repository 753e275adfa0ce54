// A one-way byte ring in shared memory that carries a connection's frames
// without a system call while the receiver is spinning for them
// (connection::start_ring).
//
// The sender makes the ring's two files and sends their descriptors over
// the socket, in one batch: a ring_announce frame (payload: the capacity;
// descriptor: the ring file) and a ring_fields frame right after it
// (descriptor: the receiver's fields file). From then on every frame of
// that direction is an entry in the ring, in order; a frame with a
// descriptor, or too large for the ring, goes on the socket and leaves a
// marker entry where it belongs in the order. The socket also carries
// wake-ups: after publishing, the sender sends a ring_wake frame unless the
// receiver is spinning, has taken everything already, or has not read the
// last wake-up yet (its socket is readable).
//
// The ring file (memfd, ring_header_bytes + capacity) is the sender's alone
// to write: it maps it, allocates every page, then seals it against
// shrinking, growing and writes through any later mapping or write()
// (F_SEAL_FUTURE_WRITE, which also forbids punching holes); its own
// mapping stays writable. The receiver maps it read-only.
//   line 0: tail u64 — bytes published
//   line 1: wakes sent u64 — counted before each goes
//   data from ring_header_bytes on
// The fields file (memfd, ring_fields_bytes; sealed against shrinking and
// growing, not writes) holds what the receiver writes:
//   head u64 at 0 — bytes consumed; spinning u32 at 8 — 1 while the
//   receiver polls the ring; wakes read u64 at 16
// Entry, 8-byte aligned, wrapping at the end of the data:
//   payload bytes u32 | type u16 | kind u16 (0: payload follows, 1: the frame
//   is the next one on the socket) | payload | zero padding to 8
//
// Both sides treat what the other writes as hostile: the reader maps only
// memfds on tmpfs sealed against shrinking (checked before their sizes are
// read, so a mapping can never run past its file), of exactly the sizes a
// ring has; the ring file sealed against writes and read-only, and — where
// mincore() tells the truth: for the file's owner's user, or a holder of
// CAP_FOWNER — with every page in memory, then locked there (best effort),
// so that no read of it allocates memory charged to the receiver: the seal
// keeps any page from being punched out after the check, the lock from
// being swapped out. The sender can punch the fields file's one page out,
// which only makes the receiver's next store allocate that page again. The
// reader checks that the tail stays within capacity of its head and every
// entry within what is published, and copies a payload out before anything
// reads it; the writer checks that the reader's head moves forward and
// never past the tail. A violation is a protocol_error. (docs/architecture.md
// has the reasoning and the limits.)
//
// Not thread-safe: the connection serializes each side (its send and
// receive locks), except a reader's seems_to_have_entries(), which any
// thread may call.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "shoal/core/unique_fd.h"

namespace shoal::channel::detail {

/// Frame types the connection keeps to itself (a protocol's frames use others).
inline constexpr std::uint16_t ring_announce_type = 0xFFF0;  // payload: capacity u64; descriptor: the ring file
inline constexpr std::uint16_t ring_wake_type = 0xFFF1;      // no payload: the ring has entries
inline constexpr std::uint16_t ring_fields_type = 0xFFF2;    // no payload; descriptor: the fields file (after the announce)

inline constexpr std::size_t ring_header_bytes = 128;
inline constexpr std::size_t ring_fields_bytes = 64;
inline constexpr std::size_t ring_entry_header_bytes = 8;
/// Capacities a receiver accepts: a power of two in this range.
inline constexpr std::size_t min_ring_capacity = 4096;
inline constexpr std::size_t max_ring_capacity = 64 << 20;

/// Bytes an entry with `payload` bytes takes in the ring.
[[nodiscard]] constexpr std::size_t ring_entry_bytes(std::size_t payload) noexcept {
  return ring_entry_header_bytes + (payload + 7) / 8 * 8;
}

/// The mappings of a ring's two files; unmapped when destroyed.
class ring_mapping {
 public:
  ring_mapping() = default;
  ring_mapping(std::byte* ring, std::byte* fields, std::size_t capacity)
      : ring_(ring), fields_(fields), capacity_(capacity) {}
  ring_mapping(ring_mapping&& other) noexcept;
  ring_mapping& operator=(ring_mapping&& other) noexcept;
  ~ring_mapping();

  [[nodiscard]] std::uint64_t load_tail() const noexcept;
  [[nodiscard]] std::uint64_t load_head() const noexcept;
  void store_tail(std::uint64_t) noexcept;
  void store_head(std::uint64_t) noexcept;
  [[nodiscard]] bool receiver_spinning() const noexcept;
  void set_receiver_spinning(bool) noexcept;
  [[nodiscard]] std::uint64_t load_wakes_sent() const noexcept;
  void store_wakes_sent(std::uint64_t) noexcept;
  [[nodiscard]] std::uint64_t load_wakes_read() const noexcept;
  void store_wakes_read(std::uint64_t) noexcept;
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Copies `out.size()` bytes from ring position `at` (wrapping) / to it.
  void copy_out(std::uint64_t at, std::span<std::byte> out) const noexcept;
  void copy_in(std::uint64_t at, std::span<const std::byte> in) noexcept;

 private:
  void unmap() noexcept;

  std::byte* ring_ = nullptr;    // the ring file: header and data
  std::byte* fields_ = nullptr;  // the receiver's fields
  std::size_t capacity_ = 0;
};

/// The sender's side.
class ring_writer {
 public:
  /// A new ring of `capacity` data bytes (rounded up to a power of two in
  /// [min_ring_capacity, max_ring_capacity]). Throws backend_error when the
  /// system refuses.
  explicit ring_writer(std::size_t capacity);

  /// The descriptors a ring_announce and a ring_fields frame carry.
  [[nodiscard]] int ring_fd() const noexcept { return ring_fd_.get(); }
  [[nodiscard]] int fields_fd() const noexcept { return fields_fd_.get(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return map_.capacity(); }
  /// Whether a frame of `payload` bytes goes in the ring itself (else on the
  /// socket, with a marker): at most a quarter of the ring.
  [[nodiscard]] bool fits_inline(std::size_t payload) const noexcept;
  /// Free bytes now, after checking the receiver's head: protocol_error when
  /// it moved back or past what was published.
  [[nodiscard]] std::size_t room();
  /// Writes an entry after the last one written (not yet visible); the
  /// caller made sure of room(). An empty payload with `on_socket` is a marker.
  void write(std::uint16_t type, std::span<const std::byte> payload, bool on_socket);
  /// Makes what write() wrote visible; true when the receiver must be
  /// woken: it is not spinning, has not taken everything published, and has
  /// read every wake-up sent (else one waits in its socket already). Each
  /// check follows the tail's store, as the receiver's stores precede its
  /// look at the tail: one side always sees the other.
  [[nodiscard]] bool publish() noexcept;
  /// Counts a wake-up about to be sent.
  void count_wake() noexcept;
  /// Whether write() wrote anything publish() has not published.
  [[nodiscard]] bool unpublished() const noexcept { return written_ != published_; }
  /// Forgets what write() wrote and publish() did not publish.
  void discard_unpublished() noexcept { written_ = published_; }

 private:
  friend struct ring_writer_steps;  // tests: publish()'s steps one at a time

  unique_fd ring_fd_, fields_fd_;
  ring_mapping map_;
  std::uint64_t written_ = 0;    // the end of the last entry written
  std::uint64_t published_ = 0;  // the tail stored
  std::uint64_t head_seen_ = 0;  // the receiver's head as last checked
  std::uint64_t wakes_ = 0;
};

/// One entry read out of a ring.
struct ring_entry {
  bool on_socket = false;  // a marker: the frame is the next one on the socket
  std::uint16_t type = 0;
  std::vector<std::byte> payload;
};

/// The receiver's side.
class ring_reader {
 public:
  /// Maps the ring a ring_announce and its ring_fields frame brought:
  /// `announced_capacity` from the announce's payload, `ring_file` its
  /// descriptor, `fields_file` the other's. protocol_error when the capacity
  /// is not one a ring has, or a descriptor is not a memfd on tmpfs sealed
  /// against shrinking, of exactly its size — the ring file sealed against
  /// writes and, where mincore() tells the truth, with every page in memory; the
  /// fields file open for writing and not sealed against it; backend_error
  /// when the system refuses a mapping otherwise.
  ring_reader(unique_fd ring_file, unique_fd fields_file, std::uint64_t announced_capacity);

  /// Whether entries wait; for the receiving thread.
  [[nodiscard]] bool has_entries() noexcept;
  /// has_entries() for any thread.
  [[nodiscard]] bool seems_to_have_entries() const noexcept;
  /// The next entry, or nullopt when none is published. protocol_error when
  /// the tail or the entry breaks the layout, the tail is back at a head
  /// has_entries() saw it away from, or a payload exceeds `max_payload`.
  [[nodiscard]] std::optional<ring_entry> take(std::size_t max_payload);
  /// Tells the sender whether this side spins (no wake-up needed). Ordered
  /// with has_entries()/take() after it as publish() is on the other side.
  void set_spinning(bool spinning) noexcept;
  /// Counts a wake-up read off the socket, and tells the sender.
  /// protocol_error when the tail did not move on since the wake-up before
  /// the last one: an honest sender wakes only after a publish, and only
  /// once the last wake-up was read, so a peer sending wake-ups without end
  /// is cut off after two for one tail.
  void note_wake();
  /// Whether the sender counted a wake-up this side has not read yet (it
  /// may still be on its way): once the ring is empty the receiver reads it
  /// off the socket if it has come, so that the socket is not left readable
  /// for frames already taken.
  [[nodiscard]] bool wakes_owed() const noexcept;

 private:
  ring_mapping map_;
  // This side's own count (the shared one is only written): atomic, since
  // seems_to_have_entries() reads it from other threads.
  std::atomic<std::uint64_t> head_{0};
  // The last time has_entries() said yes: the head, and the tail it saw away
  // from it. Receiving thread only.
  struct promise {
    std::uint64_t head = 0, tail = 0;
  };
  std::optional<promise> promised_;
  std::uint64_t wakes_read_ = 0;
  std::array<std::uint64_t, 2> tail_at_wakes_{};  // the tail when the last two wake-ups were read, older first
};

}  // namespace shoal::channel::detail
