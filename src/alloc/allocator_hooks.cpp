#include "alloc/allocator_hooks.h"

#include <algorithm>
#include <mutex>
#include <string>

#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

// The shared holds this thread has, innermost first: a hook may free a
// block (a miss hook collecting limbo) whose free is told to this
// allocator's free-wait observers, on the same thread, while the hook's
// hold is still taken. A std::shared_mutex taken twice by one thread is
// undefined behaviour (and a writer waiting in between would deadlock a
// writer-preferring one), so the inner call takes no second hold.
struct held_by_thread {
  const void* hooks;
  const held_by_thread* outer;
};
thread_local const held_by_thread* innermost_hold = nullptr;

}  // namespace

/// The hooks' shared lock, unless this thread holds it already.
class allocator_hooks::shared_hold {
 public:
  explicit shared_hold(const allocator_hooks& hooks) : hooks_(hooks), entry_{&hooks, innermost_hold} {
    for (const held_by_thread* h = innermost_hold; h != nullptr; h = h->outer) {
      if (h->hooks == &hooks) return;
    }
    hooks_.mutex_.lock_shared();
    locked_ = true;
    innermost_hold = &entry_;
  }
  ~shared_hold() {
    if (!locked_) return;
    innermost_hold = entry_.outer;
    hooks_.mutex_.unlock_shared();
  }
  shared_hold(const shared_hold&) = delete;
  shared_hold& operator=(const shared_hold&) = delete;

 private:
  const allocator_hooks& hooks_;
  held_by_thread entry_;
  bool locked_ = false;
};

template <class Callback>
std::uint64_t allocator_hooks::add(std::vector<std::pair<std::uint64_t, Callback>>& to, Callback callback) {
  std::unique_lock lock(mutex_);
  const std::uint64_t id = next_id_++;
  to.emplace_back(id, std::move(callback));
  count_callbacks();
  return id;
}

void allocator_hooks::count_callbacks() noexcept {
  miss_count_.store(miss_hooks_.size(), std::memory_order_relaxed);
  segment_count_.store(segment_observers_.size(), std::memory_order_relaxed);
  free_wait_count_.store(free_wait_observers_.size(), std::memory_order_relaxed);
}

std::uint64_t allocator_hooks::add_miss_hook(miss_hook hook) { return add(miss_hooks_, std::move(hook)); }

std::uint64_t allocator_hooks::add_forced_clear_hook(miss_hook hook) {
  return add(forced_clear_hooks_, std::move(hook));
}

std::uint64_t allocator_hooks::add_release_observer(release_observer observer) {
  return add(release_observers_, std::move(observer));
}

std::uint64_t allocator_hooks::add_segment_observer(segment_observer observer) {
  return add(segment_observers_, std::move(observer));
}

std::uint64_t allocator_hooks::add_free_wait_observer(free_wait_observer observer) {
  return add(free_wait_observers_, std::move(observer));
}

void allocator_hooks::remove(std::uint64_t id) {
  std::unique_lock lock(mutex_);
  auto has_id = [id](const auto& entry) { return entry.first == id; };
  const std::size_t erased = std::erase_if(miss_hooks_, has_id) + std::erase_if(forced_clear_hooks_, has_id) +
                             std::erase_if(release_observers_, has_id) + std::erase_if(segment_observers_, has_id) +
                             std::erase_if(free_wait_observers_, has_id);
  count_callbacks();
  if (erased == 0) {
    throw invalid_argument("caching_allocator::remove_hook: no hook or observer has id " + std::to_string(id) +
                           " (already removed, or from another allocator)");
  }
}

void allocator_hooks::run_miss_hooks() const {
  const shared_hold hold(*this);
  for (const auto& [id, hook] : miss_hooks_) hook();
}

void allocator_hooks::run_forced_clear_hooks() const {
  const shared_hold hold(*this);
  for (const auto& [id, hook] : forced_clear_hooks_) hook();
}

void allocator_hooks::notify_release(std::uintptr_t base, std::size_t bytes) const {
  const shared_hold hold(*this);
  for (const auto& [id, observer] : release_observers_) observer(base, bytes);
}

template <class Observer, class Event>
void allocator_hooks::tell(const std::vector<std::pair<std::uint64_t, Observer>>& observers,
                           const Event& event) const noexcept {
  const shared_hold hold(*this);
  for (const auto& [id, observer] : observers) {
    try {
      observer(event);
    } catch (...) {  // dropped: an observer only watches, the event has happened
    }
  }
}

void allocator_hooks::notify_segment(const segment_event& event) const noexcept { tell(segment_observers_, event); }

void allocator_hooks::notify_free_wait(const free_wait_event& event) const noexcept {
  tell(free_wait_observers_, event);
}

}  // namespace shoal::alloc::detail
