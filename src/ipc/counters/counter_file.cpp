#include "ipc/counters/counter_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "core/sealed_memfd.h"
#include "shoal/core/error.h"

namespace shoal::ipc::detail {

namespace {

constexpr std::uint64_t file_magic = 0x31435248414f4853ULL;  // "SHOAHRC1"
constexpr std::uint32_t file_version = 3;  // 2: a sealed memfd, one holder per file; 3: the received state
// What counter memory must carry, and must not.
constexpr int required_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
constexpr int write_seals = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE;

constexpr std::uint64_t pack(std::uint32_t generation, slot_state state) noexcept {
  return (static_cast<std::uint64_t>(generation) << 2) | static_cast<std::uint64_t>(state);
}

[[noreturn]] void fail(const char* call) { throw os_error{errno, call}; }

}  // namespace

struct counter_file::header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t slots;
  std::int32_t creator_pid;
  std::uint32_t reserved;
  std::uint64_t creator_start_time;
  std::byte padding[32];
};
static_assert(sizeof(counter_file::header) == 64);

struct counter_file::slot {
  std::atomic<std::uint64_t> word;
  std::int64_t holder_pid;        // written by the producer before the word
  std::uint64_t holder_start_time;
  std::uint64_t reserved;
};
static_assert(sizeof(counter_file::slot) == 32);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "slots are shared between processes");

counter_file::counter_file(unique_fd fd, void* mapping, std::size_t bytes, std::uint32_t slots)
    : fd_(std::move(fd)), mapping_(mapping), bytes_(bytes), slots_(slots), owner_(::getpid()) {}

counter_file::counter_file(counter_file&& other) noexcept
    : fd_(std::move(other.fd_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      bytes_(other.bytes_),
      slots_(other.slots_),
      owner_(other.owner_) {}

counter_file::~counter_file() {
  if (mapping_ != nullptr) ::munmap(mapping_, bytes_);
}

counter_file counter_file::create(std::uint32_t slots) {
  if (slots == 0) throw invalid_argument("counter_file::create: a counter file needs at least one slot");
  const process_identity self = process_identity::self();
  const std::size_t bytes = sizeof(header) + std::size_t{slots} * sizeof(slot);
  static_assert(required_seals == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), "what make_sealed_memfd seals");
  unique_fd fd = shoal::detail::make_sealed_memfd("shoal-counters", bytes);
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (mapping == MAP_FAILED) fail("mmap");
  // ftruncate gave zeroes: every slot is free at generation 0.
  auto* h = static_cast<header*>(mapping);
  h->version = file_version;
  h->slots = slots;
  h->creator_pid = self.pid;
  h->creator_start_time = self.start_time;
  std::atomic_ref<std::uint64_t>(h->magic).store(file_magic, std::memory_order_release);
  return counter_file(std::move(fd), mapping, bytes, slots);
}

counter_file counter_file::open(unique_fd fd, std::uint32_t slots) {
  if (!fd) throw protocol_error("counter file: no descriptor came with the message");
  if (slots == 0) throw protocol_error("counter file: a slot count of 0 was announced");
  const int access = ::fcntl(fd.get(), F_GETFL);
  if (access < 0 || (access & O_ACCMODE) != O_RDWR) {
    throw protocol_error("counter file: the descriptor is not open for reading and writing");
  }
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & required_seals) != required_seals || (seals & write_seals) != 0) {
    throw protocol_error("counter file: the descriptor is not a memfd sealed against shrinking, growing and new "
                         "seals, and open for writes (anyone could truncate it under this process)");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail("fstat");
  const std::size_t bytes = sizeof(header) + std::size_t{slots} * sizeof(slot);
  if (!shoal::detail::on_tmpfs(fd.get())) {
    throw protocol_error("counter file: the descriptor is not a memfd on tmpfs (a hugetlbfs one could fault with "
                         "SIGBUS once its sender punched a page out)");
  }
  if (!S_ISREG(st.st_mode) || static_cast<std::size_t>(st.st_size) != bytes) {
    throw protocol_error("counter file: the descriptor is not a counter file of " + std::to_string(slots) +
                         " slots (" + std::to_string(bytes) + " bytes expected, found " +
                         std::to_string(st.st_size) + ")");
  }
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (mapping == MAP_FAILED) {
    throw protocol_error(std::string("counter file: the descriptor cannot be mapped read-write: ") + std::strerror(errno));
  }
  const auto* h = static_cast<const header*>(mapping);
  if (std::atomic_ref<const std::uint64_t>(h->magic).load(std::memory_order_acquire) != file_magic ||
      h->version != file_version || h->slots != slots) {
    ::munmap(mapping, bytes);
    throw protocol_error("counter file: bad header (magic, version or slot count do not match)");
  }
  fd.mark_safe_to_close();  // a memfd on tmpfs
  return counter_file(std::move(fd), mapping, bytes, slots);
}

counter_file::slot& counter_file::at(std::uint32_t index) const noexcept {
  auto* first = reinterpret_cast<slot*>(static_cast<std::byte*>(mapping_) + sizeof(header));
  return first[index];
}

bool counter_file::owned_here() const noexcept { return ::getpid() == owner_; }

void counter_file::claim(slot_ticket t, const process_identity& holder) noexcept {
  if (!owned_here()) return;
  slot& s = at(t.index);
  s.holder_pid = holder.pid;
  s.holder_start_time = holder.start_time;
  s.word.store(pack(t.generation, slot_state::held), std::memory_order_release);
}

bool counter_file::released(slot_ticket t) const noexcept {
  return at(t.index).word.load(std::memory_order_acquire) == pack(t.generation, slot_state::released);
}

bool counter_file::taken(slot_ticket t) const noexcept {
  return at(t.index).word.load(std::memory_order_acquire) != pack(t.generation, slot_state::held);
}

void counter_file::recycle(slot_ticket t) noexcept {
  if (!owned_here()) return;
  at(t.index).word.store(pack(t.generation, slot_state::free), std::memory_order_relaxed);
}

bool counter_file::take_back(slot_ticket t) noexcept {
  if (!owned_here()) return false;
  return at(t.index).word.exchange(pack(t.generation, slot_state::released), std::memory_order_acq_rel) !=
         pack(t.generation, slot_state::released);
}

bool counter_file::holds(slot_ticket t) const noexcept {
  return t.index < slots_ && at(t.index).word.load(std::memory_order_acquire) == pack(t.generation, slot_state::held);
}

void counter_file::mark_received(slot_ticket t) noexcept {
  if (t.index >= slots_ || !owned_here()) return;
  std::uint64_t expected = pack(t.generation, slot_state::held);
  (void)at(t.index).word.compare_exchange_strong(expected, pack(t.generation, slot_state::received),
                                                 std::memory_order_release, std::memory_order_relaxed);
}

bool counter_file::release(slot_ticket t) noexcept {
  if (t.index >= slots_ || !owned_here()) return false;
  const std::uint64_t released = pack(t.generation, slot_state::released);
  for (const slot_state from : {slot_state::received, slot_state::held}) {
    std::uint64_t expected = pack(t.generation, from);
    if (at(t.index).word.compare_exchange_strong(expected, released, std::memory_order_acq_rel)) return true;
  }
  return false;
}

}  // namespace shoal::ipc::detail
