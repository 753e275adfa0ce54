#include "shoal/storage/storage.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <mutex>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "storage/cow_context.h"
#include "storage/shared_block.h"
#include "storage/stream_fences.h"
#include "storage/stream_set.h"

namespace shoal::storage {

namespace detail {

static_assert(std::atomic<backend::stream_ref>::is_always_lock_free, "mutable_data's fast path is one atomic load");

// A block of one storage's size, allocated on one stream for a
// materializing copy; freed on that stream unless released to its storage
// (a copy enqueued into it runs before the free, on the same stream).
class spare_block {
 public:
  spare_block(alloc::caching_allocator& allocator, backend::stream_ref stream)
      : allocator_(allocator), stream_(stream) {}
  spare_block(const spare_block&) = delete;
  spare_block& operator=(const spare_block&) = delete;
  ~spare_block() {
    if (data_ == nullptr) return;
    try {
      allocator_.deallocate(data_, stream_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a refused free leaves the block allocated, counted
    }
  }
  // Claimed: the materialized storage owns it, and a take_over of it is refused.
  void allocate(std::size_t bytes) { data_ = allocator_.allocate_claimed(bytes, stream_); }
  [[nodiscard]] void* get() const noexcept { return data_; }
  void release() noexcept { data_ = nullptr; }

 private:
  alloc::caching_allocator& allocator_;
  const backend::stream_ref stream_;
  void* data_ = nullptr;
};

// One storage object. It owns its data outright (cow_ == nullptr and no
// owner_), holds one reference to a copy-on-write context whose data it
// reads, or leaves its data to an owner (owner_ set; never lazy then).
class storage_impl {
 public:
  storage_impl(alloc::caching_allocator& allocator, std::size_t size, void* data, cow_context* cow,
               backend::stream_ref own_stream)
      : allocator_(allocator), size_(size), data_(data), last_used_(own_stream), cow_(cow), streams_(own_stream) {}
  storage_impl(const storage_impl&) = delete;
  storage_impl& operator=(const storage_impl&) = delete;

  // The last handle is gone: no other thread uses this object any more.
  ~storage_impl() {
    try {
      void* data = data_.load();
      if (owner_) {
        // A block handed over stays the allocator's until its owner frees it.
        if (handed_over_) record_on_block_or_wait(data);
        owner_->storage_released(streams_.view());  // always: the owner gives the memory back only then
      } else if (cow_ == nullptr) {
        // Every stream, its own included: after a steal the own stream is
        // not the block's, and with cross_stream_safety off a free waits for
        // no stream but those recorded (the allocator skips the block's own).
        record_on_block_or_wait(data);
        allocator_.deallocate_or_wait(data, streams_.own());
      } else if (cow_->release_for_drop(streams_.view())) {
        delete cow_;
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch)
      // A destructor cannot report: the free was refused (a stream it had
      // to wait for was destroyed first, or its work failed; no host memory
      // is waited out instead), and the block stays allocated, visible in the
      // allocator's statistics, rather than reused unsafely or the process
      // terminated.
    }
  }

  // The block's free waits for every stream this storage used. A stream the
  // allocator has no room to remember is waited for here instead (as
  // shared_block::storage_released does), so that neither the free overtakes
  // it nor the owner is left untold.
  void record_on_block_or_wait(void* data) noexcept {
    for (auto s : streams_.view()) {
      try {
        allocator_.record_stream(data, s);
      } catch (...) {
        try {
          allocator_.device().synchronize(s);
        } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
        }
      }
    }
  }

  // Records a use on `stream`; lock-free when it is the last one recorded.
  void record_use(backend::stream_ref stream) {
    if (last_used_.load(std::memory_order_acquire) == stream) return;
    std::lock_guard lock(mutex_);
    record_use_locked(stream);
  }
  void record_use_locked(backend::stream_ref stream) {  // mutex_ held
    fences_.order(allocator_.device(), stream);
    streams_.add(stream);
    last_used_.store(stream, std::memory_order_release);
  }

  // Gives this storage data of its own to write on `stream`, unless another
  // thread did meanwhile; `lock` holds mutex_ on entry and on return. A copy's
  // block is allocated with the lock let go: an allocation may call
  // out-of-memory observers, which may take any lock (this storage's, or
  // Python's GIL while a thread holding it waits for this storage's).
  void materialize(std::unique_lock<std::mutex>& lock, backend::stream_ref stream) {
    spare_block block(allocator_, stream);
    while (cow_ != nullptr) {
      // Under the lock the family only shrinks: a sole holder stays one, and
      // a block allocated for a copy is used or freed below.
      if (cow_->sole_holder() || block.get() != nullptr) {
        materialize_locked(stream, block);
        return;
      }
      lock.unlock();
      try {
        block.allocate(size_);
      } catch (const out_of_memory&) {
        // No room for a copy of its own is no error when a racing writer
        // made one meanwhile, or the family's others went: no block needed.
        lock.lock();
        if (cow_ == nullptr || cow_->sole_holder()) continue;
        throw;
      }
      lock.lock();
    }
  }

  // This storage's own data, for a write on `stream` recorded as a use; `lock`
  // holds mutex_ on entry and on return (materialize lets it go only to
  // allocate, and checks again after).
  void* data_for_write(std::unique_lock<std::mutex>& lock, backend::stream_ref stream) {
    if (cow_ != nullptr) materialize(lock, stream);
    if (last_used_.load(std::memory_order_relaxed) != stream) record_use_locked(stream);
    return data_.load(std::memory_order_relaxed);
  }

  // materialize's step with mutex_ held: steals, or copies into `block`.
  void materialize_locked(backend::stream_ref stream, spare_block& block) {
    streams_.make_room_for({cow_->created_on(), stream});  // nothing below throws once the data is ours
    fences_.make_room();
    // A throw changes nothing. After a copy, cow_ is not read again unless
    // `last`: the reference is given up, and the others may delete it.
    const auto [data, last, stolen] = cow_->release_for_write(stream, streams_.view(), block.get());
    if (stolen) {
      streams_.add(cow_->created_on());  // stolen: the family's uses there were left to the final free
    } else {
      block.release();  // the copy is this storage's data now
      // A new block of `stream`. The streams before stay: the one it was
      // allocated on needs no record, so a read queued there of the new data
      // may precede the free (the family's uses of the old data went with it).
      streams_.make_own(stream);
    }
    if (last) delete cow_;
    cow_ = nullptr;
    // Streams first: a thread that sees the new data sees last_used_ == stream,
    // so its record_use of another stream takes the lock and is not lost,
    // and waits for the copy or the steal's waits on `stream`.
    fences_.start_over(stream);
    record_use_locked(stream);
    data_.store(data, std::memory_order_release);
    lazy_.store(false, std::memory_order_release);
  }

  alloc::caching_allocator& allocator_;
  const std::size_t size_;
  std::atomic<void*> data_;
  std::atomic<bool> lazy_{false};               // cow_ != nullptr, readable without the mutex
  std::atomic<backend::stream_ref> last_used_;  // the newest stream in streams_
  std::mutex mutex_;                            // guards cow_, streams_ and ownership changes
  cow_context* cow_;
  stream_set streams_;                    // guarded by mutex_
  stream_fences fences_;                  // guarded by mutex_
  bool shared_outside_ = false;           // guarded by mutex_
  bool handed_over_ = false;              // guarded by mutex_: owner_ frees a block of allocator_
  std::shared_ptr<storage_owner> owner_;  // guarded by mutex_; set once
};

}  // namespace detail

storage storage::allocate(alloc::caching_allocator& allocator, std::size_t bytes, backend::stream_ref stream) {
  void* data = allocator.allocate_claimed(bytes, stream);  // a later take_over of it is refused, not a second owner
  try {
    return storage(std::make_shared<detail::storage_impl>(allocator, bytes, data, nullptr, stream));
  } catch (...) {
    allocator.deallocate(data, stream);
    throw;
  }
}

storage storage::allocate(alloc::caching_allocator& allocator, std::size_t bytes) {
  return allocate(allocator, bytes, backend::current_stream(allocator.device()));
}

storage storage::adopt(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                       std::shared_ptr<storage_owner> owner, backend::stream_ref stream) {
  if (!owner) throw invalid_argument("storage::adopt: no owner given; adopted memory needs one to give it back");
  if (data == nullptr || bytes == 0) throw invalid_argument("storage::adopt: empty memory (null pointer or 0 bytes)");
  auto impl = std::make_shared<detail::storage_impl>(allocator, bytes, data, nullptr, stream);
  impl->owner_ = std::move(owner);
  impl->shared_outside_ = true;
  return storage(std::move(impl));
}

storage storage::adopt(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                       std::shared_ptr<storage_owner> owner) {
  return adopt(allocator, data, bytes, std::move(owner), backend::current_stream(allocator.device()));
}

std::vector<storage> storage::allocate_parts(alloc::caching_allocator& allocator, std::span<const std::size_t> bytes,
                                             backend::stream_ref stream) {
  if (bytes.empty()) throw invalid_argument("storage::allocate_parts: no parts asked for");
  std::vector<std::size_t> offsets;
  offsets.reserve(bytes.size());
  std::size_t end = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] == 0) {
      throw invalid_argument("storage::allocate_parts: part " + std::to_string(i) + " is empty; every part needs a byte");
    }
    const std::size_t offset = (end + part_alignment - 1) / part_alignment * part_alignment;
    if (offset < end || bytes[i] > SIZE_MAX - offset) {
      throw invalid_argument("storage::allocate_parts: the parts add up to more than the address space");
    }
    offsets.push_back(offset);
    end = offset + bytes[i];
  }
  // Claimed: part 0 starts the block, and a take_over of it is refused.
  auto* block = static_cast<std::byte*>(allocator.allocate_claimed(end, stream));
  std::shared_ptr<detail::shared_block> owner;
  try {
    owner = std::make_shared<detail::shared_block>(allocator, block, stream);
  } catch (...) {
    allocator.deallocate(block, stream);
    throw;
  }
  // From here the owner frees the block, once the parts made so far are gone.
  std::vector<storage> parts;
  parts.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    auto impl = std::make_shared<detail::storage_impl>(allocator, bytes[i], block + offsets[i], nullptr, stream);
    impl->owner_ = owner;  // not shared outside the process: lazy_clone copies because of the owner
    parts.push_back(storage(std::move(impl)));
  }
  return parts;
}

storage storage::take_over(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                           backend::stream_ref stream) {
  if (data == nullptr || bytes == 0) throw invalid_argument("storage::take_over: empty memory (null pointer or 0 bytes)");
  const std::size_t block = allocator.block_size(data);  // invalid_argument unless `data` starts a live block
  if (bytes > block) {
    throw invalid_argument("storage::take_over: " + std::to_string(bytes) + " bytes asked of a block of " +
                           std::to_string(block));
  }
  // Refused for a block a storage owns (one allocated as a storage, the
  // block of a storage's parts, or one taken over already): a second owner
  // would free it under the first. Should making the storage fail below,
  // the claim stays until the previous holder frees the block.
  allocator.claim(data);
  auto impl = std::make_shared<detail::storage_impl>(allocator, bytes, data, nullptr, stream);
  impl->shared_outside_ = true;  // its previous holder may still write it: never lazily shared
  return storage(std::move(impl));
}

detail::storage_impl& storage::impl() const {
  if (!impl_) {
    throw invalid_argument(
        "storage: this handle is empty (default-constructed, moved from, or its memory handed on, as a region given "
        "to publish is)");
  }
  return *impl_;
}

std::size_t storage::size() const { return impl().size_; }
backend::device& storage::device() const { return impl().allocator_.device(); }
alloc::caching_allocator& storage::allocator() const { return impl().allocator_; }
const void* storage::data() const { return impl().data_.load(std::memory_order_acquire); }
void storage::enqueue_read(backend::stream_ref stream, const std::function<void(const void*)>& enqueue) const {
  detail::storage_impl& s = impl();
  std::lock_guard lock(s.mutex_);
  s.record_use_locked(stream);
  enqueue(s.data_.load(std::memory_order_relaxed));
}
bool storage::is_lazy() const { return impl().lazy_.load(std::memory_order_acquire); }

void* storage::mutable_data(backend::stream_ref stream) {
  detail::storage_impl& s = impl();
  if (!s.lazy_.load(std::memory_order_acquire)) {
    s.record_use(stream);
    return s.data_.load(std::memory_order_relaxed);
  }
  std::unique_lock lock(s.mutex_);
  return s.data_for_write(lock, stream);
}

void* storage::mutable_data() { return mutable_data(backend::current_stream(device())); }

void storage::enqueue_write(backend::stream_ref stream, const std::function<void(void*)>& enqueue) {
  detail::storage_impl& s = impl();
  std::unique_lock lock(s.mutex_);
  // Held from taking the data to enqueueing the write: a clone (which takes
  // this lock) cannot share the data between the two.
  enqueue(s.data_for_write(lock, stream));
}

void storage::record_stream(backend::stream_ref stream) const { impl().record_use(stream); }

backend::stream_ref storage::last_used_on() const { return impl().last_used_.load(std::memory_order_acquire); }

void storage::mark_shared_outside_process() {
  detail::storage_impl& s = impl();
  std::unique_lock lock(s.mutex_);
  if (s.cow_ != nullptr) s.materialize(lock, s.last_used_.load(std::memory_order_relaxed));
  s.shared_outside_ = true;
}

void storage::mark_shared_outside_process(backend::stream_ref stream) {
  detail::storage_impl& s = impl();
  std::unique_lock lock(s.mutex_);
  if (s.cow_ != nullptr) s.materialize(lock, stream);
  s.shared_outside_ = true;
}

bool storage::shared_outside_process() const {
  detail::storage_impl& s = impl();
  std::lock_guard lock(s.mutex_);
  return s.shared_outside_;
}

std::shared_ptr<storage_owner> storage::owner() const {
  detail::storage_impl& s = impl();
  std::lock_guard lock(s.mutex_);
  return s.owner_;
}

std::shared_ptr<storage_owner> storage::hand_over(
    const std::function<std::shared_ptr<storage_owner>(void* data, std::size_t bytes)>& make_owner,
    backend::stream_ref stream) const {
  detail::storage_impl& s = impl();
  std::unique_lock lock(s.mutex_);
  if (s.cow_ != nullptr) s.materialize(lock, stream);
  if (s.owner_) return s.owner_;  // handed over before, or while materialize let the lock go
  s.owner_ = make_owner(s.data_.load(), s.size_);
  if (!s.owner_) throw invalid_argument("storage::hand_over: make_owner returned no owner");
  s.handed_over_ = true;
  s.shared_outside_ = true;
  return s.owner_;
}

namespace {

// Whether `s` may be lazily shared (mutex_ held). Once false, false for good:
// shared_outside_ and owner_ are never unset, and both are set only once the
// storage is not lazy, so its data then stays at one address for its life.
bool may_share_lazily(const detail::storage_impl& s) { return !s.shared_outside_ && !s.owner_; }

// The clone lazy_clone makes of a storage that may be lazily shared (mutex_ held).
std::shared_ptr<detail::storage_impl> lazy_clone_locked(detail::storage_impl& s, backend::stream_ref stream) {
  // The clone's reads on `stream` see the source's writes enqueued so far on
  // its other streams (the eager copy waits for them too). Before the
  // context changes, so that a throw leaves everything as it was; no device
  // call when the source was used on `stream` alone, the common case.
  detail::order_after(s.allocator_.device(), stream, s.streams_.view());
  // A first clone's context is the source's only once the clone exists: a
  // throw before leaves the source owning its data, not lazy. (A note left
  // in a context that was there only orders later copies after more work.)
  std::unique_ptr<detail::cow_context> made;
  detail::cow_context* cow = s.cow_;
  if (cow == nullptr) {
    made = std::make_unique<detail::cow_context>(s.allocator_, s.data_.load(), s.size_, stream);
    cow = made.get();
  }
  cow->note_clone(stream, s.streams_.view());
  auto clone = std::make_shared<detail::storage_impl>(s.allocator_, s.size_, s.data_.load(), cow, stream);
  // Nothing below throws.
  if (made) {
    s.cow_ = made.release();
    s.lazy_.store(true, std::memory_order_release);
  }
  cow->add_reference();  // only once the clone exists: a clone not made holds none
  clone->lazy_.store(true, std::memory_order_relaxed);
  return clone;
}

}  // namespace

storage lazy_clone(const storage& source, backend::stream_ref stream) {
  detail::storage_impl& s = source.impl();
  std::unique_lock lock(s.mutex_);
  if (!may_share_lazily(s)) {
    // Memory another process or framework may write: a lazy clone could not
    // see those writes coming. Memory an owner gives back (a part of a
    // shared block among them): a copy-on-write context would free it as a
    // block of the allocator. Either way the clone is an eager copy, made now,
    // into memory allocated with the lock let go (as materialize does): for
    // good not lazily shared, the source keeps its data at one address.
    lock.unlock();
    storage copy = storage::allocate(s.allocator_, s.size_, stream);
    lock.lock();
    // Room first: once the copy is enqueued, recording its read on the
    // source must not fail, or the source's free would not wait for it.
    s.streams_.make_room_for({stream});
    s.fences_.make_room();
    copy.impl().fences_.make_room();
    detail::order_after(s.allocator_.device(), stream, s.streams_.view());
    s.allocator_.device().copy(stream, copy.impl().data_.load(), s.data_.load(), s.size_);
    copy.impl().fences_.start_over(stream);  // the clone's uses on other streams wait for the copy into it
    // The source's later writes on other streams wait for the copy's read,
    // and its release too; cannot throw now.
    s.fences_.add(stream);
    s.record_use_locked(stream);
    return copy;
  }
  return storage(lazy_clone_locked(s, stream));
}

storage try_lazy_clone(const storage& source, backend::stream_ref stream) {
  detail::storage_impl& s = source.impl();
  std::lock_guard lock(s.mutex_);
  if (!may_share_lazily(s)) return storage();
  return storage(lazy_clone_locked(s, stream));
}

storage lazy_clone(const storage& source) { return lazy_clone(source, source.last_used_on()); }

}  // namespace shoal::storage
