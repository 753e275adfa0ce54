// PyTorch's memory history for the PyTorch plugin: what
// torch.cuda.memory._record_memory_history asks of an allocator
// (recordHistory), kept as PyTorch's own allocator keeps it, for
// torch.cuda.memory._snapshot and _dump_snapshot (pytorch.org/memory_viz).
//
// While recording, each device has a ring of its newest trace entries (the
// recorder's alloc_trace_max_entries): "alloc" at each allocation, "oom" at
// each allocation refused for want of memory, "free_requested" at each free
// and "free_completed" when the block is free again: at the free, or, for a
// free that waits for streams (freed on another stream, or record_stream
// named one), when shoal finds its wait over (observe_free_waits), with the
// context of the call that found it (an allocation; an empty_cache at
// context='all') or else the one the block was allocated with, as PyTorch's
// allocator records a free its stream events delayed. Each block allocated
// while recording is
// remembered by its address (its requested size, stream, device, pool and
// context) until it is freed: a free (whose size PyTorch's tensor deleter
// does not pass) takes its size from there, and a snapshot gives the block
// its context_when_allocated. `when` says which entries carry a context from
// the recorder (NEVER: none; STATE: the blocks alone; ALLOC: the trace
// entries too; ALL: frees gather their own). Stopping (enabled = false)
// clears the entries, as PyTorch's allocator does, and forgets the blocks.
//
// Segment entries come from shoal's segment observer (observe_segments):
// "segment_alloc" / "segment_free" as a plain segment is taken from the
// device or given back, "segment_map" / "segment_unmap" as a stretch of a
// growable segment is backed or given back. Each carries the context of the
// call that made it (a `segments_for` scope names it): an allocation's, or
// torch.cuda.empty_cache's at context='all'; a plain segment given back
// outside such a call, or where that call has none, carries the context it
// was taken with, as PyTorch's allocator records them.
//
// Not as PyTorch's allocator records it:
//   - A delayed free's "free_completed" comes when shoal makes the memory
//     reusable: it finds the wait over at an allocation that misses its
//     pool's cache or at empty_cache (not at every allocation, as PyTorch's
//     allocator looks, so it may come well after the stream passed), or,
//     short of memory, an allocation has its stream wait on the device;
//     also when a graph pool is settled before a capture or destroyed.
//   - A free deferred while a CUDA graph is captured (graph_pools) records
//     "free_completed" at the free call, not when the capture ends.
//   - A growable segment's stretch given back outside such a call (or by
//     empty_cache below context='all') carries no context, and a growable
//     segment's snapshot entry has none (PyTorch keeps the context of its
//     first map).
//   - A destroyed graph pool's "segment_free" names no stream, and no
//     "snapshot" entry is recorded when a snapshot is taken (PyTorch's
//     allocator records one).
//   - A block allocated before recording began has no entry when it is freed
//     while recording (its size is not known), and blocks lose their context
//     when recording stops (so that, stopped, the free path costs one load).
//
// Thread-safety: every member may be called from any thread at once. The
// recorder (which may take the GIL) is called with no lock of this class
// held, as PyTorch's allocator calls it.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace shoal_torch {

using context = std::shared_ptr<c10::GatheredContext>;
using trace_entry = c10::cuda::CUDACachingAllocator::TraceEntry;
using record_context = c10::cuda::CUDACachingAllocator::RecordContext;
using context_recorder = c10::cuda::CUDACachingAllocator::CreateContextFn;
using segment_info = decltype(c10::cuda::CUDACachingAllocator::SnapshotInfo::segments)::value_type;

/// One allocation, as its trace entry names it.
struct allocation {
  void* ptr = nullptr;
  size_t bytes = 0;  ///< requested
  int device = 0;
  cudaStream_t stream = nullptr;
  c10::cuda::MempoolId_t pool{0, 0};  ///< of a graph pool's route; {0, 0}: the ordinary pools
};

class memory_history {
  struct live_block {
    size_t bytes;
    int device;
    cudaStream_t stream;
    c10::cuda::MempoolId_t pool;
    context allocated_in;
  };

 public:
  /// True while recording: one relaxed load, all that the allocate and free
  /// paths pay while not recording.
  [[nodiscard]] bool recording() const noexcept { return recording_.load(std::memory_order_relaxed); }

  /// recordHistory's arguments, as PyTorch's allocator takes them. Throws
  /// PyTorch's error (an unknown action in `skip_actions`, a `when` other than
  /// NEVER without a recorder) with nothing changed.
  void configure(bool enabled, context_recorder recorder, size_t max_entries, record_context when,
                 bool clear_history, const std::vector<std::string>& skip_actions);

  /// The context an allocation keeps (null unless `when` is STATE or more).
  /// Calls the recorder: call it with no lock held.
  [[nodiscard]] context allocation_context() const;

  /// A block handed out while recording, called after shoal hands it out:
  /// its "alloc" entry, and it is remembered until freed. Never throws (a
  /// failure to record is reported on stderr; the allocation stands).
  void allocated(const allocation& block, context allocated_in) noexcept;

  /// An allocation refused for want of memory: its "oom" entry, whose addr
  /// is the device's free memory, as PyTorch's allocator records it.
  void out_of_memory(const allocation& refused, size_t device_free, context refused_in) noexcept;

  /// A free while recording, made from before shoal takes the block back
  /// until shoal's deallocate returned: its "free_requested" entry at once
  /// (the block is forgotten), its "free_completed" entry when the scope
  /// ends — unless shoal told the free held meanwhile (free_held, on this
  /// thread), which free_wait_over completes. Calls the recorder when `when`
  /// is ALL. Never throws. Scopes nest (only the innermost is told held).
  class free_scope {
   public:
    free_scope(memory_history& history, void* ptr) noexcept;
    ~free_scope();
    free_scope(const free_scope&) = delete;
    free_scope& operator=(const free_scope&) = delete;

   private:
    friend class memory_history;
    memory_history& history_;
    std::uintptr_t address_;
    std::optional<live_block> freed_;  ///< the block whose free was recorded (none: not allocated while recording)
    context freed_in_;  ///< the free's stack, else the allocation's
    bool held_ = false;  ///< told held: its completion is free_wait_over's
    free_scope* outer_;
  };

  /// Shoal's free of the block at `address` waits for streams (told within
  /// its deallocate, on the freeing thread, under shoal's locks): when this
  /// thread's free_scope frees it, its "free_completed" waits for
  /// free_wait_over. Takes only this class's lock. Never throws.
  void free_held(int device, std::uintptr_t address) noexcept;

  /// The wait of a free told held is over (on any thread, under shoal's
  /// locks, before the block is handed out again): its "free_completed"
  /// entry, with the context of this thread's segments_for scope, or else
  /// the one the block was allocated with. Takes only this class's lock.
  /// Never throws.
  void free_wait_over(int device, std::uintptr_t address) noexcept;

  /// While alive, this thread's segment events carry `in`, the context of
  /// the call the thread is making (an allocation, an empty_cache). Scopes
  /// nest: the outer one's context is back when an inner one ends.
  class segments_for {
   public:
    explicit segments_for(const context& in) noexcept;
    ~segments_for();
    segments_for(const segments_for&) = delete;
    segments_for& operator=(const segments_for&) = delete;

   private:
    const context* outer_;
  };

  /// The context the segments an empty_cache gives back carry: the caller's
  /// stack at context='all', none below, as PyTorch's allocator gathers it.
  /// Calls the recorder: call it with no lock held.
  [[nodiscard]] context release_context() const;

  /// A segment event while recording (one of the SEGMENT_ actions): its
  /// entry, naming the segment's pool as PyTorch's allocator does. Called from shoal's segment observer, under shoal's allocator
  /// locks: takes only this class's lock and calls no recorder. Never throws.
  void segment_changed(trace_entry::Action action, int device, std::uintptr_t address, size_t size,
                       cudaStream_t stream, c10::cuda::MempoolId_t pool) noexcept;

  /// Each of `devices` devices' entries, oldest first, their times in
  /// microseconds since the epoch (SnapshotInfo::device_traces).
  [[nodiscard]] std::vector<std::vector<trace_entry>> traces(size_t devices);

  /// Gives each allocated block of `segments` that was allocated while
  /// recording its context_when_allocated, and each plain segment taken
  /// while recording the context it was taken with.
  void add_contexts(std::vector<segment_info>& segments);

 private:
  [[nodiscard]] context gather(record_context level) const;
  /// Appends an entry to its device's ring, dropping the oldest past
  /// max_entries_; its context only when `when` is ALLOC or more. mutex_ held.
  void record(trace_entry::Action action, size_t addr, const allocation& of, const context& in);

  // Read outside mutex_ (the fast paths and the recorder's call), written under it.
  std::atomic<bool> recording_{false};
  std::atomic<context_recorder> recorder_{nullptr};
  std::atomic<record_context> when_{record_context::NEVER};

  std::mutex mutex_;
  size_t max_entries_ = 1;                              // guarded by mutex_
  std::unordered_set<int> skipped_;                     // trace_entry::Action values; guarded by mutex_
  std::vector<std::deque<trace_entry>> rings_;          // by device; guarded by mutex_
  /// The blocks allocated while recording and not freed yet, by address. An
  /// address is added after shoal hands it out and removed before shoal
  /// takes it back, so no two blocks of one address are ever here at once.
  std::unordered_map<std::uintptr_t, live_block> live_;  // guarded by mutex_
  /// The blocks whose frees were told held and not completed yet, by address.
  std::unordered_map<std::uintptr_t, live_block> waiting_;  // guarded by mutex_
  /// The contexts plain segments taken while recording were taken with, by
  /// device and address, until given back.
  std::unordered_map<std::uintptr_t, std::pair<int, context>> segments_;  // guarded by mutex_
  c10::ApproximateClockToUnixTimeConverter clock_;      // its start, measured once; makeConverter only reads it
};

}  // namespace shoal_torch
