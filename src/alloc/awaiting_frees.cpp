#include "alloc/awaiting_frees.h"

#include <algorithm>

namespace shoal::alloc::detail {

void await_free(block_pool& pool, block* b, backend::device& device, event_pool& events) noexcept {
  pool.awaiting.push_back(b);
  pool.awaiting_bytes += b->size;
  if (pool.awaiting_bytes < seal_bytes && pool.awaiting.size() < seal_blocks) return;
  try {
    seal_awaiting(pool, device, events);
  } catch (...) {  // NOLINT(bugprone-empty-catch): still awaiting, so held; the next seal reports it
  }
}

void seal_awaiting(block_pool& pool, backend::device& device, event_pool& events) {
  if (pool.awaiting.empty()) return;
  const backend::event_ref e = events.take();
  try {
    device.record(e, pool.stream);
  } catch (...) {
    events.give_back(e);
    throw;
  }
  for (block* b : pool.awaiting) {
    b->waits.push_back(e);
    b->wait_shared = true;
  }
  pool.sealed.push_back({e, pool.awaiting.size()});
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
