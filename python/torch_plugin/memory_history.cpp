#include "memory_history.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <utility>

namespace shoal_torch {

namespace {

std::unordered_set<int> parse_actions(const std::vector<std::string>& names) {
  std::unordered_set<int> out;
  for (const std::string& name : names) out.insert(c10::CachingDeviceAllocator::parseTraceEntryAction(name));
  return out;
}

// The context of the call this thread is making (memory_history::segments_for).
thread_local const context* segments_in = nullptr;

// The free this thread is making (memory_history::free_scope).
thread_local memory_history::free_scope* freeing_here = nullptr;

/// The trace entry's view of a block recorded at `address`.
allocation as_allocation(std::uintptr_t address, const auto& block) {
  return allocation{reinterpret_cast<void*>(address), block.bytes, block.device, block.stream, block.pool};
}

void report(const char* what, const std::exception* e) noexcept {
  std::fprintf(stderr, "shoal: recording %s in the memory history failed: %s\n", what,
               e != nullptr ? e->what() : "unknown error");
}

// Runs `record` and reports what it throws: the history never fails the
// allocation, free or segment event it records.
template <typename Record>
void guarded(const char* what, Record&& record) noexcept {
  try {
    record();
  } catch (const std::exception& e) {
    report(what, &e);
  } catch (...) {
    report(what, nullptr);
  }
}

}  // namespace

void memory_history::configure(bool enabled, context_recorder recorder, size_t max_entries, record_context when,
                               bool clear_history, const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(when == record_context::NEVER || recorder != nullptr,
              "shoal: recording memory history with stack contexts needs a context recorder");
  std::unordered_set<int> skipped = parse_actions(skip_actions);
  std::lock_guard lock(mutex_);
  max_entries_ = std::max<size_t>(1, max_entries);
  skipped_ = std::move(skipped);
  for (std::deque<trace_entry>& ring : rings_) {
    if (!enabled || clear_history) ring.clear();
    while (ring.size() > max_entries_) ring.pop_front();
  }
  if (!enabled) {
    live_.clear();
    waiting_.clear();
    segments_.clear();
  }
  recorder_.store(enabled ? recorder : nullptr);
  when_.store(enabled ? when : record_context::NEVER);
  recording_.store(enabled, std::memory_order_relaxed);
}

context memory_history::gather(record_context level) const {
  const context_recorder recorder = recorder_.load();
  if (recorder == nullptr || when_.load() < level) return nullptr;
  // A recorder that fails costs the entry its stack, never the allocation or the free.
  context out;
  guarded("a stack", [&] { out = recorder(); });
  return out;
}

context memory_history::allocation_context() const { return gather(record_context::STATE); }

void memory_history::record(trace_entry::Action action, size_t addr, const allocation& of, const context& in) {
  if (skipped_.count(action) != 0) return;
  if (rings_.size() <= static_cast<size_t>(of.device)) rings_.resize(static_cast<size_t>(of.device) + 1);
  std::deque<trace_entry>& ring = rings_[static_cast<size_t>(of.device)];
  ring.emplace_back(action, static_cast<c10::DeviceIndex>(of.device), addr, of.bytes, static_cast<void*>(of.stream),
                    of.pool, c10::getApproximateTime(), when_.load() >= record_context::ALLOC ? in : nullptr);
  if (ring.size() > max_entries_) ring.pop_front();
}

void memory_history::allocated(const allocation& block, context allocated_in) noexcept {
  guarded("an allocation", [&] {
    const auto address = reinterpret_cast<std::uintptr_t>(block.ptr);
    std::lock_guard lock(mutex_);
    if (!recording_.load(std::memory_order_relaxed)) return;  // stopped meanwhile: nothing is remembered
    // Remembered first: were the entry's record to fail, the free still finds the block.
    live_.insert_or_assign(address, live_block{block.bytes, block.device, block.stream, block.pool, allocated_in});
    record(trace_entry::ALLOC, address, block, allocated_in);
  });
}

void memory_history::out_of_memory(const allocation& refused, size_t device_free, context refused_in) noexcept {
  guarded("an out of memory", [&] {
    std::lock_guard lock(mutex_);
    if (!recording_.load(std::memory_order_relaxed)) return;
    record(trace_entry::OOM, device_free, refused, refused_in);
  });
}

memory_history::free_scope::free_scope(memory_history& history, void* ptr) noexcept
    : history_(history), address_(reinterpret_cast<std::uintptr_t>(ptr)), outer_(freeing_here) {
  freeing_here = this;
  guarded("a free", [&] {
    freed_in_ = history_.gather(record_context::ALL);
    std::lock_guard lock(history_.mutex_);
    auto node = history_.live_.extract(address_);  // forgotten first: a failed record leaves no stale entry
    if (node.empty()) return;  // allocated before recording began (or stopped meanwhile)
    freed_ = std::move(node.mapped());
    if (freed_in_ == nullptr) freed_in_ = freed_->allocated_in;
    history_.record(trace_entry::FREE_REQUESTED, address_, as_allocation(address_, *freed_), freed_in_);
  });
}

memory_history::free_scope::~free_scope() {
  freeing_here = outer_;
  if (!freed_ || held_) return;
  guarded("a free", [&] {
    std::lock_guard lock(history_.mutex_);
    if (!history_.recording_.load(std::memory_order_relaxed)) return;
    history_.record(trace_entry::FREE_COMPLETED, address_, as_allocation(address_, *freed_), freed_in_);
  });
}

void memory_history::free_held(int device, std::uintptr_t address) noexcept {
  free_scope* const scope = freeing_here;
  if (scope == nullptr || scope->address_ != address || !scope->freed_ || scope->freed_->device != device) return;
  guarded("a free", [&] {
    std::lock_guard lock(mutex_);
    if (!recording_.load(std::memory_order_relaxed)) return;
    waiting_.insert_or_assign(address, std::move(*scope->freed_));  // a failed insert moves nothing
    scope->held_ = true;
  });
}

void memory_history::free_wait_over(int device, std::uintptr_t address) noexcept {
  guarded("a free", [&] {
    std::lock_guard lock(mutex_);
    const auto found = waiting_.find(address);
    if (found == waiting_.end() || found->second.device != device) return;  // held before recording, or stopped since
    const auto node = waiting_.extract(found);  // forgotten first: a failed record leaves no stale entry
    const live_block& b = node.mapped();
    // As PyTorch's allocator records a free its stream events delayed: with
    // the context of the call that found the wait over (an allocation, an
    // empty_cache at context='all'), else the block's own.
    const context& in = segments_in != nullptr && *segments_in != nullptr ? *segments_in : b.allocated_in;
    record(trace_entry::FREE_COMPLETED, address, as_allocation(address, b), in);
  });
}

memory_history::segments_for::segments_for(const context& in) noexcept : outer_(segments_in) { segments_in = &in; }

memory_history::segments_for::~segments_for() { segments_in = outer_; }

context memory_history::release_context() const { return gather(record_context::ALL); }

void memory_history::segment_changed(trace_entry::Action action, int device, std::uintptr_t address, size_t size,
                                     cudaStream_t stream, c10::cuda::MempoolId_t pool) noexcept {
  guarded("a segment", [&] {
    std::lock_guard lock(mutex_);
    if (!recording_.load(std::memory_order_relaxed)) return;
    context in = segments_in != nullptr ? *segments_in : nullptr;
    if (action == trace_entry::SEGMENT_ALLOC) {
      segments_.insert_or_assign(address, std::pair{device, in});
    } else if (action == trace_entry::SEGMENT_FREE) {
      auto taken = segments_.extract(address);
      if (in == nullptr && !taken.empty() && taken.mapped().first == device) in = std::move(taken.mapped().second);
    }
    record(action, address, allocation{nullptr, size, device, stream, pool}, in);
  });
}

std::vector<std::vector<trace_entry>> memory_history::traces(size_t devices) {
  const auto to_ns = clock_.makeConverter();  // measures for a while: before the lock
  std::vector<std::vector<trace_entry>> out(devices);
  {
    std::lock_guard lock(mutex_);
    for (size_t d = 0; d < std::min(devices, rings_.size()); ++d) out[d].assign(rings_[d].begin(), rings_[d].end());
  }
  for (std::vector<trace_entry>& trace : out) {
    for (trace_entry& e : trace) e.time_.t_ = to_ns(e.time_.approx_t_) / 1000;
  }
  return out;
}

void memory_history::add_contexts(std::vector<segment_info>& segments) {
  std::lock_guard lock(mutex_);
  if (live_.empty() && segments_.empty()) return;
  for (segment_info& segment : segments) {
    const auto taken = segments_.find(static_cast<std::uintptr_t>(segment.address));
    if (taken != segments_.end() && taken->second.first == segment.device && !segment.is_expandable) {
      segment.context_when_allocated = taken->second.second;
    }
    // A snapshot's blocks carry no address: they cover their segment in address order.
    auto address = static_cast<std::uintptr_t>(segment.address);
    for (auto& block : segment.blocks) {
      const auto found = block.allocated ? live_.find(address) : live_.end();
      if (found != live_.end() && found->second.device == segment.device) {
        block.context_when_allocated = found->second.allocated_in;
      }
      address += static_cast<std::uintptr_t>(block.size);
    }
  }
}

}  // namespace shoal_torch
