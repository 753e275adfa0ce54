#include "tools/shoal/daemon_settings.h"

#include <toml++/toml.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "shoal/backend/devices.h"
#include "shoal/core/error.h"

namespace shoal::tools {

namespace {

struct unit {
  const char* suffix;
  std::size_t bytes;
};
constexpr unit units[] = {{"KiB", std::size_t{1} << 10},
                          {"MiB", std::size_t{1} << 20},
                          {"GiB", std::size_t{1} << 30},
                          {"TiB", std::size_t{1} << 40}};

[[noreturn]] void bad(const char* what, const std::string& text, const char* expected) {
  throw invalid_argument(std::string(what) + ": '" + text + "' is not " + expected);
}

// `bytes` in the largest unit that holds it whole ("2MiB"), else in bytes.
std::string size_text(std::size_t bytes) {
  for (auto u = std::rbegin(units); u != std::rend(units); ++u) {
    if (bytes != 0 && bytes % u->bytes == 0) return std::to_string(bytes / u->bytes) + u->suffix;
  }
  return std::to_string(bytes);
}

// A TOML float as its shortest exact text ("1e-10", not to_string's
// "0.000000"), always read as a fraction: 1.0 is the whole device, not 1 byte.
std::string fraction_text(double value) {
  char text[32];  // holds any double's shortest text
  std::string out(std::begin(text), std::to_chars(std::begin(text), std::end(text), value).ptr);
  if (std::isfinite(value) && out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

// The chunk sizes of one prepare entry: SIZE, or COUNTxSIZE. Refused before
// they are listed when all entries so far (`granules`, each chunk rounded up
// to the device's granularity) would hold more than `capacity`, so the list
// stays that short however many entries a file has.
void add_prepared(const std::string& entry, backend::device& device, std::size_t capacity, std::size_t& granules,
                  std::vector<std::size_t>& sizes) {
  const auto times = entry.find('x');
  std::uint64_t count = 1;
  if (times != std::string::npos) {
    const auto [end, ec] = std::from_chars(entry.data(), entry.data() + times, count);
    if (ec != std::errc() || end != entry.data() + times || count == 0 || count > 1'000'000) {
      bad("prepare", entry, "SIZE or COUNTxSIZE with a COUNT of 1 to 1000000 (like 4x1GiB)");
    }
  }
  const size_setting size{entry.substr(times == std::string::npos ? 0 : times + 1)};
  const std::size_t bytes = size.bytes(device, "prepare");
  const std::size_t granularity = std::max<std::size_t>(device.granularity(), 1);
  const auto rounded = [&](std::size_t b) { return b / granularity + (b % granularity != 0 ? 1 : 0); };
  const std::size_t room = capacity / granularity - std::min(granules, capacity / granularity);
  if (rounded(bytes) == 0 || count > room / rounded(bytes)) {
    throw invalid_argument("prepare: '" + entry + "' with the entries before it holds more than the capacity (" +
                           std::to_string(capacity) + " bytes, each chunk rounded up to " +
                           std::to_string(granularity) + ")");
  }
  granules += count * rounded(bytes);
  sizes.insert(sizes.end(), count, bytes);
}

}  // namespace

std::size_t size_setting::bytes(backend::device& device, const char* what) const {
  constexpr const char* forms = "a size: bytes, a number with KiB, MiB, GiB or TiB, or a fraction like 0.8";
  if (text.find_first_of(".eE") != std::string::npos) {  // 0.8, 5e-1; no unit holds an e
    double fraction = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), fraction);
    if (ec == std::errc() && end != text.data() + text.size()) {
      for (auto u = std::begin(units); u != std::end(units); ++u) {
        if (std::string_view(end) != u->suffix) continue;
        // "1.5GiB": a number with a unit is whole; name the smaller unit that holds it whole.
        std::string whole = "a whole number of a smaller unit";
        const double smaller = fraction * 1024;
        if (smaller > 0 && smaller < 0x1p53 && std::floor(smaller) == smaller) {
          whole = std::to_string(static_cast<std::uint64_t>(smaller)) + (u == std::begin(units) ? "" : (u - 1)->suffix);
        }
        bad(what, text, ("a size: a number with a unit is whole (write " + whole + ")").c_str());
      }
    }
    if (ec != std::errc() || end != text.data() + text.size() || !(fraction > 0) || fraction > 1) {
      bad(what, text, "a fraction in (0, 1] of the device's memory");
    }
    return static_cast<std::size_t>(std::floor(fraction * static_cast<double>(device.memory().total_bytes)));
  }
  std::uint64_t number = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc() || end == text.data() || number == 0) bad(what, text, forms);
  const std::string_view rest(end, static_cast<std::size_t>(text.data() + text.size() - end));
  std::size_t scale = 1;
  if (!rest.empty()) {
    scale = 0;
    for (const auto& u : units) {
      if (rest == u.suffix) scale = u.bytes;
    }
    if (scale == 0) bad(what, text, forms);
  }
  if (number > std::numeric_limits<std::size_t>::max() / scale) bad(what, text, "a size that fits in 64 bits");
  return static_cast<std::size_t>(number) * scale;
}

std::size_t size_setting::lendable_bytes(backend::device& device, const char* what) const {
  const std::size_t given = bytes(device, what);
  const std::size_t chunk = std::max<std::size_t>(device.granularity(), 1);
  if (given < chunk) {
    throw invalid_argument(std::string(what) + ": '" + text + "' is " + std::to_string(given) +
                           " bytes, less than one chunk of the device (" + std::to_string(chunk) +
                           " bytes), which would refuse every borrow; the smallest accepted value is " +
                           size_text(chunk) + " (a fraction of the device's memory is written with a point, like 1.0)");
  }
  return given;
}

void daemon_settings::read_file(const std::string& path) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw invalid_argument("config file " + path + ": " + std::string(e.description()) + " (line " +
                           std::to_string(e.source().begin.line) + ")");
  }
  const auto where = [&](std::string_view key) { return "config file " + path + ": key '" + std::string(key) + "'"; };
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    const auto text = [&]() {
      if (const auto* s = node.as_string()) return s->get();
      if (const auto* i = node.as_integer()) return std::to_string(i->get());
      if (const auto* f = node.as_floating_point()) return fraction_text(f->get());
      throw invalid_argument(where(name) + " must be a string or a number");
    };
    // The flags' range (the lender refuses milliseconds past its own ranges).
    const auto count = [&]() -> std::uint64_t {
      const auto* i = node.as_integer();
      if (i == nullptr || i->get() <= 0 || i->get() > max_count) {
        throw invalid_argument(where(name) + " must be an integer 1 to " + std::to_string(max_count));
      }
      return static_cast<std::uint64_t>(i->get());
    };
    if (name == "socket") {
      socket = text();
    } else if (name == "device") {
      device = text();
    } else if (name == "capacity") {
      capacity.text = text();
    } else if (name == "quota") {
      quota.text = text();
    } else if (name == "quota_per_uid") {
      quota_per_uid.text = text();
    } else if (name == "max_borrowers") {
      max_borrowers = count();
    } else if (name == "max_observers") {
      max_observers = count();
    } else if (name == "max_connections_per_uid") {
      const auto* i = node.as_integer();
      if (i == nullptr || i->get() < 0 || i->get() > max_count) {
        throw invalid_argument(where(name) + " must be an integer 0 to " + std::to_string(max_count) + " (0: no cap)");
      }
      max_connections_per_uid = static_cast<std::uint64_t>(i->get());
    } else if (name == "max_regions_per_borrower") {
      max_regions_per_borrower = count();
    } else if (name == "peer_timeout_ms") {
      peer_timeout_ms = count();
    } else if (name == "max_wait_ms") {
      max_wait_ms = count();
    } else if (name == "preempt_after_ms") {
      const auto* i = node.as_integer();
      const auto* s = node.as_string();
      if (s != nullptr && s->get() == "off") {
        preempt_after_ms.reset();
      } else if (i != nullptr && i->get() >= 0) {
        preempt_after_ms = static_cast<std::uint64_t>(i->get());
      } else {
        throw invalid_argument(where(name) + " must be an integer >= 0 (0: at once) or \"off\"");
      }
    } else if (name == "preempt_deadline_ms") {
      preempt_deadline_ms = count();
    } else if (name == "log_format") {
      log_format = text();
    } else if (name == "reuse") {
      reuse = text();
    } else if (name == "prepare") {
      prepare.clear();
      if (const auto* list = node.as_array()) {
        for (const auto& item : *list) {
          const auto* entry = item.as_string();
          if (entry == nullptr) throw invalid_argument(where(name) + " must hold strings like \"4x1GiB\"");
          prepare.push_back(entry->get());
        }
      } else {
        prepare.push_back(text());
      }
    } else if (name == "metrics_port") {
      const auto* port = node.as_integer();
      if (port == nullptr || port->get() < 0 || port->get() > 65535) {
        throw invalid_argument(where(name) + " must be a port (an integer 0 to 65535; 0: a free one)");
      }
      metrics_port = static_cast<std::int32_t>(port->get());
    } else if (name == "log_rate") {
      const auto* rate = node.as_integer();
      if (rate == nullptr || rate->get() < 0 || static_cast<std::uint64_t>(rate->get()) > max_log_rate) {
        throw invalid_argument(where(name) + " must be an integer 0 to " + std::to_string(max_log_rate) +
                               " (records a second per borrower; 0: no limit)");
      }
      log_rate = static_cast<std::uint64_t>(rate->get());
    } else if (name == "allowed_uids" || name == "allowed_gids") {
      const auto* list = node.as_array();
      if (list == nullptr) throw invalid_argument(where(name) + " must be a list of ids");
      auto& ids = name == "allowed_uids" ? allowed_uids : allowed_gids;
      ids.clear();
      for (const auto& item : *list) {
        const auto* id = item.as_integer();
        if (id == nullptr || id->get() < 0 || id->get() > std::numeric_limits<std::uint32_t>::max()) {
          throw invalid_argument(where(name) + " must hold ids (integers 0 to 4294967295)");
        }
        ids.push_back(static_cast<std::uint32_t>(id->get()));
      }
    } else {
      throw invalid_argument(where(name) +
                             " is not a setting (socket, device, capacity, quota, quota_per_uid, max_borrowers, "
                             "max_observers, max_connections_per_uid, max_regions_per_borrower, peer_timeout_ms, "
                             "max_wait_ms, preempt_after_ms, "
                             "preempt_deadline_ms, allowed_uids, allowed_gids, log_format, log_rate, metrics_port, "
                             "reuse, prepare)");
    }
  }
}

backend::device& daemon_settings::resolve_device() const {
  if (device == "host") return backend::host_device_instance();
  try {
    if (device == "default") return backend::default_device();
    if (device == "cuda") return backend::cuda_device_instance(0);
    if (device.rfind("cuda:", 0) == 0) {
      int ordinal = -1;
      const auto* first = device.data() + 5;
      const auto [end, ec] = std::from_chars(first, device.data() + device.size(), ordinal);
      if (ec == std::errc() && end == device.data() + device.size() && ordinal >= 0) {
        return backend::cuda_device_instance(ordinal);
      }
    }
  } catch (const device_unavailable& e) {
    // The device layer's advice names the environment variable; the daemon's
    // own setting is the flag (or the TOML key).
    throw device_unavailable(std::string(e.what()) + " (for the daemon: --device host, or device = \"host\")");
  }
  throw invalid_argument("device: '" + device + "' is not default, host, cuda or cuda:N");
}

bool daemon_settings::abstract_socket() const { return !socket.empty() && socket.front() == '@'; }

channel::channel_address daemon_settings::resolve_address() const {
  if (socket.empty()) return channel::channel_address::in_runtime_dir("lender.sock");
  if (abstract_socket()) return channel::channel_address::abstract(socket.substr(1));
  return channel::channel_address::at_path(socket);
}

lending::lender_config daemon_settings::lender_config(backend::device& d) const {
  if (log_format != "text" && log_format != "json") {
    throw invalid_argument("log_format: '" + log_format + "' is not text or json");
  }
  if (log_rate > max_log_rate) {
    throw invalid_argument("log_rate: " + std::to_string(log_rate) + " is past " + std::to_string(max_log_rate));
  }
  if (reuse != "same_uid" && reuse != "never") {
    throw invalid_argument("reuse: '" + reuse + "' is not same_uid or never");
  }
  lending::lender_config c;
  c.reuse = reuse == "never" ? lending::reuse_policy::never : lending::reuse_policy::same_uid;
  c.capacity_bytes = capacity.lendable_bytes(d, "capacity");
  if (const std::size_t total = d.memory().total_bytes; c.capacity_bytes > total) {
    // Lending what the device does not have fails later, borrow by borrow.
    throw invalid_argument("capacity: " + capacity.text + " is " + std::to_string(c.capacity_bytes) +
                           " bytes, more than the device's memory of " + std::to_string(total) +
                           "; give at most that, or a fraction like 0.9");
  }
  c.quota_bytes = quota.lendable_bytes(d, "quota");
  c.quota_bytes_per_uid = quota_per_uid.text == "none" ? 0 : quota_per_uid.lendable_bytes(d, "quota_per_uid");
  std::size_t granules = 0;  // the prepared chunks', in the device's granularity
  for (const auto& entry : prepare) add_prepared(entry, d, c.capacity_bytes, granules, c.prepared_chunks);
  c.max_borrowers = static_cast<std::size_t>(max_borrowers);
  c.max_observers = static_cast<std::size_t>(max_observers);
  c.max_connections_per_uid = static_cast<std::size_t>(max_connections_per_uid);
  c.max_regions_per_borrower = static_cast<std::size_t>(max_regions_per_borrower);
  c.peer_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(peer_timeout_ms));
  c.max_wait = std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(max_wait_ms, UINT64_C(1) << 40)));
  // Capped only so that the cast cannot wrap: the lender refuses what is past its range.
  if (preempt_after_ms) {
    c.preempt_after = std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(*preempt_after_ms, UINT64_C(1) << 40)));
  }
  c.preempt_deadline =
      std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(preempt_deadline_ms, UINT64_C(1) << 40)));
  for (auto uid : allowed_uids) c.policy.allowed_uids.push_back(static_cast<uid_t>(uid));
  for (auto gid : allowed_gids) c.policy.allowed_gids.push_back(static_cast<gid_t>(gid));
  // A socket path lies in a 0700 directory of the daemon's user: no other
  // user but root can reach it, whatever the access policy admits.
  const bool others_admitted =
      !allowed_gids.empty() ||
      std::any_of(allowed_uids.begin(), allowed_uids.end(), [](std::uint32_t uid) { return uid != 0 && uid != ::geteuid(); });
  if (!abstract_socket() && others_admitted) {
    throw invalid_argument("allowed_uids/allowed_gids: the socket " + (socket.empty() ? "lender.sock" : socket) +
                           " lies in a directory only this user can enter (mode 0700), so the users admitted cannot "
                           "reach it; for a daemon that other users connect to, name an abstract socket "
                           "(--socket @NAME), which the access policy alone guards");
  }
  return c;
}

}  // namespace shoal::tools
