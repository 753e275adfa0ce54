// A region of the device inserted into an allocator as a private pool, and
// given back to the device at the end (tests of private pools).
#pragma once

#include <cstddef>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/device.h"

namespace shoal::testing {

struct region_pool {
  backend::device& dev;
  alloc::caching_allocator& a;
  char* base;
  alloc::private_pool_id id;
  region_pool(backend::device& d, alloc::caching_allocator& al, std::size_t bytes)
      : dev(d), a(al), base(static_cast<char*>(d.allocate_segment(bytes))), id(a.create_private_pool(base, bytes)) {}
  ~region_pool() {
    dev.synchronize_device();  // debug poison may still be queued on it
    dev.free_segment(base);
  }
  region_pool(const region_pool&) = delete;
  region_pool& operator=(const region_pool&) = delete;
  /// `bytes` from the pool, handed out on `s`.
  void* allocate(std::size_t bytes, backend::stream_ref s = {}) {
    alloc::private_pool_scope scope(a, id);
    return a.allocate(bytes, s);
  }
};

}  // namespace shoal::testing
