// For tests of the lender only: a hook that runs in publish between its
// checks and where it makes the region shared, so that a test can revoke
// the region right there and show that publish sees it. Never use it
// elsewhere. A public header, as channel/listener_test_hook.h is, because
// the test programs build against the public headers only; the test_hook
// namespace marks it.
//
// Thread-safety: none; set it while no lender is serving.
#pragma once

#include <cstdint>
#include <functional>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending::test_hook {

/// Runs `hook` with the region's id in every later publish of every lender,
/// on its serving thread, outside its locks, after the request was checked
/// and before the region is made shared; an empty function clears it.
void set_before_publish_commits(std::function<void(std::uint64_t region)> hook);

}  // namespace shoal::lending::test_hook

#pragma GCC visibility pop
