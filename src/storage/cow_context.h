// The copy-on-write context: one allocation's data shared by several lazy
// clones. Every storage in the family holds one reference.
//
// Protocol (each step's reason beside it):
//   - A storage touches the context only while it holds its reference, and
//     giving the reference up is the last thing it does there: so whoever
//     takes the count to zero, or finds it at one, is alone with the context
//     and sees all the others did (acq_rel on the count).
//   - A materializing copier keeps its reference until its copy, and the
//     event that marks the copy's end, are enqueued: the data cannot be freed
//     under the copy, and a throw on the way leaves the reference whole.
//   - The last reference writes in place (steal); its stream first waits for
//     the data's clone-time writes, every copy's event and every stream a
//     storage that went used the data on. The count stays 1 meanwhile, so a
//     throw there changes nothing.
//   - A storage that gives up the data records the streams it used it on
//     while it still holds its reference: with the allocator (record_stream),
//     so the final free waits for them (its uses on created_on() are covered
//     by the final free itself, which is enqueued on created_on()), and here
//     (read_on_), so a steal's write in place does.
// Invariant: refcount = number of storages holding the context; the data is
// released exactly once: freed by the release that takes the count to zero,
// or stolen by the last reference, whose storage then owns it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "core/fork_epoch.h"
#include "shoal/alloc/caching_allocator.h"

namespace shoal::storage::detail {

class cow_context {
 public:
  cow_context(alloc::caching_allocator& allocator, void* data, std::size_t size, backend::stream_ref written_on);
  ~cow_context();
  cow_context(const cow_context&) = delete;
  cow_context& operator=(const cow_context&) = delete;

  /// One more storage is to be cloned on `cloned_on` from a storage that
  /// used the data on `source_used_on`: copies are ordered after the work
  /// enqueued on all of these streams until then. Takes no reference.
  void note_clone(backend::stream_ref cloned_on, std::span<const backend::stream_ref> source_used_on);
  /// The clone note_clone announced now exists and holds a reference. Only
  /// once nothing can fail any more: the clone's drop gives it up.
  void add_reference() noexcept { refcount_.fetch_add(1, std::memory_order_relaxed); }

  /// What release_for_write leaves its caller.
  struct written {
    void* data;   // the caller's data from now on: its own copy, or data() (stolen)
    bool last;    // the caller held the last reference: it deletes the context
    bool stolen;  // data is data(); else a copy, and the context may be gone unless `last`
  };
  /// Whether the caller's reference is the only one: its write steals the
  /// data and needs no block. Stays true while the caller's storage is
  /// locked (only a holder adds a reference).
  [[nodiscard]] bool sole_holder() const noexcept { return refcount_.load(std::memory_order_acquire) == 1; }
  /// The caller's storage, which used the data on `used_on`, gives up the
  /// shared data to write on `stream`. Gives its own copy, made on `stream`
  /// into `block` (size() bytes the caller allocated on `stream`, with no
  /// lock held: an allocation may call out-of-memory observers, which may
  /// take any lock); or, when it holds the last reference, data() itself
  /// (steal): its storage's release must then wait for created_on() too.
  /// `block` may be null only when sole_holder(). The caller frees `block`
  /// unless a copy went there (not stolen), and on a throw, which leaves
  /// its reference whole.
  written release_for_write(backend::stream_ref stream, std::span<const backend::stream_ref> used_on, void* block);
  /// The caller's storage, which used the data on `used_on`, is gone: frees
  /// the data if it was the last one. Returns true when the context must be
  /// deleted by the caller. A use it cannot record (no host memory, the
  /// record refused) is waited for on the host instead: the reference always
  /// goes.
  bool release_for_drop(std::span<const backend::stream_ref> used_on) noexcept;

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] backend::stream_ref created_on() const noexcept { return created_on_; }

 private:
  // Makes `stream` wait for the writes the data had when it was cloned.
  void order_after_clone_writes(backend::stream_ref stream);
  // Makes a stealer's `stream` wait for everything that read the data.
  void order_before_steal(backend::stream_ref stream);
  // Copies the data into `block`, a block of the caller's, on `stream`.
  void copy_out(backend::stream_ref stream, std::span<const backend::stream_ref> used_on, void* block);
  void note_copy_done(backend::stream_ref stream);
  void note_written_on(backend::stream_ref stream);
  // The data's free and a steal wait for `used_on`.
  void record_uses(std::span<const backend::stream_ref> used_on);
  // Gives up the caller's reference; the last one frees the data. True
  // when it was the last: the caller deletes the context.
  bool release() noexcept;

  alloc::caching_allocator& allocator_;
  void* const data_;
  const std::size_t size_;
  const backend::stream_ref created_on_;  // also in written_on_; read without the lock
  std::atomic<std::int64_t> refcount_{1};
  const shoal::detail::fork_epoch epoch_;  // a fork() child drops its references without the family's lock

  std::mutex streams_mutex_;
  std::vector<backend::stream_ref> written_on_;  // guarded by streams_mutex_
  std::vector<backend::stream_ref> read_on_;     // guarded by streams_mutex_: the used_on of storages gone
  // The end of the newest copy on each stream that copied the data (one
  // event per stream, recorded again by each copy there).
  struct copy_done {
    backend::stream_ref stream;
    backend::event_ref event;
  };
  std::vector<copy_done> copies_done_;  // guarded by streams_mutex_
};

}  // namespace shoal::storage::detail
