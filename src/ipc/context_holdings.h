// What the consumer tables of one sharing context hold for all producers
// together, within sharing_options' context-wide limits (max_mapped_bytes,
// max_producer_resources): each share is reserved before it is taken and
// given back as it goes, by tables that may outlive the context's state.
//
// Thread-safety: any thread (atomics); a reservation is not shared.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "ipc/left_open_imports.h"

namespace shoal::ipc::detail {

class consumer_state;

struct context_holdings {
  std::atomic<std::size_t> mapped_bytes{0};  // producers' segment chunks mapped (max_mapped_bytes)
  // Descriptors and memory mappings: segments announced, counter files
  // until the last storage using one goes, event sources opened, segment
  // chunks mapped (max_producer_resources).
  std::atomic<std::size_t> resources{0};
  // The context's tables: when a count is full, the mappings no storage
  // uses are closed in every one of them, so that one producer's idle cached
  // mappings cannot keep another producer out.
  std::mutex tables_mutex;
  std::vector<std::weak_ptr<consumer_state>> tables;  // guarded by tables_mutex
  // What tables left open when they went, still counted above.
  left_open_imports left_open;
};

/// Whether `more` fits under `limit` beside `used`, without overflow.
[[nodiscard]] inline bool fits(std::size_t used, std::size_t more, std::size_t limit) noexcept {
  return used <= limit && more <= limit - used;
}

/// Adds `more` to `count` unless the sum would pass `limit`.
[[nodiscard]] inline bool reserve(std::atomic<std::size_t>& count, std::size_t more, std::size_t limit) noexcept {
  std::size_t now = count.load(std::memory_order_relaxed);
  do {
    if (!fits(now, more, limit)) return false;
  } while (!count.compare_exchange_weak(now, now + more, std::memory_order_relaxed));
  return true;
}

/// True in Debug builds and in builds with SHOAL_CHECK_INVARIANTS (the
/// sanitizer builds): a give_back of more than was reserved ends the process.
[[nodiscard]] bool holdings_checked() noexcept;

/// A give_back of more than was reserved: a bug in this layer's counting,
/// never a peer's doing. Ends the process with a message where
/// holdings_checked(); elsewhere the count wraps, and the context then
/// refuses every share past its limits (nothing unsafe, but nothing shared).
void gave_back_more_than_reserved(std::size_t reserved, std::size_t given_back) noexcept;

/// Takes back `n` reserved before.
inline void give_back(std::atomic<std::size_t>& count, std::size_t n) noexcept {
  const std::size_t before = count.fetch_sub(n, std::memory_order_relaxed);
  if (before < n) [[unlikely]] gave_back_more_than_reserved(before, n);
}

/// `n` reserved in `count`, given back at scope exit unless kept.
class reservation {
 public:
  reservation(std::atomic<std::size_t>& count, std::size_t n) noexcept : count_(count), n_(n) {}
  ~reservation() {
    if (!kept_) give_back(count_, n_);
  }
  reservation(const reservation&) = delete;
  reservation& operator=(const reservation&) = delete;
  void keep() noexcept { kept_ = true; }

 private:
  std::atomic<std::size_t>& count_;
  std::size_t n_;
  bool kept_ = false;
};

}  // namespace shoal::ipc::detail
