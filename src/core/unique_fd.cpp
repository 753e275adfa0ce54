#include "shoal/core/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shoal/core/error.h"

namespace shoal {

void unique_fd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) ::close(fd_);
  fd_ = fd;
}

unique_fd unique_fd::duplicate() const {
  if (fd_ < 0) throw invalid_argument("unique_fd::duplicate: there is no descriptor to duplicate");
  const int copy = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) throw backend_error("fcntl(F_DUPFD_CLOEXEC)", std::strerror(errno));
  return unique_fd(copy);
}

}  // namespace shoal
