#include "transfer/parallel_memcpy.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>

#include "shoal/core/error.h"
#include "transfer/spin_wait.h"
#include "transfer/streaming_copy.h"

namespace shoal::transfer {

parallel_memcpy::parallel_memcpy(std::size_t helpers) {
  // The claim word counts slices in 16 bits: at most one per thread.
  if (helpers >= 0xFFFF) throw invalid_argument("parallel_memcpy: " + std::to_string(helpers) + " helpers; at most 65534");
  // A copy of one job (copy(), a large buffer's chunks) allocates nothing.
  starts_.reserve(64);
  helpers_.reserve(helpers);
  try {
    for (std::size_t i = 0; i < helpers; ++i) helpers_.emplace_back([this, i] { help(i + 1); });
  } catch (const std::system_error& e) {
    // The process may start no more threads (a pids cgroup, RLIMIT_NPROC):
    // those started must be joined before the vector of them goes.
    const std::size_t started = helpers_.size();
    stop_helpers();
    throw backend_error("std::thread", "started " + std::to_string(started) + " of " + std::to_string(helpers) +
                                           " staging helper threads (" + e.what() +
                                           "); lower transfer_config::staging_helpers or raise the process's thread limit");
  } catch (...) {
    stop_helpers();
    throw;
  }
}

parallel_memcpy::~parallel_memcpy() { stop_helpers(); }

void parallel_memcpy::stop_helpers() noexcept {
  {
    std::lock_guard lock(sleep_mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  work_.notify_all();
  wide_work_.notify_all();
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
  const copy_job job{static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes};
  copy_all({&job, 1}, stores);
}

void parallel_memcpy::copy_all(std::span<const copy_job> jobs, store_kind stores, std::size_t max_threads) {
  std::size_t bytes = 0;
  for (const copy_job& j : jobs) bytes += j.bytes;
  const std::size_t parts =
      std::clamp<std::size_t>(bytes / min_slice, 1, std::max<std::size_t>(1, std::min(max_threads, helpers_.size() + 1)));
  if (stores == store_kind::automatic) stores = parts > narrow_threads ? store_kind::cached : store_kind::streaming;
  if (parts == 1) {
    for (const copy_job& j : jobs) copy_slice(j.dst, j.src, j.bytes, stores);
    return;
  }
  jobs_ = jobs;
  starts_.clear();
  std::size_t start = 0;
  for (const copy_job& j : jobs) {
    starts_.push_back(start);
    start += j.bytes;
  }
  bytes_ = bytes;
  slice_ = (bytes + parts - 1) / parts;
  stores_ = stores;
  finished_.store(0, std::memory_order_relaxed);
  const std::uint32_t generation = ++generation_;
  claim_.store(pack(generation, parts, 0), std::memory_order_release);
  announced_.store(pack(generation, parts, 0), std::memory_order_release);
  {
    std::lock_guard lock(sleep_mutex_);
    if (sleepers_ > 0) work_.notify_all();
    if (wide_sleepers_ > 0 && parts > narrow_threads) wide_work_.notify_all();
  }
  take_slices(generation, false);
  // The last slices are helpers', each a few microseconds of copying: spin
  // for them, yielding once it takes longer than the window (a helper
  // descheduled while it holds one).
  const auto all_done = [&] { return finished_.load(std::memory_order_acquire) == parts; };
  if (!spin_for(spin_window, all_done)) {
    while (!all_done()) std::this_thread::yield();
  }
}

void parallel_memcpy::copy_range(std::size_t begin, std::size_t end) const noexcept {
  // The last job that starts at or before `begin`, then on while bytes remain.
  auto i = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
  for (; i < jobs_.size() && starts_[i] < end; ++i) {
    const copy_job& j = jobs_[i];
    const std::size_t from = std::max(begin, starts_[i]) - starts_[i];
    const std::size_t to = std::min(end, starts_[i] + j.bytes) - starts_[i];
    if (from < to) copy_slice(j.dst + from, j.src + from, to - from, stores_);
  }
}

void parallel_memcpy::take_slices(std::uint32_t generation, bool by_helper) noexcept {
  for (;;) {
    std::uint64_t c = claim_.load(std::memory_order_acquire);
    do {
      if (generation_of(c) != generation || next_of(c) >= slices_of(c)) return;
    } while (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire));
    // Claimed: the copy cannot finish before this slice does, so its fields
    // stay as they were published.
    const std::size_t offset = next_of(c) * slice_;
    copy_range(offset, std::min(offset + slice_, bytes_));
    // Counted before the slice is finished: a caller back from copy() sees it.
    if (by_helper) helper_slices_.fetch_add(1, std::memory_order_relaxed);
    finished_.fetch_add(1, std::memory_order_release);
  }
}

void parallel_memcpy::help(std::size_t index) noexcept {
  const bool wide = index >= narrow_threads;
  std::condition_variable& work = wide ? wide_work_ : work_;
  std::size_t& sleepers = wide ? wide_sleepers_ : sleepers_;
  std::uint32_t seen = 0;
  bool watch = !wide;
  const auto has_news = [&] {
    return stopping_.load(std::memory_order_acquire) ||
           generation_of(announced_.load(std::memory_order_acquire)) != seen;
  };
  for (;;) {
    // Watch for the next copy for a while, then sleep until one comes.
    if (!(watch && spin_for(spin_window, has_news))) {
      std::unique_lock lock(sleep_mutex_);
      ++sleepers;
      work.wait(lock, has_news);
      --sleepers;
    }
    if (stopping_.load(std::memory_order_acquire)) return;
    const std::uint64_t c = announced_.load(std::memory_order_acquire);
    seen = generation_of(c);
    // Helper k takes part in copies of more than k slices: the others stay
    // off the claim word.
    const bool needed = index < slices_of(c);
    if (needed) take_slices(seen, true);
    if (wide) watch = needed;
  }
}

}  // namespace shoal::transfer
