#include "support/refused_opendir.h"

#include <dirent.h>
#include <dlfcn.h>

#include <cerrno>

namespace shoal::testing {
namespace {

thread_local int refusing_with = 0;  // 0: not refusing
thread_local int refused_count = 0;

}  // namespace

refusing_opendir::refusing_opendir(int error) noexcept {
  refusing_with = error;
  refused_count = 0;
}
refusing_opendir::~refusing_opendir() { refusing_with = 0; }
int refusing_opendir::refused() const noexcept { return refused_count; }

// Whether this thread's opendir() fails now, with errno set (and counted).
bool refuse_opendir_now() noexcept {
  if (refusing_with == 0) return false;
  ++refused_count;
  errno = refusing_with;
  return true;
}

}  // namespace shoal::testing

extern "C" DIR* opendir(const char* name) {
  using opendir_fn = DIR* (*)(const char*);
  // The next definition in lookup order: the C library's, or a sanitizer's.
  static const auto real = reinterpret_cast<opendir_fn>(::dlsym(RTLD_NEXT, "opendir"));
  if (shoal::testing::refuse_opendir_now()) return nullptr;
  return real(name);
}
