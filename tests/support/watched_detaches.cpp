#include "support/watched_detaches.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <thread>

namespace shoal::testing {
namespace {

thread_local pid_t watched = 0;
thread_local std::chrono::milliseconds grace_of_watch{0};
thread_local bool detach_ran = false;
thread_local bool ended_first = false;

// Signal 0 checks that the thread exists; an ended thread's id is gone even
// before it is joined or detached.
bool thread_exists(pid_t thread) noexcept { return ::syscall(SYS_tgkill, ::getpid(), thread, 0) == 0; }

// Called on the detaching thread, before the real detach.
void note_detach() noexcept {
  if (watched == 0 || detach_ran) return;
  detach_ran = true;
  const auto until = std::chrono::steady_clock::now() + grace_of_watch;
  while (thread_exists(watched) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ended_first = !thread_exists(watched);
}

}  // namespace

watching_detach::watching_detach(pid_t thread, std::chrono::milliseconds grace) noexcept {
  watched = thread;
  grace_of_watch = grace;
  detach_ran = false;
  ended_first = false;
}
watching_detach::~watching_detach() { watched = 0; }
bool watching_detach::detached() const noexcept { return detach_ran; }
bool watching_detach::ended_before_detach() const noexcept { return ended_first; }

pid_t this_thread_id() noexcept { return static_cast<pid_t>(::syscall(SYS_gettid)); }

}  // namespace shoal::testing

extern "C" int pthread_detach(pthread_t thread) {
  using detach_fn = int (*)(pthread_t);
  // The next definition in lookup order: the C library's, or a sanitizer's.
  static const auto real = reinterpret_cast<detach_fn>(::dlsym(RTLD_NEXT, "pthread_detach"));
  shoal::testing::note_detach();
  return real(thread);
}
