// Letting go of the streams their owners destroyed while the allocator held
// them (allocator_core::let_destroyed_streams_go). Without it, every stream
// a program ever allocated on would stay held, with its pools, until the
// allocator's teardown: a stream per request would pile up host threads
// (host backend) or cudaStream_t handles (CUDA).
#include <algorithm>

#include "alloc/allocator_core.h"
#include "alloc/awaiting_frees.h"

namespace shoal::alloc::detail {

void allocator_core::let_destroyed_streams_go(bool wait) {
  if (epoch_.forked_since()) return;  // the streams and the memory are the parent's
  std::unique_lock sweeping(sweep_mutex_, std::defer_lock);
  if (wait) {
    sweeping.lock();
  } else if (!sweeping.try_lock()) {
    return;  // another thread sweeps now
  }
  // Read before the streams are listed: a destroy after it moves the count
  // again, and a later allocation sweeps for it.
  destroys_seen_.store(device.deferred_stream_destroys(), std::memory_order_relaxed);
  try {
    for (const backend::stream_ref s : directory_.streams_destroyed_by_owner()) {
      stream_pools* pools = directory_.find_stream_pools(s);
      if (pools == nullptr || pools->private_blocks_remember.load(std::memory_order_relaxed)) continue;
      if (!wait && !device.query(s)) continue;  // its work still runs: a later sweep
      // A live block's free will record on it (record_stream): held till then.
      if (recorded_on_a_live_block(s)) continue;
      bool emptied = empty_destroyed_streams_pool(pools->small, wait);
      emptied = empty_destroyed_streams_pool(pools->large, wait) && emptied;
      if (!emptied) continue;  // a live block, a free not done yet, a segment kept: a later sweep
      if (wait) device.synchronize(s);  // its last work (the pools gave nothing back, so nothing waited)
      bool retired = false;
      {
        std::lock_guard retired_lock(retired_mutex_);  // its counters move to retired_ atomically for stats()
        retired = directory_.retire_stream_pools(
            s, [](stream_pools&) { return true; }, [&](block_pool& p) { retire_counters(p); });
      }
      if (retired) directory_.end_retired_stream_hold(s);
    }
  } catch (...) {
    // empty_cache reports it; an allocation goes on without the sweep (a
    // release observer's error, the device's, the host out of memory), and
    // the stream waits for a later one.
    if (wait) throw;
  }
  check_step();
}

bool allocator_core::recorded_on_a_live_block(backend::stream_ref stream) {
  bool found = false;
  directory_.for_each_pool([&](block_pool& p) {
    if (found) return;
    std::lock_guard lock(p.lock);
    if (!p.streams_recorded) return;
    bool any = false;  // used_on is cleared at the free: only live blocks (and tombstones) have some
    for (const auto& seg : p.segments) {
      for (const block* b = seg->first; b != nullptr && !found; b = b->next) {
        if (b->used_on.empty()) continue;
        any = true;
        found = std::find(b->used_on.begin(), b->used_on.end(), stream) != b->used_on.end();
      }
    }
    if (!any) p.streams_recorded = false;  // exact: streams are noted under this lock
  });
  return found;
}

bool allocator_core::empty_destroyed_streams_pool(block_pool& pool, bool wait) {
  std::vector<backend::event_ref> waits;
  {
    std::lock_guard lock(pool.lock);
    // Awaiting frees (pinned memory) wait for an event on this stream that
    // only its own calls would record: none will come now. Recorded here,
    // on the stream that is still held, and waited for below.
    if (!pool.awaiting.empty()) seal_awaiting(pool, device, events_);
    if (wait) {
      for (block* b : pool.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
    } else if (!pool.sealed.empty()) {
      waits.push_back(pool.sealed.back().event);  // on this stream, idle but for the seal: done at once
    }
  }
  for (auto e : waits) device.synchronize_event(e);  // without the lock: this may take long
  std::lock_guard lock(pool.lock);
  collect_pending(pool, false);
  if (!pool.pending.empty()) return false;
  source_.release_cached(pool);
  return source_.release_unmapped_growable(pool) && pool.segments.empty();
}

}  // namespace shoal::alloc::detail
