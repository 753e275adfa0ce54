// For tests of the listener only: hooks that run after a listener has
// checked its directory and before it binds there, so that a test can swap
// directories in between and show that the socket still lands in the one
// that was checked; and between its bind and its listen, so that a test can
// start another listener there meanwhile; and one that shortens the wait for
// the start lock beside a socket file. Never use them elsewhere. It is a public header, as
// alloc/invariant_test_hook.h is, because the test programs build against
// the public headers only (src/ is not on their include path, and the
// layering check keeps it so); the test_hook namespace marks it.
//
// Thread-safety: none; set them while no listener is being made.
#pragma once

#include <chrono>
#include <functional>
#include <string>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::channel::test_hook {

/// Runs `hook` with the directory's path in every later listener made on a
/// path, between its directory check and its bind; an empty function clears it.
void set_after_directory_check(std::function<void(const std::string& directory)> hook);

/// Runs `hook` with the address's text in every later listener, between its
/// bind and its listen (a connect there is refused meanwhile); an empty
/// function clears it. The hook may run on several threads at once.
void set_between_bind_and_listen(std::function<void(const std::string& address)> hook);

/// How long later listeners wait for the start lock (`.<name>.lock`) another
/// process holds, in their constructor, destructor and abandoned-socket
/// sweep; 2 s unless set.
void set_start_lock_wait(std::chrono::milliseconds wait);

}  // namespace shoal::channel::test_hook

#pragma GCC visibility pop
