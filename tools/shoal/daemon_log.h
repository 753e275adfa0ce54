// The daemon's log: records on standard error, one line each, as text
// (`time level key=value ...`) or JSON (one object per line, numbers as
// numbers). The lender's serving thread logs each event, so a record is
// queued, never written on the caller's thread: a reader that stops reading
// (a full pipe, a paused terminal, a slow journal) cannot stall the lender,
// nor the stop after a signal. The queue holds log_queue_records; past that
// the oldest records are dropped, counted (dropped()), and said in a record
// of their own at the next record after a drop.
//
// Thread-safety: info, warn and dropped may be called from any thread at once.
//
// log_rate_limit keeps one borrower from filling the disk through this log:
// see it below.
#pragma once

#include <spdlog/async.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "shoal/lending/lending_types.h"

namespace shoal::tools {

/// One field of a log record; a number is written unquoted in JSON.
struct log_field {
  const char* key;
  std::string value;
  bool number = false;
};

[[nodiscard]] log_field number(const char* key, std::uint64_t value);

class stderr_writer_sink;

class daemon_log {
 public:
  static constexpr std::size_t log_queue_records = 8192;
  /// How long the end waits for the queued records to be written.
  static constexpr std::chrono::seconds drain_deadline{2};

  explicit daemon_log(bool json);
  /// Waits up to drain_deadline for the queued records to be written. When
  /// they are not (the reader stopped reading), the writer thread is left
  /// blocked where it is, never joined, and ends with the process.
  ~daemon_log();
  daemon_log(const daemon_log&) = delete;
  daemon_log& operator=(const daemon_log&) = delete;

  /// A record of `fields`: in JSON, numbers as numbers and the rest as strings.
  void info(std::initializer_list<log_field> fields) { write(spdlog::level::info, {fields.begin(), fields.size()}); }
  void warn(std::initializer_list<log_field> fields) { write(spdlog::level::warn, {fields.begin(), fields.size()}); }
  /// A record of fields counted at run time.
  void warn(std::span<const log_field> fields) { write(spdlog::level::warn, fields); }

  /// Records lost so far: dropped, the queue being full, or failed.
  [[nodiscard]] std::uint64_t dropped() const;

 private:
  void write(spdlog::level::level_enum level, std::span<const log_field> fields);
  [[nodiscard]] std::string line_of(std::span<const log_field> fields) const;
  /// Nothing queued and nothing being written.
  [[nodiscard]] bool drained() const;

  bool json_;
  std::shared_ptr<spdlog::details::thread_pool> workers_;
  std::shared_ptr<stderr_writer_sink> sink_;
  std::shared_ptr<spdlog::async_logger> logger_;
  // Shared with the error handler, which a kept logger may call after this is gone.
  std::shared_ptr<std::atomic<std::uint64_t>> failed_ = std::make_shared<std::atomic<std::uint64_t>>(0);
  std::atomic<std::uint64_t> reported_{0};  // dropped() when last said in the log
};

/// The lender's record of `e` (event, pid, uid, region, bytes, detail); a
/// warning for closed_for_error and orphaned.
void log_lender_event(daemon_log& log, const lending::lender_event& e);

/// A rate limit per borrower process on the lender's routine records. A
/// borrower looping on borrow and give-back, or sending requests that are
/// refused, makes the lender log a record each time: ~2 MB/s, which fills a
/// disk where standard error goes to a file. Each borrower process (pid and
/// start time: a pid reused by a new process is a new borrower; every
/// connection of one process shares it) has a token bucket of
/// `burst_seconds` of records at `records_per_second`. A record past it is not
/// written but counted by its event, and a `log_records_suppressed` record
/// says how many of that borrower's were (`records`, and a count for each
/// event) within `summary_interval` of the first one it leaves out, when it
/// disconnects, and when the daemon stops: records written and records
/// counted in summaries add up to the records the lender made.
///
/// Events of no borrower (a connection refused before its hello, a spare
/// chunk released) share one bucket, said as pid 0: a flood of connection
/// attempts is bounded like any borrower's records.
///
/// Never suppressed: warnings (closed_for_error, orphaned), which an operator
/// must see and which a borrower cannot repeat quickly (its connection
/// closes), and the daemon's own records, which do not pass here.
///
/// The state is bounded: an entry whose bucket is full again and that has
/// nothing to report is dropped (tick: it says no more than no entry would),
/// and the table holds at most `max_tracked` entries (past that the one seen
/// longest ago is evicted, its summary written first). A borrower that
/// disconnects gets its summary then, but its entry is dropped only once its
/// bucket refills: a process that reconnects in a loop would get a fresh
/// burst each time otherwise.
///
/// Not thread-safe: the daemon calls it under the lock that orders its records.
class log_rate_limit {
 public:
  using clock = std::chrono::steady_clock;
  /// The bucket holds this many seconds of records: 200 at the default 20/s,
  /// so a borrower's start (its connection and some hundred regions lent)
  /// is logged whole, and a burst of work after a quiet while too.
  static constexpr std::uint64_t burst_seconds = 10;
  /// A borrower's summary is written at most this long after the first
  /// record it leaves out: a borrower that floods without end gets one
  /// summary record per 5 s, and its count is never long out of the log.
  static constexpr std::chrono::seconds summary_interval{5};
  /// Borrower processes tracked at once: far past the lender's connections
  /// (max_borrowers of each class plus max_observers), so only a crowd of
  /// short-lived processes, each of its own, fills it. ~200 bytes an entry.
  static constexpr std::size_t max_tracked = 4096;

  /// records_per_second 0: no limit (every record written, nothing tracked).
  log_rate_limit(daemon_log& log, std::uint64_t records_per_second);

  /// Writes `e`'s record unless its borrower is past its limit (then counts
  /// it); writes the borrower's summary when it is due, and after its
  /// disconnected event.
  void record(const lending::lender_event& e, clock::time_point now);
  /// Writes the summaries that are due and drops the entries that say
  /// nothing. Called every second or so, so that a borrower that went quiet
  /// still gets its summary.
  void tick(clock::time_point now);
  /// Writes every pending summary (the daemon stops).
  void flush();
  /// Records suppressed since the start.
  [[nodiscard]] std::uint64_t suppressed() const noexcept { return suppressed_; }
  /// Borrowers tracked now.
  [[nodiscard]] std::size_t tracked() const noexcept { return entries_.size(); }

 private:
  static constexpr std::size_t kinds = static_cast<std::size_t>(lending::lender_event::kind::waiting) + 1;
  struct entry {
    double tokens = 0;
    clock::time_point refilled;   // when tokens was last brought up to date
    clock::time_point seen;       // its last record
    clock::time_point first_left_out;  // the first record counted in `left_out` (while pending)
    uid_t uid = 0;
    std::uint64_t pending = 0;    // records left out since the last summary
    std::uint64_t left_out[kinds] = {};  // of those, by event
  };
  using key = std::pair<pid_t, std::uint64_t>;  // process_identity: pid, start time

  void refill(entry& e, clock::time_point now) const;
  void summarize(pid_t pid, entry& e, const char* reason);
  std::map<key, entry>::iterator find_or_add(const lending::lender_event& e, clock::time_point now);

  daemon_log& log_;
  double rate_;   // records per second; 0: no limit
  double burst_;  // the bucket's size
  std::map<key, entry> entries_;
  std::uint64_t suppressed_ = 0;
};

}  // namespace shoal::tools
