#include "shoal/ipc/sharing.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "core/deadline.h"
#include "core/fork_epoch.h"
#include "ipc/peer_link.h"
#include "ipc/producer_state.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"

namespace shoal::ipc {

// The background collector: collect(reclaim) every interval until stopped.
class sharing_context::collector {
 public:
  collector(std::shared_ptr<detail::producer_state> state, std::chrono::milliseconds interval) {
    start(std::move(state), interval);
  }
  /// In a fork() child the thread is not there, and destroying the
  /// condition variable it waited on would block forever.
  [[nodiscard]] bool forked_since() const noexcept { return epoch_.forked_since(); }
  ~collector() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

 private:
  void start(std::shared_ptr<detail::producer_state> state, std::chrono::milliseconds interval);
  void run(detail::producer_state& state, std::chrono::milliseconds interval) {
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, interval, [this] { return stopping_; })) {
      lock.unlock();
      try {
        state.collect(true);
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): tried again next time; collect() reports to callers
      }
      lock.lock();
    }
  }

  const shoal::detail::fork_epoch epoch_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;  // guarded by mutex_
  std::thread thread_;     // started last, in the constructor's body
};

// Out of the class body, so not inline: a lambda's closure inside an inline
// function gets default visibility from GCC, and the thread's state type made
// of it would be exported from a shared library.
void sharing_context::collector::start(std::shared_ptr<detail::producer_state> state,
                                       std::chrono::milliseconds interval) {
  thread_ = std::thread([this, state = std::move(state), interval] { run(*state, interval); });
}

namespace {

sharing_options checked(sharing_options options) {
  if (options.max_mapped_bytes == 0) {
    throw invalid_argument("sharing_options::max_mapped_bytes is 0; this process could map no producer's memory "
                           "(default 32 TiB)");
  }
  if (options.max_producer_resources == 0) {
    throw invalid_argument("sharing_options::max_producer_resources is 0; this process could take no producer's "
                           "segment (default 32768)");
  }
  if (options.max_peer_mapped_bytes == 0) {
    throw invalid_argument("sharing_options::max_peer_mapped_bytes is 0; a consumer could map no producer's memory "
                           "(give at least the largest segment a producer shares; default 1 TiB)");
  }
  if (options.max_peer_ring_bytes < channel::connection::min_ring_bytes) {
    throw invalid_argument("sharing_options::max_peer_ring_bytes is " + std::to_string(options.max_peer_ring_bytes) +
                           "; the smallest ring a peer sends through is " +
                           std::to_string(channel::connection::min_ring_bytes) + " bytes");
  }
  return options;
}

}  // namespace

sharing_context::sharing_context(alloc::caching_allocator& allocator, sharing_options options)
    : state_(std::make_shared<detail::producer_state>(allocator, checked(options))) {
  state_->attach();
  if (options.collect_interval.count() > 0) {
    collector_ = std::make_unique<collector>(state_, options.collect_interval);
  }
}

sharing_context::~sharing_context() {
  if (state_ && state_->epoch.forked_since()) {
    // A fork() child: the collector's thread stayed with the parent, and
    // the references the context tracks are the parent's (a child's drops
    // release nothing), so there is nothing to collect here either.
    (void)collector_.release();
    return;
  }
  collector_.reset();
  try {
    state_->collect(true);
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): a destructor cannot report
  }
}

alloc::caching_allocator& sharing_context::allocator() const noexcept { return state_->allocator; }
std::size_t sharing_context::collect() { return state_->collect(true); }
sharing_stats sharing_context::stats() const { return state_->stats(); }
std::vector<holder_stats> sharing_context::holders() const { return state_->holders(); }

peer::peer(sharing_context& context, channel::connection link)
    : link_(std::make_shared<detail::peer_link>(context.state_, std::move(link))) {}
peer::~peer() = default;

namespace {

// Runs `call`; an error the peer caused names the peer.
template <class Call>
auto naming_peer(const detail::peer_link& link, const Call& call) {
  const auto who = [&] {
    const channel::peer_credentials& c = link.credentials();
    return "peer pid " + std::to_string(c.process.pid) + " (uid " + std::to_string(c.uid) + "): ";
  };
  try {
    return call();
  } catch (const protocol_error& e) {
    throw protocol_error(who() + e.what());
  } catch (const connection_closed& e) {
    throw connection_closed(who() + e.what());
  }
}

}  // namespace

void peer::send(const storage::storage& st, std::span<const std::byte> metadata, backend::stream_ref stream) {
  naming_peer(*link_, [&] { link_->send(st, metadata, stream); });
}
void peer::send(const storage::storage& st, std::span<const std::byte> metadata) {
  send(st, metadata, backend::current_stream(st.device()));
}
void peer::send_note(std::span<const std::byte> metadata) {
  naming_peer(*link_, [&] { link_->send_note(metadata); });
}
received peer::receive(backend::stream_ref stream) {
  return naming_peer(*link_, [&] { return link_->receive(stream, std::nullopt); });
}
received peer::receive() { return receive(backend::current_stream(link_->allocator().device())); }
received peer::receive_for(std::chrono::milliseconds timeout, backend::stream_ref stream) {
  const auto until = shoal::detail::deadline_after(timeout);
  return naming_peer(*link_, [&] { return link_->receive(stream, until); });
}
received peer::receive_for(std::chrono::milliseconds timeout) {
  return receive_for(timeout, backend::current_stream(link_->allocator().device()));
}
std::optional<received> peer::try_receive(backend::stream_ref stream) {
  return naming_peer(*link_, [&] { return link_->try_receive(stream); });
}
std::optional<received> peer::try_receive() { return try_receive(backend::current_stream(link_->allocator().device())); }
std::optional<received> peer::try_receive(backend::stream_ref stream, std::chrono::nanoseconds spin) {
  return naming_peer(*link_, [&] { return link_->try_receive(stream, spin); });
}
void peer::check_greeting() {
  naming_peer(*link_, [&] { link_->check_greeting(); });
}
std::size_t peer::pending() const { return link_->pending(); }
taken_state peer::wait_taken(std::chrono::milliseconds timeout, std::size_t at_most) {
  return link_->wait_taken(timeout, at_most);
}
std::size_t peer::untaken() { return link_->untaken(); }
void peer::revoke() { link_->revoke(); }
const channel::peer_credentials& peer::credentials() const noexcept { return link_->credentials(); }
peer_stats peer::stats() const { return link_->stats(); }
int peer::native_handle() const noexcept { return link_->native_handle(); }

}  // namespace shoal::ipc
