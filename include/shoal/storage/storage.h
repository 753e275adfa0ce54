// Reference-counted storages and copy-on-write lazy clones.
//
// A `storage` is a handle to one storage object: memory from a caching
// allocator (size, device, owning allocator, data pointer). Copying the
// handle aliases: two handles alias iff they name the same storage object
// (`aliases`). `lazy_clone` makes a new storage object that shares the data
// through a copy-on-write context, copying nothing.
//
// Copy-on-write rules:
//   - read access (`data`) never copies;
//   - the first mutable access (`mutable_data`) to a storage in a
//     copy-on-write context materializes it: the last reference steals the
//     data without a copy; any other copies it, and gives up its share only
//     once the copy is enqueued, so the data outlives the copy and a copy
//     that fails (the call throws) leaves the storage lazy, as it was; the
//     reference count and the steal decision are atomic;
//   - while shared, the data is never written in place through shoal, so it
//     stays as it was at clone time: a pointer mutable_data returned before
//     a lazy_clone must not be written after it (take a new one, which
//     materializes; or enqueue_write, which no clone can come between
//     taking the pointer and enqueueing the write), and a pointer data()
//     returned is no longer this storage's data once a write materializes
//     it by a copy (the storage moves to the copy; the old pointer shows the
//     shared data, and only while another storage of the family holds it).
//     Once the others are gone, the one left takes the data over and writes
//     in place.
// Streams a storage was used on (one rule for every kind of storage):
//   - a storage remembers the streams its data was used on: its own stream
//     (the one it was allocated, adopted or received on, or its clone's or
//     copy's stream), every stream given to mutable_data, and every stream
//     given to record_stream; the newest of them is `last_used_on()`. A
//     write that copies a lazy storage's data into a block of its own keeps
//     them all (the writer's stream becomes the own one): a read queued on
//     the first stream without a record stays safe whether or not another
//     thread made a clone meanwhile;
//   - its memory is released only once each of those streams has passed the
//     work enqueued on it until the last handle went, on whichever thread
//     that happens (the dropping thread's current stream is not one of them
//     unless recorded). Memory from the allocator is freed the allocator's
//     way (deallocate on its own stream, record_stream for the others);
//     memory with an owner is handed back with the streams (storage_owner);
//   - reads through data() on a stream other than these are not seen:
//     tell the storage with record_stream, as for the allocator's blocks;
//   - up to two streams cost no heap memory; a use on the last recorded
//     stream costs one atomic load;
//   - every stream a storage was used on must outlive that release: for a
//     clone family, until the family's final free (the last member gone),
//     since the shared block's free waits for the streams of every member
//     (the allocator's rule: a stream outlives every free recorded on it).
// Stream order of lazy clones: the clone's stream waits, when the clone is
// made, for every other stream the source was used on (the clone's reads on
// it see the source's earlier writes); the materializing copy is enqueued on the
// caller's stream after an event on the clone's stream and on every stream
// the source was used on when the clone was made (the data's writes before
// the clone are passed first);
// the shared block is held by the allocator until that copy and every use of
// the family's storages complete, and a stealer's stream waits for every
// copy, and for every stream a storage of the family that went (dropped or
// materialized) used the data on, before writing in place.
// Work shoal enqueues on a storage's data by itself (that materializing copy,
// a steal's waits, an eager clone's copy out of its source) comes before the
// storage's later uses on other streams too: the first time each other
// stream is given to mutable_data, enqueue_write, enqueue_read or
// record_stream after it,
// that stream waits (GPU-side) for the work enqueued so far on the stream
// shoal worked on. So writes of disjoint parts on two streams, which need no
// order between them, stay as safe on a lazy clone as on any storage; a read
// through data() on another stream is ordered by a record_stream before it
// (or enqueue_read).
// A storage shoal never worked on adds no wait between its streams.
// Memory that has left the process (shared over IPC, exported writable
// through DLPack) is never lazily shared: lazy_clone of such a storage makes
// an eager copy at once, ordered after the source's streams. (A read-only
// export is a reader, not a writer: it holds a try_lazy_clone, a snapshot.)
//
// Thread-safety: different storage objects may be used from any threads at
// once, including clones of one family and parts of one block. One storage
// object's mutable_data, enqueue_write and record_stream may be called from
// several threads at once; they materialize it once and record every
// stream. enqueue_write holds the storage's lock across its caller's
// enqueue step (an allocation for its copy comes before, with the lock let
// go). No storage lock is held
// while memory is allocated (a materializing copy, an eager clone): the
// allocator's out-of-memory observers may use any storage, this one included;
// writers racing to materialize one storage may each allocate a block for a
// moment, and one is kept (one that finds no memory for its block writes to
// the copy another made, though the out-of-memory observers saw it fail).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/types.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::storage {

namespace detail {
class __attribute__((visibility("hidden"))) storage_impl;  // hidden: the library's own
}

/// Keeps memory alive that a storage did not take from its allocator (for
/// example memory mapped from another process); its destructor gives the
/// memory back. Also what a storage shared with other processes hands its
/// memory to (see shoal/ipc).
class storage_owner {
 public:
  storage_owner() = default;
  storage_owner(const storage_owner&) = delete;
  storage_owner& operator=(const storage_owner&) = delete;
  virtual ~storage_owner() = default;

  /// A storage over this owner's memory is gone: `used_on` are the streams
  /// it was used on, its own stream first. The owner gives the memory back
  /// only after each of them has passed the work enqueued on it until now.
  /// Called once per storage, before it lets go of the owner, on the thread
  /// that dropped its last handle; storages sharing an owner may call it from
  /// several threads at once. The default does nothing, which suits a block
  /// taken over with hand_over and freed through its allocator: the storage
  /// records these streams on the block itself (record_stream). It runs in
  /// the storage's destructor and must not throw: an owner that needs memory
  /// to remember the streams falls back to what cannot fail when the heap
  /// refuses (ipc's received storages then wait for such a stream on the host).
  virtual void storage_released(std::span<const backend::stream_ref> used_on) noexcept { (void)used_on; }
};

class storage {
 public:
  /// A storage of `bytes` bytes from `allocator`, for use on `stream`.
  static storage allocate(alloc::caching_allocator& allocator, std::size_t bytes, backend::stream_ref stream);
  /// A storage on the calling thread's current stream.
  static storage allocate(alloc::caching_allocator& allocator, std::size_t bytes);

  /// A storage over `bytes` bytes at `data`, for use on `stream`, memory
  /// that `owner` keeps alive until the storage's last handle is gone (and
  /// gives back after the streams it is told of); `allocator` (of the
  /// memory's device) serves copies. Such memory counts as shared outside
  /// the process, so it is never lazily shared.
  static storage adopt(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                       std::shared_ptr<storage_owner> owner, backend::stream_ref stream);
  /// adopt for use on the calling thread's current stream.
  static storage adopt(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                       std::shared_ptr<storage_owner> owner);

  /// Storages over the parts of one block from `allocator` (one allocator
  /// call), for use on `stream`: part i holds `bytes[i]` bytes (each > 0)
  /// and starts at the next multiple of part_alignment after part i-1 ends,
  /// so parts follow each other in order with at most part_alignment - 1
  /// bytes between them. Each part is a storage of its own (no two alias);
  /// the block is freed once every part's last handle is gone and each
  /// stream any part was used on has passed that part's uses (a part's
  /// release records its streams on the block; the last one frees it on
  /// `stream`), so a part dropped on one stream while another is read on a
  /// second never lets the block be reused under that read. A part holds the
  /// whole block: memory returns when the last part goes. Parts are never
  /// lazily shared (lazy_clone makes an eager copy: a copy-on-write context
  /// frees its data as a block of its own); they have not left the process
  /// (shared_outside_process() is false until marked) and owner() is the
  /// block's. Every stream a part was used on must outlive the block's free.
  /// Part 0's pointer is the block's start, so block-level calls on it act
  /// on the whole block (the allocator's record_stream adds a stream to the
  /// block's free; take_over is refused, as for any storage's block), while
  /// the other parts' pointers start no block and those calls refuse them.
  /// invalid_argument when `bytes` is empty or holds a 0.
  static std::vector<storage> allocate_parts(alloc::caching_allocator& allocator, std::span<const std::size_t> bytes,
                                             backend::stream_ref stream);
  /// Where allocate_parts starts each part: a multiple of this many bytes
  /// from the block's start.
  static constexpr std::size_t part_alignment = 256;

  /// A storage that takes over the live block at `data`, which `allocator`
  /// handed out (allocate) and someone else held until now (say, a
  /// framework's tensor), for use on `stream`: from now on the storage owns
  /// the block — its release frees it, as for allocate — and the previous
  /// holder must not free it itself (it drops a handle of the storage
  /// instead). `bytes` (> 0) is how much of the block the storage spans.
  /// The previous holder may still write the memory, so it counts as shared
  /// outside the process: never lazily shared. invalid_argument when `data`
  /// does not start a block `allocator` has handed out, when a storage owns
  /// that block already (allocated as a storage, the block whose start is
  /// part 0 of allocate_parts, or taken over before: the allocator's claim),
  /// or when `bytes` is 0 or more than the block holds.
  static storage take_over(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                           backend::stream_ref stream);

  storage() = default;  ///< an empty handle: valid() is false

  [[nodiscard]] bool valid() const noexcept { return impl_ != nullptr; }
  [[nodiscard]] std::size_t size() const;
  [[nodiscard]] backend::device& device() const;
  [[nodiscard]] alloc::caching_allocator& allocator() const;

  /// Read access: never copies.
  [[nodiscard]] const void* data() const;
  /// Enqueues reads of the data on `stream`: `enqueue` gets the pointer and
  /// enqueues them, with the storage's lock held from recording `stream` as
  /// a use until it returns (as enqueue_write). Another thread's write that
  /// moves this storage to a copy, or the family's steal or final free,
  /// comes wholly before it (the reads wait for a copy into the data) or
  /// wholly after (and waits for the reads); data() and a record_stream
  /// after it can be split by them. Never copies. `enqueue` must not use
  /// this storage.
  void enqueue_read(backend::stream_ref stream, const std::function<void(const void*)>& enqueue) const;
  /// Write access on `stream`: materializes a lazily shared storage first,
  /// and records a use on `stream`.
  [[nodiscard]] void* mutable_data(backend::stream_ref stream);
  /// Write access on the calling thread's current stream.
  [[nodiscard]] void* mutable_data();
  /// A write enqueued on `stream` in one step with taking its pointer: as
  /// mutable_data(stream), then `enqueue(data)` with the storage's lock held,
  /// so a lazy_clone or try_lazy_clone on another thread comes wholly before
  /// (the write then materializes this storage away from the clone, which
  /// keeps the data it had) or wholly after (the clone is ordered after the
  /// write, a use of `stream`). mutable_data and an enqueue after it could
  /// write into a clone made between the two (a read-only export's snapshot).
  /// `enqueue` only enqueues work on `stream` (a copy, a fill): it allocates
  /// nothing from an allocator, synchronizes nothing and calls nothing on
  /// this storage (a copy from pageable host memory, which CUDA may run
  /// before it returns, holds the lock meanwhile). A throw from it leaves the
  /// storage materialized and `stream` recorded as a use.
  void enqueue_write(backend::stream_ref stream, const std::function<void(void*)>& enqueue);
  /// Records a use of the data on `stream` (a read, or a write through a
  /// pointer taken earlier): the memory's release waits for the work
  /// enqueued there until then, lazy clones made afterwards are ordered
  /// after it, and it becomes last_used_on(). Like the allocator's
  /// record_stream; a stream recorded must outlive the storage's release.
  void record_stream(backend::stream_ref stream) const;
  /// The stream of the last use recorded (see the header comment).
  [[nodiscard]] backend::stream_ref last_used_on() const;

  /// True iff both handles name the same storage object.
  [[nodiscard]] bool aliases(const storage& other) const noexcept { return impl_ == other.impl_; }
  /// How many handles name this storage object now, this one included (0
  /// for an empty handle). A snapshot: other threads may copy or drop
  /// handles meanwhile; 1 means no one else can reach it through shoal.
  [[nodiscard]] long handles() const noexcept { return impl_.use_count(); }
  /// True while this storage shares its data with others through copy-on-write.
  [[nodiscard]] bool is_lazy() const;
  /// Marks the data as shared outside the process (IPC, DLPack): from now on
  /// it is never lazily shared. Materializes it first if it is lazy, on
  /// last_used_on().
  void mark_shared_outside_process();
  /// mark_shared_outside_process, materializing a lazy storage on `stream`
  /// (then a use of `stream`). One step under the storage's lock: a
  /// lazy_clone on another thread comes wholly before it (the mark
  /// materializes this storage away from the clone) or wholly after (an
  /// eager copy). So a writable export marks first, then takes
  /// mutable_data: the pointer it gets is never shared with a lazy clone.
  void mark_shared_outside_process(backend::stream_ref stream);
  [[nodiscard]] bool shared_outside_process() const;
  /// The owner of this storage's memory, or nullptr when its allocator
  /// owns it.
  [[nodiscard]] std::shared_ptr<storage_owner> owner() const;

  /// Hands this storage's memory to the owner `make_owner(data, size)`
  /// returns, unless it has an owner already, after marking it shared outside
  /// the process (materializing a lazy storage first, on `stream`). Returns
  /// the owner it has then. The owner frees the memory when it is destroyed.
  std::shared_ptr<storage_owner> hand_over(
      const std::function<std::shared_ptr<storage_owner>(void* data, std::size_t bytes)>& make_owner,
      backend::stream_ref stream) const;

 private:
  friend storage lazy_clone(const storage& source, backend::stream_ref stream);
  friend storage try_lazy_clone(const storage& source, backend::stream_ref stream);
  explicit storage(std::shared_ptr<detail::storage_impl> impl) : impl_(std::move(impl)) {}
  [[nodiscard]] detail::storage_impl& impl() const;

  std::shared_ptr<detail::storage_impl> impl_;
};

/// A new storage sharing `source`'s data copy-on-write, in O(1); cloning a
/// clone joins its context. The clone is for use on `stream`; its data is
/// what the source holds once `stream` and every stream the source was used
/// on have passed the work enqueued so far: `stream` is made to wait (on the
/// GPU, an event each) for the source's other streams, so reads of the
/// clone on `stream` never overtake the source's earlier writes. No device
/// call when the source was used on `stream` alone.
[[nodiscard]] storage lazy_clone(const storage& source, backend::stream_ref stream);
/// lazy_clone on the stream the source was last used on (last_used_on()).
[[nodiscard]] storage lazy_clone(const storage& source);
/// lazy_clone when `source` may be lazily shared; otherwise (shared outside
/// the process, or its memory has an owner) an empty handle, with no copy
/// and no device call. Decided under the source's lock, so it cannot race a
/// mark. What a reader that must keep a snapshot alive wants (a read-only
/// DLPack export): a clone keeps the data it shows allocated whatever the
/// family writes; a storage that may not be lazily shared keeps its data at
/// one address for its life (written in place, never moved to a copy), so
/// holding the storage itself keeps that memory alive.
[[nodiscard]] storage try_lazy_clone(const storage& source, backend::stream_ref stream);

}  // namespace shoal::storage

#pragma GCC visibility pop
