#include "tools/shoal/daemon.h"

#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/lender.h"
#include "tools/shoal/daemon_log.h"
#include "tools/shoal/daemon_settings.h"
#include "tools/shoal/decimal_flags.h"
#if defined(SHOAL_HAVE_METRICS_HTTP)
#include "tools/shoal/metrics_endpoint.h"
#endif

namespace shoal::tools {

namespace {

int serve(const daemon_settings& settings) {
  // First of all: every thread made from here on (the device's too) inherits
  // this mask, so the signals reach sigwait alone. SIGHUP too: a daemon whose
  // terminal closed stops as cleanly as one told to (its socket file removed).
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  // A reader of the log that went away (`shoal daemon 2>&1 | head`) must not
  // end the daemon: its writes then fail with EPIPE, which the log ignores.
  ::signal(SIGPIPE, SIG_IGN);
  backend::device& device = settings.resolve_device();
  const auto address = settings.resolve_address();
  lending::lender_config config = settings.lender_config(device);
  daemon_log log(settings.log_format == "json");
  log_rate_limit limit(log, settings.log_rate);  // used under log_order
  // The lender serves from its construction on: its events wait for the
  // "started" record, which can only be written once the listener exists.
  std::mutex log_order;
  std::unique_lock starting(log_order);
  config.on_event = [&limit, &log_order](const lending::lender_event& e) {
    std::lock_guard in_order(log_order);
    limit.record(e, log_rate_limit::clock::now());
  };
  const lending::lender lender(device, address, config);
  std::string metrics_url = "off";
  std::string metrics_failure;
#if defined(SHOAL_HAVE_METRICS_HTTP)
  std::optional<metrics_endpoint> endpoint;  // destroyed before the lender it reads
  if (settings.metrics_port >= 0) {
    // Lending goes on without it: any local user may take a port first, and
    // must not keep the daemon from starting that way.
    try {
      endpoint.emplace(static_cast<std::uint16_t>(settings.metrics_port), [&lender] { return lender.metrics_text(); });
      metrics_url = "http://127.0.0.1:" + std::to_string(endpoint->port()) + "/metrics";
    } catch (const error& e) {
      metrics_url = "unavailable";
      metrics_failure = e.what();
    } catch (...) {
      starting.unlock();  // the lender's events may be waiting for it while it stops
      throw;
    }
  }
#endif
  log.info({{"event", "started"},
            {"socket", address.is_abstract() ? "@" + address.name() : address.name()},
            {"device", device.name()},
            number("capacity_bytes", config.capacity_bytes),
            number("quota_bytes", config.quota_bytes),
            number("quota_bytes_per_uid", config.quota_bytes_per_uid),
            number("max_borrowers", config.max_borrowers),
            number("max_observers", config.max_observers),
            number("max_connections_per_uid", config.max_connections_per_uid),
            number("max_wait_ms", static_cast<std::uint64_t>(config.max_wait.count())),
            config.preempt_after ? number("preempt_after_ms", static_cast<std::uint64_t>(config.preempt_after->count()))
                                 : log_field{"preempt_after_ms", "off", false},
            number("preempt_deadline_ms", static_cast<std::uint64_t>(config.preempt_deadline.count())),
            {"reuse", config.reuse == lending::reuse_policy::never ? "never" : "same_uid"},  // what the lender got
            number("prepared_chunks", config.prepared_chunks.size()),
            number("prepared_bytes", lender.status().prepared_bytes),
            {"metrics", metrics_url},
            number("log_rate", settings.log_rate)});
  if (!metrics_failure.empty()) {
    log.warn({{"event", "metrics_unavailable"}, {"detail", metrics_failure + "; lending goes on without it"}});
  }
  starting.unlock();
  // Each second the rate limit writes the summaries that are due (a
  // borrower that went quiet gets its own) and forgets idle borrowers.
  int signal = -1;
  while (signal < 0) {
    const timespec second{1, 0};
    signal = sigtimedwait(&stop, nullptr, &second);
    if (signal < 0) {
      const std::lock_guard in_order(log_order);
      limit.tick(log_rate_limit::clock::now());
    }
  }
  const auto s = lender.status();
  const std::lock_guard in_order(log_order);
  limit.flush();
  log.info({{"event", "stopping"},
            number("signal", static_cast<std::uint64_t>(signal)),
            number("regions", s.regions.size()),
            number("lent_bytes", s.lent_bytes),
            number("log_records_dropped", log.dropped()),
            number("log_records_suppressed", limit.suppressed())});
  return 0;
}

// What `status` and `revoke` ask of a running daemon.
struct daemon_request {
  double timeout_seconds = 5.0;
  std::vector<uid_t> daemon_uids;  // the daemon's uid when it is not this user's
  std::uint64_t region = 0;        // revoke: the region
  double deadline_seconds = 10.0;  // revoke: the time its borrower has
};

// Connects to the daemon and runs `ask` on the connection. The daemon must
// run as this user or one of `daemon_uids` (a daemon of another user, a
// service account say, is named; any other is refused).
template <class Ask>
int ask_daemon(const daemon_settings& settings, const daemon_request& request, Ask&& ask) {
  channel::access_policy daemon_policy;
  daemon_policy.allowed_uids = request.daemon_uids;
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(request.timeout_seconds * 1000));
  try {
    // An observer: not counted among the daemon's borrowers, and served
    // while it has all it admits.
    lending::borrower_options observer;
    observer.observer = true;
    lending::borrower b(settings.resolve_device(), settings.resolve_address(), daemon_policy, timeout, observer);
    ask(b, timeout);
  } catch (const peer_refused& e) {
    // The channel's refusal of the daemon's uid ends with advice naming its
    // C++ setting; on the command line it is --daemon-uid. Any other
    // refusal (the daemon's own) goes as it is.
    const std::string why = e.what();
    const auto advice = why.find("; add it to");
    if (advice == std::string::npos) throw;
    throw peer_refused(why.substr(0, advice) + "; if you trust the daemon's user, name its uid: --daemon-uid UID");
  } catch (const connection_closed& e) {
    // Greeted, then closed: a daemon that is stopping, or one older than
    // observer connections (it greets, then refuses the observer's hello).
    // No one listening is said well enough by the connect.
    if (e.no_listener()) throw;
    throw connection_closed(std::string(e.what()) +
                            " (the daemon closed the connection: it is stopping, or it is older than this shoal "
                            "command, which connects as an observer; its log says which)");
  }
  return 0;
}

int status(const daemon_settings& settings, const daemon_request& request) {
  return ask_daemon(settings, request, [](lending::borrower& b, std::chrono::milliseconds timeout) {
    const std::string text = b.metrics(timeout);
    (void)std::fwrite(text.data(), 1, text.size(), stdout);  // all of it, a NUL byte included
  });
}

// Asks the daemon to revoke a region, as its operator (this user is the
// daemon's, or root): its borrower is told to give it back in time.
int revoke(const daemon_settings& settings, const daemon_request& request) {
  return ask_daemon(settings, request, [&](lending::borrower& b, std::chrono::milliseconds timeout) {
    b.revoke(request.region,
             std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(request.deadline_seconds * 1000))), timeout);
    std::printf("region %llu: its borrower is asked to give it back within %g s\n",
                static_cast<unsigned long long>(request.region), request.deadline_seconds);
  });
}

}  // namespace

int run_daemon(int argc, char** argv) {
  CLI::App app("The shoal memory daemon: lends this machine's device memory to borrower processes.", "shoal daemon");
  daemon_settings settings;
  std::string config_file;
  app.add_option("--config", config_file, "a TOML file of settings (flags given too win)")->check(CLI::ExistingFile);
  auto* socket = app.add_option("--socket", settings.socket, "socket path (in a 0700 directory) or @abstract-name; default: lender.sock in "
                                 "$XDG_RUNTIME_DIR, or in /tmp/shoal-UID when that is unset");
  auto* device = app.add_option("--device", settings.device, "default, host, cuda or cuda:N")->capture_default_str();
  auto* capacity =
      app.add_option("--capacity", settings.capacity.text, "bytes to lend in all: 12GiB, or a fraction of the device's memory like 0.8; "
                     "default: 0.9");
  auto* quota = app.add_option("--quota", settings.quota.text, "bytes one borrower (connection) may hold, as --capacity; default: 1.0 (no "
                                      "limit below the capacity)");
  auto* quota_per_uid = app.add_option("--quota-per-uid", settings.quota_per_uid.text,
                                       "bytes one uid may hold over all its connections, as --capacity, or none "
                                       "(the default: no such limit)");
  // Checked as signed numbers and as decimal text (decimal_flags.h): CLI11 reads "-1" into an unsigned
  // one as its largest value, and "010" as 8.
  const auto count_range = CLI::Range(std::int64_t{1}, daemon_settings::max_count);
  auto* borrowers = app.add_option("--max-borrowers", settings.max_borrowers,
                                   "borrowers connected at once, of each class (the daemon's uid and root; other uids)")
                        ->check(count_range)
                        ->check(decimal_unsigned())
                        ->capture_default_str();
  auto* observers = app.add_option("--max-observers", settings.max_observers,
                                   "observer connections (status, revoke) served besides the borrowers")
                        ->check(count_range)
                        ->check(decimal_unsigned())
                        ->capture_default_str();
  auto* per_uid = app.add_option("--max-connections-per-uid", settings.max_connections_per_uid,
                                 "connections one uid other than the daemon's and root may have at once, so that "
                                 "one cannot fill the places all other uids share (0: no cap)")
                      ->check(CLI::Range(std::int64_t{0}, daemon_settings::max_count))
                      ->check(decimal_unsigned())
                      ->capture_default_str();
  auto* regions = app.add_option("--max-regions", settings.max_regions_per_borrower, "regions one borrower may hold")
                      ->check(count_range)
                      ->check(decimal_unsigned())
                      ->capture_default_str();
  auto* timeout = app.add_option("--peer-timeout-ms", settings.peer_timeout_ms, "deadline of every wait on a borrower")
                      ->check(decimal_unsigned())
                      ->capture_default_str();
  auto* max_wait = app.add_option("--max-wait-ms", settings.max_wait_ms,
                                  "the longest a borrow may wait for memory (a longer wait is cut to this)")
                       ->check(decimal_unsigned())
                       ->capture_default_str();
  auto* preempt_after = app.add_option("--preempt-after-ms", settings.preempt_after_ms,
                                       "revoke other borrowers' regions for the borrow waiting first in line once it "
                                       "has waited this long (0: at once), lent longest ago first, as many as it "
                                       "lacks; off by default")
                            ->check(decimal_unsigned());
  bool no_preempt = false;
  auto* no_preempt_flag =
      app.add_flag("--no-preempt", no_preempt, "no preemption, whatever the config file says")->excludes(preempt_after);
  auto* preempt_deadline =
      app.add_option("--preempt-deadline-ms", settings.preempt_deadline_ms,
                     "the time a preempted region's borrower has to give it back")
          ->check(CLI::PositiveNumber)
          ->check(decimal_unsigned())
          ->capture_default_str();
  auto* uids = app.add_option("--allow-uid", settings.allowed_uids, "a uid allowed besides the daemon's own (repeat)")
                   ->check(decimal_unsigned());
  auto* gids = app.add_option("--allow-gid", settings.allowed_gids, "a group whose members are allowed (repeat)")
                   ->check(decimal_unsigned());
  auto* format =
      app.add_option("--log-format", settings.log_format, "text or json")->check(CLI::IsMember({"text", "json"}))->capture_default_str();
  auto* reuse = app.add_option("--reuse", settings.reuse, "lend given-back memory again: same_uid or never")
                    ->check(CLI::IsMember({"same_uid", "never"}))
                    ->capture_default_str();
  auto* prepare = app.add_option("--prepare", settings.prepare,
                                 "chunks made when the daemon starts, lent first to regions of their size: SIZE or "
                                 "COUNTxSIZE, like 4x1GiB (repeat; counted against --capacity); default: none, "
                                 "memory grows on demand");
  auto* metrics_port = app.add_option("--metrics-port", settings.metrics_port,
                                      "serve GET /metrics over HTTP on 127.0.0.1 at this port (0: a free one, "
                                      "named in the log); off by default")
                           ->check(CLI::Range(0, 65535))
                           ->check(decimal_unsigned());
  bool no_metrics_port = false;
  auto* no_metrics_port_flag =
      app.add_flag("--no-metrics-port", no_metrics_port, "no HTTP metrics endpoint, whatever the config file says")
          ->excludes(metrics_port);
  auto* log_rate = app.add_option("--log-rate", settings.log_rate,
                                  "routine log records per second per borrower process, after a burst of " +
                                      std::to_string(log_rate_limit::burst_seconds) +
                                      " s of them; past it they are counted (log_records_suppressed) and not "
                                      "written; warnings always are (0: no limit)")
                       ->check(CLI::Range(std::int64_t{0}, std::int64_t{daemon_settings::max_log_rate}))
                       ->check(decimal_unsigned())
                       ->capture_default_str();
  daemon_request request;
  // What both subcommands take: where the daemon is comes from the options above.
  const auto asks_the_daemon = [&](CLI::App* command, const char* name) {
    command->fallthrough();  // --socket and --device after the subcommand too
    command->footer(std::string("--socket, --device and --config (see shoal daemon --help) name the daemon, before "
                                "or after `") + name + "`");
    command->add_option("--timeout", request.timeout_seconds, "seconds to wait for the daemon")
        ->check(CLI::Range(0.001, 86400.0))
        ->check(decimal_real())
        ->capture_default_str();
    command->add_option("--daemon-uid", request.daemon_uids,
                        "the uid the daemon runs as, when it is not yours (repeat); a daemon of any other uid is "
                        "refused")
        ->check(decimal_unsigned());
  };
  auto* status_command = app.add_subcommand("status", "print a running daemon's metrics (Prometheus text)");
  asks_the_daemon(status_command, "status");
  auto* revoke_command = app.add_subcommand(
      "revoke",
      "ask the borrower of a region (its id as `status` names it: shoal_lending_region_bytes{id=...}) to give it "
      "back, so that another borrower may take its memory; the daemon's own user or root only");
  asks_the_daemon(revoke_command, "revoke");
  revoke_command->add_option("region", request.region, "the region's id")->required()->check(decimal_unsigned());
  revoke_command->add_option("--deadline", request.deadline_seconds, "seconds its borrower has to give it back")
      ->check(CLI::Range(0.001, 4'000'000.0))
      ->check(decimal_real())
      ->capture_default_str();
  try {
    app.parse(argc, argv);
    if (!config_file.empty()) {
      // The file first, then the flags given again on top of it.
      daemon_settings from_file;
      from_file.read_file(config_file);
      const daemon_settings flags = settings;
      settings = from_file;
      if (socket->count() > 0) settings.socket = flags.socket;
      if (device->count() > 0) settings.device = flags.device;
      if (capacity->count() > 0) settings.capacity = flags.capacity;
      if (quota->count() > 0) settings.quota = flags.quota;
      if (quota_per_uid->count() > 0) settings.quota_per_uid = flags.quota_per_uid;
      if (borrowers->count() > 0) settings.max_borrowers = flags.max_borrowers;
      if (observers->count() > 0) settings.max_observers = flags.max_observers;
      if (per_uid->count() > 0) settings.max_connections_per_uid = flags.max_connections_per_uid;
      if (regions->count() > 0) settings.max_regions_per_borrower = flags.max_regions_per_borrower;
      if (timeout->count() > 0) settings.peer_timeout_ms = flags.peer_timeout_ms;
      if (max_wait->count() > 0) settings.max_wait_ms = flags.max_wait_ms;
      if (preempt_after->count() > 0) settings.preempt_after_ms = flags.preempt_after_ms;
      if (no_preempt_flag->count() > 0) settings.preempt_after_ms.reset();
      if (preempt_deadline->count() > 0) settings.preempt_deadline_ms = flags.preempt_deadline_ms;
      if (uids->count() > 0) settings.allowed_uids = flags.allowed_uids;
      if (gids->count() > 0) settings.allowed_gids = flags.allowed_gids;
      if (format->count() > 0) settings.log_format = flags.log_format;
      if (reuse->count() > 0) settings.reuse = flags.reuse;
      if (prepare->count() > 0) settings.prepare = flags.prepare;
      if (metrics_port->count() > 0) settings.metrics_port = flags.metrics_port;
      if (no_metrics_port_flag->count() > 0) settings.metrics_port = -1;
      if (log_rate->count() > 0) settings.log_rate = flags.log_rate;
    }
    if (status_command->parsed()) return status(settings, request);
    if (revoke_command->parsed()) return revoke(settings, request);
#if !defined(SHOAL_HAVE_METRICS_HTTP)
    if (settings.metrics_port >= 0) {
      throw invalid_argument(
          "metrics_port: this build has no HTTP metrics endpoint: Boost.Beast (libboost-dev) was not found when it "
          "was configured (scripts/ensure-deps installs it); `shoal daemon status` reads the metrics over the socket");
    }
#endif
    return serve(settings);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const invalid_argument& e) {
    std::fprintf(stderr, "shoal daemon: %s\n", e.what());
    return 2;
  } catch (const os_error& e) {
    // A socket path below a directory that does not exist is a bad setting;
    // an address in use (another daemon there) and the rest: cannot start.
    std::fprintf(stderr, "shoal daemon: %s\n", e.what());
    return e.code() == ENOENT || e.code() == ENOTDIR ? 2 : 1;
  }
}

}  // namespace shoal::tools
