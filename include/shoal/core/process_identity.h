// Which process is at the other end: a pid and the time it started.
//
// A pid names a process only while it runs: after it exits the kernel may
// give the number to a new one. The pair (pid, start time) names one process
// for as long as the machine is up, so a holder that died is told apart from
// a newcomer that got its pid.
//
// Thread-safe: the functions read /proc (one small read each) and keep no
// state.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal {

struct process_identity {
  pid_t pid = 0;
  std::uint64_t start_time = 0;  ///< clock ticks after boot: field 22 of /proc/<pid>/stat

  /// This process. Throws backend_error if /proc cannot be read.
  [[nodiscard]] static process_identity self();

  friend bool operator==(const process_identity&, const process_identity&) = default;
};

/// The running process with this pid, or nullopt when there is none: the pid
/// was never used, its process was reaped, or its process has exited and
/// waits for its parent (a zombie). A process whose main thread exited
/// (pthread_exit) while another of its threads runs is running: /proc shows
/// its leader as a zombie, but its memory and connections live on. Throws
/// backend_error if /proc cannot be
/// read for another reason (not mounted, say).
[[nodiscard]] std::optional<process_identity> identify_process(pid_t pid);

/// Whether `process` still runs: its pid names a running process that started
/// at the same time. A pid reused by a newer process reads as dead, and so
/// does a zombie.
[[nodiscard]] bool is_alive(const process_identity& process);

}  // namespace shoal

#pragma GCC visibility pop
