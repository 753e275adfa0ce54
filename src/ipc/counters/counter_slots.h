// The producer's reference-counter slots over any number of counter files,
// one holder process per file.
//
// Each file counts the references of one holder (counter_file.h), so what a
// holder writes into its file can only ever concern its own references, and
// nothing it writes can stop the producer serving other holders. Which slots
// are handed out, to whom and under which generation is kept here, in the
// producer's own memory: decisions never rest on what a holder can write
// (a dead holder is recognised by this record, not by the slot's fields).
//
// A holder's new file is created when its files are full; a file whose last
// slot is freed is closed (its memory goes once its holder closes it too),
// except the holder's newest while the holder lives and is connected (a
// holder's last connection closing closes its empty files). Freed slots are
// reused first.
//
// Holders are also recorded as such (holder_info): how many connections
// this process has to them, and whether they were revoked (the record stays
// until the process dies).
//
// Thread-safety: none; the producer state's mutex guards it.
#pragma once

#include <cstddef>
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

/// A reference handed out and not released: who holds it, on which block.
struct held_reference {
  process_identity holder;
  std::uintptr_t block = 0;
  std::size_t bytes = 0;
};

/// A counter file closed, and the holder it counted for.
struct closed_file {
  std::uint64_t id = 0;
  process_identity holder;
};

struct holder_info {
  process_identity holder;
  std::size_t connections = 0;
  bool revoked = false;
};

class counter_slots {
 public:
  explicit counter_slots(std::uint32_t slots_per_file);

  /// A slot held by `holder` on the `bytes` at `block`, in one of that
  /// holder's files.
  slot_ref claim(const process_identity& holder, std::uintptr_t block, std::size_t bytes);
  [[nodiscard]] bool released(const slot_ref& slot) const;
  /// Releases a held slot as its holder would (a share that never arrived);
  /// nothing when its file is gone already (its slots were taken back).
  void release(const slot_ref& slot);
  /// Frees a released slot; may close its file (see take_closed_files).
  void recycle(const slot_ref& slot);
  /// Marks released every slot handed out to a holder that has died;
  /// returns how many.
  std::size_t reclaim_dead_holders();

  /// A connection to `holder` opened / closed. The last one closing closes
  /// the holder's files with nothing handed out.
  void connect(const process_identity& holder);
  void disconnect(const process_identity& holder);
  /// Records `holder` as revoked (see revoked()); its slots stay held.
  void revoke(const process_identity& holder);
  [[nodiscard]] bool revoked(const process_identity& holder) const;
  /// Every reference handed out whose slot is not released yet.
  [[nodiscard]] std::vector<held_reference> held() const;
  /// Every holder connected, revoked, or with a file.
  [[nodiscard]] std::vector<holder_info> holders() const;

  /// The file, kept open for as long as the caller holds it (a send that
  /// passes its descriptor on must not find it closed, or reused, meanwhile).
  [[nodiscard]] std::shared_ptr<const counter_file> file(std::uint64_t file_id) const;
  [[nodiscard]] std::uint32_t slots_per_file() const noexcept { return slots_per_file_; }
  [[nodiscard]] std::size_t file_count() const noexcept { return files_.size(); }
  [[nodiscard]] std::size_t slots_in_use() const noexcept { return in_use_; }
  /// Files closed since the last call (their holders may close theirs).
  std::vector<closed_file> take_closed_files();

 private:
  struct handed_slot {
    std::uint32_t generation = 0;
    std::uintptr_t block = 0;
    std::size_t bytes = 0;
  };
  struct file_entry {
    std::shared_ptr<counter_file> file;
    process_identity holder;
    bool holder_dead = false;
    std::vector<std::uint32_t> free_slots;   // indices never handed out are in here too
    std::vector<std::uint32_t> generations;  // per slot, the last generation handed out
    std::map<std::uint32_t, handed_slot> handed_out;  // by index, until recycled
  };
  using holder_key = std::pair<pid_t, std::uint64_t>;
  struct holder_record {
    std::size_t connections = 0;
    bool revoked = false;
  };
  file_entry& entry(std::uint64_t file_id);
  /// The holder's file with a free slot (lowest id), or a new one.
  std::pair<std::uint64_t, file_entry*> file_for(const process_identity& holder);
  /// Closes the file when nothing of it is handed out and it is not its
  /// living, connected holder's newest.
  void close_if_unused(std::uint64_t file_id, const file_entry& e);

  const std::uint32_t slots_per_file_;
  std::map<std::uint64_t, std::unique_ptr<file_entry>> files_;
  std::map<holder_key, holder_record> holders_;  // connected or revoked ones
  std::size_t in_use_ = 0;
  std::vector<closed_file> closed_;
};

}  // namespace shoal::ipc::detail
