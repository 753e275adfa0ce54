// Private pools: memory handed in from outside, split into named sub-pools.
#include <mutex>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

private_pool_id allocator_core::create_private_pool(void* base, std::size_t bytes,
                                                    const std::vector<std::pair<std::string, std::size_t>>& parts) {
  const auto start = reinterpret_cast<std::uintptr_t>(base);
  if (base == nullptr || bytes == 0) throw invalid_argument("create_private_pool: the region is empty or null");
  if (start % min_block != 0) throw invalid_argument("create_private_pool: the region must be 512-byte aligned");
  std::vector<std::pair<std::string, std::size_t>> layout = parts;
  if (layout.empty()) layout.emplace_back("", bytes);
  std::size_t total = 0;
  for (const auto& [name, size] : layout) {
    if (size == 0 || size % min_block != 0) {
      throw invalid_argument("create_private_pool: sub-pool '" + name + "' has " + std::to_string(size) +
                             " bytes; give each a positive multiple of 512");
    }
    for (const auto& [other, ignored] : layout) {
      if (&other != &name && other == name)
        throw invalid_argument("create_private_pool: two sub-pools are named '" + name + "'");
    }
    total += size;
  }
  if (total > bytes) {
    throw invalid_argument("create_private_pool: the sub-pools need " + std::to_string(total) +
                           " bytes but the region has " + std::to_string(bytes));
  }
  auto pool = std::make_unique<private_pool>();
  std::uintptr_t at = start;
  for (const auto& [name, size] : layout) {
    auto part = directory_.new_private_part();
    part->kind = pool_kind::large;
    part->is_private = true;
    part->part_name = name;
    auto s = std::make_unique<segment>();
    s->base = at;
    s->size = s->mapped_bytes = size;
    s->pool = part.get();
    s->external = true;
    s->part_name = name;
    block* b = part->new_block();
    b->address = at;
    b->size = size;
    b->owner = s.get();
    s->first = b;
    part->bins.insert(b);
    directory_.register_segment(*s);
    part->segments.push_back(std::move(s));
    pool_counters::add(part->counters.segments, 1);
    pool_counters::add(part->counters.reserved_bytes, static_cast<std::int64_t>(size));
    pool->parts.push_back(std::move(part));
    at += size;
  }
  const private_pool_id id = directory_.add_private_pool(std::move(pool));
  if constexpr (check_every_step) check_invariants();
  return id;
}

namespace {

// Throws unless every block of the sub-pool is free.
void require_no_live_blocks(block_pool& part, const char* op) {
  std::size_t live = 0, live_bytes = 0;
  for (auto& s : part.segments) {
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->state != block_state::free) {
        ++live;
        live_bytes += b->size;
      }
    }
  }
  if (live > 0) {
    throw invalid_argument(std::string(op) + ": sub-pool '" + part.part_name + "' still has " + std::to_string(live) +
                           " live block(s) (" + std::to_string(live_bytes) +
                           " bytes, allocated or waiting for a stream); free them first");
  }
}

}  // namespace

void allocator_core::clear_private_pool(private_pool_id id, const std::string& part_name) {
  block_pool& part = private_part(id, part_name);
  {
    std::lock_guard lock(part.lock);
    require_no_live_blocks(part, "clear_private_pool");
    for (auto& s : part.segments) {
      block* first = s->first;
      for (block* b = first; b != nullptr;) {
        block* next = b->next;
        part.bins.remove(b);
        if (b->counted_inactive_split) {
          pool_counters::sub(part.counters.inactive_split, 1);
          pool_counters::sub(part.counters.inactive_split_bytes, static_cast<std::int64_t>(b->size));
          b->counted_inactive_split = false;
        }
        if (b != first) recycle(part, b);
        b = next;
      }
      first->size = s->size;
      first->next = nullptr;
      first->last_streams.clear();  // the memory is forgotten, not just its layout
      part.bins.insert(first);
    }
  }
  if constexpr (check_every_step) check_invariants();
}

void allocator_core::drain_private_pool(private_pool_id id, const std::string& part_name) {
  block_pool& part = private_part(id, part_name);
  // Waited for without the lock: this may take long.
  std::vector<backend::event_ref> waits;
  {
    std::lock_guard lock(part.lock);
    for (block* b : part.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
  }
  for (auto e : waits) device.synchronize_event(e);
  std::vector<backend::stream_ref> streams;
  {
    std::lock_guard lock(part.lock);
    collect_pending(part, false);
    for (auto& s : part.segments) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) {
          for (auto stream : b->last_streams) add_unique(streams, stream);
        }
      }
    }
  }
  for (auto stream : streams) device.synchronize(stream);
}

void allocator_core::destroy_private_pool(private_pool_id id) {
  directory_.remove_private_pool(id, [](block_pool& part) { require_no_live_blocks(part, "destroy_private_pool"); });
  if constexpr (check_every_step) check_invariants();
}

}  // namespace shoal::alloc::detail
