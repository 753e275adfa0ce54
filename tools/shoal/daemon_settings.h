// The memory daemon's settings: a TOML file and command-line flags (flags
// win), turned into what the lender needs. Parsing is separate from running
// so that a bad setting is reported before anything starts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/channel/channel.h"
#include "shoal/lending/lender.h"

namespace shoal::tools {

/// A size as written by a person: bytes ("1048576"), with a unit ("512MiB",
/// "12GiB", "2TiB", "64KiB"), or a fraction of the device's memory ("0.8",
/// "5e-1").
struct size_setting {
  std::string text;
  /// The bytes it stands for on `device`. Throws invalid_argument naming
  /// `what` when the text is none of the forms above.
  [[nodiscard]] std::size_t bytes(backend::device& device, const char* what) const;
  /// bytes(), refused as well (invalid_argument) below one chunk of the
  /// device: the lender rounds regions up to whole chunks, so a capacity or
  /// quota smaller than one would refuse every borrow.
  [[nodiscard]] std::size_t lendable_bytes(backend::device& device, const char* what) const;
};

struct daemon_settings {
  std::string socket;              ///< a path, or "@name"; empty: lender.sock in $XDG_RUNTIME_DIR
  std::string device = "default";  ///< "default", "host", "cuda" or "cuda:N"
  size_setting capacity{"0.9"};
  size_setting quota{"1.0"};
  size_setting quota_per_uid{"none"};  ///< "none": no per-uid quota
  std::uint64_t max_borrowers = 64;
  std::uint64_t max_observers = 4;  ///< lender_config::max_observers
  std::uint64_t max_connections_per_uid = 0;  ///< lender_config::max_connections_per_uid (0: no cap)
  std::uint64_t max_regions_per_borrower = 1024;
  std::uint64_t peer_timeout_ms = 1000;
  std::uint64_t max_wait_ms = 300000;  ///< lender_config::max_wait
  /// lender_config::preempt_after (0: at once); empty: no preemption.
  std::optional<std::uint64_t> preempt_after_ms;
  std::uint64_t preempt_deadline_ms = 10000;  ///< lender_config::preempt_deadline
  std::vector<std::uint32_t> allowed_uids;
  std::vector<std::uint32_t> allowed_gids;
  std::string log_format = "text";  ///< "text" or "json"
  std::string reuse = "same_uid";   ///< "same_uid" or "never" (lender_config::reuse)
  /// Chunks made when the daemon starts (lender_config::prepared_chunks):
  /// each a size_setting ("1GiB", "0.25") or COUNTxSIZE ("4x1GiB").
  std::vector<std::string> prepare;
  /// The loopback HTTP metrics endpoint's port on 127.0.0.1 (0: a free one,
  /// named in the log); -1: no endpoint.
  std::int32_t metrics_port = -1;
  /// Routine log records a second per borrower process (log_rate_limit,
  /// daemon_log.h); 0: no limit. 20 a second is ~3 KB/s of text for a
  /// borrower that floods without end (~250 MB a day, against ~2 MB/s
  /// unlimited), and more than a borrower that works needs: a training
  /// loop borrowing and giving back each step at 10 steps a second.
  std::uint64_t log_rate = 20;
  static constexpr std::uint64_t max_log_rate = 1'000'000;
  /// The largest count or millisecond setting taken, from a flag or the file.
  static constexpr std::int64_t max_count = std::int64_t{1} << 32;

  /// Reads a TOML file's keys (socket, device, capacity, quota,
  /// quota_per_uid, max_borrowers, max_observers, max_connections_per_uid, max_regions_per_borrower, peer_timeout_ms,
  /// max_wait_ms, preempt_after_ms, preempt_deadline_ms, allowed_uids, allowed_gids, log_format, log_rate, metrics_port, reuse, prepare: a
  /// string or a list of them) into these
  /// settings. Throws
  /// invalid_argument naming the file, the key and what was wrong.
  void read_file(const std::string& path);

  [[nodiscard]] backend::device& resolve_device() const;
  /// Whether `socket` names an abstract socket ("@name").
  [[nodiscard]] bool abstract_socket() const;
  [[nodiscard]] channel::channel_address resolve_address() const;
  /// The lender's config (without on_event). Throws invalid_argument for a
  /// value out of range, and for other users admitted at a socket path
  /// (its 0700 directory keeps them out: an abstract socket serves them).
  [[nodiscard]] lending::lender_config lender_config(backend::device& device) const;
};

}  // namespace shoal::tools
