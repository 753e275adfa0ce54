// `shoal daemon`: the memory daemon program around the lender, and
// `shoal daemon status`, which prints a running daemon's metrics.
#pragma once

namespace shoal::tools {

/// `argv[0]` is "daemon". Returns the exit status: 0 after a shutdown signal
/// (SIGINT, SIGTERM, SIGHUP), 1 when the daemon cannot start or the status cannot be
/// read, 2 for bad flags or settings.
int run_daemon(int argc, char** argv);

}  // namespace shoal::tools
