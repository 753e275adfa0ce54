#include "support/refused_threads.h"

#include <dlfcn.h>
#include <pthread.h>

#include <cerrno>

namespace shoal::testing {
namespace {

thread_local bool refusing = false;
thread_local int allowed_left = 0;
thread_local int refused_count = 0;

// Whether this thread's next creation is refused (and counts it).
bool refuse_now() noexcept {
  if (!refusing) return false;
  if (allowed_left > 0) {
    --allowed_left;
    return false;
  }
  ++refused_count;
  return true;
}

}  // namespace

refusing_threads::refusing_threads(int allowed) noexcept {
  refusing = true;
  allowed_left = allowed;
  refused_count = 0;
}
refusing_threads::~refusing_threads() { refusing = false; }
int refusing_threads::refused() const noexcept { return refused_count; }

}  // namespace shoal::testing

extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*), void* arg) {
  using create_fn = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  // The next definition in lookup order: the C library's, or a sanitizer's.
  static const auto real = reinterpret_cast<create_fn>(::dlsym(RTLD_NEXT, "pthread_create"));
  if (shoal::testing::refuse_now()) return EAGAIN;
  return real(thread, attr, start, arg);
}
