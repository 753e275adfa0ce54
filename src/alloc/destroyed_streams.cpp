// Letting go of the streams their owners destroyed while the allocator held
// them (allocator_core::let_destroyed_streams_go). Without it, every stream
// a program ever allocated on would stay held, with its pools, until the
// allocator's teardown: a stream per request would pile up host threads
// (host backend) or cudaStream_t handles (CUDA). Their pools are made vacant
// with their cache, which the next new stream takes over: the sweep gives
// no memory back and makes no device call but a query, a seal's record and
// its wait (empty_cache gives vacant pools' memory back).
#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "alloc/allocator_core.h"
#include "alloc/awaiting_frees.h"
#include "alloc/block_structure.h"

namespace shoal::alloc::detail {

namespace {

std::uint64_t frees_seen(block_pool& pool) {
  std::lock_guard lock(pool.lock);
  return pool.frees;
}

}  // namespace

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
  std::exception_ptr first_error;
  bool skipped = false;
  try {
    const std::vector<backend::stream_ref> destroyed = directory_.streams_destroyed_by_owner();
    const std::vector<backend::stream_ref> recorded =
        destroyed.empty() ? std::vector<backend::stream_ref>{} : streams_recorded_on_live_blocks();
    for (const backend::stream_ref s : destroyed) {
      try {
        stream_pools* pools = directory_.find_stream_pools(s);
        // A private pool's block remembers it: held until teardown, no retry.
        if (pools == nullptr || pools->private_blocks_remember.load(std::memory_order_relaxed)) continue;
        // Pools with nothing to quiesce (a stream per request's) skip the
        // first query: the last one below covers all their stream's work.
        const bool nothing_to_quiesce = idle_at_a_look(pools->small) && idle_at_a_look(pools->large);
        bool ready = std::find(recorded.begin(), recorded.end(), s) == recorded.end() &&  // no free to record there
                     (nothing_to_quiesce ||
                      ((wait || device.query(s)) &&  // its work has run (waited for by empty_cache)
                       quiesce_destroyed_streams_pool(pools->small, wait) &&
                       quiesce_destroyed_streams_pool(pools->large, wait)));
        // Everything queued on it so far must have run before another stream
        // gets the memory: quiescing's own work (a seal, debug mode's poison
        // fills), and any other thread's (the stream stays usable while
        // held). From here nothing can queue more (no block of its pools is
        // live or pending), unless a free came meanwhile: the frees counted
        // now, before the last look, must still be all at the vacating.
        const std::uint64_t frees_small = frees_seen(pools->small), frees_large = frees_seen(pools->large);
        if (ready) {
          if (wait) {
            device.synchronize(s);
          } else {
            ready = device.query(s);
          }
        }
        if (ready && directory_.vacate_stream_pools(s, [&](block_pool& p) {
              // Parked blocks stay parked: the next stream's requests of
              // the same sizes take them as they are (a stream per request).
              return p.frees == (p.kind == pool_kind::small ? frees_small : frees_large);
            })) {
          directory_.end_vacated_stream_hold(s);
        } else {
          skipped = true;
        }
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
        skipped = true;
      }
    }
  } catch (...) {  // the listing: no host memory
    if (!first_error) first_error = std::current_exception();
    skipped = true;
  }
  schedule_sweep_retry(skipped);
  check_step();
  // empty_cache reports the first error once every stream had its turn; an
  // allocation goes on without (the stream waits for a later sweep).
  if (wait && first_error) std::rethrow_exception(first_error);
}

void allocator_core::schedule_sweep_retry(bool skipped) noexcept {
  // A stream skipped (its work still running, a block of it or recorded on
  // it still live) is looked at again after 16 allocations off the cached
  // pair, then 32, ... up to 1024 while it stays: a stream kept for long
  // costs a sweep per thousand such allocations, not one each.
  constexpr std::uint32_t first = 16, most = 1024;
  if (!skipped) {
    sweep_retry_interval_ = first;
    sweep_retry_in_.store(0, std::memory_order_relaxed);
    return;
  }
  sweep_retry_in_.store(sweep_retry_interval_, std::memory_order_relaxed);
  sweep_retry_interval_ = std::min(sweep_retry_interval_ * 2, most);
}

bool allocator_core::sweep_due() noexcept {
  if (!host_waits_allowed()) return false;  // a retry that falls due stays due for an allocation that may sweep
  if (device.deferred_stream_destroys() != destroys_seen_.load(std::memory_order_relaxed)) return true;
  // Counted down to 0 and no further (threads race here): the one that
  // takes it from 1 sweeps.
  std::uint32_t left = sweep_retry_in_.load(std::memory_order_relaxed);
  while (left != 0 && !sweep_retry_in_.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
  }
  return left == 1;
}

std::vector<backend::stream_ref> allocator_core::streams_recorded_on_live_blocks() {
  std::vector<backend::stream_ref> recorded;
  // A stream noted after this load is noted after the look, as it would be
  // after a pool's look below: the listing is of the streams noted before.
  if (!streams_ever_recorded_.load(std::memory_order_acquire)) return recorded;
  // A look, not a take: the sweep runs on any thread that allocates, and
  // must not cost the other threads' pools their bias. A listing that
  // cannot grow is thrown once every pool is let go.
  directory_.look_at_each_pool_or_throw(true, [&](block_pool& p) {
    if (!p.streams_recorded) return;
    bool any = false;  // used_on is cleared at the free (and a forced clear): only live blocks have some
    for (const auto& seg : p.segments) {
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (b->used_on.empty()) continue;
        any = true;
        for (const auto s : b->used_on) add_unique(recorded, s);
      }
    }
    if (!any) p.streams_recorded = false;  // exact: streams are noted under this lock
  });
  return recorded;
}

bool allocator_core::idle_at_a_look(block_pool& pool) {
  std::lock_guard lock(pool.lock);
  return pool.awaiting.empty() && pool.pending.empty() && pool.sealed.empty() && pool.handed_out() == 0;
}

bool allocator_core::quiesce_destroyed_streams_pool(block_pool& pool, bool wait) {
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
  return pool.pending.empty() && pool.handed_out() == 0;
}

}  // namespace shoal::alloc::detail
