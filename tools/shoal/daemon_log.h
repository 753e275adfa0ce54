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
#pragma once

#include <spdlog/async.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

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
  void info(std::initializer_list<log_field> fields) { write(spdlog::level::info, fields); }
  void warn(std::initializer_list<log_field> fields) { write(spdlog::level::warn, fields); }

  /// Records lost so far: dropped, the queue being full, or failed.
  [[nodiscard]] std::uint64_t dropped() const;

 private:
  void write(spdlog::level::level_enum level, std::initializer_list<log_field> fields);
  [[nodiscard]] std::string line_of(std::initializer_list<log_field> fields) const;
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

}  // namespace shoal::tools
