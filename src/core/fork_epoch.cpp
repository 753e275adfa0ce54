#include "core/fork_epoch.h"

#include <pthread.h>

namespace shoal::detail {

namespace fork_counting {
std::atomic<std::uint64_t> forks{0};
}  // namespace fork_counting

namespace {
void count_fork_in_child() noexcept { fork_counting::forks.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

std::uint64_t forks_so_far() noexcept {
  // Registered once, at the latest when the first epoch is made: forks
  // before that cannot matter (nothing that asks existed). pthread_atfork
  // fails only without memory for the handler, and then forks go uncounted
  // as before. Forks that run no atfork handlers (glibc's _Fork, a raw clone)
  // are not counted.
  static const bool registered = ::pthread_atfork(nullptr, nullptr, &count_fork_in_child) == 0;
  (void)registered;
  return fork_counting::forks.load(std::memory_order_relaxed);
}

namespace {
// At load, while one thread runs: a fork can then never come in the middle
// of the registration above (a child would find it unfinished, forever).
[[maybe_unused]] const std::uint64_t registered_at_load = forks_so_far();
}  // namespace

}  // namespace shoal::detail
