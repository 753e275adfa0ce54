#include "shoal/storage/storage.h"

#include <atomic>
#include <mutex>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "storage/cow_context.h"

namespace shoal::storage {

namespace detail {

// One storage object. It owns its data outright (cow_ == nullptr and no
// owner_), holds one reference to a copy-on-write context whose data it
// reads, or leaves its data to an owner (owner_ set; never lazy then).
class storage_impl {
 public:
  storage_impl(alloc::caching_allocator& allocator, std::size_t size, void* data, cow_context* cow)
      : allocator_(allocator), size_(size), data_(data), cow_(cow) {}
  storage_impl(const storage_impl&) = delete;
  storage_impl& operator=(const storage_impl&) = delete;

  ~storage_impl() {
    if (owner_) return;  // the owner gives the memory back when it goes
    try {
      if (cow_ == nullptr) {
        allocator_.deallocate(data_.load());
      } else if (cow_->release_for_drop()) {
        delete cow_;
      }
    } catch (const error&) {  // NOLINT(bugprone-empty-catch)
      // A destructor cannot report: the free was refused (a stream it had
      // to wait for was destroyed first), and the block stays allocated,
      // visible in the allocator's statistics, rather than reused unsafely.
    }
  }

  alloc::caching_allocator& allocator_;
  const std::size_t size_;
  std::atomic<void*> data_;
  std::atomic<bool> lazy_{false};  // cow_ != nullptr, readable without the mutex
  std::mutex mutex_;               // guards cow_ and ownership changes
  cow_context* cow_;
  bool shared_outside_ = false;    // guarded by mutex_
  std::shared_ptr<storage_owner> owner_;  // guarded by mutex_; set once

  // Gives this storage data of its own to write on `stream` (mutex_ held).
  void materialize(backend::stream_ref stream) {
    if (void* copy = cow_->release_for_write(stream)) {
      data_.store(copy);
    } else {
      data_.store(cow_->data());
      delete cow_;
    }
    cow_ = nullptr;
    lazy_.store(false, std::memory_order_release);
  }
};

}  // namespace detail

storage storage::allocate(alloc::caching_allocator& allocator, std::size_t bytes, backend::stream_ref stream) {
  void* data = allocator.allocate(bytes, stream);
  try {
    return storage(std::make_shared<detail::storage_impl>(allocator, bytes, data, nullptr));
  } catch (...) {
    allocator.deallocate(data, stream);
    throw;
  }
}

storage storage::allocate(alloc::caching_allocator& allocator, std::size_t bytes) {
  return allocate(allocator, bytes, backend::current_stream(allocator.device()));
}

storage storage::adopt(alloc::caching_allocator& allocator, void* data, std::size_t bytes,
                       std::shared_ptr<storage_owner> owner) {
  if (!owner) throw invalid_argument("storage::adopt: no owner given; adopted memory needs one to give it back");
  if (data == nullptr || bytes == 0) throw invalid_argument("storage::adopt: empty memory (null pointer or 0 bytes)");
  auto impl = std::make_shared<detail::storage_impl>(allocator, bytes, data, nullptr);
  impl->owner_ = std::move(owner);
  impl->shared_outside_ = true;
  return storage(std::move(impl));
}

detail::storage_impl& storage::impl() const {
  if (!impl_) throw invalid_argument("storage: this handle is empty (default-constructed or moved from)");
  return *impl_;
}

std::size_t storage::size() const { return impl().size_; }
backend::device& storage::device() const { return impl().allocator_.device(); }
alloc::caching_allocator& storage::allocator() const { return impl().allocator_; }
const void* storage::data() const { return impl().data_.load(std::memory_order_acquire); }
bool storage::is_lazy() const { return impl().lazy_.load(std::memory_order_acquire); }

void* storage::mutable_data(backend::stream_ref stream) {
  detail::storage_impl& s = impl();
  if (!s.lazy_.load(std::memory_order_acquire)) return s.data_.load(std::memory_order_relaxed);
  std::lock_guard lock(s.mutex_);
  if (s.cow_ != nullptr) s.materialize(stream);
  return s.data_.load(std::memory_order_relaxed);
}

void* storage::mutable_data() { return mutable_data(backend::current_stream(device())); }

void storage::mark_shared_outside_process() {
  detail::storage_impl& s = impl();
  std::lock_guard lock(s.mutex_);
  if (s.cow_ != nullptr) s.materialize(backend::current_stream(s.allocator_.device()));
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
  std::lock_guard lock(s.mutex_);
  if (s.owner_) return s.owner_;
  if (s.cow_ != nullptr) s.materialize(stream);
  s.owner_ = make_owner(s.data_.load(), s.size_);
  if (!s.owner_) throw invalid_argument("storage::hand_over: make_owner returned no owner");
  s.shared_outside_ = true;
  return s.owner_;
}

storage lazy_clone(const storage& source, backend::stream_ref stream) {
  detail::storage_impl& s = source.impl();
  std::lock_guard lock(s.mutex_);
  if (s.shared_outside_) {
    // Memory another process or framework may write: a lazy clone could not
    // see those writes coming, so the clone is an eager copy, made now.
    storage copy = storage::allocate(s.allocator_, s.size_, stream);
    s.allocator_.device().copy(stream, copy.impl().data_.load(), s.data_.load(), s.size_);
    return copy;
  }
  if (s.cow_ == nullptr) {
    s.cow_ = new detail::cow_context(s.allocator_, s.data_.load(), s.size_, stream);
    s.lazy_.store(true, std::memory_order_release);
  }
  s.cow_->add_reference(stream);
  auto clone = std::make_shared<detail::storage_impl>(s.allocator_, s.size_, s.data_.load(), s.cow_);
  clone->lazy_.store(true, std::memory_order_relaxed);
  return storage(std::move(clone));
}

storage lazy_clone(const storage& source) {
  return lazy_clone(source, backend::current_stream(source.device()));
}

}  // namespace shoal::storage
