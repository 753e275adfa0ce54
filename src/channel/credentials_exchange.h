// Telling the two ends of a socketpair who is at the other end.
//
// SO_PEERCRED on a socketpair names the process that created it on both
// ends, so after a fork the parent would take its child for itself. Instead
// each end sends a short greeting with its credentials attached
// (SCM_CREDENTIALS, which the kernel checks: a process can only claim its
// own pid, uid and gid) and reads the other's.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <optional>

namespace shoal::channel::detail {

/// Sends this process's credentials on `socket` and returns the other
/// end's. Both ends must call it. Throws protocol_error when the greeting is
/// not one, connection_closed when the other end goes, timeout_error when
/// its greeting has not come whole by `until`, backend_error when the system
/// refuses. `sender` gets the uid of whoever wrote what was read (the
/// kernel's credentials of each message), also when it throws.
ucred exchange_credentials(int socket, std::chrono::steady_clock::time_point until, std::optional<uid_t>& sender);

}  // namespace shoal::channel::detail
