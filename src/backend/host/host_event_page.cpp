#include "backend/host/host_event_page.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <new>
#include <string>
#include <thread>

#include "core/process_wide_id.h"
#include "core/sealed_memfd.h"
#include "shoal/core/error.h"
#include "shoal/core/process_identity.h"

namespace shoal::backend::detail {

namespace {

// Page layout: the header, then slot_count counters from counters_offset.
struct page_header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t slot_count;
  std::uint64_t source_id;
  std::int64_t exporter_pid;
  std::uint64_t exporter_start_time;
};
constexpr std::uint64_t page_magic = 0x5348'4f41'4c45'5650;  // "SHOALEVP"
constexpr std::uint32_t page_version = 1;
constexpr std::size_t counters_offset = 64;
constexpr std::size_t page_bytes = counters_offset + host_event_page::slot_count * sizeof(std::uint64_t);
static_assert(sizeof(page_header) <= counters_offset);
// Counters are shared between processes, which only works lock-free.
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

// How often a waiter looks whether the exporter lives, and its longest nap.
constexpr auto liveness_period = std::chrono::milliseconds(10);
constexpr auto longest_nap = std::chrono::microseconds(500);

std::atomic<std::uint64_t>* counters_in(void* mapping) {
  return reinterpret_cast<std::atomic<std::uint64_t>*>(static_cast<std::byte*>(mapping) + counters_offset);
}

// What is wrong with an imported page's header, or nullptr.
const char* header_fault(const page_header& header, std::uint64_t source_id) {
  if (header.magic != page_magic) return "bad magic number";
  if (header.version != page_version) return "another page version";
  if (header.slot_count != host_event_page::slot_count) return "another slot count";
  if (header.source_id != source_id) return "a source id other than the source's";
  if (header.exporter_pid <= 0 || header.exporter_pid > INT_MAX) return "an impossible exporter pid";
  return nullptr;
}

[[noreturn]] void refuse(const std::string& why) {
  throw invalid_argument("open_event_source: " + why + "; the source did not come from a matching shoal host device");
}

}  // namespace

// ---- a stream's slot ---------------------------------------------------------

host_stream_slot::host_stream_slot(std::shared_ptr<host_event_page> page, std::uint32_t index) noexcept
    : page_(std::move(page)), index_(index) {}

host_stream_slot::~host_stream_slot() {
  if (page_) page_->give_back(index_);
}

std::uint64_t host_stream_slot::source_id() const noexcept { return page_->source_id(); }

std::atomic<std::uint64_t>& host_stream_slot::counter() const noexcept { return page_->counter(index_); }

// ---- the exporting side ------------------------------------------------------------

std::shared_ptr<host_event_page> host_event_page::create() {
  // Importers tell this process from a later one with its pid by this.
  const process_identity self = process_identity::self();
  unique_fd fd = shoal::detail::make_unsealed_memfd("shoal-event-page", page_bytes);
  void* mapping = ::mmap(nullptr, page_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (mapping == MAP_FAILED) throw os_error{errno, "mmap(event page)"};
  const std::uint64_t id = shoal::detail::next_process_wide_id();
  new (mapping) page_header{page_magic, page_version, slot_count, id, self.pid, self.start_time};
  std::atomic<std::uint64_t>* counters = counters_in(mapping);
  for (std::uint32_t i = 0; i < slot_count; ++i) new (counters + i) std::atomic<std::uint64_t>(0);
  // Sealed after mapping: this mapping stays writable, every later one
  // (any importer's) can only read, and the size is fixed (no SIGBUS).
  try {
    shoal::detail::seal_memfd(fd.get(), "shoal-event-page", F_SEAL_FUTURE_WRITE);
  } catch (...) {
    ::munmap(mapping, page_bytes);
    throw;
  }
  return std::shared_ptr<host_event_page>(new host_event_page(std::move(fd), mapping, id));
}

host_event_page::host_event_page(unique_fd fd, void* mapping, std::uint64_t source_id)
    : fd_(std::move(fd)), mapping_(mapping), source_id_(source_id) {
  free_.reserve(slot_count);
}

host_event_page::~host_event_page() { ::munmap(mapping_, page_bytes); }

std::optional<host_stream_slot> host_event_page::lease() {
  std::lock_guard lock(mutex_);
  std::uint32_t index;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else if (never_leased_ < slot_count) {
    index = never_leased_++;
  } else {
    return std::nullopt;
  }
  return host_stream_slot(shared_from_this(), index);
}

std::atomic<std::uint64_t>& host_event_page::counter(std::uint32_t index) const noexcept {
  return counters_in(mapping_)[index];
}

void host_event_page::give_back(std::uint32_t index) noexcept {
  std::lock_guard lock(mutex_);
  free_.push_back(index);  // cannot throw: room for every slot was reserved at construction
}

// ---- the importing side -------------------------------------------------------------

host_imported_page::host_imported_page(const event_source& source) {
  if (source.kind != event_source_kind::host_page || source.device != device_kind::host) {
    throw invalid_argument("open_event_source: the host device opens host_page sources only; this one comes from a " +
                           std::string(to_string(source.device)) + " device");
  }
  if (!source.fd) throw invalid_argument("open_event_source: the source has no file descriptor (closed, or moved from)");
  // The seals first: only a memfd has them, and asking a file of another
  // kind (a peer's FUSE file) could wait on its file system.
  const int seals = ::fcntl(source.fd.get(), F_GET_SEALS);
  struct stat st {};
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstat(source.fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
      !shoal::detail::on_tmpfs(source.fd.get())) {
    refuse("the descriptor is not a sealed memfd on tmpfs");
  }
  if (static_cast<std::uint64_t>(st.st_size) != page_bytes) {
    refuse("the page holds " + std::to_string(st.st_size) + " bytes, not " + std::to_string(page_bytes));
  }
  void* mapping = ::mmap(nullptr, page_bytes, PROT_READ, MAP_SHARED, source.fd.get(), 0);
  if (mapping == MAP_FAILED) throw os_error{errno, "mmap(imported event page)"};
  page_header header{};
  std::memcpy(&header, mapping, sizeof header);  // read once: the exporter could change it later
  if (const char* fault = header_fault(header, source.source_id)) {
    ::munmap(mapping, page_bytes);
    refuse(std::string("the page header has ") + fault);
  }
  mapping_ = mapping;
  source_id_ = header.source_id;
  exporter_pid_ = static_cast<pid_t>(header.exporter_pid);
  exporter_start_time_ = header.exporter_start_time;
}

host_imported_page::~host_imported_page() { ::munmap(const_cast<void*>(mapping_), page_bytes); }

void host_imported_page::check(const event_point& point) const {
  if (point.source_id != source_id_) {
    throw invalid_argument("wait_imported: the point belongs to event source " + std::to_string(point.source_id) +
                           ", but the source given is " + std::to_string(source_id_) +
                           "; open the point's own source and wait on that");
  }
  if (point.stream_slot >= host_event_page::slot_count) {
    throw invalid_argument("wait_imported: stream slot " + std::to_string(point.stream_slot) + " is past the page's " +
                           std::to_string(host_event_page::slot_count) + " slots");
  }
}

const std::atomic<std::uint64_t>& host_imported_page::counter(std::uint32_t index) const noexcept {
  return reinterpret_cast<const std::atomic<std::uint64_t>*>(static_cast<const std::byte*>(mapping_) + counters_offset)[index];
}

bool host_imported_page::passed(const event_point& point) const noexcept {
  // Acquire: whoever sees the count also sees the exporter's work before it.
  return counter(point.stream_slot).load(std::memory_order_acquire) >= point.ticket;
}

bool host_imported_page::exporter_alive() const {
  return is_alive({exporter_pid_, exporter_start_time_});
}

void host_imported_page::wait_until_passed(const event_point& point, std::chrono::milliseconds limit) const {
  // Points are often about to be passed when waited on: spin a little first.
  for (int spin = 0; spin < 64; ++spin) {
    if (passed(point)) return;
    std::this_thread::yield();
  }
  using clock = std::chrono::steady_clock;
  auto nap = std::chrono::microseconds(10);
  const auto deadline = clock::now() + limit;
  auto next_look = clock::now() + liveness_period;
  while (!passed(point)) {
    if (clock::now() >= deadline && !passed(point)) {
      throw stream_error("waiting on a point exported by process " + std::to_string(exporter_pid_) +
                         " (event source " + std::to_string(source_id_) + ", stream slot " +
                         std::to_string(point.stream_slot) + ", ticket " + std::to_string(point.ticket) +
                         "): that process lives but has not passed the point in " + std::to_string(limit.count()) +
                         " ms (its stream is at " +
                         std::to_string(counter(point.stream_slot).load(std::memory_order_acquire)) +
                         "); the wait gives up (host_device_options::peer_wait_limit)");
    }
    if (clock::now() >= next_look) {
      // Read once more after finding it dead: it may have passed the point
      // just before it died.
      if (!exporter_alive() && !passed(point)) {
        throw stream_error("waiting on a point exported by process " + std::to_string(exporter_pid_) +
                           " (event source " + std::to_string(source_id_) + ", stream slot " +
                           std::to_string(point.stream_slot) + ", ticket " + std::to_string(point.ticket) +
                           "): that process died with its stream at " +
                           std::to_string(counter(point.stream_slot).load(std::memory_order_acquire)) +
                           ", before passing the point, so what it was to produce is missing");
      }
      next_look = clock::now() + liveness_period;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, longest_nap);
  }
}

}  // namespace shoal::backend::detail
