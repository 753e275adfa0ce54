#include "channel/shared_ring.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/sealed_memfd.h"
#include "shoal/core/error.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

namespace shoal::channel::detail {

namespace {

// In the ring file (the sender's lines).
constexpr std::size_t tail_offset = 0, wakes_sent_offset = 64;
// In the fields file (the receiver's).
constexpr std::size_t head_offset = 0, spinning_offset = 8, wakes_read_offset = 16;

std::string errno_text() { return std::strerror(errno); }

template <class T>
std::atomic_ref<T> field(std::byte* base, std::size_t offset) noexcept {
  return std::atomic_ref<T>(*reinterpret_cast<T*>(base + offset));
}

std::byte* map_file(int fd, std::size_t bytes, int protection, const char* what) {
  void* p = ::mmap(nullptr, bytes, protection, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    // The file's own modes or seals refuse the mapping: the sender's doing.
    if (errno == EACCES || errno == EPERM) {
      throw protocol_error(std::string("the ring's ") + what + " cannot be mapped (" + errno_text() + ")");
    }
    throw os_error{errno, std::string("mmap(ring's ") + what + ", " + std::to_string(bytes) + " bytes)"};
  }
  return static_cast<std::byte*>(p);
}

// Maps a new memfd of `bytes` read-write and allocates each of its pages
// (charged to this side) with a write fault, which leaves them up to date:
// what the reader's check of its pages looks for. A page merely fallocated
// is not up to date until touched, and would fail that check.
std::byte* map_allocated_memfd(const unique_fd& fd, std::size_t bytes, const char* name) {
  std::byte* base = map_file(fd.get(), bytes, PROT_READ | PROT_WRITE, name);
  (void)::madvise(base, bytes, MADV_NOHUGEPAGE);  // small pages, which the reader's lock keeps
  if (::madvise(base, bytes, MADV_POPULATE_WRITE) != 0) {
    if (errno != EINVAL) {  // EINVAL: a kernel before 5.14, without it; the loop does the same
      const int error = errno;
      ::munmap(base, bytes);
      throw os_error{error, std::string("madvise(MADV_POPULATE_WRITE, ") + name + ")"};
    }
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    for (std::size_t at = 0; at < bytes; at += page) {
      std::atomic_ref<std::byte>(base[at]).store(std::byte{0}, std::memory_order_relaxed);
    }
  }
  // Locked (best effort) so that an honest ring is not swapped out before
  // its reader checks its pages, which would refuse it.
  (void)::mlock(base, bytes);
  return base;
}

// Checks a file the peer sent as one of a ring's: a memfd on tmpfs, sealed
// against shrinking (checked before its size is read, so that the size
// holds), of exactly `bytes`; returns its seals and owner.
struct ring_file_facts {
  int seals;
  uid_t owner;
  gid_t group;
};
ring_file_facts check_ring_file(int fd, std::size_t bytes, const char* what) {
  const int seals = fd >= 0 ? ::fcntl(fd, F_GET_SEALS) : -1;
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    throw protocol_error(std::string("the ring's ") + what + " is not a memfd sealed against shrinking");
  }
  struct stat st {};
  if (!shoal::detail::on_tmpfs(fd) || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    throw protocol_error(std::string("the ring's ") + what + " is not a memfd on tmpfs");
  }
  if (static_cast<std::uint64_t>(st.st_size) != bytes) {
    throw protocol_error(std::string("the ring's ") + what + " holds " + std::to_string(st.st_size) +
                         " bytes; it takes " + std::to_string(bytes));
  }
  return {seals, st.st_uid, st.st_gid};
}

// Whether mincore() tells this process the truth of a file of `facts`: it
// does to its owner's user, and to a holder of CAP_FOWNER whose user
// namespace maps the owner and the group (else fstat shows them as the
// overflow ids, 65534). Of anyone else's file it tells the truth only while
// the file grants this process writing — a mode the owner can change at
// any moment — and says every page is in otherwise.
bool mincore_tells_the_truth(const ring_file_facts& facts) {
  if (facts.owner == ::geteuid()) return true;
  constexpr std::uint32_t overflow_id = 65534;
  if (facts.owner == overflow_id || facts.group == overflow_id) return false;
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  std::array<__user_cap_data_struct, _LINUX_CAPABILITY_U32S_3> capabilities{};
  if (::syscall(SYS_capget, &header, capabilities.data()) != 0) return false;
  return (capabilities[CAP_FOWNER / 32].effective & (1u << (CAP_FOWNER % 32))) != 0;
}

// Keeps the pages of a ring mapping where they are, as far as this process
// may: no huge page made of them by khugepaged (which charges it to the
// mapping's process: the reader), and, with `lock` (pages known to be in
// memory: locking a missing one would allocate it), no swapping out (a page
// swapped in again is charged to its cgroup, or to the reader's when that
// cgroup is gone). The lock is best effort: RLIMIT_MEMLOCK bounds it, and a
// ring that cannot be locked works all the same.
void keep_pages_in_place(std::byte* base, std::size_t bytes, bool lock) noexcept {
  (void)::madvise(base, bytes, MADV_NOHUGEPAGE);  // EINVAL where the kernel has no huge pages
  if (lock) (void)::mlock(base, bytes);
}

// Throws protocol_error when a page of the mapping at `base` is not in
// memory: one its sender never allocated (a hole), which this side's first
// read would allocate and have charged to it. mincore() takes no lock of
// the file (lseek's SEEK_HOLE would take its inode lock, which the sender
// can hold without end: a write() into the file from a buffer whose page
// fault never completes). A page swapped out reads as missing too.
void check_every_page_in_memory(std::byte* base, std::size_t bytes) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  if (::mincore(base, bytes, resident.data()) != 0) throw os_error{errno, "mincore(ring)"};
  const auto missing = static_cast<std::size_t>(
      std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) == 0; }));
  if (missing != 0) {
    throw protocol_error("the ring's file has " + std::to_string(missing) + " of its " + std::to_string(resident.size()) +
                         " pages out of memory (never allocated by its sender, or swapped out): reading them would "
                         "allocate them, charged to this side");
  }
}

}  // namespace

// ring_mapping ---------------------------------------------------------------

ring_mapping::ring_mapping(ring_mapping&& other) noexcept
    : ring_(std::exchange(other.ring_, nullptr)),
      fields_(std::exchange(other.fields_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)) {}

ring_mapping& ring_mapping::operator=(ring_mapping&& other) noexcept {
  if (this != &other) {
    unmap();
    ring_ = std::exchange(other.ring_, nullptr);
    fields_ = std::exchange(other.fields_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

ring_mapping::~ring_mapping() { unmap(); }

void ring_mapping::unmap() noexcept {
  if (ring_ != nullptr) ::munmap(ring_, ring_header_bytes + capacity_);
  if (fields_ != nullptr) ::munmap(fields_, ring_fields_bytes);
}

std::uint64_t ring_mapping::load_tail() const noexcept { return field<std::uint64_t>(ring_, tail_offset).load(); }
std::uint64_t ring_mapping::load_head() const noexcept {
  return field<std::uint64_t>(fields_, head_offset).load(std::memory_order_acquire);
}
void ring_mapping::store_tail(std::uint64_t v) noexcept { field<std::uint64_t>(ring_, tail_offset).store(v); }
void ring_mapping::store_head(std::uint64_t v) noexcept {
  field<std::uint64_t>(fields_, head_offset).store(v, std::memory_order_release);
}
bool ring_mapping::receiver_spinning() const noexcept {
  return field<std::uint32_t>(fields_, spinning_offset).load() != 0;
}
void ring_mapping::set_receiver_spinning(bool spinning) noexcept {
  field<std::uint32_t>(fields_, spinning_offset).store(spinning ? 1 : 0);
}

std::uint64_t ring_mapping::load_wakes_sent() const noexcept {
  return field<std::uint64_t>(ring_, wakes_sent_offset).load(std::memory_order_relaxed);
}
void ring_mapping::store_wakes_sent(std::uint64_t v) noexcept {
  field<std::uint64_t>(ring_, wakes_sent_offset).store(v, std::memory_order_relaxed);
}
std::uint64_t ring_mapping::load_wakes_read() const noexcept {
  return field<std::uint64_t>(fields_, wakes_read_offset).load();
}
void ring_mapping::store_wakes_read(std::uint64_t v) noexcept {
  field<std::uint64_t>(fields_, wakes_read_offset).store(v);
}

void ring_mapping::copy_out(std::uint64_t at, std::span<std::byte> out) const noexcept {
  if (out.empty()) return;  // (an empty span's data may be null, which memcpy may not take)
  const std::size_t start = at & (capacity_ - 1);
  const std::size_t first = std::min(out.size(), capacity_ - start);
  const std::byte* data = ring_ + ring_header_bytes;
  std::memcpy(out.data(), data + start, first);
  std::memcpy(out.data() + first, data, out.size() - first);
}

void ring_mapping::copy_in(std::uint64_t at, std::span<const std::byte> in) noexcept {
  if (in.empty()) return;
  const std::size_t start = at & (capacity_ - 1);
  const std::size_t first = std::min(in.size(), capacity_ - start);
  std::byte* data = ring_ + ring_header_bytes;
  std::memcpy(data + start, in.data(), first);
  std::memcpy(data, in.data() + first, in.size() - first);
}

// ring_writer ----------------------------------------------------------------

ring_writer::ring_writer(std::size_t capacity) {
  capacity = std::bit_ceil(std::clamp(capacity, min_ring_capacity, max_ring_capacity));
  constexpr const char* ring_name = "shoal-channel-ring";
  constexpr const char* fields_name = "shoal-channel-ring-fields";
  ring_fd_ = shoal::detail::make_unsealed_memfd(ring_name, ring_header_bytes + capacity);
  fields_fd_ = shoal::detail::make_unsealed_memfd(fields_name, ring_fields_bytes);
  std::byte* ring = map_allocated_memfd(ring_fd_, ring_header_bytes + capacity, ring_name);
  std::byte* fields = nullptr;
  try {
    fields = map_allocated_memfd(fields_fd_, ring_fields_bytes, fields_name);
  } catch (...) {
    ::munmap(ring, ring_header_bytes + capacity);
    throw;
  }
  map_ = ring_mapping(ring, fields, capacity);
  // Mapped first: the seal forbids writable mappings made after it (and
  // punching holes), and keeps this one.
  shoal::detail::seal_memfd(ring_fd_.get(), ring_name, F_SEAL_FUTURE_WRITE);
  shoal::detail::seal_memfd(fields_fd_.get(), fields_name);
}

bool ring_writer::fits_inline(std::size_t payload) const noexcept {
  return ring_entry_bytes(payload) <= capacity() / 4;
}

std::size_t ring_writer::room() {
  const std::uint64_t head = map_.load_head();
  // Forward from where it was, and not past what was published.
  if (head - head_seen_ > published_ - head_seen_) {
    throw protocol_error("the receiver moved its ring head to " + std::to_string(head) + ", outside " +
                         std::to_string(head_seen_) + ".." + std::to_string(published_) + " (consumed..published)");
  }
  head_seen_ = head;
  return capacity() - static_cast<std::size_t>(written_ - head);
}

void ring_writer::write(std::uint16_t type, std::span<const std::byte> payload, bool on_socket) {
  std::byte header[ring_entry_header_bytes];
  const auto bytes = static_cast<std::uint32_t>(payload.size());
  const std::uint16_t kind = on_socket ? 1 : 0;
  std::memcpy(header, &bytes, 4);
  std::memcpy(header + 4, &type, 2);
  std::memcpy(header + 6, &kind, 2);
  map_.copy_in(written_, header);
  map_.copy_in(written_ + ring_entry_header_bytes, payload);
  const std::size_t padding = ring_entry_bytes(payload.size()) - ring_entry_header_bytes - payload.size();
  static constexpr std::byte zeros[8] = {};
  map_.copy_in(written_ + ring_entry_header_bytes + payload.size(), std::span(zeros, padding));
  written_ += ring_entry_bytes(payload.size());
}

bool ring_writer::publish() noexcept {
  published_ = written_;
  map_.store_tail(published_);  // sequentially consistent, as are the loads after it
  if (map_.receiver_spinning()) return false;
  if (map_.load_head() == published_) return false;  // it took everything already
  return map_.load_wakes_read() == wakes_;             // else a wake-up waits unread
}

void ring_writer::count_wake() noexcept { map_.store_wakes_sent(++wakes_); }

// ring_reader ----------------------------------------------------------------

ring_reader::ring_reader(unique_fd ring_file, unique_fd fields_file, std::uint64_t announced_capacity) {
  if (announced_capacity < min_ring_capacity || announced_capacity > max_ring_capacity ||
      !std::has_single_bit(announced_capacity)) {
    throw protocol_error("a ring of " + std::to_string(announced_capacity) + " bytes; a ring holds a power of two from " +
                         std::to_string(min_ring_capacity) + " to " + std::to_string(max_ring_capacity));
  }
  const std::size_t capacity = announced_capacity;
  const ring_file_facts ring_facts = check_ring_file(ring_file.get(), ring_header_bytes + capacity, "file");
  if ((ring_facts.seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) == 0) {
    throw protocol_error("the ring's file is not sealed against writes; only its sender may write it");
  }
  const ring_file_facts field_facts = check_ring_file(fields_file.get(), ring_fields_bytes, "fields file");
  if ((field_facts.seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    throw protocol_error("the ring's fields file is sealed against writes; the receiver writes its head into it");
  }
  const int mode = ::fcntl(fields_file.get(), F_GETFL);
  if (mode < 0 || (mode & O_ACCMODE) != O_RDWR) {
    throw protocol_error("the ring's fields file is not open for reading and writing");
  }
  std::byte* ring = map_file(ring_file.get(), ring_header_bytes + capacity, PROT_READ, "file");
  std::byte* fields = nullptr;
  try {
    // Sealed against writes, the ring file can lose no page to a hole after
    // this check, and the lock keeps them from swap. Where mincore() may lie,
    // the peer is bounded by allow_peer_ring's size alone.
    const bool checked = mincore_tells_the_truth(ring_facts);
    if (checked) check_every_page_in_memory(ring, ring_header_bytes + capacity);
    keep_pages_in_place(ring, ring_header_bytes + capacity, checked);
    fields = map_file(fields_file.get(), ring_fields_bytes, PROT_READ | PROT_WRITE, "fields file");
    keep_pages_in_place(fields, ring_fields_bytes, false);
  } catch (...) {
    ::munmap(ring, ring_header_bytes + capacity);
    throw;
  }
  map_ = ring_mapping(ring, fields, capacity);
  ring_file.mark_safe_to_close();  // memfds on tmpfs
  fields_file.mark_safe_to_close();
}

bool ring_reader::has_entries() noexcept {
  const std::uint64_t head = head_.load(std::memory_order_relaxed);
  const std::uint64_t tail = map_.load_tail();
  if (tail == head) return false;
  promised_ = promise{head, tail};
  return true;
}
bool ring_reader::seems_to_have_entries() const noexcept {
  return map_.load_tail() != head_.load(std::memory_order_acquire);
}

std::optional<ring_entry> ring_reader::take(std::size_t max_payload) {
  const std::uint64_t head = head_.load(std::memory_order_relaxed);
  const std::uint64_t tail = map_.load_tail();
  if (tail == head) {
    // An honest tail only moves on: once has_entries() saw it away from this
    // head, it cannot be back. A peer flipping it in time with this side's
    // looks would keep the two disagreeing, and a receive looping between
    // them without looking at its deadline.
    if (promised_ && promised_->head == head) {
      throw protocol_error("the sender's ring tail went from " + std::to_string(promised_->tail) +
                           " back to the head " + std::to_string(head));
    }
    return std::nullopt;
  }
  const std::uint64_t published = tail - head;
  if (published > map_.capacity() || published % 8 != 0) {
    throw protocol_error("the sender's ring tail " + std::to_string(tail) + " is not a whole number of entries within " +
                         std::to_string(map_.capacity()) + " bytes of the head " + std::to_string(head));
  }
  std::byte header[ring_entry_header_bytes];
  if (published < sizeof header) throw protocol_error("a ring entry shorter than its header");
  map_.copy_out(head, header);
  std::uint32_t bytes = 0;
  std::uint16_t kind = 0;
  ring_entry e;
  std::memcpy(&bytes, header, 4);
  std::memcpy(&e.type, header + 4, 2);
  std::memcpy(&kind, header + 6, 2);
  if (kind > 1) throw protocol_error("a ring entry of kind " + std::to_string(kind) + "; kinds are 0 and 1");
  e.on_socket = kind == 1;
  if (e.on_socket && bytes != 0) throw protocol_error("a ring marker that carries a payload");
  if (bytes > max_payload) {
    throw protocol_error("a ring entry of " + std::to_string(bytes) + " payload bytes, over the limit of " +
                         std::to_string(max_payload));
  }
  if (ring_entry_bytes(bytes) > published) {
    throw protocol_error("a ring entry of " + std::to_string(ring_entry_bytes(bytes)) + " bytes runs past the " +
                         std::to_string(published) + " published");
  }
  e.payload.resize(bytes);
  map_.copy_out(head + ring_entry_header_bytes, e.payload);
  const std::uint64_t next = head + ring_entry_bytes(bytes);
  head_.store(next, std::memory_order_release);
  map_.store_head(next);
  return e;
}

void ring_reader::set_spinning(bool spinning) noexcept { map_.set_receiver_spinning(spinning); }

// Two honest wake-ups can find one tail: this side looks at the tail for
// wake-up k after the publish that wake-up k+1 is for has stored it, and the
// sender, seeing wake-up k read just after that look, sends k+1. But k+2
// follows a publish the sender made after it saw k read, so after this
// side's look for k: across any two wake-ups the tail moves on.
void ring_reader::note_wake() {
  const std::uint64_t tail = map_.load_tail();
  if (tail <= tail_at_wakes_[0]) {
    throw protocol_error("three ring wake-ups with nothing published between the first and the last");
  }
  tail_at_wakes_ = {tail_at_wakes_[1], tail};
  map_.store_wakes_read(++wakes_read_);
}

// A sender that counts more than it sends only makes this side look at its socket more often.
bool ring_reader::wakes_owed() const noexcept { return map_.load_wakes_sent() != wakes_read_; }

}  // namespace shoal::channel::detail
