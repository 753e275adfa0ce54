// For tests of the allocator's late frees only: a hook that runs at each
// step of a free of an address that no block held at its first look (the
// late free of a forced clear's tombstone whose pool was destroyed: an
// orphan), while the freeing thread holds the allocator's region hand-off
// lock, so that a test can make another thread's growth take the orphan,
// or its give-back try to turn a tombstone back into one, between the
// steps. Never use it elsewhere. A public header, as invariant_test_hook.h
// is, because the test programs build against the public headers only; the
// test_hook namespace marks it.
//
// Thread-safety: none; set it while no allocator frees.
#pragma once

#include <cstdint>
#include <functional>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::alloc::test_hook {

/// Where a late free stands when the hook runs.
enum class late_free_step : std::uint8_t {
  before_orphans,    ///< its look in the block index, under the lock, missed; next it looks among the orphans
  before_last_look,  ///< no orphan was there either; next it looks in the block index once more
};

/// Runs `hook` at each step of every later late free, on the freeing
/// thread; an empty function clears it.
void set_late_free_hook(std::function<void(late_free_step)> hook);

}  // namespace shoal::alloc::test_hook

#pragma GCC visibility pop
