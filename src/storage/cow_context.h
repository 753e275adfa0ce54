// The copy-on-write context: one allocation's data shared by several lazy
// clones. Every storage in the family holds one reference.
//
// Protocol (each step's reason beside it):
//   - A materializing copier takes the shared lock *before* giving up its
//     reference, so the data cannot be freed under its copy.
//   - Whoever drops the count to zero takes the exclusive lock, so it waits
//     for every copy in progress, then owns the data (steal) or frees it.
//   - Copiers record an event after their copy; a stealer's stream waits on
//     all of them before it writes in place.
//   - A storage that gives up the data records the streams it used it on
//     with the allocator (record_stream) while it still holds its reference,
//     so the final free waits for them; its uses on created_on() are covered
//     by the final free itself, which is enqueued on created_on().
// Invariant: refcount = number of storages holding the context; the data is
// released exactly once, by the one that took the count to zero.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <vector>

#include "shoal/alloc/caching_allocator.h"

namespace shoal::storage::detail {

class cow_context {
 public:
  cow_context(alloc::caching_allocator& allocator, void* data, std::size_t size, backend::stream_ref written_on);
  ~cow_context();
  cow_context(const cow_context&) = delete;
  cow_context& operator=(const cow_context&) = delete;

  /// One more storage, cloned on `cloned_on` from a storage that used the
  /// data on `source_used_on`, shares the data: copies are ordered after
  /// the work enqueued on all of these streams until then.
  void add_reference(backend::stream_ref cloned_on, std::span<const backend::stream_ref> source_used_on);

  /// The caller's storage, which used the data on `used_on`, gives up the
  /// shared data to write on `stream`. Returns its own copy, made on
  /// `stream`; or nullptr when it was the last reference and now owns data()
  /// (steal): the caller must then delete the context, and its storage's
  /// release wait for created_on() too.
  void* release_for_write(backend::stream_ref stream, std::span<const backend::stream_ref> used_on);
  /// The caller's storage, which used the data on `used_on`, is gone: frees
  /// the data if it was the last one. Returns true when the context must be
  /// deleted by the caller.
  bool release_for_drop(std::span<const backend::stream_ref> used_on);

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] backend::stream_ref created_on() const noexcept { return created_on_; }

 private:
  // Makes `stream` wait for the writes the data had when it was cloned.
  void order_after_clone_writes(backend::stream_ref stream);
  void note_written_on(backend::stream_ref stream);
  // The data's free waits for `used_on` (those not covered by created_on_).
  void record_uses(std::span<const backend::stream_ref> used_on);

  alloc::caching_allocator& allocator_;
  void* const data_;
  const std::size_t size_;
  const backend::stream_ref created_on_;  // also in written_on_; read without the lock
  std::atomic<std::int64_t> refcount_{1};
  std::shared_mutex mutex_;  // shared: a copy in progress; exclusive: the last reference

  std::mutex streams_mutex_;
  std::vector<backend::stream_ref> written_on_;  // guarded by streams_mutex_
  std::vector<backend::event_ref> copies_done_;  // guarded by streams_mutex_
};

}  // namespace shoal::storage::detail
