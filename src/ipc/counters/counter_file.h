// A reference-counter file: POSIX shared memory holding many slots, each the
// count of one reference a holder process has on shared memory.
//
// The producer creates the file (mode 0600, name "/shoal-<uid>-rc-<pid>-<n>")
// and unlinks the name at once: the memory lives while some process maps it
// and travels by descriptor (SCM_RIGHTS), so no name can outlive the
// processes, whatever way they end.
//
// A slot is one 64-bit word, generation << 2 | state:
//   free -> held       the producer claims it for a holder (pid + start time
//                      written first, then the word, with release order);
//   held -> released   the holder drops its reference (one compare-exchange
//                      on the exact word, so a stale release of an earlier
//                      generation can never hit a reused slot), or the
//                      producer reclaims it for a holder that died;
//   released -> free   the producer recycles it, bumping the generation.
// Only the producer moves slots out of free or released; so a holder and the
// producer never race except on held -> released, which is one CAS.
//
// Thread-safety: the word operations are atomic across processes; mapping
// and unmapping belong to one owner.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "shoal/core/process_identity.h"
#include "shoal/core/unique_fd.h"

namespace shoal::ipc::detail {

enum class slot_state : std::uint64_t { free = 0, held = 1, released = 2 };

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
  /// Maps a file another process created, received as `fd`; validates its
  /// header (protocol_error when it is not a counter file of `slots` slots).
  static counter_file open(unique_fd fd, std::uint32_t slots);

  counter_file(counter_file&& other) noexcept;
  counter_file& operator=(counter_file&&) = delete;
  counter_file(const counter_file&) = delete;
  ~counter_file();

  [[nodiscard]] std::uint32_t slot_count() const noexcept { return slots_; }
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  /// The name it had for the moment it was created (for messages).
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

  // ---- producer side
  /// Marks free slot `index` held by `holder`; returns its ticket.
  slot_ticket claim(std::uint32_t index, const process_identity& holder);
  /// True when the reference of `ticket` was released (or reclaimed).
  [[nodiscard]] bool released(slot_ticket ticket) const noexcept;
  /// Makes a released slot free again (the next claim bumps the generation).
  void recycle(slot_ticket ticket) noexcept;
  /// The ticket of slot `index` when it is held, else nothing.
  [[nodiscard]] std::optional<slot_ticket> held_ticket(std::uint32_t index) const noexcept;
  /// The holder a held slot records.
  [[nodiscard]] process_identity holder(std::uint32_t index) const noexcept;
  /// held -> released for a holder that died; false if it was released first.
  bool reclaim(slot_ticket ticket) noexcept;

  // ---- holder side
  /// True when `ticket` names a slot held right now under that generation.
  [[nodiscard]] bool holds(slot_ticket ticket) const noexcept;
  /// Drops the reference of `ticket`; false when it was not held (already
  /// released, or reclaimed).
  bool release(slot_ticket ticket) noexcept;

 private:
  counter_file(unique_fd fd, void* mapping, std::size_t bytes, std::uint32_t slots, std::string name);
  [[nodiscard]] slot& at(std::uint32_t index) const noexcept;

  unique_fd fd_;
  void* mapping_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint32_t slots_ = 0;
  std::string name_;
};

}  // namespace shoal::ipc::detail
