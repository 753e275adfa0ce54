#include "transfer/parallel_memcpy.h"

#include <algorithm>
#include <cstring>

#include "transfer/streaming_copy.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace shoal::transfer {

namespace {

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

parallel_memcpy::parallel_memcpy(std::size_t helpers) {
  helpers_.reserve(helpers);
  for (std::size_t i = 0; i < helpers; ++i) helpers_.emplace_back([this] { help(); });
}

parallel_memcpy::~parallel_memcpy() {
  {
    std::lock_guard lock(mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  work_.notify_all();
  for (auto& t : helpers_) t.join();
}

void parallel_memcpy::copy_slice(std::byte* to, const std::byte* from, std::size_t n, store_kind stores) noexcept {
  if (stores == store_kind::streaming && n >= min_slice) {
    copy_streaming(to, from, n);
  } else {
    std::memcpy(to, from, n);
  }
}

void parallel_memcpy::copy(void* dst, const void* src, std::size_t bytes, store_kind stores) {
  const std::size_t parts = std::clamp<std::size_t>(bytes / min_slice, 1, helpers_.size() + 1);
  if (parts == 1) {
    copy_slice(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes, stores);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    dst_ = static_cast<std::byte*>(dst);
    src_ = static_cast<const std::byte*>(src);
    bytes_ = bytes;
    slice_ = (bytes + parts - 1) / parts;
    slices_ = parts;
    next_slice_ = 0;
    stores_ = stores;
    finished_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    if (sleepers_ > 0) work_.notify_all();
  }
  take_slices();
  // The last slices are a helper's, each a few microseconds of copying:
  // spin for them, yielding once a slice takes longer than the window (a
  // helper descheduled while it holds one).
  const auto spin_until = std::chrono::steady_clock::now() + spin_window;
  while (finished_.load(std::memory_order_acquire) != parts) {
    if (std::chrono::steady_clock::now() < spin_until) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

void parallel_memcpy::take_slices() noexcept {
  for (;;) {
    std::byte* to = nullptr;
    const std::byte* from = nullptr;
    std::size_t n = 0;
    store_kind stores{};
    {
      std::lock_guard lock(mutex_);
      if (next_slice_ == slices_) return;
      const std::size_t offset = next_slice_++ * slice_;
      n = std::min(slice_, bytes_ - offset);
      to = dst_ + offset;
      from = src_ + offset;
      stores = stores_;
    }
    copy_slice(to, from, n, stores);
    finished_.fetch_add(1, std::memory_order_release);
  }
}

void parallel_memcpy::help() noexcept {
  std::uint64_t seen = 0;
  for (;;) {
    const auto spin_until = std::chrono::steady_clock::now() + spin_window;
    bool woke = false;
    // Watch for the next copy for a while, then sleep until one comes.
    while (std::chrono::steady_clock::now() < spin_until) {
      if (generation_.load(std::memory_order_acquire) != seen || stopping_.load(std::memory_order_acquire)) {
        woke = true;
        break;
      }
      for (int i = 0; i < 64; ++i) cpu_relax();
    }
    if (!woke) {
      std::unique_lock lock(mutex_);
      ++sleepers_;
      work_.wait(lock, [&] {
        return stopping_.load(std::memory_order_relaxed) || generation_.load(std::memory_order_relaxed) != seen;
      });
      --sleepers_;
    }
    if (stopping_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    take_slices();
  }
}

}  // namespace shoal::transfer
