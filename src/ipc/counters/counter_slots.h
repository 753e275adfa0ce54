// The producer's reference-counter slots over any number of counter files.
//
// A new file is created when every slot is taken; a file whose last slot is
// freed is closed (its memory goes once consumers close it too), except the
// newest, which stays for the next claims. Freed slots are reused first.
//
// Thread-safety: none; the sharing state's mutex guards it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "ipc/counters/counter_file.h"

namespace shoal::ipc::detail {

struct slot_ref {
  std::uint64_t file_id = 0;
  slot_ticket ticket;
};

class counter_slots {
 public:
  explicit counter_slots(std::uint32_t slots_per_file);

  /// A slot held by `holder`.
  slot_ref claim(const process_identity& holder);
  [[nodiscard]] bool released(const slot_ref& slot) const;
  /// Releases a held slot as its holder would (a share that never arrived).
  void release(const slot_ref& slot);
  /// Frees a released slot; may close its file (see file_closed).
  void recycle(const slot_ref& slot);
  /// Marks released every held slot whose holder has died; returns how many.
  std::size_t reclaim_dead_holders();

  [[nodiscard]] const counter_file& file(std::uint64_t file_id) const;
  [[nodiscard]] std::uint32_t slots_per_file() const noexcept { return slots_per_file_; }
  [[nodiscard]] std::size_t file_count() const noexcept { return files_.size(); }
  [[nodiscard]] std::size_t slots_in_use() const noexcept { return in_use_; }
  /// Ids of files closed since the last call (consumers may close theirs).
  std::vector<std::uint64_t> take_closed_files();

 private:
  struct file_entry {
    counter_file file;
    std::vector<std::uint32_t> free_slots;  // indices never handed out are in here too
    std::uint32_t in_use = 0;
  };
  file_entry& entry(std::uint64_t file_id);

  const std::uint32_t slots_per_file_;
  std::map<std::uint64_t, std::unique_ptr<file_entry>> files_;
  std::size_t in_use_ = 0;
  std::vector<std::uint64_t> closed_;
};

}  // namespace shoal::ipc::detail
