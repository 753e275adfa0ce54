#include "alloc/pool_directory.h"

#include <array>
#include <atomic>
#include <new>
#include <sstream>
#include <vector>

#include "alloc/core_util.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

std::atomic<std::uint64_t> next_directory_serial{1};

// The pools this thread's allocations from each allocator go to, set by
// private_pool_scope (thread_cache::direction_count counts them).
struct direction {
  std::uint64_t directory;
  pool_direction to;
};
thread_local std::vector<direction> directions;

// Empties a destroyed private pool's sub-pool so it can serve another: its
// block objects go to its spare list, its segments, counts and tombstones
// go. Every other block is free, and a private pool's free blocks are all
// settled (never parked), so each is in the bins. Under the sub-pool's lock.
void empty_for_reuse(block_pool& part) noexcept {
  for (auto& s : part.segments) {
    for (block* b = s->first; b != nullptr;) {
      block* next = b->next;
      if (b->state == block_state::invalidated) {
        (void)part.by_address.take(b->address);  // a tombstone: its late free finds the orphan now
      } else {
        part.bins.remove(b);  // free and settled: the pool held no live block
      }
      part.recycle(b);
      b = next;
    }
  }
  part.segments.clear();
  part.counters = {};
  part.part_name.clear();
  part.owner = {};
  part.grows = false;
  part.in_service = false;  // a stale per-thread cache entry finds nothing here
}

}  // namespace

block_pool* private_pool::part(const std::string& name) {
  for (auto& p : parts) {
    if (p->part_name == name) return p.get();
  }
  return nullptr;
}

pool_directory::pool_directory(backend::device& device)
    : device_(device), serial_(next_directory_serial.fetch_add(1)), pools_serial_(serial_) {}

void pool_directory::release_stream_holds() noexcept {
  for (auto& [native, pools] : stream_pools_) {
    try {
      device_.release_stream(pools->small.stream);
    } catch (...) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
    }
  }
}

stream_pools& pool_directory::pools_of_uncached(backend::stream_ref stream) {
  // The pools serial is read with the lookup, under the directory's lock
  // (a vacating changes it under that lock, exclusive): pools made vacant after
  // the lookup leave this thread's entry stale, never current.
  stream_pools* pools = nullptr;
  std::uint64_t serial = 0;
  {
    std::shared_lock lock(directory_mutex_);
    serial = pools_serial();
    if (auto it = stream_pools_.find(stream.native); it != stream_pools_.end()) pools = it->second.get();
  }
  if (pools == nullptr) {
    // Held first (no device call runs under the directory's lock), let go
    // when another thread's pools hold it already or making them fails.
    device_.hold_stream(stream);
    bool made_here = false;
    try {
      std::unique_lock lock(directory_mutex_);
      serial = pools_serial();
      if (auto it = stream_pools_.find(stream.native); it != stream_pools_.end()) {
        pools = it->second.get();  // another thread's, first
      } else {
        // Vacant pools first: their cache serves the new stream at once.
        // Moved into the map under one hold of the lock, so a walk of the
        // pools meets them in one list or the other. The map's entry is made
        // (empty) before it takes them: its allocation fails with nothing
        // taken, and the pools stay vacant; nothing after it throws.
        if (!vacant_pools_.empty()) {
          std::unique_ptr<stream_pools>& slot = stream_pools_.try_emplace(stream.native).first->second;
          slot = std::move(vacant_pools_.back());
          vacant_pools_.pop_back();
          serve(*slot, stream, false);
          pools = slot.get();
        } else {
          auto made = std::make_unique<stream_pools>();
          made->small.kind = pool_kind::small;
          made->large.kind = pool_kind::large;
          made->small.sibling = &made->large;
          made->large.sibling = &made->small;
          serve(*made, stream, false);
          pools = stream_pools_.emplace(stream.native, std::move(made)).first->second.get();
        }
        made_here = true;
      }
    } catch (...) {
      device_.release_stream(stream);
      throw;
    }
    if (!made_here) device_.release_stream(stream);  // theirs still holds it: this destroys nothing
  }
  thread_cache::last_pools = {serial, stream.native, pools};
  return *pools;
}

void pool_directory::serve(stream_pools& pools, backend::stream_ref stream, bool vacant) noexcept {
  for (block_pool* p : {&pools.small, &pools.large}) {
    std::lock_guard pool_lock(p->lock);
    p->stream = stream;
    p->vacant = vacant;
  }
}

std::vector<backend::stream_ref> pool_directory::streams_destroyed_by_owner() const {
  std::vector<backend::stream_ref> streams;
  {
    std::shared_lock lock(directory_mutex_);
    streams.reserve(stream_pools_.size());
    for (const auto& [native, pools] : stream_pools_) streams.push_back(pools->small.stream);
  }
  std::erase_if(streams, [&](backend::stream_ref s) { return !device_.stream_destroy_pending(s); });
  return streams;
}

stream_pools* pool_directory::find_stream_pools(backend::stream_ref stream) const {
  std::shared_lock lock(directory_mutex_);
  const auto it = stream_pools_.find(stream.native);
  return it == stream_pools_.end() ? nullptr : it->second.get();
}

bool pool_directory::vacate_stream_pools(backend::stream_ref stream, const std::function<bool(block_pool&)>& ready) {
  std::unique_lock lock(directory_mutex_);
  const auto it = stream_pools_.find(stream.native);
  if (it == stream_pools_.end()) return false;
  stream_pools& pools = *it->second;
  vacant_pools_.reserve(vacant_pools_.size() + 1);  // room first: nothing below throws
  {
    std::scoped_lock pool_locks(pools.small.lock, pools.large.lock);
    const auto idle = [&](block_pool& p) {
      return ready(p) && p.handed_out() == 0 && p.pending.empty() && p.sealed.empty();  // parked blocks go along
    };
    if (pools.private_blocks_remember.load(std::memory_order_relaxed) || !idle(pools.small) || !idle(pools.large)) {
      return false;
    }
    for (block_pool* p : {&pools.small, &pools.large}) {
      p->stream = {};
      p->vacant = true;
    }
  }
  // Stale from now on: a thread whose last stream this was looks again
  // (a new stream may be given the same handle once the hold ends).
  pools_serial_.store(next_directory_serial.fetch_add(1), std::memory_order_relaxed);
  vacant_pools_.push_back(std::move(it->second));  // within the room reserved above
  stream_pools_.erase(it);
  return true;
}

void pool_directory::end_vacated_stream_hold(backend::stream_ref stream) noexcept {
  try {
    device_.release_stream(stream);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the hold ended; only the destroy failed (an adopted stream)
  }
}

pool_direction pool_directory::scoped_direction() const noexcept {
  for (auto it = directions.rbegin(); it != directions.rend(); ++it) {
    if (it->directory == serial_) return it->to;
  }
  return {};
}

pool_direction pool_directory::direct_to(pool_direction to) noexcept {
  const pool_direction previous = directed_pool();
  std::erase_if(directions, [&](const direction& d) { return d.directory == serial_; });
  if (to.part != nullptr) directions.push_back({serial_, to});
  thread_cache::direction_count = directions.size();
  return previous;
}

block_pool* pool_directory::directory_pool(std::uintptr_t address) const {
  std::shared_lock lock(segments_mutex_);
  auto it = segments_by_base_.upper_bound(address);
  if (it == segments_by_base_.begin()) return nullptr;
  --it;
  if (address - it->first >= it->second.first) return nullptr;
  auto& recent = thread_cache::recent_segments;
  auto& slot = recent.entries[recent.next++ % recent.entries.size()];
  slot = {serial_, it->first, it->first + it->second.first, it->second.second};
  return it->second.second;
}

void pool_directory::register_segment(const segment& s) {
  std::unique_lock lock(segments_mutex_);
  segments_by_base_[s.base] = {s.size, s.pool};
}

segment_map::const_iterator pool_directory::overlapping_locked(std::uintptr_t base, std::size_t size) const {
  // Segments never overlap: only the last one that begins before the end may.
  auto it = segments_by_base_.lower_bound(base + size);
  if (it == segments_by_base_.begin()) return segments_by_base_.end();
  --it;
  return it->first + it->second.first > base ? it : segments_by_base_.end();
}

void pool_directory::unregister_segment(const segment& s) {
  std::unique_lock lock(segments_mutex_);
  segments_by_base_.erase(s.base);
}

segment_map::node_type pool_directory::take_segment_entry(const segment& s) {
  std::unique_lock lock(segments_mutex_);
  return segments_by_base_.extract(s.base);
}

void pool_directory::put_back_segment_entry(segment_map::node_type entry) noexcept {
  std::unique_lock lock(segments_mutex_);
  segments_by_base_.insert(std::move(entry));
}

std::unique_ptr<block_pool> pool_directory::new_private_part() {
  {
    std::unique_lock lock(directory_mutex_);
    if (!reusable_parts_.empty()) {
      auto part = std::move(reusable_parts_.back());
      reusable_parts_.pop_back();
      return part;
    }
  }
  auto part = std::make_unique<block_pool>();
  part->in_service = false;  // until add_private_pool (a reused one is already out, empty_for_reuse)
  return part;
}

private_pool_id pool_directory::add_private_pool(std::unique_ptr<private_pool>& pool) {
  // The pool and its segments enter together, under the directory's lock:
  // a walk of the pools (the invariant checker) never finds a segment that
  // is in the directory and in no pool, nor a pool that is out of service.
  std::unique_lock lock(directory_mutex_);
  std::vector<const segment*> registered;
  std::size_t segments = 0;
  for (auto& part : pool->parts) segments += part->segments.size();
  registered.reserve(segments);
  try {
    {
      // Checked and entered under one hold: two pools over one region, or a
      // region inside a segment (a block of this allocator), would hand the
      // same bytes out twice and leave the directory naming one of them.
      std::unique_lock segments_lock(segments_mutex_);
      for (auto& part : pool->parts) {
        for (auto& s : part->segments) {
          if (const auto it = overlapping_locked(s->base, s->size); it != segments_by_base_.end()) {
            throw invalid_argument("create_private_pool: the region [" + hex(s->base) + ", " +
                                   hex(s->base + s->size) + ") overlaps memory this allocator manages already, [" +
                                   hex(it->first) + ", " + hex(it->first + it->second.first) +
                                   ") (another private pool's region, or a segment its blocks come from)");
          }
        }
      }
      for (auto& part : pool->parts) {
        for (auto& s : part->segments) {
          segments_by_base_[s->base] = {s->size, s->pool};
          registered.push_back(s.get());
        }
      }
    }
    const std::uint64_t id = next_private_id_;
    const auto added = private_pools_.emplace(id, std::move(pool)).first;
    ++next_private_id_;
    // In the directory and in service at once (block_pool::in_service).
    for (auto& part : added->second->parts) {
      std::lock_guard part_lock(part->lock);
      part->in_service = true;
      part->owner = private_pool_id{id};
      ++part->service_generation;
    }
    return private_pool_id{id};
  } catch (...) {
    for (const segment* s : registered) unregister_segment(*s);
    throw;  // the pool stays the caller's
  }
}

void pool_directory::discard_private_pool(std::unique_ptr<private_pool> pool) noexcept {
  for (auto& part : pool->parts) {
    // A stale per-thread cache entry may lead to a reused sub-pool.
    std::lock_guard part_lock(part->lock);
    empty_for_reuse(*part);
  }
  std::unique_lock lock(directory_mutex_);
  for (auto& part : pool->parts) keep_for_reuse(std::move(part));
}

void pool_directory::keep_for_reuse(std::unique_ptr<block_pool> part) noexcept {
  try {
    reusable_parts_.push_back(std::move(part));
  } catch (const std::bad_alloc&) {
    // push_back moved nothing: the sub-pool is left allocated, never
    // freed, as a stale cache entry may still lead to it.
    (void)part.release();
  }
}

block_pool& pool_directory::private_part(private_pool_id id, const std::string& part) const {
  std::shared_lock lock(directory_mutex_);
  return find_private_part(id, part);
}

block_pool& pool_directory::find_private_part(private_pool_id id, const std::string& part) const {
  const auto it = private_pools_.find(id.value);
  if (it == private_pools_.end()) throw invalid_argument("private pool " + std::to_string(id.value) + " does not exist");
  block_pool* p = it->second->part(part);
  if (p == nullptr) {
    std::ostringstream names;
    for (auto& q : it->second->parts) names << " '" << q->part_name << "'";
    throw invalid_argument("private pool " + std::to_string(id.value) + " has no sub-pool '" + part + "'; it has" + names.str());
  }
  return *p;
}

pool_direction pool_directory::direction_to(private_pool_id id, const std::string& part) const {
  std::shared_lock lock(directory_mutex_);  // the generation changes under it (and the sub-pool's lock)
  block_pool& p = find_private_part(id, part);
  return {&p, p.service_generation};
}

std::vector<block_pool*> pool_directory::private_parts(private_pool_id id) const {
  std::shared_lock lock(directory_mutex_);
  const auto it = private_pools_.find(id.value);
  if (it == private_pools_.end()) throw invalid_argument("private pool " + std::to_string(id.value) + " does not exist");
  std::vector<block_pool*> parts;
  for (auto& p : it->second->parts) parts.push_back(p.get());
  return parts;
}

bool pool_directory::remove_private_pool(private_pool_id id,
                                         const std::function<bool(const std::vector<block_pool*>&)>& ready,
                                         const std::function<void(block_pool&)>& take) {
  std::unique_ptr<private_pool> pool;
  {
    std::unique_lock lock(directory_mutex_);
    const auto it = private_pools_.find(id.value);
    if (it == private_pools_.end()) throw invalid_argument("private pool " + std::to_string(id.value) + " does not exist");
    std::vector<block_pool*> parts;
    for (auto& part : it->second->parts) parts.push_back(part.get());
    std::vector<std::unique_lock<biased_lock>> part_locks;
    part_locks.reserve(parts.size());
    for (block_pool* part : parts) part_locks.emplace_back(part->lock);
    if (!ready(parts)) return false;
    for (block_pool* part : parts) take(*part);
    // Out of the segment directory, and emptied, while still under every
    // lock: a walk of the pools (the invariant checker) never finds a
    // segment that is in the directory and in no pool, and a free that
    // found a sub-pool before it left and waits for its lock finds no
    // block there (a tombstone's late free then finds its orphan).
    for (block_pool* part : parts) {
      for (auto& s : part->segments) unregister_segment(*s);
      empty_for_reuse(*part);
    }
    pool = std::move(it->second);
    private_pools_.erase(it);
    for (auto& part : pool->parts) keep_for_reuse(std::move(part));
  }
  return true;
}

}  // namespace shoal::alloc::detail
