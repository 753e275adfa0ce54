#include "backend/host/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

#include "core/address_text.h"
#include "core/descriptor_limit.h"
#include "core/sealed_memfd.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

std::size_t page_round(std::size_t bytes) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

void* map_shared(int fd, std::size_t bytes, void* fixed_address, memory_access access = memory_access::read_write) {
  const int flags = MAP_SHARED | (fixed_address != nullptr ? MAP_FIXED : 0);
  const int protection = access == memory_access::read_only ? PROT_READ : PROT_READ | PROT_WRITE;
  void* p = ::mmap(fixed_address, bytes, protection, flags, fd, 0);
  if (p == MAP_FAILED) throw os_error{errno, "mmap(memfd, " + std::to_string(bytes) + " bytes)"};
  return p;
}

// Puts inaccessible, unbacked address space at [address, address + bytes).
void* map_hole(void* address, std::size_t bytes) {
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (address != nullptr ? MAP_FIXED : 0);
  void* p = ::mmap(address, bytes, PROT_NONE, flags, -1, 0);
  if (p == MAP_FAILED) throw os_error{errno, "mmap(PROT_NONE, " + std::to_string(bytes) + " bytes)"};
  return p;
}

// Checks the chunks one import maps with `access` (see
// device::import_memory); returns their total size.
std::size_t importable_bytes(std::span<const shareable_handle> chunks, memory_access access) {
  if (chunks.empty()) throw invalid_argument("import_memory: no handles were given; pass at least one");
  std::size_t total = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const shareable_handle& h = chunks[i];
    const std::string which = "import_memory: " + (chunks.size() == 1 ? std::string("the handle") : "chunk " + std::to_string(i));
    if (h.kind != handle_kind::host_memfd || h.device != device_kind::host) {
      throw invalid_argument(which + " comes from a " + std::string(to_string(h.device)) +
                             " device; the host device imports host_memfd handles only");
    }
    if (!h.fd) throw invalid_argument(which + " has no file descriptor (closed, or moved from)");
    if (h.size == 0 || h.offset >= h.size) {
      throw invalid_argument(which + ": offset " + std::to_string(h.offset) + " is not inside size " + std::to_string(h.size));
    }
    if (i > 0 && h.offset != 0) {
      throw invalid_argument(which + " has offset " + std::to_string(h.offset) +
                             "; only the first chunk may point inside itself, the others are mapped whole");
    }
    if (chunks.size() > 1 && h.size % host_memory::chunk_granularity != 0) {
      throw invalid_argument(which + " has " + std::to_string(h.size) + " bytes, not a multiple of the " +
                             std::to_string(host_memory::chunk_granularity) +
                             "-byte granularity; only chunks of growable ranges are imported together");
    }
    // The seals first: only a memfd has them, and asking a file of another
    // kind (a peer's FUSE file) could wait on its file system.
    const int seals = ::fcntl(h.fd.get(), F_GET_SEALS);
    struct stat st {};
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstat(h.fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
        !shoal::detail::on_tmpfs(h.fd.get())) {
      throw invalid_argument(which + ": the descriptor is not a sealed shoal memfd (on tmpfs)");
    }
    // A read-write mapping of a read-only descriptor or of a write-sealed
    // memfd is the sender's error, told as such rather than as a failing mmap.
    const int mode = ::fcntl(h.fd.get(), F_GETFL);
    if (mode < 0) throw invalid_argument(which + ": the descriptor's access mode cannot be read: " + std::strerror(errno));
    if (access == memory_access::read_write &&
        ((mode & O_ACCMODE) != O_RDWR || (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0)) {
      throw invalid_argument(which + ": the descriptor cannot be mapped for writing (read-only, or sealed against writes); "
                             "import it with memory_access::read_only");
    }
    if ((mode & O_ACCMODE) == O_WRONLY) throw invalid_argument(which + ": the descriptor is open for writing only");
    if (static_cast<std::uint64_t>(st.st_size) < h.size) {
      throw invalid_argument(which + " claims " + std::to_string(h.size) + " bytes but the file holds " +
                             std::to_string(st.st_size));
    }
    if (h.size > std::numeric_limits<std::size_t>::max() - total) throw invalid_argument("import_memory: the chunks' sizes overflow");
    total += h.size;
  }
  return total;
}

}  // namespace

struct host_memory::chunk {
  chunk(unique_fd f, std::size_t s, std::shared_ptr<std::atomic<std::size_t>> used)
      : fd(std::move(f)), size(s), used_bytes(std::move(used)) {}
  chunk(const chunk&) = delete;
  chunk& operator=(const chunk&) = delete;
  ~chunk() { used_bytes->fetch_sub(size); }

  unique_fd fd;
  std::size_t size;
  std::shared_ptr<std::atomic<std::size_t>> used_bytes;
};

host_memory::host_memory(std::size_t capacity_bytes)
    : capacity_(capacity_bytes), used_(std::make_shared<std::atomic<std::size_t>>(0)) {
  // Each segment and chunk keeps a memfd open (it must stay exportable).
  shoal::detail::raise_descriptor_limit();
}

host_memory::~host_memory() {
  std::lock_guard lock(mutex_);
  for (auto& [base, s] : segments_) ::munmap(reinterpret_cast<void*>(base), s.size);
  for (auto& [base, size] : pinned_) ::munmap(reinterpret_cast<void*>(base), size);
  for (auto& [base, r] : reservations_) ::munmap(reinterpret_cast<void*>(base), r.size);
  for (auto& [ptr, i] : imports_) ::munmap(i.base, i.size);
}

memory_info host_memory::info() const {
  const std::size_t used = used_->load();
  return {capacity_ > used ? capacity_ - used : 0, capacity_};
}

void host_memory::charge(std::size_t bytes, const char* what) {
  std::size_t used = used_->load();
  do {
    if (bytes > capacity_ || used > capacity_ - bytes) {
      throw out_of_memory(std::string("host device: cannot ") + what + " of " + std::to_string(bytes) + " bytes: " +
                              std::to_string(capacity_ - used) + " of " + std::to_string(capacity_) +
                              " bytes free; free memory or give the host device a larger capacity_bytes",
                          bytes);
    }
  } while (!used_->compare_exchange_weak(used, used + bytes));
}

namespace {

// New device memory on CUDA holds whatever was there (memory this process
// freed, say): a pattern at the first and last page of each new segment and
// chunk keeps a host test from taking zeros for granted. Only their edges:
// filling all of it would touch every page the suites reserve.
constexpr unsigned char fresh_memory_pattern = 0xDB;
constexpr std::size_t pattern_edge = 4096;

void mark_fresh(void* base, std::size_t size) noexcept {
  auto* p = static_cast<unsigned char*>(base);
  std::memset(p, fresh_memory_pattern, std::min(size, pattern_edge));
  if (size > pattern_edge) std::memset(p + size - pattern_edge, fresh_memory_pattern, pattern_edge);
}

// mark_fresh for memory not mapped yet (a chunk's file); best effort.
void mark_fresh_file(int fd, std::size_t size) noexcept {
  static const std::array<unsigned char, pattern_edge> pattern = [] {
    std::array<unsigned char, pattern_edge> p{};
    p.fill(fresh_memory_pattern);
    return p;
  }();
  const std::size_t edge = std::min(size, pattern_edge);
  (void)!::pwrite(fd, pattern.data(), edge, 0);
  if (size > pattern_edge) (void)!::pwrite(fd, pattern.data(), pattern_edge, static_cast<off_t>(size - pattern_edge));
}

}  // namespace

void* host_memory::allocate_segment(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("allocate_segment: size is 0; ask for at least one byte");
  if (bytes > capacity_) charge(bytes, "allocate a segment");  // throws before rounding can overflow
  const std::size_t size = page_round(bytes);
  charge(size, "allocate a segment");
  try {
    unique_fd fd = shoal::detail::make_sealed_memfd("shoal-segment", size);
    void* base = map_shared(fd.get(), size, nullptr);
    mark_fresh(base, size);
    std::lock_guard lock(mutex_);
    segments_.emplace(reinterpret_cast<std::uintptr_t>(base), segment{size, std::move(fd)});
    return base;
  } catch (...) {
    used_->fetch_sub(size);
    throw;
  }
}

void host_memory::free_segment(void* base) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == segments_.end()) {
    throw invalid_argument("free_segment(" + shoal::detail::hex(base) +
                           "): not the base of a live segment of this host device (foreign pointer, or freed already)");
  }
  ::munmap(base, it->second.size);
  used_->fetch_sub(it->second.size);
  segments_.erase(it);
}

// The host backend has no page-locking to do: "pinned" memory is ordinary
// anonymous memory, private to the process, outside the device's capacity.
void* host_memory::allocate_pinned_host(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("allocate_pinned_host: size is 0; ask for at least one byte");
  const std::size_t size = page_round(bytes);
  if (size < bytes) throw out_of_memory("allocate_pinned_host: " + std::to_string(bytes) + " bytes is past the address space", bytes);
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    throw out_of_memory("allocate_pinned_host: the system refused " + std::to_string(size) + " bytes of host memory",
                        bytes);
  }
  std::lock_guard lock(mutex_);
  pinned_.emplace(reinterpret_cast<std::uintptr_t>(base), size);
  return base;
}

void host_memory::free_pinned_host(void* base) {
  std::lock_guard lock(mutex_);
  const auto it = pinned_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == pinned_.end()) {
    throw invalid_argument("free_pinned_host(" + shoal::detail::hex(base) +
                           "): not the base of a live pinned segment of this host device (foreign pointer, or freed "
                           "already)");
  }
  ::munmap(base, it->second);
  pinned_.erase(it);
}

void* host_memory::reserve_range(std::size_t bytes) {
  if (bytes == 0 || bytes % chunk_granularity != 0) {
    throw invalid_argument("reserve_range: " + std::to_string(bytes) + " bytes is not a positive multiple of the " +
                           std::to_string(chunk_granularity) + "-byte granularity");
  }
  // Over-reserve, then trim, so the range is aligned to the granularity as
  // CUDA's reservations are.
  const std::size_t padded = bytes + chunk_granularity;
  if (padded < bytes) throw out_of_memory("reserve_range: " + std::to_string(bytes) + " bytes is past the address space", bytes);
  auto* raw = static_cast<char*>(map_hole(nullptr, padded));
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + chunk_granularity - 1) / chunk_granularity * chunk_granularity;
  if (aligned > start) ::munmap(raw, aligned - start);
  const std::size_t tail = padded - (aligned - start) - bytes;
  if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  std::lock_guard lock(mutex_);
  reservations_.emplace(aligned, reservation{bytes, {}});
  return reinterpret_cast<void*>(aligned);
}

void host_memory::release_range(void* base) {
  std::lock_guard lock(mutex_);
  const auto it = reservations_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == reservations_.end()) {
    throw invalid_argument("release_range(" + shoal::detail::hex(base) + "): not the base of a live reservation of this host device");
  }
  if (!it->second.mappings.empty()) {
    throw invalid_argument("release_range(" + shoal::detail::hex(base) + "): " + std::to_string(it->second.mappings.size()) +
                           " chunk(s) are still mapped in it; unmap them first");
  }
  ::munmap(base, it->second.size);
  reservations_.erase(it);
}

physical_ref host_memory::create_physical(std::size_t bytes) {
  if (bytes == 0 || bytes % chunk_granularity != 0) {
    throw invalid_argument("create_physical: " + std::to_string(bytes) + " bytes is not a positive multiple of the " +
                           std::to_string(chunk_granularity) + "-byte granularity");
  }
  charge(bytes, "create a physical chunk");
  std::shared_ptr<chunk> c;
  try {
    c = std::make_shared<chunk>(shoal::detail::make_sealed_memfd("shoal-chunk", bytes), bytes, used_);
    mark_fresh_file(c->fd.get(), bytes);
  } catch (...) {
    used_->fetch_sub(bytes);
    throw;
  }
  std::lock_guard lock(mutex_);
  const std::uint64_t id = next_chunk_id_++;
  chunks_.emplace(id, std::move(c));
  return physical_ref{id};
}

void host_memory::release_physical(physical_ref ref) {
  std::lock_guard lock(mutex_);
  if (chunks_.erase(ref.native) == 0) {
    throw invalid_argument("release_physical: chunk " + std::to_string(ref.native) +
                           " is not a live chunk of this host device (released already?)");
  }
}

host_memory::reservation* host_memory::reservation_holding(std::uintptr_t address, std::size_t bytes) {
  auto it = reservations_.upper_bound(address);
  if (it == reservations_.begin()) return nullptr;
  --it;
  const std::uintptr_t base = it->first;
  if (address - base > it->second.size || bytes > it->second.size - (address - base)) return nullptr;
  return &it->second;
}

void host_memory::map(void* address, physical_ref ref) {
  std::lock_guard lock(mutex_);
  const auto c = chunks_.find(ref.native);
  if (c == chunks_.end()) throw invalid_argument("map: chunk " + std::to_string(ref.native) + " is not a live chunk of this host device");
  const auto addr = reinterpret_cast<std::uintptr_t>(address);
  const std::size_t size = c->second->size;
  if (addr % chunk_granularity != 0) throw invalid_argument("map: address " + shoal::detail::hex(address) + " is not granularity-aligned");
  reservation* r = reservation_holding(addr, size);
  if (r == nullptr) {
    throw invalid_argument("map: [" + shoal::detail::hex(address) + ", +" + std::to_string(size) +
                           ") does not lie inside one reservation of this host device");
  }
  // Overlap with the mapping at or before `addr`, or with the next one.
  auto next = r->mappings.lower_bound(addr);
  const bool hits_next = next != r->mappings.end() && next->first < addr + size;
  const bool hits_prev = next != r->mappings.begin() && std::prev(next)->first + std::prev(next)->second.size > addr;
  if (hits_next || hits_prev) throw invalid_argument("map: [" + shoal::detail::hex(address) + ", +" + std::to_string(size) + ") overlaps a mapped chunk");
  map_shared(c->second->fd.get(), size, address);
  r->mappings.emplace(addr, mapping{size, c->second});
}

void host_memory::unmap(void* address) {
  std::lock_guard lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(address);
  if (reservation* r = reservation_holding(addr, 0)) {
    if (const auto m = r->mappings.find(addr); m != r->mappings.end()) {
      map_hole(address, m->second.size);
      r->mappings.erase(m);
      return;
    }
  }
  throw invalid_argument("unmap(" + shoal::detail::hex(address) + "): no chunk of this host device is mapped at that address");
}

shareable_handle host_memory::export_memory(const void* ptr) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard lock(mutex_);
  shareable_handle h;
  h.kind = handle_kind::host_memfd;
  h.device = device_kind::host;
  if (auto s = segments_.upper_bound(addr); s != segments_.begin() && addr - std::prev(s)->first < std::prev(s)->second.size) {
    --s;
    h.size = s->second.size;
    h.offset = addr - s->first;
    h.fd = s->second.fd.duplicate();
    return h;
  }
  if (auto r = reservations_.upper_bound(addr); r != reservations_.begin()) {
    const auto& maps = std::prev(r)->second.mappings;
    if (auto m = maps.upper_bound(addr); m != maps.begin() && addr - std::prev(m)->first < std::prev(m)->second.size) {
      --m;
      h.size = m->second.size;
      h.offset = addr - m->first;
      h.fd = m->second.backing->fd.duplicate();
      return h;
    }
  }
  throw invalid_argument("export_memory(" + shoal::detail::hex(ptr) + "): not inside a segment or mapped chunk of this host device");
}

void* host_memory::import_memory(std::span<const shareable_handle> chunks, memory_access access) {
  const std::size_t total = importable_bytes(chunks, access);
  // Reserved first, so the chunks land back to back with nothing between.
  void* base = map_hole(nullptr, total);
  try {
    std::size_t at = 0;
    for (const shareable_handle& h : chunks) {
      map_shared(h.fd.get(), h.size, static_cast<char*>(base) + at, access);
      at += h.size;
    }
  } catch (...) {
    ::munmap(base, total);
    throw;
  }
  void* ptr = static_cast<char*>(base) + chunks.front().offset;
  std::lock_guard lock(mutex_);
  imports_.emplace(ptr, import{base, total});
  return ptr;
}

void host_memory::close_import(void* ptr) {
  std::lock_guard lock(mutex_);
  const auto it = imports_.find(ptr);
  if (it == imports_.end()) {
    throw invalid_argument("close_import(" + shoal::detail::hex(ptr) + "): not a pointer import_memory returned, or closed already");
  }
  ::munmap(it->second.base, it->second.size);
  imports_.erase(it);
}

}  // namespace shoal::backend::detail
