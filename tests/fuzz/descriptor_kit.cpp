#include "fuzz/descriptor_kit.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <limits>
#include <string>

#include "shoal/core/process_identity.h"

namespace shoal::fuzz {

namespace {

constexpr int library_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

unique_fd memfd(std::size_t bytes, int seals) {
  unique_fd fd(::memfd_create("shoal-fuzz-peer", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) return {};
  if (seals != 0 && ::fcntl(fd.get(), F_ADD_SEALS, seals) != 0) return {};
  return fd;
}

}  // namespace

descriptor_kit::~descriptor_kit() = default;

int descriptor_kit::keep(unique_fd fd, bool memory) {
  if (!fd) return -1;
  struct stat st {};
  if (memory && ::fstat(fd.get(), &st) == 0) inodes_.insert(st.st_ino);
  fds_.push_back(std::move(fd));
  return fds_.back().get();
}

int descriptor_kit::make(descriptor_kind kind, std::uint8_t size_choice) {
  const std::size_t bytes = memfd_sizes[size_choice % std::size(memfd_sizes)];
  switch (kind) {
    case descriptor_kind::sealed_memfd:
      return keep(memfd(bytes, library_seals), true);
    case descriptor_kind::write_sealed_memfd:
      return keep(memfd(bytes, library_seals | F_SEAL_WRITE), true);
    case descriptor_kind::future_write_memfd:
      return keep(memfd(bytes, library_seals | F_SEAL_FUTURE_WRITE), true);
    case descriptor_kind::unsealed_memfd:
      return keep(memfd(bytes, 0), true);
    case descriptor_kind::read_only_memfd: {
      const unique_fd writable = memfd(bytes, library_seals);
      if (!writable) return -1;
      const std::string path = "/proc/self/fd/" + std::to_string(writable.get());
      return keep(unique_fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), true);
    }
    case descriptor_kind::counter_memory:
      return counter_memory(1u << (size_choice % 17), size_choice % 9, size_choice % 4, true);
    case descriptor_kind::event_page:
      return keep(page().share(), false);
    case descriptor_kind::pipe_end: {
      int ends[2];
      if (::pipe2(ends, O_CLOEXEC) != 0) return -1;
      keep(unique_fd(ends[1]), false);
      return keep(unique_fd(ends[0]), false);
    }
    case descriptor_kind::socket_end: {
      int ends[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) return -1;
      keep(unique_fd(ends[1]), false);
      return keep(unique_fd(ends[0]), false);
    }
  }
  return -1;
}

int descriptor_kit::counter_memory(std::uint32_t slots, std::uint32_t held, std::uint32_t generation, bool as_memory) {
  files_.push_back(ipc::detail::counter_file::create(slots));
  ipc::detail::counter_file &file = files_.back();
  const process_identity self = process_identity::self();
  for (std::uint32_t i = 0; i < held && i < slots; ++i) file.claim({i, generation}, self);
  return keep(unique_fd(::dup(file.fd())), as_memory);
}

backend::detail::host_event_page &descriptor_kit::page() {
  if (!page_) page_ = backend::detail::host_event_page::create();
  return *page_;
}

void descriptor_kit::pass_every_point() {
  if (!page_) return;
  std::vector<backend::detail::host_stream_slot> slots;
  while (auto slot = page_->lease()) {
    slot->counter().store(std::numeric_limits<std::uint64_t>::max(), std::memory_order_release);
    slots.push_back(std::move(*slot));
  }
}

}  // namespace shoal::fuzz
