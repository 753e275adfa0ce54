// Descriptors passed with a socket message (SCM_RIGHTS): attaching them to an
// outgoing msghdr, taking ownership of those that came with a received one.
// The one place that handles SCM_RIGHTS (the channel, and the tests' bare
// transport, use it). Internal (not installed).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <span>
#include <vector>

#include "shoal/core/unique_fd.h"

namespace shoal::detail {

/// SO_PASSRIGHTS (Linux 6.16 on; libc headers may not name it yet): off, a
/// peer's sendmsg with descriptors to the socket fails with EPERM.
inline constexpr int so_passrights = 83;

/// The most descriptors one message can carry (the kernel's SCM_MAX_FD).
/// A receive with room for them all is never cut short for descriptors: the
/// kernel closes those that do not fit, in the receiving thread, where a
/// peer's file could hold that close (see unique_fd::from_peer).
inline constexpr std::size_t max_descriptors_per_message = 253;

/// Control space for up to N descriptors, aligned for cmsghdr.
template <std::size_t N>
struct descriptor_space {
  alignas(cmsghdr) char bytes[CMSG_SPACE(sizeof(int) * N)]{};
};

/// Points `header`'s control data at `space` and puts `fds` there (nothing
/// when `fds` is empty). Throws invalid_argument when they do not fit.
void attach_descriptors(msghdr& header, std::span<const int> fds, std::span<char> space);

/// Appends every descriptor that came with `header` to `into`, owned, so
/// none leaks whatever is done with the message; each the peer's, of uid
/// `peer_uid` (unique_fd::from_peer), closed off the caller's thread until
/// checked.
void take_descriptors(msghdr& header, std::vector<unique_fd>& into, std::uint32_t peer_uid);

/// The uid of the process at the other end of unix socket `socket` when it
/// connected (SO_PEERCRED); unique_fd::no_one_peer when the kernel does not say.
[[nodiscard]] std::uint32_t peer_uid_of(int socket) noexcept;

}  // namespace shoal::detail
