// The device interface: everything the upper layers ask of a GPU.
//
// Two implementations: `cuda_device` (a CUDA GPU) and `host_device` (host
// memory with executor threads as streams, which keeps GPU ordering exactly:
// work enqueued on a stream runs after the enqueueing call returns).
//
// Thread-safety: every member function may be called from any thread at once.
// Ordering semantics (the same on both backends):
//   - work on one stream runs in the order it was enqueued;
//   - record(e, s) marks the point in s after all work enqueued on s so far;
//     e is complete once s has passed that point; re-recording moves it;
//   - wait(s2, e) makes work enqueued on s2 afterwards start only after e is
//     complete, without blocking the caller;
//   - an event never recorded is complete.
// Lifetimes: a stream or event is destroyed by its device's destroy_*; using
// it afterwards gives shoal::invalid_argument. Pending work still completes.
// A stream something holds (hold_stream: a caching allocator holds each
// stream it keeps a pool for) is destroyed at its last release instead.
// Errors: bad arguments give shoal::invalid_argument, exhausted memory
// shoal::out_of_memory, failing runtime calls shoal::backend_error.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>

#include "shoal/backend/shareable_event.h"
#include "shoal/backend/shareable_handle.h"
#include "shoal/backend/types.h"
#include "shoal/core/process_identity.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

class device {
 public:
  device();
  device(const device&) = delete;
  device& operator=(const device&) = delete;
  virtual ~device() = default;

  [[nodiscard]] virtual device_kind kind() const noexcept = 0;
  /// Index among devices of the same kind (CUDA device number; 0 for host).
  [[nodiscard]] virtual int ordinal() const noexcept = 0;
  /// Human-readable name, e.g. "NVIDIA H100 80GB HBM3" or "host".
  [[nodiscard]] virtual std::string name() const = 0;
  /// A number unique to this device object within the process, never reused.
  [[nodiscard]] std::uint64_t serial() const noexcept { return serial_; }

  // ---- plain segments --------------------------------------------------
  /// Free and total memory as the device reports it.
  [[nodiscard]] virtual memory_info memory() const = 0;
  /// A new segment of at least `bytes` (> 0), aligned to 256 bytes or more.
  virtual void* allocate_segment(std::size_t bytes) = 0;
  /// Returns a segment to the device. `base` must be a pointer
  /// allocate_segment returned and that was not freed since.
  virtual void free_segment(void* base) = 0;

  // ---- pinned host memory -------------------------------------------------
  /// A page-locked host segment of at least `bytes` (> 0), aligned to 256
  /// bytes or more: memory the calling process's threads read and write
  /// directly and copy() moves to and from this device at the link's full
  /// speed, asynchronously (CUDA: cudaHostAlloc, portable; host backend:
  /// ordinary memory with the same contract). Not counted in memory(), not
  /// shareable with other processes. out_of_memory when the system refuses.
  virtual void* allocate_pinned_host(std::size_t bytes) = 0;
  /// Returns a pinned segment. `base` must be a pointer allocate_pinned_host
  /// returned and that was not freed since; work still queued on it must
  /// have run (the caller waits: CUDA may not).
  virtual void free_pinned_host(void* base) = 0;

  // ---- growable ranges: reserve addresses, map physical chunks ----------
  /// Whether this device has growable ranges, and whether their chunks can
  /// be shared with other processes (see growable_support). Asked of the
  /// driver once, when the device is made; cheap to call. Not pure: a device
  /// written before the query keeps what it had, growable ranges in use and
  /// exported wherever its own calls allow.
  [[nodiscard]] virtual growable_support growable() const noexcept { return {.supported = true, .shareable = true}; }
  /// Size and alignment unit of reservations, chunks and mappings.
  [[nodiscard]] virtual std::size_t granularity() const noexcept = 0;
  /// Reserves `bytes` (a multiple of granularity()) of address space with no
  /// memory behind it.
  virtual void* reserve_range(std::size_t bytes) = 0;
  /// Gives a reservation back. Every mapping in it must be unmapped first.
  virtual void release_range(void* base) = 0;
  /// A physical chunk of `bytes` (a multiple of granularity()).
  virtual physical_ref create_physical(std::size_t bytes) = 0;
  /// Drops the chunk's handle. Mappings of it stay valid; its memory is
  /// returned when the last mapping is unmapped.
  virtual void release_physical(physical_ref chunk) = 0;
  /// Maps the whole chunk at `address`, which must lie, with the chunk's
  /// size, inside one reservation, granularity-aligned and not yet mapped.
  virtual void map(void* address, physical_ref chunk) = 0;
  /// Maps `chunks` back to back from `address` (each whole, each where the
  /// one before ends, by the size it gives, which must be the size it was
  /// created with; the same rules as map) and grants this device access
  /// to the whole range at once (CUDA: one cuMemMap per chunk and one
  /// cuMemSetAccess over the range, where map pays one per chunk). All or
  /// nothing: on an error nothing of it stays mapped. Each chunk is unmapped
  /// on its own (unmap, at its own address).
  ///
  /// Optional: this default maps the chunks one by one with map (an access
  /// grant each), which is all the host backend needs (mmap grants access).
  virtual void map_chunks(void* address, std::span<const sized_chunk> chunks);
  /// Unmaps the chunk mapped at `address`.
  virtual void unmap(void* address) = 0;
  /// Lets device `peer` (another device of this kind) read and write this
  /// device's growable ranges: every chunk mapped now and every chunk mapped
  /// later. Granting a peer again does nothing. Memory in plain segments
  /// follows the runtime's own peer access instead (CUDA:
  /// cudaDeviceEnablePeerAccess, made current on `peer`, the caller's), and
  /// a kernel of `peer` that reads this device's memory needs that too;
  /// memory imported from another process stays this device's alone.
  /// Throws invalid_argument for this device itself or a device that does
  /// not exist, backend_error where `peer` has no path to this device's
  /// memory (CUDA: cudaDeviceCanAccessPeer says no; copy through
  /// cudaMemcpyPeer there).
  ///
  /// Optional: this default only checks that `peer` is another device,
  /// which is all the host backend needs (host memory is every device's).
  virtual void grant_peer_access(int peer);

  // ---- streams ----------------------------------------------------------
  virtual stream_ref create_stream() = 0;
  /// Destroys a stream created by create_stream; its pending work completes.
  /// A held stream (hold_stream) is only marked, and stays usable until its
  /// last release_stream destroys it; a second destroy_stream meanwhile gives
  /// shoal::invalid_argument, as for a stream destroyed already.
  void destroy_stream(stream_ref stream);
  /// Keeps `stream` from being destroyed until a release_stream for each
  /// hold_stream, for an owner that uses the stream past the calls it was
  /// given in (a caching allocator keeps a pool per stream, synchronizes it
  /// when it gives memory back, and makes later users of a block wait for
  /// it): the stream's user may destroy it whenever it is done with it, and
  /// the handle is not reused for a new stream while held. A live stream of
  /// this device (not checked); holding the default stream or an adopted one
  /// is allowed and defers nothing shoal does (it destroys neither), but a
  /// destroy_stream of an adopted one while held is refused only at the last
  /// release, by that release (an allocator's, at its teardown, drops the
  /// error: destroy only streams of this device's create_stream).
  void hold_stream(stream_ref stream);
  /// Ends one hold_stream of `stream`. The last one destroys the stream when
  /// destroy_stream was called meanwhile, and throws what that destroy throws.
  /// A stream with no hold gives shoal::invalid_argument.
  ///
  /// In a fork() child of the process that made the device, destroy_stream,
  /// hold_stream and release_stream do nothing (and stream_destroy_pending
  /// says false): the streams are the
  /// parent's, and so may be the holds' lock (another of its threads may
  /// have held it at the fork). The host backend's own calls refuse there
  /// with device_unavailable, or do nothing for what drops a stream, an
  /// event or an event source.
  void release_stream(stream_ref stream);
  /// How many destroy_stream calls a hold deferred so far (only ever grows):
  /// a holder compares it with what it saw last to learn, with one load, that
  /// an owner is done with a stream it holds (stream_destroy_pending says
  /// which), and lets that stream go early.
  [[nodiscard]] std::uint64_t deferred_stream_destroys() const noexcept {
    return deferred_destroys_.load(std::memory_order_acquire);
  }
  /// Whether destroy_stream was called on `stream` while held, and its last
  /// release_stream has not come yet.
  [[nodiscard]] bool stream_destroy_pending(stream_ref stream);
  /// A stream this device did not create — another library's, such as
  /// PyTorch's, CuPy's or JAX's — usable wherever a stream is from now on
  /// (idempotent; the default stream and this device's own streams come back
  /// as they are). shoal never destroys it: the caller guarantees it stays a
  /// live stream of this device while shoal may use it (work enqueued on it,
  /// frees recorded on it). CUDA checks the handle as far as the runtime
  /// allows (it answers a query and belongs to this device); the host
  /// backend has no foreign streams. invalid_argument otherwise.
  virtual stream_ref adopt_external_stream(void* native) = 0;
  /// Blocks until all work enqueued on `stream` has run. Throws
  /// shoal::stream_error if any of it failed.
  virtual void synchronize(stream_ref stream) = 0;
  /// Blocks until all work enqueued so far on every stream of this device
  /// has run, streams no caller told shoal about and streams destroyed with
  /// work still queued included (CUDA: cudaDeviceSynchronize, which is
  /// illegal while another thread captures a CUDA graph in global mode: it
  /// fails and invalidates that capture; do not call it then). Throws shoal::stream_error when the device
  /// reports failed work; a failed host task stays reported by its own
  /// stream's next synchronize.
  ///
  /// Optional: both of shoal's devices implement it; an implementation
  /// that does not (one written before it was added) inherits this default,
  /// which throws shoal::backend_error (call "synchronize_device") and waits
  /// for nothing. What needs the device-wide wait refuses then, before it
  /// changes anything: a forced clear (alloc::live_blocks::invalidate).
  virtual void synchronize_device();
  /// True when all work enqueued on `stream` has run.
  [[nodiscard]] virtual bool query(stream_ref stream) = 0;

  // ---- events -----------------------------------------------------------
  /// A new event (timing disabled).
  virtual event_ref create_event() = 0;
  virtual void destroy_event(event_ref event) = 0;
  virtual void record(event_ref event, stream_ref stream) = 0;
  /// True when `event` is complete.
  [[nodiscard]] virtual bool query_event(event_ref event) = 0;
  /// Blocks the calling thread until `event` is complete.
  virtual void synchronize_event(event_ref event) = 0;
  /// Work enqueued on `stream` from now on waits for `event` (GPU-side).
  virtual void wait(stream_ref stream, event_ref event) = 0;

  // ---- work on a stream -------------------------------------------------
  /// Copies `bytes` from `src` to `dst` in stream order. Either may be
  /// device memory of this device or ordinary host memory.
  virtual void copy(stream_ref stream, void* dst, const void* src, std::size_t bytes) = 0;
  /// Sets `bytes` bytes at `dst` (device memory) to `value` in stream order.
  virtual void fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) = 0;
  /// Keeps the stream busy for `duration`: a spinning kernel on CUDA, a
  /// sleeping executor on host. Stands in for a long-running kernel.
  virtual void delay(stream_ref stream, std::chrono::microseconds duration) = 0;
  /// Runs `task` on a host thread when the stream reaches it. The task must
  /// not call into the device (CUDA forbids it in host functions). If it
  /// throws, the next synchronize of the stream throws shoal::stream_error.
  virtual void host_task(stream_ref stream, std::function<void()> task) = 0;

  // ---- sharing with other processes --------------------------------------
  /// Describes the segment or mapped chunk that contains `ptr` so another
  /// process can map it; handle.offset locates `ptr` inside it.
  [[nodiscard]] virtual shareable_handle export_memory(const void* ptr) = 0;
  /// Maps memory exported by another process; returns the pointer that was
  /// exported (base + offset). Each import is closed by close_import.
  /// Importing in the exporting process itself is refused on CUDA.
  void* import_memory(const shareable_handle& handle, memory_access access = memory_access::read_write) {
    return import_memory(std::span(&handle, 1), access);
  }
  /// import_memory(chunks, memory_access::read_write).
  void* import_memory(std::span<const shareable_handle> chunks) {
    return import_memory(chunks, memory_access::read_write);
  }
  /// Maps several exported chunks back to back, in order and each whole, in
  /// one contiguous range; returns its base + chunks[0].offset. The chunks
  /// must be non-empty, of one kind and device; every chunk after the first
  /// has offset 0, and when there are several every size is a multiple of
  /// granularity(). CUDA legacy IPC handles (cuda_ipc) are imported only
  /// singly. Anything else gives shoal::invalid_argument and maps nothing.
  ///
  /// `access` is what this mapping allows. read_only: reads only, a write
  /// through the mapping faults (CUDA: the mapping's access flags are
  /// CU_MEM_ACCESS_FLAGS_PROT_READ, a kernel's write is an illegal-address
  /// error; host: PROT_READ pages, a write is SIGSEGV, and the host backend
  /// then also accepts descriptors opened read-only or sealed against
  /// writes). It protects this mapping, not the memory: whoever holds the
  /// handle may map it again for writing. cuda_ipc handles cannot be mapped
  /// read-only (invalid_argument).
  virtual void* import_memory(std::span<const shareable_handle> chunks, memory_access access) = 0;
  /// Unmaps an import, all of its chunks. `ptr` must be what import_memory
  /// returned.
  virtual void close_import(void* ptr) = 0;

  // ---- ordering across processes ------------------------------------------
  // A stream of this process exports points; another process opens their
  // source once and makes its own streams wait for points, as wait() does
  // for events. Sources stay valid until this device is destroyed, also for
  // streams destroyed meanwhile. See shareable_event.h for the wire forms.

  /// Records the point in `stream` after all work enqueued so far, in a form
  /// another process can wait on. Throws shoal::backend_error when the stream
  /// cannot be exported (host: see host_device.h).
  [[nodiscard]] virtual event_point export_event(stream_ref stream) = 0;
  /// Describes the source of points export_event returned (one per stream or
  /// per page; `source_id` from event_point), with a fresh descriptor where
  /// the kind carries one, for another process to open once. An id this
  /// device never exported gives shoal::invalid_argument.
  [[nodiscard]] virtual event_source describe_event_source(std::uint64_t source_id) = 0;
  /// Opens a source exported by another process. Close with
  /// close_event_source. A source of another backend, or one that does not
  /// check out (a descriptor that is not a sealed shoal counter page), gives
  /// shoal::invalid_argument. Opening in the exporting process itself may be
  /// refused on CUDA.
  virtual imported_event_ref open_event_source(const event_source& source) = 0;
  /// The process an opened source says exported it, where its kind records
  /// one: a host page's header names its exporter (pid and start time); a
  /// CUDA interprocess event names no process (nothing). A receiver checks it
  /// against the peer the source came from: a page naming another live
  /// process could make its waits last as long as that process. A source
  /// this device did not open gives shoal::invalid_argument.
  [[nodiscard]] virtual std::optional<process_identity> event_source_exporter(imported_event_ref source) = 0;
  /// Work enqueued on `stream` from now on waits until the exporting stream
  /// has passed `point` (GPU-side on CUDA; on host, the stream's executor
  /// waits). A point of another source, or of a slot the source does not
  /// have, gives shoal::invalid_argument. On the host, if the exporting
  /// process dies before passing the point, the wait ends and the next
  /// synchronize of `stream` throws shoal::stream_error; on CUDA what a dead
  /// exporter's event does is up to the driver.
  virtual void wait_imported(stream_ref stream, imported_event_ref source, const event_point& point) = 0;
  /// Closes a source open_event_source returned. Waits already enqueued on it
  /// still complete.
  virtual void close_event_source(imported_event_ref source) = 0;

 protected:
  /// destroy_stream's work, once no hold defers it: checks that `stream` is a
  /// live stream this device created (shoal::invalid_argument otherwise) and
  /// destroys it.
  virtual void destroy_stream_now(stream_ref stream) = 0;

 private:
  struct stream_holds {
    std::size_t count = 0;
    bool destroy_pending = false;  // destroy_stream was called while held
  };

  [[nodiscard]] bool in_fork_child() const noexcept;

  std::uint64_t serial_;
  std::uint64_t forks_when_made_;  // the process's fork depth when made (in_fork_child)
  std::mutex holds_mutex_;                          // a leaf lock: no device call runs under it
  std::unordered_map<void*, stream_holds> holds_;  // guarded by holds_mutex_; entries have count > 0
  std::atomic<std::uint64_t> deferred_destroys_{0};  // destroy_stream calls a hold deferred
};

}  // namespace shoal::backend

#pragma GCC visibility pop
