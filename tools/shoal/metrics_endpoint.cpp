#include "tools/shoal/metrics_endpoint.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <list>
#include <optional>
#include <thread>
#include <utility>

#include "shoal/core/error.h"

namespace shoal::tools {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class metrics_endpoint::state {
 public:
  state(std::uint16_t port, std::function<std::string()> metrics) : metrics_(std::move(metrics)) {
    const tcp::endpoint loopback(asio::ip::address_v4::loopback(), port);
    boost::system::error_code ec;
    (void)acceptor_.open(loopback.protocol(), ec);
    if (!ec) (void)acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) (void)acceptor_.bind(loopback, ec);
    if (!ec) (void)acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      throw error("metrics endpoint: cannot listen on 127.0.0.1:" + std::to_string(port) + ": " + ec.message() +
                  " (choose another metrics port, or 0 for a free one)");
    }
    port_ = acceptor_.local_endpoint().port();
    accept();
    thread_ = std::thread([this] { serve(); });
  }

  ~state() {
    io_.stop();
    thread_.join();
  }
  state(const state&) = delete;
  state& operator=(const state&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

 private:
  class session;

  void serve() noexcept {
    // The handlers report every error through error codes, and the only
    // throwing call of an answer (the metrics function) is caught there; an
    // exception here is bad_alloc from asio itself: keep serving.
    while (!io_.stopped()) {
      try {
        io_.run();
      } catch (...) {  // NOLINT(bugprone-empty-catch): one connection's failure, already dropped
      }
    }
  }

  void accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        // Out of descriptors, say: wait a little rather than spin.
        retry_.expires_after(std::chrono::milliseconds(100));
        retry_.async_wait([this](boost::system::error_code e) {
          if (!e) accept();
        });
        return;
      }
      // Every slot taken: the connection waiting longest for its request
      // gives its slot up (an honest client sends its request at once, so
      // idle connections cannot keep a scraper out). Only when every slot
      // is answering is the newcomer closed here, unanswered.
      if (slots_ == max_connections && !reading_.empty()) evict_oldest_reading();
      // Armed again first: a throw below (bad_alloc making the session) loses
      // this connection only, where it left no accept pending and serve()'s
      // run() then ended with the last connection (found in review).
      accept();
      if (slots_ < max_connections) start(std::move(socket));
    });
  }

  void start(tcp::socket socket);
  void evict_oldest_reading();

  /// Whether a request's Host names this machine's loopback: a web page that
  /// rebinds its own name to 127.0.0.1 sends that name, and is refused.
  static bool loopback_host(std::string_view host) {
    if (host.empty()) return true;  // HTTP/1.0: no name to check
    if (host.front() == '[') return host.starts_with("[::1]");
    host = host.substr(0, host.find(':'));
    return host == "127.0.0.1" || host == "localhost";
  }

  /// The answer to a request for `target` with `method`, naming `host`.
  http::response<http::string_body> answer(http::verb method, std::string_view target, std::string_view host) {
    if (!loopback_host(host)) {
      return text(http::status::forbidden, "forbidden: this endpoint answers requests for 127.0.0.1 or localhost only\n");
    }
    const std::string_view path = target.substr(0, target.find('?'));
    if (path != "/metrics") return text(http::status::not_found, "not found: this endpoint serves /metrics only\n");
    if (method != http::verb::get) {
      auto r = text(http::status::method_not_allowed, "method not allowed: /metrics answers GET only\n");
      r.set(http::field::allow, "GET");
      return r;
    }
    try {
      auto r = text(http::status::ok, metrics_());
      r.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      return r;
    } catch (const std::exception& e) {
      return text(http::status::internal_server_error, std::string("the metrics could not be read: ") + e.what() + "\n");
    }
  }

  static http::response<http::string_body> text(http::status status, std::string body) {
    http::response<http::string_body> r(status, 11);
    r.set(http::field::content_type, "text/plain; charset=utf-8");
    r.keep_alive(false);
    r.body() = std::move(body);
    r.prepare_payload();
    return r;
  }

  std::function<std::string()> metrics_;
  std::uint16_t port_ = 0;
  // The serving thread's own: connections holding a slot (not evicted), and
  // those of them still reading their request, oldest first.
  std::size_t slots_ = 0;
  std::list<session*> reading_;
  // Last but the thread: destroyed first, with the sessions its handlers own.
  asio::io_context io_{1};
  tcp::acceptor acceptor_{io_};
  asio::steady_timer retry_{io_};
  std::thread thread_;
};

/// One connection: one request read, one answer written, within the deadline.
class metrics_endpoint::state::session : public std::enable_shared_from_this<session> {
 public:
  session(state& owner, tcp::socket socket)
      : owner_(owner), stream_(std::move(socket)), in_reading_(owner_.reading_.insert(owner_.reading_.end(), this)) {
    ++owner_.slots_;
    parser_.header_limit(static_cast<std::uint32_t>(max_request_bytes));
    parser_.body_limit(0);
  }
  ~session() {
    if (holds_slot_) --owner_.slots_;
    stop_reading();
  }
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  void read() {
    stream_.expires_after(request_deadline);  // for the request and the answer together
    http::async_read(stream_, buffer_, parser_,
                     [self = shared_from_this()](boost::system::error_code ec, std::size_t) { self->on_read(ec); });
  }

  /// Gives the slot up and closes the connection; the pending read ends
  /// with operation_aborted, and the session with it.
  void evict() {
    --owner_.slots_;
    holds_slot_ = false;
    stop_reading();
    stream_.close();
  }

 private:
  void stop_reading() {
    if (in_reading_ == owner_.reading_.end()) return;
    owner_.reading_.erase(in_reading_);
    in_reading_ = owner_.reading_.end();
  }

  void on_read(boost::system::error_code ec) {
    stop_reading();
    if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::operation_aborted) {
      return;  // hung up or too slow: closed unanswered
    }
    if (ec) {
      write(text(http::status::bad_request, "bad request: " + ec.message() + "\n"));
      return;
    }
    const auto& request = parser_.get();
    // Two Host fields name two sites (RFC 9112, 3.2): which one it meant is
    // not for this endpoint to guess.
    if (request.count(http::field::host) > 1) {
      write(text(http::status::bad_request, "bad request: more than one Host field\n"));
      return;
    }
    const auto host = request[http::field::host];
    write(owner_.answer(request.method(), std::string_view(request.target().data(), request.target().size()),
                        std::string_view(host.data(), host.size())));
  }

  void write(http::response<http::string_body> response) {
    response_ = std::move(response);
    http::async_write(stream_, response_, [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
      if (!ec) (void)self->stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    });
  }

  state& owner_;
  beast::tcp_stream stream_;
  std::list<session*>::iterator in_reading_;  // end() once the request is read (or the session evicted)
  bool holds_slot_ = true;
  beast::flat_buffer buffer_{max_request_bytes};
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
};

void metrics_endpoint::state::evict_oldest_reading() { reading_.front()->evict(); }

void metrics_endpoint::state::start(tcp::socket socket) {
  std::make_shared<session>(*this, std::move(socket))->read();
}

metrics_endpoint::metrics_endpoint(std::uint16_t port, std::function<std::string()> metrics)
    : state_(std::make_unique<state>(port, std::move(metrics))) {}

metrics_endpoint::~metrics_endpoint() = default;

std::uint16_t metrics_endpoint::port() const noexcept { return state_->port(); }

}  // namespace shoal::tools
