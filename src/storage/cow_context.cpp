#include "storage/cow_context.h"

#include <algorithm>
#include <cassert>

#include "storage/stream_set.h"

namespace shoal::storage::detail {

cow_context::cow_context(alloc::caching_allocator& allocator, void* data, std::size_t size,
                         backend::stream_ref written_on)
    : allocator_(allocator), data_(data), size_(size), created_on_(written_on), written_on_{written_on} {}

cow_context::~cow_context() {
  // Each on its own: a device in a sticky error state may refuse one, and
  // a destructor that threw would terminate the process.
  for (const auto& done : copies_done_) {
    try {
      allocator_.device().destroy_event(done.event);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a refused destroy leaks one event, nothing worse
    }
  }
}

void cow_context::note_clone(backend::stream_ref cloned_on, std::span<const backend::stream_ref> source_used_on) {
  note_written_on(cloned_on);
  for (auto s : source_used_on) note_written_on(s);
}

void cow_context::note_written_on(backend::stream_ref stream) {
  if (stream == created_on_) return;  // the common case: clones made on one stream
  std::lock_guard lock(streams_mutex_);
  if (std::find(written_on_.begin(), written_on_.end(), stream) == written_on_.end()) written_on_.push_back(stream);
}

void cow_context::record_uses(std::span<const backend::stream_ref> used_on) {
  // created_on_ too: it need not be the block's stream, and with
  // cross_stream_safety off the final free on it waits for nothing unrecorded.
  for (auto s : used_on) allocator_.record_stream(data_, s);
  std::lock_guard lock(streams_mutex_);
  for (auto s : used_on) {
    if (std::find(read_on_.begin(), read_on_.end(), s) == read_on_.end()) read_on_.push_back(s);
  }
}

void cow_context::order_after_clone_writes(backend::stream_ref stream) {
  // The shared data is never written in place, so an event recorded now on
  // a clone-time stream covers every write the data had at clone time.
  std::vector<backend::stream_ref> streams;
  {
    std::lock_guard lock(streams_mutex_);
    streams = written_on_;
  }
  order_after(allocator_.device(), stream, streams);
}

void cow_context::order_before_steal(backend::stream_ref stream) {
  order_after_clone_writes(stream);
  std::lock_guard lock(streams_mutex_);
  order_after(allocator_.device(), stream, read_on_);  // the uses of the storages that went
  // The copies read what the stealer will overwrite.
  for (const auto& done : copies_done_) allocator_.device().wait(stream, done.event);
}

cow_context::written cow_context::release_for_write(backend::stream_ref stream,
                                                    std::span<const backend::stream_ref> used_on, void* block) {
  // Only a holder adds a reference: at 1 the caller's is the last and stays
  // so, the count untouched while the steal is ordered (a throw changes nothing).
  if (sole_holder()) {
    order_before_steal(stream);
    return {data_, true, true};
  }
  assert(block != nullptr && "a copy needs the caller's block");
  copy_out(stream, used_on, block);
  return {block, release(), false};  // the last one if the others went meanwhile
}

void cow_context::copy_out(backend::stream_ref stream, std::span<const backend::stream_ref> used_on, void* block) {
  record_uses(used_on);
  order_after_clone_writes(stream);
  allocator_.device().copy(stream, block, data_, size_);
  allocator_.record_stream(data_, stream);  // whoever frees the data waits for this copy
  note_copy_done(stream);
}

void cow_context::note_copy_done(backend::stream_ref stream) {
  backend::device& device = allocator_.device();
  // One event per stream, recorded again by each copy there: a stream runs
  // in order, so its newest record covers every earlier copy on it, and a
  // family cloned and written again and again keeps as many events as it
  // has copying streams, not one per copy. Recorded under the lock: a
  // concurrent copier on the same stream re-records the same event.
  std::lock_guard lock(streams_mutex_);
  const auto known = std::ranges::find(copies_done_, stream, &copy_done::stream);
  if (known != copies_done_.end()) {
    device.record(known->event, stream);
    return;
  }
  copies_done_.reserve(copies_done_.size() + 1);  // room first: a new event is never lost
  const backend::event_ref done = device.create_event();
  try {
    device.record(done, stream);
  } catch (...) {
    device.destroy_event(done);
    throw;
  }
  copies_done_.push_back({stream, done});
}

bool cow_context::release_for_drop(std::span<const backend::stream_ref> used_on) noexcept {
  // A fork() child's drop of an inherited family member: the data, the
  // events and the family's lock are the parent's. The context is left
  // (never deleted there: its events are the parent's device's).
  if (epoch_.forked_since()) return false;
  try {
    record_uses(used_on);  // while this reference keeps the data allocated
  } catch (...) {
    // No room to remember a stream (or its record refused): the uses are
    // waited for here instead, and the reference goes all the same (kept, it
    // would hold the family's data for good, and every other member would
    // copy to write).
    for (const auto s : used_on) {
      try {
        allocator_.device().synchronize(s);
      } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
      }
    }
  }
  return release();
}

bool cow_context::release() noexcept {
  if (refcount_.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;
  try {
    allocator_.deallocate_or_wait(data_, created_on_);  // no host memory: waits for the data's streams instead
  } catch (...) {  // NOLINT(bugprone-empty-catch)
    // As for a storage's own block (storage.cpp): a free refused otherwise
    // (a stream's work failed) leaves the block allocated, visible in the
    // allocator's statistics, rather than reused unsafely.
  }
  return true;
}

}  // namespace shoal::storage::detail
