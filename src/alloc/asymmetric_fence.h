// Asymmetric fences: a cheap one for the frequent side of a Dekker-style
// handshake and a costly one for the rare side, which together order a
// store before a load as a pair of full fences would.
//
// The frequent side (light_fence) stops only the compiler. The rare side
// (heavy_fence) asks the kernel, through membarrier(2) with
// MEMBARRIER_CMD_PRIVATE_EXPEDITED, to run a full memory barrier on every
// CPU now running a thread of this process (one that is not running passed
// one when it was switched out). So for a thread T that does
//   store A; light_fence(); load B
// while another does
//   store B; heavy_fence(); load A
// at least one of the two loads sees the other's store.
//
// Available only where the kernel has that command and lets the process
// register for it (Linux 4.14 on); where it does not, heavy_fence is never
// called and the users of these fences keep to plain atomics
// (asymmetric_fences_available says which). Thread-safety: all may be
// called from any thread at once.
#pragma once

#include <atomic>
#include <cstdint>

namespace shoal::alloc::detail {

// ThreadSanitizer does not see what membarrier does: there both sides use
// sequentially consistent operations instead (a correct Dekker on their
// own), so it checks the protocol, not the fences.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool fences_are_sequential = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool fences_are_sequential = true;
#else
inline constexpr bool fences_are_sequential = false;
#endif
#else
inline constexpr bool fences_are_sequential = false;
#endif

/// The memory order of the handshake's own stores and loads.
inline constexpr std::memory_order handshake_order =
    fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_relaxed;

inline void light_fence() noexcept { std::atomic_signal_fence(std::memory_order_seq_cst); }

/// Registers this process for membarrier on the first call; true when
/// heavy_fence may be used. Cached after the first call.
[[nodiscard]] bool asymmetric_fences_available() noexcept;

/// Only after asymmetric_fences_available() returned true (under
/// ThreadSanitizer it does nothing: see fences_are_sequential). The kernel
/// refuses the command only to an unregistered process: then it registers
/// again, and if even a global membarrier fails the process terminates, as
/// going on could let two threads into one critical section.
void heavy_fence() noexcept;

/// How many heavy fences this process asked for so far (tests, and anyone
/// weighing what a reader of many locks costs).
[[nodiscard]] std::uint64_t heavy_fences_so_far() noexcept;

}  // namespace shoal::alloc::detail
