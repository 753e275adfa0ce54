#include "shoal/core/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/descriptor_closer.h"
#include "shoal/core/error.h"

namespace shoal {

static_assert(unique_fd::no_one_peer == detail::unknown_owner);

void unique_fd::reset(int fd) noexcept {
  if (fd == fd_) return;
  if (fd_ >= 0) {
    if (from_peer_) {
      detail::close_off_thread(fd_, peer_uid_);
    } else {
      ::close(fd_);
    }
  }
  fd_ = fd;
  from_peer_ = false;
}

unique_fd unique_fd::duplicate() const {
  if (fd_ < 0) throw invalid_argument("unique_fd::duplicate: there is no descriptor to duplicate");
  const int copy = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) throw os_error{errno, "fcntl(F_DUPFD_CLOEXEC)"};
  return from_peer_ ? from_peer(copy, peer_uid_) : unique_fd(copy);
}

}  // namespace shoal
