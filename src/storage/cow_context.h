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
// Invariant: refcount = number of storages holding the context; the data is
// released exactly once, by the one that took the count to zero.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "shoal/alloc/caching_allocator.h"

namespace shoal::storage::detail {

class cow_context {
 public:
  cow_context(alloc::caching_allocator& allocator, void* data, std::size_t size, backend::stream_ref written_on);
  ~cow_context();
  cow_context(const cow_context&) = delete;
  cow_context& operator=(const cow_context&) = delete;

  /// One more storage shares the data; `written_on` is the stream its data
  /// was last written on when it was cloned.
  void add_reference(backend::stream_ref written_on);

  /// The caller's storage gives up the shared data to write on `stream`.
  /// Returns its own copy, made on `stream`; or nullptr when it was the last
  /// reference and now owns data() (steal): the caller must then delete the
  /// context.
  void* release_for_write(backend::stream_ref stream);
  /// The caller's storage is gone: frees the data if it was the last one.
  /// Returns true when the context must be deleted by the caller.
  bool release_for_drop();

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  // Makes `stream` wait for the writes the data had when it was cloned.
  void order_after_clone_writes(backend::stream_ref stream);

  alloc::caching_allocator& allocator_;
  void* const data_;
  const std::size_t size_;
  const backend::stream_ref created_on_;  // also in written_on_; read without the lock
  std::atomic<std::int64_t> refcount_{1};
  std::shared_mutex mutex_;  // shared: a copy in progress; exclusive: the last reference

  std::mutex streams_mutex_;
  std::vector<backend::stream_ref> written_on_;    // guarded by streams_mutex_
  std::vector<backend::event_ref> copies_done_;    // guarded by streams_mutex_
};

}  // namespace shoal::storage::detail
