#include "support/refused_allocations.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <new>
#include <utility>

namespace shoal::testing {
namespace {

thread_local bool refusing = false;
thread_local int refused_count = 0;

thread_local refusing_one_allocation* one_refusal = nullptr;  // this thread's, while its scope lasts

thread_local bool joined = false;
thread_local unsigned joined_allocations = 0;
std::atomic<int> elsewhere_period{0};  // 0: no refusing_allocations_elsewhere scope
std::atomic<int> elsewhere_refused{0};

}  // namespace

refusing_allocations::refusing_allocations() noexcept {
  refusing = true;
  refused_count = 0;
}
refusing_allocations::~refusing_allocations() { refusing = false; }
int refusing_allocations::refused() noexcept { return refused_count; }

refusing_allocations_elsewhere::refusing_allocations_elsewhere(int period) noexcept {
  elsewhere_refused.store(0);
  elsewhere_period.store(period > 0 ? period : 1);
}
refusing_allocations_elsewhere::~refusing_allocations_elsewhere() { elsewhere_period.store(0); }
void refusing_allocations_elsewhere::join() noexcept { joined = true; }
int refusing_allocations_elsewhere::refused() noexcept { return elsewhere_refused.load(); }

refusing_one_allocation::refusing_one_allocation(int nth, std::function<void()> before)
    : left_(nth), before_(std::move(before)) {
  one_refusal = this;
}
refusing_one_allocation::~refusing_one_allocation() { one_refusal = nullptr; }

// Called by operator new: counts the allocation against this thread's
// refusing_one_allocation and, at the chosen one, runs its `before` (which
// may allocate: the scope is off by then) and refuses.
void refuse_if_chosen() {
  refusing_one_allocation* scope = one_refusal;
  if (scope == nullptr || --scope->left_ != 0) return;
  one_refusal = nullptr;
  scope->refused_ = true;
  scope->before_();
  throw std::bad_alloc();
}

namespace {

// Throws std::bad_alloc where a scope of this file refuses the allocation.
void refuse_if_asked() {
  refuse_if_chosen();
  if (refusing) {
    ++refused_count;
    throw std::bad_alloc();
  }
  if (joined) {
    const int period = elsewhere_period.load(std::memory_order_relaxed);
    if (period > 0 && ++joined_allocations % static_cast<unsigned>(period) == 0) {
      elsewhere_refused.fetch_add(1, std::memory_order_relaxed);
      throw std::bad_alloc();
    }
  }
}

}  // namespace
}  // namespace shoal::testing

void* operator new(std::size_t bytes) {
  shoal::testing::refuse_if_asked();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
// Over-aligned types (the allocator's alignas(64) pools) come here: counted
// and refused the same way.
void* operator new(std::size_t bytes, std::align_val_t align) {
  shoal::testing::refuse_if_asked();
  const auto alignment = static_cast<std::size_t>(align);
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + alignment - 1) / alignment * alignment;
  if (void* p = std::aligned_alloc(alignment, rounded)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes, std::align_val_t align) { return ::operator new(bytes, align); }
void* operator new(std::size_t bytes, std::align_val_t align, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(bytes, align);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, std::align_val_t align, const std::nothrow_t& nothrow) noexcept {
  return ::operator new(bytes, align, nothrow);
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void* operator new[](std::size_t bytes) { return ::operator new(bytes); }
// The nothrow forms too (std::stable_sort's buffer takes one), so that what
// they return is freed by the deletes below, as malloc's: refused, they
// return null.
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(bytes);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t& nothrow) noexcept {
  return ::operator new(bytes, nothrow);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
