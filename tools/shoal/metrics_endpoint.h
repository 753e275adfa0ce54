// The daemon's loopback HTTP metrics endpoint: `GET /metrics` answers with
// the lender's Prometheus text, any other path 404, any other method 405.
//
// It listens on 127.0.0.1 only (there is no setting for another address:
// metrics leave the machine through a scraper running on it, never through
// the daemon). Its clients are untrusted local processes:
//   - a request is a head of at most max_request_bytes, with no body; a
//     larger head or a body is answered 400 and the connection closed;
//   - each connection has request_deadline, from accept to the last byte of
//     the answer, for everything; then it is closed, whatever it was doing;
//   - one answer per connection (Connection: close), and at most
//     max_connections at once: one more takes the slot of the connection
//     that has waited longest for its request (closed unanswered), or is
//     closed at accept when every slot is answering;
//   - no error of a client, or of the metrics function (answered 500),
//     leaves the endpoint's thread; a failing accept (no descriptors left)
//     is retried after a pause instead of spinning.
//
// Thread-safety: serves on its own thread, from construction to destruction;
// `metrics` is called on that thread, one call at a time. port() may be
// called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace shoal::tools {

class metrics_endpoint {
 public:
  static constexpr std::size_t max_request_bytes = 8192;
  static constexpr std::size_t max_connections = 16;
  static constexpr std::chrono::seconds request_deadline{5};

  /// Listens on 127.0.0.1:`port` (0: a free port, see port()) and starts
  /// serving `metrics`. Throws shoal::error naming the address when it
  /// cannot listen there (say, the port is taken).
  metrics_endpoint(std::uint16_t port, std::function<std::string()> metrics);
  /// Stops listening, closes every connection and joins the thread.
  ~metrics_endpoint();
  metrics_endpoint(const metrics_endpoint&) = delete;
  metrics_endpoint& operator=(const metrics_endpoint&) = delete;

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const noexcept;

  class state;

 private:
  std::unique_ptr<state> state_;
};

}  // namespace shoal::tools
