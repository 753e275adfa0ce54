#include "transfer/parallel_memcpy.h"

#include "transfer/streaming_copy.h"

#include <algorithm>
#include <cstring>

namespace shoal::transfer {

parallel_memcpy::parallel_memcpy(std::size_t helpers) {
  helpers_.reserve(helpers);
  for (std::size_t i = 0; i < helpers; ++i) helpers_.emplace_back([this] { help(); });
}

parallel_memcpy::~parallel_memcpy() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  for (auto& t : helpers_) t.join();
}

void parallel_memcpy::copy(void* dst, const void* src, std::size_t bytes) {
  const std::size_t parts = std::clamp<std::size_t>(bytes / min_slice, 1, helpers_.size() + 1);
  if (parts == 1) {
    // Small copies stay in the cache, where the copy engine's reads may find them.
    if (bytes < min_slice) {
      std::memcpy(dst, src, bytes);
    } else {
      copy_streaming(dst, src, bytes);
    }
    return;
  }
  std::unique_lock lock(mutex_);
  dst_ = static_cast<std::byte*>(dst);
  src_ = static_cast<const std::byte*>(src);
  bytes_ = bytes;
  slice_ = (bytes + parts - 1) / parts;
  slices_ = parts;
  next_slice_ = 0;
  finished_ = 0;
  ++generation_;
  work_.notify_all();
  take_slices(lock);
  done_.wait(lock, [&] { return finished_ == slices_; });
}

void parallel_memcpy::take_slices(std::unique_lock<std::mutex>& lock) {
  while (next_slice_ < slices_) {
    const std::size_t i = next_slice_++;
    const std::size_t offset = i * slice_;
    const std::size_t n = std::min(slice_, bytes_ - offset);
    std::byte* to = dst_ + offset;
    const std::byte* from = src_ + offset;
    lock.unlock();
    copy_streaming(to, from, n);
    lock.lock();
    if (++finished_ == slices_) done_.notify_all();
  }
}

void parallel_memcpy::help() noexcept {
  std::unique_lock lock(mutex_);
  std::uint64_t seen = generation_;
  for (;;) {
    work_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    take_slices(lock);
  }
}

}  // namespace shoal::transfer
