#pragma once

namespace shoal::detail {

// The library's checks of its own consistency — a breach is a bug in shoal,
// never a caller's or a peer's doing, and the check ends the process with a
// message — run in Debug builds and in builds with SHOAL_CHECK_INVARIANTS
// (the sanitizer builds, which define NDEBUG). Every library target gets that
// definition alike (CMakeLists.txt); the constant has internal linkage, so a
// test built without it that includes this header cannot clash with the
// library's value (tests ask the library's own functions instead).
#if defined(SHOAL_CHECK_INVARIANTS) || !defined(NDEBUG)
constexpr bool library_checks_on = true;
#else
constexpr bool library_checks_on = false;
#endif

}  // namespace shoal::detail
