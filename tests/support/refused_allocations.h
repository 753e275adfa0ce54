// Makes heap allocations fail on demand, to test what code does when the
// host runs out of memory. Linking refused_allocations.cpp replaces the
// global operator new of the whole test binary, its over-aligned and
// nothrow forms too (malloc-based, as the default); only a thread inside a
// refusing_allocations or refusing_one_allocation scope, or one that joined
// refusing_allocations_elsewhere while such a scope lasts, sees
// std::bad_alloc.
#pragma once

#include <functional>

namespace shoal::testing {

class refusing_allocations {
 public:
  refusing_allocations() noexcept;
  ~refusing_allocations();
  refusing_allocations(const refusing_allocations&) = delete;
  refusing_allocations& operator=(const refusing_allocations&) = delete;

  /// How many allocations were refused in this scope so far.
  [[nodiscard]] static int refused() noexcept;
};

/// Makes every `period`-th heap allocation (1: each one) of the threads
/// that joined fail, while the scope lasts (made and ended on any thread):
/// for code on a thread the test does not own, such as a server's, which
/// joins from a callback the server runs there. A joined thread stays
/// joined; outside a scope it allocates as usual.
class refusing_allocations_elsewhere {
 public:
  explicit refusing_allocations_elsewhere(int period) noexcept;
  ~refusing_allocations_elsewhere();
  refusing_allocations_elsewhere(const refusing_allocations_elsewhere&) = delete;
  refusing_allocations_elsewhere& operator=(const refusing_allocations_elsewhere&) = delete;

  /// The calling thread's allocations take part from now on.
  static void join() noexcept;
  /// How many allocations were refused in this scope so far, on every joined thread.
  [[nodiscard]] static int refused() noexcept;
};

/// Refuses one heap allocation of the calling thread: the `nth` it makes
/// from now on (1: the next one), after running `before` there while the
/// code that asked for the memory waits inside operator new — to stop that
/// code at a chosen point and act on another thread meanwhile. `before` may
/// allocate (that does not count). Only while the scope lasts.
class refusing_one_allocation {
 public:
  refusing_one_allocation(int nth, std::function<void()> before);
  ~refusing_one_allocation();
  refusing_one_allocation(const refusing_one_allocation&) = delete;
  refusing_one_allocation& operator=(const refusing_one_allocation&) = delete;

  /// Whether the allocation was refused (false: the code made fewer).
  [[nodiscard]] bool refused() const noexcept { return refused_; }

 private:
  friend void refuse_if_chosen();
  int left_;
  std::function<void()> before_;
  bool refused_ = false;
};

}  // namespace shoal::testing
