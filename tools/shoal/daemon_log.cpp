#include "tools/shoal/daemon_log.h"

#include <poll.h>
#include <spdlog/details/null_mutex.h>
#include <spdlog/sinks/base_sink.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <iterator>
#include <thread>
#include <utility>
#include <vector>

namespace shoal::tools {

/// A log writer that could not write out its queue when the daemon stopped
/// (its reader stopped reading): kept for the rest of the process, blocked
/// where it is. A global with external linkage, so that a leak check scans it.
using kept_writer = std::pair<std::shared_ptr<spdlog::async_logger>, std::shared_ptr<spdlog::details::thread_pool>>;
kept_writer* volatile kept_log_writer = nullptr;  // NOLINT(cppcoreguidelines-avoid-non-const-global-variables)

namespace {

/// `text` as the body of a JSON string, in ASCII: a peer's bytes (a protocol
/// name in a refused hello) may be anything, and a log line must stay one
/// valid line, with no terminal control sequence in it.
std::string json_escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out;
}

}  // namespace

/// Writes formatted records to standard error. Only the async logger's one
/// worker thread calls it, and it may block there (never elsewhere).
class stderr_writer_sink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 public:
  /// Whether a record is being written now.
  [[nodiscard]] bool busy() const noexcept { return busy_.load(std::memory_order_acquire); }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    busy_.store(true, std::memory_order_release);
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    // write(2), not stdio: a write blocked on a reader that stopped reading
    // then holds no stdio lock that the process's exit would wait for. A
    // non-blocking stderr is waited for, so no line is cut; a reader that
    // went away (EPIPE) loses the record, as it would any other.
    for (std::size_t done = 0; done < line.size();) {
      const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EAGAIN) {
        pollfd writable{STDERR_FILENO, POLLOUT, 0};
        (void)::poll(&writable, 1, -1);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        break;
      }
    }
    busy_.store(false, std::memory_order_release);
  }
  void flush_() override {}  // nothing is buffered here

 private:
  std::atomic<bool> busy_{false};
};

log_field number(const char* key, std::uint64_t value) { return {key, std::to_string(value), true}; }

daemon_log::daemon_log(bool json)
    : json_(json),
      workers_(std::make_shared<spdlog::details::thread_pool>(log_queue_records, 1)),
      sink_(std::make_shared<stderr_writer_sink>()),
      logger_(std::make_shared<spdlog::async_logger>("shoal-daemon", sink_, workers_,
                                                     spdlog::async_overflow_policy::overrun_oldest)) {
  logger_->set_pattern(json ? R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l",%v})"
                            : "%Y-%m-%dT%H:%M:%S.%e%z %l %v");
  // spdlog's own handler writes to stderr under a lock: it could block the
  // caller where the log was to be queued. A failed record is counted.
  logger_->set_error_handler(
      [failed = failed_](const std::string&) { failed->fetch_add(1, std::memory_order_relaxed); });
}

daemon_log::~daemon_log() {
  const auto until = std::chrono::steady_clock::now() + drain_deadline;
  while (!drained() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (drained()) return;
  // Never joined: its pool's destructor would. A volatile store, which no
  // compiler drops, so a leak check finds the writer reachable at exit.
  kept_log_writer = new kept_writer(logger_, workers_);
}

std::uint64_t daemon_log::dropped() const {
  return workers_->overrun_counter() + failed_->load(std::memory_order_relaxed);
}

void daemon_log::write(spdlog::level::level_enum level, std::span<const log_field> fields) {
  if (const std::uint64_t lost = dropped(); reported_.exchange(lost) != lost) {
    const log_field said[] = {{"event", "log_records_dropped"}, number("records", lost),
                              {"detail", "the log's reader fell behind; the oldest records were dropped"}};
    logger_->log(spdlog::level::warn, "{}", line_of(said));
  }
  logger_->log(level, "{}", line_of(fields));
}

std::string daemon_log::line_of(std::span<const log_field> fields) const {
  // A value bare in text only when it is printable ASCII with no space, quote
  // or '=' (and not empty); else quoted and escaped.
  const auto quoted = [](const std::string& value) {
    const bool bare = !value.empty() && std::all_of(value.begin(), value.end(), [](char c) {
      return c > 0x20 && c < 0x7f && c != '"' && c != '=';
    });
    return bare ? value : "\"" + json_escaped(value) + "\"";
  };
  std::string line;
  for (const auto& [key, value, is_number] : fields) {
    if (!line.empty()) line += json_ ? "," : " ";
    if (json_) {
      line += "\"" + std::string(key) + "\":" + (is_number ? value : "\"" + json_escaped(value) + "\"");
    } else {
      line += std::string(key) + "=" + quoted(value);
    }
  }
  return line;
}

bool daemon_log::drained() const {
  // Seen twice a moment apart: the writer takes a record off the queue a
  // moment before it starts on it.
  const auto idle = [&] { return workers_->queue_size() == 0 && !sink_->busy(); };
  if (!idle()) return false;
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return idle();
}

void log_lender_event(daemon_log& log, const lending::lender_event& e) {
  const bool warning =
      e.what == lending::lender_event::kind::closed_for_error || e.what == lending::lender_event::kind::orphaned;
  const std::initializer_list<log_field> fields{{"event", lending::to_string(e.what)},
                                                number("pid", static_cast<std::uint64_t>(e.borrower.pid)),
                                                number("uid", e.uid),
                                                number("region", e.region),
                                                number("bytes", e.bytes),
                                                {"detail", e.detail}};
  warning ? log.warn(fields) : log.info(fields);
}

log_rate_limit::log_rate_limit(daemon_log& log, std::uint64_t records_per_second)
    : log_(log),
      rate_(static_cast<double>(records_per_second)),
      burst_(static_cast<double>(records_per_second) * static_cast<double>(burst_seconds)) {}

void log_rate_limit::refill(entry& e, clock::time_point now) const {
  if (now <= e.refilled) return;
  e.tokens = std::min(burst_, e.tokens + std::chrono::duration<double>(now - e.refilled).count() * rate_);
  e.refilled = now;
}

void log_rate_limit::summarize(pid_t pid, entry& e, const char* reason) {
  if (e.pending == 0) return;
  std::vector<log_field> fields{{"event", "log_records_suppressed"},
                                number("pid", static_cast<std::uint64_t>(pid)),
                                number("uid", e.uid),
                                number("records", e.pending),
                                {"reason", reason}};
  for (std::size_t k = 0; k < kinds; ++k) {
    if (e.left_out[k] != 0) {
      fields.push_back(number(lending::to_string(static_cast<lending::lender_event::kind>(k)), e.left_out[k]));
    }
  }
  // Counted as said before it is written: were the write to throw (no
  // memory), the count would not be said twice.
  e.pending = 0;
  std::fill(std::begin(e.left_out), std::end(e.left_out), 0);
  log_.warn(fields);
}

std::map<log_rate_limit::key, log_rate_limit::entry>::iterator log_rate_limit::find_or_add(
    const lending::lender_event& e, clock::time_point now) {
  const key k{e.borrower.pid, e.borrower.start_time};
  if (const auto it = entries_.find(k); it != entries_.end()) return it;
  if (entries_.size() >= max_tracked) tick(now);
  if (entries_.size() >= max_tracked) {
    // A crowd of borrowers each with a record left out or a bucket not yet
    // full: the one seen longest ago goes, its count said first. It starts
    // afresh if it comes back.
    const auto oldest = std::min_element(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
      return a.second.seen < b.second.seen;
    });
    summarize(oldest->first.first, oldest->second, "evicted");
    entries_.erase(oldest);
  }
  entry fresh;
  fresh.tokens = burst_;
  fresh.refilled = now;
  return entries_.emplace(k, fresh).first;
}

void log_rate_limit::record(const lending::lender_event& e, clock::time_point now) {
  using kind = lending::lender_event::kind;
  if (rate_ == 0 || e.what == kind::closed_for_error || e.what == kind::orphaned) {
    log_lender_event(log_, e);
    return;
  }
  const auto it = find_or_add(e, now);
  entry& b = it->second;
  b.seen = now;
  b.uid = e.uid;
  refill(b, now);
  if (b.pending != 0 && now - b.first_left_out >= summary_interval) summarize(e.borrower.pid, b, "interval");
  if (b.tokens >= 1) {
    b.tokens -= 1;
    // Its summary first when it disconnects: the last of its records then.
    if (e.what == kind::disconnected) summarize(e.borrower.pid, b, "disconnected");
    log_lender_event(log_, e);
    return;
  }
  if (b.pending == 0) b.first_left_out = now;
  ++b.pending;
  ++suppressed_;
  if (const auto k = static_cast<std::size_t>(e.what); k < kinds) ++b.left_out[k];
  if (e.what == kind::disconnected) summarize(e.borrower.pid, b, "disconnected");
}

void log_rate_limit::tick(clock::time_point now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    entry& b = it->second;
    refill(b, now);
    if (b.pending != 0 && now - b.first_left_out >= summary_interval) summarize(it->first.first, b, "interval");
    // Full and with nothing to say: no different from no entry at all.
    it = b.pending == 0 && b.tokens >= burst_ ? entries_.erase(it) : std::next(it);
  }
}

void log_rate_limit::flush() {
  for (auto& [k, b] : entries_) summarize(k.first, b, "stopping");
}

}  // namespace shoal::tools
