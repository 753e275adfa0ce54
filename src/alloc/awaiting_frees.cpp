#include "alloc/awaiting_frees.h"

#include <algorithm>
#include <new>

namespace shoal::alloc::detail {

void make_room_to_await(block_pool& pool) {
  // Room for a full group, kept from seal to seal; a group that failed to
  // seal may grow past it (the next seal, or this, makes more room).
  const std::size_t wanted = std::max(seal_blocks, pool.awaiting.size() + 1);
  if (pool.awaiting.capacity() < wanted) pool.awaiting.reserve(std::max(wanted, 2 * pool.awaiting.capacity()));
}

void await_free(block_pool& pool, block* b, backend::device& device, event_pool& events) noexcept {
  pool.awaiting.push_back(b);  // make_room_to_await made room: no allocation
  pool.awaiting_bytes += b->size;
  if (pool.awaiting_bytes < seal_bytes && pool.awaiting.size() < seal_blocks) return;
  try {
    seal_awaiting(pool, device, events);
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): still awaiting, so held; the next seal reports it
  } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): the same
  }
}

void seal_awaiting(block_pool& pool, backend::device& device, event_pool& events) {
  if (pool.awaiting.empty()) return;
  // Everything that may throw comes before anything changes.
  for (block* b : pool.awaiting) b->waits.reserve(1);
  pool.sealed.push_back({backend::event_ref{}, 0});
  backend::event_ref e{};
  try {
    e = events.take();
  } catch (...) {
    pool.sealed.pop_back();
    throw;
  }
  try {
    device.record(e, pool.stream);
  } catch (...) {
    events.give_back(e);
    pool.sealed.pop_back();
    throw;
  }
  pool.sealed.back() = {e, pool.awaiting.size()};
  for (block* b : pool.awaiting) {
    b->waits.push_back(e);
    b->wait_shared = true;
  }
  pool.awaiting.clear();
  pool.awaiting_bytes = 0;
}

void release_shared_wait(block_pool& pool, backend::event_ref event, event_pool& events) noexcept {
  // Groups complete in the order they were sealed: usually the first.
  const auto it = std::find_if(pool.sealed.begin(), pool.sealed.end(),
                               [&](const block_pool::sealed_group& g) { return g.event == event; });
  if (it == pool.sealed.end()) return;
  if (--it->holders > 0) return;
  events.give_back(event);
  pool.sealed.erase(it);
}

}  // namespace shoal::alloc::detail
