// When a process started, to tell a live process from a later one that got
// the same pid. Linux only (/proc).
//
// Thread-safety: callable from any thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>

namespace shoal::backend::detail {

/// The start time of process `pid` (field 22 of /proc/<pid>/stat: clock
/// ticks after boot), or nothing when no live process has that pid: none
/// does, it is a zombie, or this process may not see it.
[[nodiscard]] std::optional<std::uint64_t> process_start_time(pid_t pid);

}  // namespace shoal::backend::detail
