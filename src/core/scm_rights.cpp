#include "core/scm_rights.h"

#include <cstring>
#include <new>
#include <string>

#include "shoal/core/error.h"

namespace shoal::detail {

void attach_descriptors(msghdr& header, std::span<const int> fds, std::span<char> space) {
  if (fds.empty()) return;
  if (CMSG_SPACE(sizeof(int) * fds.size()) > space.size()) {
    throw invalid_argument("attach_descriptors: " + std::to_string(fds.size()) + " descriptors do not fit " +
                           std::to_string(space.size()) + " bytes of control space");
  }
  header.msg_control = space.data();
  header.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
  cmsghdr* c = CMSG_FIRSTHDR(&header);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
}

void take_descriptors(msghdr& header, std::vector<unique_fd>& into, std::uint32_t peer_uid) {
  std::size_t total = into.size();
  for (cmsghdr* c = CMSG_FIRSTHDR(&header); c != nullptr; c = CMSG_NXTHDR(&header, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) total += (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
  }
  const auto each_descriptor = [&](auto&& take) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&header); c != nullptr; c = CMSG_NXTHDR(&header, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        take(fd);
      }
    }
  };
  try {
    into.reserve(total);  // so no push_back below throws and leaves a descriptor unowned
  } catch (const std::bad_alloc&) {
    // The kernel installed them already: each is closed as a peer's is.
    each_descriptor([&](int fd) { (void)unique_fd::from_peer(fd, peer_uid); });
    throw;
  }
  each_descriptor([&](int fd) { into.push_back(unique_fd::from_peer(fd, peer_uid)); });
}

std::uint32_t peer_uid_of(int socket) noexcept {
  ucred credentials{};
  socklen_t length = sizeof credentials;
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) return unique_fd::no_one_peer;
  return credentials.uid;
}

}  // namespace shoal::detail
