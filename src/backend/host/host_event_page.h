// The page through which host streams tell other processes how far they
// have run: the host backend's event source (event_source_kind::host_page).
//
// One page per host device: a sealed memfd holding a header (magic, version,
// slot count, source id, and the exporter's pid and start time, so an
// importer can tell when the exporter died) and an array of 64-bit counters,
// one slot per stream. A stream's completed-work counter lives in its slot,
// so a point {slot, ticket} is passed once counter[slot] >= ticket.
//
// Invariant: a slot's counter only grows. A slot given back by a destroyed
// stream keeps the count that stream left, and the next stream on the slot
// numbers its work on from there, so a point once passed stays passed.
//
// The exporter maps the page read-write before sealing it against further
// writable mappings (F_SEAL_FUTURE_WRITE): importers map it read-only and
// cannot move another process's counters.
//
// Thread-safety: all members may be called from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "shoal/backend/shareable_event.h"
#include "shoal/core/process_identity.h"
#include "shoal/core/unique_fd.h"

namespace shoal::backend::detail {

class host_event_page;

/// One stream's slot in a page, held while the stream lives; given back
/// when destroyed. Move-only.
class host_stream_slot {
 public:
  host_stream_slot(std::shared_ptr<host_event_page> page, std::uint32_t index) noexcept;
  host_stream_slot(host_stream_slot&&) noexcept = default;
  host_stream_slot& operator=(host_stream_slot&&) = delete;
  ~host_stream_slot();

  [[nodiscard]] std::uint32_t index() const noexcept { return index_; }
  [[nodiscard]] std::uint64_t source_id() const noexcept;
  /// The slot's counter, in the shared page.
  [[nodiscard]] std::atomic<std::uint64_t>& counter() const noexcept;

 private:
  std::shared_ptr<host_event_page> page_;  // null once moved from
  std::uint32_t index_;
};

/// The exporting side: owns the memfd and its read-write mapping.
class host_event_page : public std::enable_shared_from_this<host_event_page> {
 public:
  static constexpr std::uint32_t slot_count = 4096;

  /// A new page with every counter at 0. Throws backend_error when the
  /// system refuses (no memfd, no /proc/self/stat).
  [[nodiscard]] static std::shared_ptr<host_event_page> create();
  ~host_event_page();
  host_event_page(const host_event_page&) = delete;
  host_event_page& operator=(const host_event_page&) = delete;

  [[nodiscard]] std::uint64_t source_id() const noexcept { return source_id_; }
  /// A free slot for a new stream, or nothing when all are leased.
  [[nodiscard]] std::optional<host_stream_slot> lease();
  /// A new descriptor of the page, for another process.
  [[nodiscard]] unique_fd share() const { return fd_.duplicate(); }

 private:
  friend class host_stream_slot;
  host_event_page(unique_fd fd, void* mapping, std::uint64_t source_id);
  [[nodiscard]] std::atomic<std::uint64_t>& counter(std::uint32_t index) const noexcept;
  void give_back(std::uint32_t index) noexcept;

  const unique_fd fd_;
  void* const mapping_;
  const std::uint64_t source_id_;
  std::mutex mutex_;
  std::vector<std::uint32_t> free_;  // guarded by mutex_; slots given back
  std::uint32_t never_leased_ = 0;   // guarded by mutex_; slots >= this were never leased
};

/// The importing side: another process's page, mapped read-only.
class host_imported_page {
 public:
  /// Maps and checks the page `source` describes. Throws invalid_argument
  /// when it is not a host page or the descriptor is not a sealed shoal
  /// counter page of the size and id the source claims.
  explicit host_imported_page(const event_source& source);
  ~host_imported_page();
  host_imported_page(const host_imported_page&) = delete;
  host_imported_page& operator=(const host_imported_page&) = delete;

  [[nodiscard]] std::uint64_t source_id() const noexcept { return source_id_; }
  /// The exporter the page's header names (as read once, when opened).
  [[nodiscard]] process_identity exporter() const noexcept { return {exporter_pid_, exporter_start_time_}; }
  /// Throws invalid_argument unless `point` is of this page and one of its slots.
  void check(const event_point& point) const;
  /// True once the exporting stream has passed `point` (checked already).
  [[nodiscard]] bool passed(const event_point& point) const noexcept;
  /// Returns once `point` (checked already) is passed: spins briefly, then
  /// sleeps in growing naps, looking every ~10 ms whether the exporter still
  /// lives. Throws stream_error when it died before passing the point.
  /// Throws stream_error when the exporter dies before the point, or has not
  /// passed it within `limit`.
  void wait_until_passed(const event_point& point, std::chrono::milliseconds limit) const;

 private:
  [[nodiscard]] const std::atomic<std::uint64_t>& counter(std::uint32_t index) const noexcept;
  [[nodiscard]] bool exporter_alive() const;

  const void* mapping_ = nullptr;
  std::uint64_t source_id_ = 0;
  pid_t exporter_pid_ = 0;
  std::uint64_t exporter_start_time_ = 0;
};

}  // namespace shoal::backend::detail
