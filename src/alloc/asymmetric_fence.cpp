#include "alloc/asymmetric_fence.h"

#include <cstdio>
#include <exception>

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace shoal::alloc::detail {

namespace {

#if defined(__linux__) && defined(__NR_membarrier)
long membarrier(int command) noexcept { return syscall(__NR_membarrier, command, 0U, 0); }

bool register_private_expedited() noexcept {
  const long supported = membarrier(MEMBARRIER_CMD_QUERY);
  if (supported < 0 || (supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  return membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}
#else
bool register_private_expedited() noexcept { return false; }
#endif

std::atomic<std::uint64_t> heavy_fences{0};

}  // namespace

std::uint64_t heavy_fences_so_far() noexcept { return heavy_fences.load(std::memory_order_relaxed); }

bool asymmetric_fences_available() noexcept {
  static const bool available = fences_are_sequential || register_private_expedited();
  return available;
}

void heavy_fence() noexcept {
  heavy_fences.fetch_add(1, std::memory_order_relaxed);
  if constexpr (fences_are_sequential) return;  // the handshake's own operations order it (asymmetric_fence.h)
#if defined(__linux__) && defined(__NR_membarrier)
  if (membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return;
  // Once registered (a fork() child keeps it) the command is not refused;
  // should it be, register again and retry, then take the global command.
  if (membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 && membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) {
    return;
  }
  if (membarrier(MEMBARRIER_CMD_GLOBAL) == 0) return;
#endif
  std::fputs("shoal: membarrier(2) failed after it had worked; a biased lock cannot be taken safely\n", stderr);
  std::terminate();
}

}  // namespace shoal::alloc::detail
