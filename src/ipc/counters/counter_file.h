// A reference-counter file: sealed shared memory holding many slots, each
// the count of one reference a holder process has on shared memory.
//
// The producer creates it as a memfd sealed against shrinking and growing
// (and against further seals), so no process that maps it — a consumer
// included — can truncate it under the others (SIGBUS); it has no name, so
// nothing is left in /dev/shm whatever way a process ends, and no other user
// can squat on a name. It travels by descriptor (SCM_RIGHTS). A consumer
// refuses counter memory that is not such a memfd, read-write and unsealed
// for writes (protocol_error).
//
// One file counts the references of one holder process (counter_slots.h):
// every writer of a file is its producer or its one holder, so a holder can
// only ever move its own slots. The producer keeps the truth of its own
// side (which slots it handed out, under which generation) privately, and
// decides what to free on one thing it reads back: whether a slot's word is
// exactly "released under the generation it was handed out with".
//
// A slot is one 64-bit word, generation << 2 | state:
//   free -> held       the producer claims it for the file's holder (holder
//                      pid + start time written first, for diagnosis, then
//                      the word, with release order);
//   held -> received   the holder has mapped the memory the reference is on
//                      (from then on that memory outlives the producer);
//   held or received -> released
//                      the holder drops its reference (one compare-exchange
//                      on the exact word, so a stale release of an earlier
//                      generation can never hit a reused slot), or the
//                      producer takes it back from a holder that died;
//   released -> free   the producer recycles it.
// The producer reads two things back: whether a word is exactly "released
// under the generation it was handed out with" (decides freeing), and
// whether it is still exactly "held" under it (only how long a producer
// waits before it may end: peer::wait_taken; a lying holder loses its own
// memory).
// The producer stores its words outright rather than trusting what it finds,
// so whatever a holder writes into a free slot is overwritten at the next
// claim.
//
// The words belong to the process that created or opened the file: in a
// child it forks, the operations that write a word do nothing (a child
// dropping a storage it inherited must not release its parent's reference,
// and a forked producer must not hand out its parent's slots).
//
// Thread-safety: the word operations are atomic across processes; mapping
// and unmapping belong to one owner.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "shoal/core/process_identity.h"
#include "shoal/core/unique_fd.h"

namespace shoal::ipc::detail {

enum class slot_state : std::uint64_t { free = 0, held = 1, released = 2, received = 3 };

struct slot_ticket {
  std::uint32_t index = 0;
  std::uint32_t generation = 0;
};

class counter_file {
 public:
  struct header;  // the layout, defined in counter_file.cpp
  struct slot;

  /// Creates a new file of `slots` free slots, owned by this process.
  static counter_file create(std::uint32_t slots);
  /// Maps a file another process created, received as `fd`. protocol_error
  /// when it is not a sealed memfd (shrink, grow and seal seals; no write
  /// seal) opened read-write, of exactly `slots` slots, with a valid header.
  static counter_file open(unique_fd fd, std::uint32_t slots);

  counter_file(counter_file&& other) noexcept;
  counter_file& operator=(counter_file&&) = delete;
  counter_file(const counter_file&) = delete;
  ~counter_file();

  [[nodiscard]] std::uint32_t slot_count() const noexcept { return slots_; }
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }

  // ---- producer side
  /// Marks slot `ticket.index` held by `holder` under `ticket.generation`,
  /// whatever the slot held before.
  void claim(slot_ticket ticket, const process_identity& holder) noexcept;
  /// True when the reference of `ticket` was released (or taken back).
  [[nodiscard]] bool released(slot_ticket ticket) const noexcept;
  /// False while the slot of `ticket` is still held, not yet received: its
  /// holder has not mapped the memory (nor let the reference go).
  [[nodiscard]] bool taken(slot_ticket ticket) const noexcept;
  /// Makes a released slot free again.
  void recycle(slot_ticket ticket) noexcept;
  /// Marks `ticket` released whatever its word says: its holder died.
  /// False when it was released already.
  bool take_back(slot_ticket ticket) noexcept;

  // ---- holder side
  /// True when `ticket` names a slot held right now under that generation
  /// and not yet received (a storage message naming a slot twice is refused).
  [[nodiscard]] bool holds(slot_ticket ticket) const noexcept;
  /// Marks the held slot of `ticket` received: the memory it is on is
  /// mapped here. Nothing when it is not held, or in a forked child.
  void mark_received(slot_ticket ticket) noexcept;
  /// Drops the reference of `ticket`; false when it was neither held nor
  /// received (already released, or reclaimed), or when called in a forked child.
  bool release(slot_ticket ticket) noexcept;

 private:
  counter_file(unique_fd fd, void* mapping, std::size_t bytes, std::uint32_t slots);
  [[nodiscard]] slot& at(std::uint32_t index) const noexcept;
  [[nodiscard]] bool owned_here() const noexcept;  // not in a forked child

  unique_fd fd_;
  void* mapping_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint32_t slots_ = 0;
  pid_t owner_ = 0;  // the process that created or opened it
};

}  // namespace shoal::ipc::detail
