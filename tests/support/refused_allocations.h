// Makes this thread's heap allocations fail on demand, to test what code
// does when the host runs out of memory. Linking refused_allocations.cpp
// replaces the global operator new of the whole test binary (malloc-based,
// as the default); only a thread inside a refusing_allocations scope sees
// std::bad_alloc.
#pragma once

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

}  // namespace shoal::testing
