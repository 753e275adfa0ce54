#include "core/sealed_memfd.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "shoal/core/error.h"

namespace shoal::detail {

unique_fd make_unsealed_memfd(const char* name, std::size_t bytes) {
  unique_fd fd(::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw os_error{errno, std::string("memfd_create(") + name + ")"};
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    throw os_error{errno, std::string("ftruncate(") + name + ", " + std::to_string(bytes) + ")"};
  }
  return fd;
}

void seal_memfd(int fd, const char* name, int extra) {
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | extra | F_SEAL_SEAL) != 0) {
    throw os_error{errno, std::string("fcntl(F_ADD_SEALS, ") + name + ")"};
  }
}

unique_fd make_sealed_memfd(const char* name, std::size_t bytes) {
  unique_fd fd = make_unsealed_memfd(name, bytes);
  seal_memfd(fd.get(), name);
  return fd;
}

bool on_tmpfs(int fd) noexcept {
  struct statfs fs {};
  return ::fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC;
}

}  // namespace shoal::detail
