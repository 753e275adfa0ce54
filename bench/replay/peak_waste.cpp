#include "bench/replay/peak_waste.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "bench/common/shoal_adapter.h"

namespace shoal::bench {

namespace {

pool_waste classify(const alloc::snapshot& snap, alloc::pool_kind kind) {
  pool_waste w;
  for (const auto& s : snap.segments) {
    if (s.pool != kind) continue;
    w.reserved += s.mapped_bytes;
    ++w.segments;
    const bool idle = !s.expandable && s.blocks.size() == 1 && s.blocks.front().state == alloc::block_state::free;
    for (const auto& b : s.blocks) {
      switch (b.state) {
        case alloc::block_state::allocated:
          w.requested += b.requested;
          w.rounding += b.size - b.requested;
          break;
        case alloc::block_state::pending_free:
        case alloc::block_state::invalidated:  // a tombstone: held until its late free, as a pending one
          w.pending += b.size;
          break;
        case alloc::block_state::free:
          w.largest_free = std::max(w.largest_free, b.size);
          (s.expandable ? w.free_growable : idle ? w.free_idle : w.free_split) += b.size;
          break;
      }
    }
  }
  return w;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string row(const std::string& name, const char* pool, const pool_waste& w) {
  // The figures in a buffer of their own; the name, of any length, around them.
  char figures[256];
  std::snprintf(figures, sizeof figures, "%zu | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %zu | %.1f |\n",
                w.event, mib(w.reserved), mib(w.requested), mib(w.rounding), mib(w.free_split), mib(w.free_idle),
                mib(w.free_growable), mib(w.pending), w.segments, mib(w.largest_free));
  return "| " + name + " | " + pool + " | " + figures;
}

}  // namespace

peak_waste analyse_peak(const trace& t, const alloc::allocator_config& config, backend::device& device) {
  shoal_adapter adapter(device, config);
  const auto ids = t.streams();
  std::vector<void*> streams(ids.empty() ? 0 : ids.back() + 1);
  for (const std::uint32_t id : ids) streams[id] = adapter.create_stream();
  std::vector<void*> ptrs(t.allocation_count(), nullptr);
  std::vector<std::size_t> bytes(t.allocation_count(), 0);
  std::vector<std::uint32_t> alloc_stream(t.allocation_count(), 0);
  peak_waste best;
  std::size_t index = 0;
  for (const trace_event& e : t.events()) {
    if (e.op == trace_op::alloc) {
      ptrs[e.block] = adapter.allocate(e.bytes, streams[e.stream]);
      bytes[e.block] = e.bytes;
      alloc_stream[e.block] = e.stream;
      const auto reserved = adapter.allocator().stats().reserved_bytes;
      for (auto [kind, w] : {std::pair{alloc::pool_kind::small, &best.small}, std::pair{alloc::pool_kind::large, &best.large}}) {
        if (static_cast<std::size_t>(reserved.pool[static_cast<std::size_t>(kind)].current) <= w->reserved) continue;
        *w = classify(adapter.allocator().take_snapshot(), kind);
        w->event = index;
      }
    } else {
      adapter.deallocate(std::exchange(ptrs[e.block], nullptr), e.bytes, streams[e.stream]);
    }
    ++index;
  }
  adapter.synchronize();
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    if (ptrs[i] != nullptr) adapter.deallocate(ptrs[i], bytes[i], streams[alloc_stream[i]]);
  }
  adapter.synchronize();
  for (const std::uint32_t id : ids) adapter.destroy_stream(streams[id]);
  return best;
}

std::string waste_header() {
  return "| trace | allocator | pool | peak at event | reserved | requested | rounding | free in used segments "
         "| free idle segments | free growable | pending | segments | largest free |\n"
         "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
}

std::string waste_rows(const std::string& name, const peak_waste& w) {
  return row(name, "small", w.small) + row(name, "large", w.large);
}

}  // namespace shoal::bench
