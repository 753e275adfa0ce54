#include "support/refused_allocations.h"

#include <cstdlib>
#include <new>

namespace shoal::testing {
namespace {

thread_local bool refusing = false;
thread_local int refused_count = 0;

}  // namespace

refusing_allocations::refusing_allocations() noexcept {
  refusing = true;
  refused_count = 0;
}
refusing_allocations::~refusing_allocations() { refusing = false; }
int refusing_allocations::refused() noexcept { return refused_count; }

}  // namespace shoal::testing

void* operator new(std::size_t bytes) {
  if (shoal::testing::refusing) {
    ++shoal::testing::refused_count;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes) { return ::operator new(bytes); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
