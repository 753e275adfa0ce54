// Makes opendir() fail on demand with a chosen errno, as running out of
// descriptors (EMFILE) or memory would. Linking refused_opendir.cpp
// replaces opendir for the whole test binary; it passes every call on to
// the real one except on a thread inside a refusing_opendir scope.
#pragma once

namespace shoal::testing {

class refusing_opendir {
 public:
  /// The calling thread's opendir() calls fail with `error` while the scope lasts.
  explicit refusing_opendir(int error) noexcept;
  ~refusing_opendir();
  refusing_opendir(const refusing_opendir&) = delete;
  refusing_opendir& operator=(const refusing_opendir&) = delete;

  /// How many calls were refused in this scope so far.
  [[nodiscard]] int refused() const noexcept;
};

}  // namespace shoal::testing
