#include "bench/replay/replayer.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace shoal::bench {

namespace {

// The adapter's streams and the blocks live during a replay, indexed the way
// the trace indexes them, so the timed loop does no lookups. release()
// returns everything to the adapter, whether the replay finished or threw.
class replay_state {
 public:
  replay_state(const trace& t, allocator_adapter& allocator)
      : allocator_(allocator), ptrs_(t.allocation_count(), nullptr), alloc_streams_(t.allocation_count(), 0) {
    for (const trace_event& e : t.events()) {
      if (e.op == trace_op::alloc) alloc_streams_[e.block] = e.stream;
    }
    const auto ids = t.streams();
    streams_.resize(ids.empty() ? 0 : ids.back() + 1);
    try {
      for (const std::uint32_t id : ids) {
        streams_[id] = allocator_.create_stream();
        created_.push_back(id);
      }
    } catch (...) {
      release(t);
      throw;
    }
  }
  replay_state(const replay_state&) = delete;
  replay_state& operator=(const replay_state&) = delete;

  [[nodiscard]] void* stream(std::uint32_t id) const { return streams_[id]; }
  /// The pointer of each allocation of the trace; nullptr while not live
  /// (allocate never returns nullptr).
  [[nodiscard]] std::vector<void*>& ptrs() { return ptrs_; }

  void release(const trace& t) {
    allocator_.synchronize();
    for (const trace_event& e : t.events()) {
      if (e.op == trace_op::alloc && ptrs_[e.block] != nullptr) {
        allocator_.deallocate(std::exchange(ptrs_[e.block], nullptr), e.bytes, streams_[alloc_streams_[e.block]]);
      }
    }
    allocator_.synchronize();
    for (const std::uint32_t id : created_) allocator_.destroy_stream(streams_[id]);
    created_.clear();
  }

 private:
  allocator_adapter& allocator_;
  std::vector<void*> ptrs_;
  std::vector<std::uint32_t> alloc_streams_;
  std::vector<void*> streams_;  // indexed by trace stream id
  std::vector<std::uint32_t> created_;
};

}  // namespace

double replay_result::fragmentation() const noexcept {
  return peak_requested_bytes == 0
             ? 0.0
             : static_cast<double>(peak_reserved_bytes) / static_cast<double>(peak_requested_bytes);
}

replay_result replay(const trace& t, allocator_adapter& allocator) {
  replay_result result;
  result.events = t.events().size();
  result.streams = t.streams().size();
  replay_state state(t, allocator);
  auto& ptrs = state.ptrs();
  try {
    std::size_t live_bytes = 0;
    const auto start = std::chrono::steady_clock::now();
    for (const trace_event& e : t.events()) {
      if (e.op == trace_op::alloc) {
        ptrs[e.block] = allocator.allocate(e.bytes, state.stream(e.stream));
        live_bytes += e.bytes;
        result.peak_requested_bytes = std::max(result.peak_requested_bytes, live_bytes);
      } else {
        allocator.deallocate(std::exchange(ptrs[e.block], nullptr), e.bytes, state.stream(e.stream));
        live_bytes -= e.bytes;
      }
    }
    result.elapsed = std::chrono::steady_clock::now() - start;
    result.peak_reserved_bytes = allocator.peak_reserved_bytes();
    result.device_allocations = allocator.device_allocations();
    result.device_frees = allocator.device_frees();
    result.vmm_calls = allocator.vmm_calls();
  } catch (...) {
    state.release(t);
    throw;
  }
  state.release(t);
  return result;
}

}  // namespace shoal::bench
