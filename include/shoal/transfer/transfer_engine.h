// Background batch transfer: host buffers in, device storages out, with no
// host synchronization per batch and no batch cache.
//
// A producer submits batches of host buffers; the engine's own thread
// allocates a device storage per buffer (from the device allocator, on the
// engine's stream), copies each buffer into it on that stream — straight
// from memory that is page-locked already, through pinned staging blocks
// otherwise — and records a ready event. Batches queued when the thread
// looks for work are taken together, up to config.max_coalesced_bytes, as
// one group: the group's storages are parts of one device block (one
// allocator call: storage::allocate_parts), its small pageable buffers are
// packed into shared staging blocks in the same layout, so that a run of
// them is one copy, and the group shares one ready event. So a stream of
// small batches pays for the allocation, the event, the staging block and
// (pageable) the copy once per group; the storages stay one per buffer, the
// consumer stream's wait one per batch, and pinned buffers are copied one by
// one. Each batch of a group still has its own sequence, storages and error.
// A group's block is freed once every storage of the group is gone and each
// stream any of them was used on has passed that use: a storage kept alive
// keeps its group's block (at most max_coalesced_bytes) allocated. Storages
// that are parts of a block are copied eagerly by lazy_clone and cannot be
// sent to another process as they are (storage::allocate_parts); a group of
// one batch of one buffer gets a block of its own. A consumer
// takes batches in submission order with next() and makes its stream wait
// for the copies with transferred_batch::wait_on: a GPU-side wait, and a use
// of every storage on that stream, so when the consumer drops the batch its
// memory is reused only after that stream has passed its last use (shoal's
// stream-aware free). That is what protects batches: events and the free, not holding the
// last few batches alive.
//
// Backpressure: at most config.max_batches_in_flight batches, of at most
// config.max_bytes_in_flight bytes in all, are submitted and not yet taken by
// next() (two batches may always be, whatever their bytes); submit blocks
// (until its deadline) past that. The engine's thread keeps at most as many batches'
// copies, and bytes, queued on its stream (it waits for the oldest groups to
// run before it starts another), so a consumer that takes batches faster
// than the copies run does not pile up device memory either.
// Pinned staging memory never exceeds config.max_pinned_bytes: a staging
// block is handed out again only after the copy reading it has run, and when
// the bound is reached the engine waits for earlier copies. So a fast
// producer and a slow consumer cannot exhaust memory.
//
// Errors: a batch that cannot be transferred (device out of memory, host
// memory for its bookkeeping, a failed copy) fails with its own typed
// error from next(), in its group too, and the other batches of its group
// and later batches go on; what it allocated goes back after its copies (a
// part of its group's block, with the group's last storage). A failed copy
// of packed small buffers fails every batch with a buffer in it. A failure
// of the engine's stream, or of making or recording the group's ready event,
// fails every batch of the group (each throws that error from next()).
// (A buffer of any size can be staged: one larger than a staging chunk goes
// through the pinned ring chunk by chunk.) A stream whose events can no
// longer be queried (CUDA reports an earlier asynchronous failure so) ends
// no engine: its sources are let go of once the stream has stopped, and the
// failure reaches the consumer through the batches (their synchronize and
// is_ready, and each later group's error from next()). Host memory that
// runs out in the engine's own thread ends no process either: before the
// thread takes a group, the group's batches stay queued until memory comes
// back (dropped should the engine be destroyed first); after, they fail
// with that error from next(), as above.
//
// Thread-safety: submit, next, try_next, take and stats may be called from
// any threads at once, but none may be in progress (or begin) while the
// engine is destroyed: a caller that may be waiting in submit or next ends
// that wait first (its deadline, or a wrapper's own close, as the Python
// bindings' closable does). In a fork() child of the process that made the
// engine, submit, next, try_next, take and stats throw device_unavailable
// (the engine's thread stayed with the parent, and the locks it may have
// held at the fork stay taken). Batches come out of next() in submission order (one
// sequence across all producers). transferred_batch is a value shared by its
// copies; wait_on and synchronize may be called from any thread.
//
// Lifetimes: the device allocator must outlive the engine and every
// storage it handed out; the copy stream, like every stream an allocator is
// used with, must outlive the allocator (its storages are freed on it). The destructor finishes the batches already
// submitted, waits for their copies and stops the thread; batches not taken
// are dropped (their memory is freed after their copies).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/stream.h"
#include "shoal/storage/storage.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::transfer {

struct transfer_config {
  /// Batches submitted and not yet taken by next(), and batches whose copies
  /// are queued and not yet run (>= 1). With max_bytes_in_flight, the bytes
  /// of batches in flight are at most max(max_bytes_in_flight, two batches);
  /// the device memory they keep can be more, by what a taken batch's group
  /// holds (its block lives while any of its storages does) and up to 255
  /// bytes of padding per buffer. The count bounds small batches: 32 lets groups of up to 32
  /// batches form (64 KiB pinned batches, against the plain copy's 3.9 us:
  /// 4.7 us each at 16 in flight, 4.2 us at 32 on the H200; on the H100
  /// 0.71 and 0.86 of the copy); the bytes bound the large ones.
  std::size_t max_batches_in_flight = 32;
  /// Bytes of the batches submitted and not yet taken, and of the batches
  /// whose copies are queued and not yet run (> 0). Two batches may always be
  /// in flight whatever their bytes (within max_batches_in_flight), so a
  /// loop that submits one batch ahead of taking the last, from one thread,
  /// never waits on itself: past the bound, a batch goes while at most one
  /// other is in flight. 64 MiB: 16 batches of up to 4 MiB; from 16
  /// MiB on, at most 4 batches, as the count alone allowed before (4 was the
  /// default), so large batches hold no more device memory in flight than
  /// they did, and batches of 64 MiB and more fewer.
  std::size_t max_bytes_in_flight = std::size_t{64} << 20;
  /// Bytes of pinned staging memory the engine may hold (>= what one staging
  /// chunk reserves: staging_chunk_bytes rounded up to 2 MiB, the pinned
  /// allocator's segment step, so at least 2 MiB):
  /// the ring pageable buffers are staged through. On the H100 host a 32 MiB
  /// ring staged as fast as one of 256 MiB (16 MiB and 256 MiB buffers alike),
  /// with an eighth of the page-locked memory.
  std::size_t max_pinned_bytes = std::size_t{32} << 20;
  /// Pageable buffers are staged in pieces of at most this many bytes (> 0),
  /// so copying one piece to the device overlaps staging the next.
  std::size_t staging_chunk_bytes = std::size_t{4} << 20;
  /// Threads that help the engine's thread copy pageable bytes into staging
  /// blocks (0: it copies alone; one thread moves about 10 GB/s; at most 64).
  /// automatic_staging_helpers (the default): with 16 CPUs or more that this
  /// process may run on, 15 — on the H200 host (16 CPUs) staging 256 MiB
  /// buffers on 16 threads reached 0.79-0.86 of the pinned copy, on 8
  /// 0.53-0.55; with fewer, half of them less the engine's own thread (on 2
  /// CPUs the engine copies alone). A copy takes helpers only for slices of
  /// 64 KiB or more, and small buffers packed together (staging_pack.h) go
  /// on at most 8 threads: groups of 64 and 256 KiB batches staged at half
  /// the speed on 16 as on 8 (parallel_memcpy.h).
  std::size_t staging_helpers = automatic_staging_helpers;
  static constexpr std::size_t automatic_staging_helpers = static_cast<std::size_t>(-1);
  /// How staging writes pinned blocks: non-temporal stores (`streaming`: no
  /// read of each line of the block first, the block goes to memory),
  /// ordinary stores (`cached`), or (`automatic`, the default) streaming for
  /// a copy on up to 8 threads and cached for one on more. On the H200 host
  /// (16 CPUs) one thread staged 64 KiB at 0.91 of the pinned copy with
  /// streaming stores against 0.65 cached; 16 threads staged 16 and 256 MiB
  /// at 0.88-0.90 and 0.79-0.86 cached against 0.80 and 0.67-0.70 streaming;
  /// on 8 threads neither led at every size.
  enum class stores : std::uint8_t { streaming, cached, automatic };
  stores staging_stores = stores::automatic;
  /// Batches found queued together are transferred as one group of at most
  /// this many bytes in all (a larger batch goes alone; 0: every batch
  /// alone). A group shares one ready event and one device block, and its
  /// small pageable buffers share staging blocks and copies; it holds at
  /// most max_batches_in_flight batches, and its first batch is handed out
  /// once the whole group is enqueued. The buffers of one batch are parts of
  /// one block whatever this is: a storage kept keeps its batch's block (and
  /// its group's).
  std::size_t max_coalesced_bytes = std::size_t{4} << 20;
};

/// One host buffer of a batch.
struct host_buffer {
  const void* data = nullptr;
  std::size_t bytes = 0;  ///< > 0
  /// The memory is page-locked already (a pinned allocator's block, a
  /// registered buffer): the device copy reads it directly and `keep_alive`
  /// is held until that copy has run. Otherwise the engine stages the bytes
  /// through its pinned blocks and lets go of `keep_alive` once they are
  /// staged.
  bool pinned = false;
  /// Keeps the memory valid while the engine needs it. May be null when the
  /// caller keeps the memory valid until the batch is ready; a batch that
  /// fails is reported (next, take) only once every copy it enqueued
  /// straight from such pinned memory has run, so its caller may reuse the
  /// memory at the error.
  std::shared_ptr<const void> keep_alive;
};

/// A batch whose copies are enqueued: one device storage per buffer.
class transferred_batch {
 public:
  struct __attribute__((visibility("hidden"))) state;  // hidden: the library's own
  explicit transferred_batch(std::shared_ptr<const state> s) : state_(std::move(s)) {}

  /// The batch's place in submission order, from 0.
  [[nodiscard]] std::uint64_t sequence() const noexcept;
  /// The device storages, in the order of the buffers submitted.
  [[nodiscard]] const std::vector<storage::storage>& storages() const noexcept;
  /// Complete once every copy of the batch has run: the event of its group,
  /// shared with the batches transferred together with it and recorded once
  /// by the engine. Wait on it or query it; never record it again (that
  /// would move every batch of the group's readiness).
  [[nodiscard]] backend::event_ref ready() const noexcept;
  /// Work enqueued on `stream` from now on sees the batch's bytes (a
  /// GPU-side wait, no host synchronization), and every storage records a
  /// use on `stream`: its memory is reused only after `stream` passes the
  /// work enqueued there before the storage's last handle is dropped.
  void wait_on(backend::stream_ref stream) const;
  /// Blocks the calling thread until the copies have run.
  void synchronize() const;
  /// True once the copies have run.
  [[nodiscard]] bool is_ready() const;

 private:
  std::shared_ptr<const state> state_;
};

struct transfer_stats {
  std::uint64_t batches_submitted = 0;
  std::uint64_t batches_transferred = 0;  ///< copies enqueued, ready event recorded
  std::uint64_t batches_failed = 0;
  std::uint64_t batches_taken = 0;        ///< returned (or thrown) by next/try_next
  /// Groups of batches coalesced by the engine's thread (a batch alone is a
  /// group of one), counted once each group is done, whatever became of it:
  /// those that failed, even before their ready event was made, count too.
  /// (batches_transferred + batches_failed) / coalesced_groups batches a group.
  std::uint64_t coalesced_groups = 0;
  std::uint64_t bytes_copied = 0;         ///< bytes moved to the device
  std::uint64_t bytes_staged = 0;         ///< of those, bytes staged through pinned blocks
  /// Host-to-device copies enqueued: one per pinned buffer and per staging
  /// chunk of a large buffer, one per run of small pageable buffers packed
  /// together (so fewer than buffers when runs form).
  std::uint64_t copies = 0;
  std::size_t in_flight = 0;              ///< submitted and not yet taken
  std::size_t peak_in_flight = 0;
  std::size_t bytes_in_flight = 0;        ///< bytes of the batches in flight
  std::size_t peak_bytes_in_flight = 0;
  alloc::allocator_stats pinned;          ///< the staging allocator's stats
};

class transfer_engine {
 public:
  static constexpr std::chrono::milliseconds forever = std::chrono::milliseconds::max();

  /// Copies into storages from `device_allocator`, on `copy_stream` (a
  /// stream of its device that nothing else enqueues work on, kept by the
  /// caller: see Lifetimes). invalid_argument for a config out of range;
  /// backend_error when the process may not start the engine's thread and
  /// its staging helpers (a pids cgroup or RLIMIT_NPROC limit).
  transfer_engine(alloc::caching_allocator& device_allocator, backend::stream_ref copy_stream,
                  transfer_config config = {});
  ~transfer_engine();
  transfer_engine(const transfer_engine&) = delete;
  transfer_engine& operator=(const transfer_engine&) = delete;

  /// Queues a batch (at least one buffer, each non-null with bytes > 0, at
  /// most PTRDIFF_MAX bytes in all, else invalid_argument and nothing
  /// queued) and returns its sequence number.
  /// Blocks while the batch does not fit within max_batches_in_flight and
  /// max_bytes_in_flight (two batches may always be in flight, whatever
  /// their bytes); timeout_error when `timeout` passes first (nothing
  /// queued). Waiting submitters are admitted as room allows, not in the
  /// order they came: a batch that fits goes ahead of a larger one still
  /// waiting, so a thread that both submits and takes never waits behind
  /// another thread's batch, but other threads' small batches can keep a
  /// large one waiting until its timeout.
  /// `tag`, when given, is whatever the caller keeps with the batch (the
  /// Python layer: its structure): take() hands it back with the batch,
  /// transferred or failed, so the pairing holds whatever happens between
  /// the two calls on the caller's side. The engine lets go of it without
  /// its lock held (its deleter may take other locks): with the batch taken,
  /// with submit's throw, or as the engine is destroyed.
  std::uint64_t submit(std::vector<host_buffer> batch, std::chrono::milliseconds timeout = forever,
                       std::shared_ptr<const void> tag = nullptr);
  /// The next batch in submission order, once its copies are enqueued (wait
  /// for them with wait_on or synchronize). Throws the batch's own error
  /// when it failed (the batch is taken all the same); timeout_error when
  /// none is done within `timeout`.
  [[nodiscard]] transferred_batch next(std::chrono::milliseconds timeout = forever);
  /// next() without waiting: nothing when the next batch is not done yet.
  [[nodiscard]] std::optional<transferred_batch> try_next();

  /// What take() took: one batch, transferred or failed.
  struct taken_batch {
    std::uint64_t sequence = 0;              ///< the batch's place in submission order
    std::optional<transferred_batch> batch;  ///< set unless the batch failed
    std::exception_ptr error;                ///< the batch's own error, set when it failed
    std::shared_ptr<const void> tag;         ///< what submit was given with the batch
  };
  /// next() that hands a failed batch's error back, with the batch's
  /// sequence, instead of throwing it: a caller that keeps something per
  /// batch (the Python layer, its structure) learns which batch failed even
  /// while other threads take batches too. timeout_error as next().
  [[nodiscard]] taken_batch take(std::chrono::milliseconds timeout = forever);

  /// The counters now. device_unavailable in a fork() child (see
  /// Thread-safety).
  [[nodiscard]] transfer_stats stats() const;
  /// The stream the copies run on.
  [[nodiscard]] backend::stream_ref stream() const noexcept { return stream_; }
  [[nodiscard]] const transfer_config& config() const noexcept { return config_; }

 private:
  struct __attribute__((visibility("hidden"))) job;  // hidden: the library's own
  struct __attribute__((visibility("hidden"))) outcome;
  class __attribute__((visibility("hidden"))) batch_copier;

  void run() noexcept;
  // Moves the next group of jobs from jobs_ into `group` (empty, jobs_ not),
  // with a node in `room` made for each one's outcome first. Short of host
  // memory the group is smaller; false, nothing moved, when not even one
  // job has room.
  bool take_group_locked(std::vector<job>& group, std::list<outcome>& room);
  /// Writes the outcomes for `group` into the first nodes of `room` (one per
  /// job, in order): the copier's, or, should the copier itself throw (host
  /// memory for its bookkeeping), that error for each of its batches.
  void copy_or_fail(std::span<job> group, std::list<outcome>& room) noexcept;
  taken_batch take_locked(std::unique_lock<std::mutex>& lock);
  // take(), its errors naming `call` (next or take).
  taken_batch take(std::chrono::milliseconds timeout, const char* call);

  alloc::caching_allocator& device_allocator_;
  const transfer_config config_;
  const backend::stream_ref stream_;
  std::unique_ptr<batch_copier> copier_;

  // Lock order: mutex_ alone; the worker copies without it.
  mutable std::mutex mutex_;
  // What threads wait on, on the heap: a fork() child leaves it be (its
  // copies of the parent's waiters would block its destruction forever).
  struct __attribute__((visibility("hidden"))) wake_ups;  // hidden: the library's own
  std::unique_ptr<wake_ups> wake_;
  std::deque<job> jobs_;          // submitted, not yet picked up by the worker
  // Done (transferred or failed), not yet taken, in sequence order. A list:
  // the worker makes a group's nodes before it takes the group's jobs and
  // splices them in after its copies (splicing cannot throw), so no batch is
  // lost for want of host memory once its copies are enqueued.
  std::list<outcome> outcomes_;
  std::uint64_t next_sequence_ = 0;
  bool stopping_ = false;         // set by the destructor: the worker finishes the jobs and returns
  transfer_stats counters_;       // every field but `pinned`
  std::thread worker_;            // last: started once everything above exists
};

}  // namespace shoal::transfer

#pragma GCC visibility pop
