// The descriptors a hostile producer sends, of every kind a consumer may be
// handed: sealed memfds as the library makes them, memfds sealed against
// writes, unsealed or read-only ones, real counter memory and a real event
// page (made by the library's own code), a pipe and a socket. The kit owns
// all of them until it goes, and knows which files' memory it sent, so a
// storage can be checked to lie in nothing else.
//
// Not thread-safe: one kit per fuzz input, used by one thread.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "backend/host/host_event_page.h"
#include "ipc/counters/counter_file.h"
#include "shoal/core/unique_fd.h"

namespace shoal::fuzz {

enum class descriptor_kind : std::uint8_t {
  sealed_memfd,        // shrink, grow and seal seals: what the host backend exports
  write_sealed_memfd,  // + F_SEAL_WRITE
  future_write_memfd,  // + F_SEAL_FUTURE_WRITE
  unsealed_memfd,
  read_only_memfd,  // a sealed memfd reopened O_RDONLY
  counter_memory,   // counter_file::create's memfd
  event_page,       // host_event_page::create's memfd
  pipe_end,
  socket_end,
};
inline constexpr std::uint8_t descriptor_kinds = 9;

/// Sizes of the memfds made, chosen by a byte: page multiples, the host
/// backend's 2 MiB chunk granularity and one odd size.
inline constexpr std::size_t memfd_sizes[] = {4096, 8192, 65536, 2u << 20, 4u << 20, 1000, (2u << 20) + 4096};

class descriptor_kit {
 public:
  descriptor_kit() = default;
  descriptor_kit(const descriptor_kit &) = delete;
  descriptor_kit &operator=(const descriptor_kit &) = delete;
  ~descriptor_kit();

  /// A new descriptor of `kind`; memfds of memfd_sizes[size_choice % 7]
  /// bytes. -1 when the system refused (out of descriptors, say).
  int make(descriptor_kind kind, std::uint8_t size_choice);
  /// Real counter memory of `slots` slots whose first `held` slots are held
  /// by this process under `generation`, as a producer's claims make them;
  /// `as_memory` when it goes out as anything but counter memory (a segment,
  /// say), so that a storage may lie in it.
  int counter_memory(std::uint32_t slots, std::uint32_t held, std::uint32_t generation, bool as_memory);
  /// This input's event page (made on first use).
  backend::detail::host_event_page &page();
  /// Moves every counter of the page past any point, so no wait on it lasts.
  void pass_every_point();
  /// Whether `inode` is a file this kit made that a storage may lie in:
  /// memfds and counter memory sent as such. Not the event page or counter
  /// memory sent as counter memory, which this process maps read-write
  /// itself: a storage running past its mapping into them must not pass.
  [[nodiscard]] bool may_hold_storage(ino_t inode) const { return inodes_.contains(inode); }

 private:
  int keep(unique_fd fd, bool memory);

  std::vector<unique_fd> fds_;
  std::vector<ipc::detail::counter_file> files_;
  std::shared_ptr<backend::detail::host_event_page> page_;
  std::set<ino_t> inodes_;  // of what may_hold_storage
};

}  // namespace shoal::fuzz
