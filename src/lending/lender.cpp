#include "shoal/lending/lender.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <new>
#include <span>
#include <string_view>
#include <thread>
#include <utility>

#include "core/deadline.h"
#include "core/descriptor_limit.h"
#include "core/fork_epoch.h"
#include "core/library_checks.h"
#include "lending/automatic_spin.h"
#include "lending/lendable_memory.h"
#include "lending/messages.h"
#include "lending/metrics.h"
#include "lending/orphan_checks.h"
#include "lending/preemption.h"
#include "lending/prepared_chunks.h"
#include "lending/spare_pool.h"
#include "lending/waiting_borrows.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/lender_test_hook.h"

namespace shoal::lending {

namespace {

using detail::lending_protocol;
using detail::message_type;
using detail::refusal;
using clock_type = std::chrono::steady_clock;

// How often orphaned regions are checked for a borrower that has exited,
// and how many of their processes a check looks up at most (orphan_checks.h).
constexpr std::chrono::milliseconds orphan_check_interval{50};

// The lender's books (each connection's held and kept counts against the
// regions and spares that name it) are checked after every turn of its loop
// where the library checks itself (core/library_checks.h).
constexpr bool check_books_each_turn = shoal::detail::library_checks_on;
constexpr std::size_t orphan_lookups_per_check = 64;
// The longest peer_timeout taken.
constexpr std::chrono::milliseconds longest_peer_timeout = std::chrono::hours(24);
// How long the lender stops accepting after the system refused an accept.
constexpr std::chrono::milliseconds accept_pause{100};

std::span<const std::byte> view(const std::vector<std::byte>& bytes) { return bytes; }

std::function<void(std::uint64_t)>& before_publish_commits() {
  static std::function<void(std::uint64_t)> hook;
  return hook;
}

/// One process's hold of a region.
struct hold {
  std::uint64_t borrower = 0;  // the connection's serial; 0 once orphaned
  process_identity process;
  uid_t uid = 0;
};

// A region lives while it has a hold:
//   holds.empty() never holds for a region in the map;
//   exclusive: holds.size() == 1; shared: one hold per mapping of it, and
//   at most one orphaned hold per process (a process's connections that
//   hung up while it runs leave one between them);
//   lent_bytes_ = sum of info.bytes over the regions in the map (each once);
//   lent_bytes_ + spares_.bytes() + prepared_.bytes() <= capacity;
//   a borrower's held_bytes = sum of info.bytes over its holds, held_regions
//   = how many holds it has (a shared region counts in full for each);
//   chunk.keepers never names the connection that holds the region (its
//   kept mapping became the region's when it was lent to it);
//   a borrower's kept_bytes = sum of chunk.memory->size() over the chunks,
//   spares and regions, whose keepers name it.
struct region_entry {
  detail::chunk_record chunk;
  region_info info;  // info.holders is filled by status()
  clock_type::time_point since;
  std::vector<hold> holds;
  bool missed = false;   // a revocation's deadline passed (named once)
  region_layout layout;  // shared regions: what the writer published

  // lent while a holder is connected, orphaned once none is; revoking stays
  // while its (exclusive) borrower is connected.
  void settle_state() {
    const bool connected = std::any_of(holds.begin(), holds.end(), [](const hold& h) { return h.borrower != 0; });
    if (!connected) {
      info.state = region_state::orphaned;
    } else if (info.state != region_state::revoking) {
      info.state = region_state::lent;
    }
  }
};

struct borrower_entry {
  std::uint64_t serial = 0;
  channel::connection link;
  clock_type::time_point accepted;  // its hello is due within the peer timeout of this
  bool greeted = false;  // its hello arrived (and the lender's was sent): a borrower or an observer
  // Its hello named the observer protocol: metrics and revokes only, never a
  // region; counted apart from the borrowers (lender_config::max_observers).
  bool observer = false;
  // Its uid is the lender's own or root's: its connections are bounded apart.
  bool operator_uid = false;
  // Accepted while borrowers or observers had no room: the lender's hello
  // waits for this one's, and goes only if its kind has room by then.
  bool held_back = false;
  // Held back, and no room of its hello's kind but for connections greeted
  // at once whose hello has not come (each may turn out the other kind): its
  // answer waits for them until this time at most (admit_awaiting_room).
  // Nothing more is read from it meanwhile.
  std::optional<clock_type::time_point> room_awaited_until = std::nullopt;
  bool awaits_as_observer = false;  // the class whose room it awaits (its hello said)
  bool failed = false;   // broke the protocol: hung up on by the loop
  // Why, when it was failed where no event could be sent (under the lock):
  // the loop names it as it hangs up.
  const char* failed_why = nullptr;
  std::size_t held_bytes = 0;
  std::size_t held_regions = 0;
  // Memory it gave back and still maps (it may write it until told to
  // forget it): counted against its quota with held_bytes.
  std::size_t kept_bytes = 0;
  // Its borrow waits for memory (the lender's waiting_); anything it sends
  // meanwhile ends that wait first.
  bool waiting = false;
};

/// A refusal to send: the borrower's request is answered, its connection stays.
struct refused_request {
  refusal reason;
  std::string why;
};

}  // namespace

const char* to_string(region_mode mode) noexcept {
  switch (mode) {
    case region_mode::exclusive:
      return "exclusive";
    case region_mode::shared:
      return "shared";
  }
  return "unknown";
}

const char* to_string(shortage why) noexcept {
  switch (why) {
    case shortage::capacity:
      return "capacity";
    case shortage::wait_expired:
      return "wait_expired";
    case shortage::others_waiting:
      return "others_waiting";
    case shortage::cannot_fit:
      return "cannot_fit";
    case shortage::stopped_waiting:
      return "stopped_waiting";
  }
  return "unknown";
}

const char* to_string(region_state state) noexcept {
  switch (state) {
    case region_state::lent:
      return "lent";
    case region_state::orphaned:
      return "orphaned";
    case region_state::revoking:
      return "revoking";
  }
  return "unknown";
}

const char* to_string(lender_event::kind what) noexcept {
  switch (what) {
    case lender_event::kind::connected:
      return "connected";
    case lender_event::kind::disconnected:
      return "disconnected";
    case lender_event::kind::lent:
      return "lent";
    case lender_event::kind::published:
      return "published";
    case lender_event::kind::given_back:
      return "given_back";
    case lender_event::kind::refused:
      return "refused";
    case lender_event::kind::orphaned:
      return "orphaned";
    case lender_event::kind::reclaimed:
      return "reclaimed";
    case lender_event::kind::closed_for_error:
      return "closed_for_error";
    case lender_event::kind::revoke_requested:
      return "revoke_requested";
    case lender_event::kind::revoke_missed:
      return "revoke_missed";
    case lender_event::kind::spare_released:
      return "spare_released";
    case lender_event::kind::waiting:
      return "waiting";
  }
  return "unknown";
}

class lender::state {
 public:
  state(backend::device& device, const channel::channel_address& address, lender_config config)
      : device_(device),
        config_(std::move(config)),
        poll_spin_(detail::spin_or_automatic(config_.poll_spin, lender_config::automatic_poll_spin)),
        spinning_borrowers_limit_(detail::spinning_borrowers_limit()),
        listener_(address, config_.policy, detail::max_frame_payload) {
    // No borrower or observer sends descriptors: from Linux 6.16 on none can
    // (a lingering socket's close would hold the serving thread).
    listener_.refuse_descriptors();
    fds_.reserve(3);  // the loop's poll set never grows past what accept_one made room for
    wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_) throw os_error{errno, "eventfd"};
    for (const std::size_t size : config_.prepared_chunks) {
      const std::size_t bytes = detail::round_up(size, device_.granularity());
      prepared_.put({std::make_unique<detail::lendable_memory>(device_, bytes, next_memory_++), {}});
      ++counters_.chunks_made;
    }
    start_serving();
  }

  /// In a fork() child: the serving thread stayed with the parent, and the
  /// connections and memory are the parent's (lender::~lender).
  [[nodiscard]] bool forked_since() const noexcept { return epoch_.forked_since(); }

  ~state() {
    stopping_.store(true);
    const std::uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    thread_.join();
    // Connections close with their entries; the regions' memory returns as
    // each borrower unmaps it.
  }

  lender_status status() const {
    std::lock_guard lock(mutex_);
    lender_status s = counters_;
    s.capacity_bytes = config_.capacity_bytes;
    s.lent_bytes = lent_bytes_;
    s.spare_bytes = spares_.bytes();
    s.prepared_bytes = prepared_.bytes();
    s.prepared_chunks = prepared_.count();
    s.borrowers = borrower_count_.load();
    s.observers = observer_count_.load();
    s.connections = connection_count_.load();
    const auto now = clock_type::now();
    for (const auto& spare : spares_.chunks()) {
      s.spares.push_back({spare.chunk.memory->id(), spare.chunk.memory->size(), spare.uid, spare.chunk.keepers.size(),
                          now - spare.since});
    }
    waiting_.visit([&](const detail::waiting_borrow& w) {
      s.waiting.push_back({w.process, w.uid, w.bytes, w.request.purpose, now - w.since,
                           std::max(w.until - now, clock_type::duration::zero())});
    });
    for (const auto& [id, region] : regions_) {
      s.regions.push_back(region.info);
      s.regions.back().age = now - region.since;
      if (region.info.mode != region_mode::shared) continue;
      for (const hold& h : region.holds) {
        s.regions.back().holders.push_back(
            {h.process, h.uid, h.borrower != 0 ? region_state::lent : region_state::orphaned});
      }
    }
    return s;
  }

  const channel::channel_address& address() const noexcept { return listener_.address(); }

  void revoke(std::uint64_t id, std::chrono::milliseconds deadline) {
    if (auto why = start_revoke(id, deadline)) throw invalid_argument("lender::revoke: " + *why);
  }

  // Marks region `id` to be revoked within `deadline` and wakes the serving
  // thread; else says, in words that name no function (a borrower's revoke
  // request is answered with them), why it cannot be.
  std::optional<std::string> start_revoke(std::uint64_t id, std::chrono::milliseconds deadline) {
    if (deadline <= std::chrono::milliseconds(0) || deadline.count() > std::numeric_limits<std::uint32_t>::max()) {
      return "the deadline must be 1 ms to about 49 days";
    }
    {
      std::lock_guard lock(mutex_);
      const auto it = regions_.find(id);
      if (it != regions_.end() && it->second.info.mode == region_mode::shared) {
        return "region " + std::to_string(id) + " ('" + it->second.info.purpose +
               "') is shared: each of its holders gives its own hold back, and it goes with the last; "
               "revoke exclusive regions only";
      }
      if (it == regions_.end() || it->second.info.state != region_state::lent) {
        return "region " + std::to_string(id) + " is not lent to a connected borrower" +
               (it == regions_.end() ? "" : " (it is being revoked, or its borrower hung up)");
      }
      revocations_.push_back({id, deadline, {}});  // first: when memory runs out the region stays lent
      mark_revoking(it->second, deadline);
    }
    const std::uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    return std::nullopt;
  }

 private:
  void start_serving();  // starts serve() on thread_

  // One thread reads every borrower without waiting on any: a frame is
  // handled once its batch has come whole, and a borrower that sends part of
  // one and stalls is hung up on after peer_timeout (hang_up_stalled) while
  // the others are served. A borrower with answers queued is polled for
  // room in its socket only (a hang-up is reported all the same) and read
  // no further until they have gone: however fast it asks, its queue holds
  // one answer and the revokes and forgets sent meanwhile.
  void serve() noexcept {
    auto next_check = clock_type::now();
    auto last_served = clock_type::time_point{};
    while (!stopping_.load()) {
      // fds_ keeps its room from turn to turn: no allocation per wake-up.
      fds_.clear();
      // While accepting is paused the listener is polled for nothing: its
      // backlog would keep it readable.
      const bool accepting = clock_type::now() >= accept_paused_until_;
      fds_.push_back({listener_.native_handle(), accepting ? short{POLLIN} : short{0}, 0});
      fds_.push_back({wake_.get(), POLLIN, 0});
      bool pending = false;
      for (const auto& b : borrowers_) {
        const bool answers_wait = b.link.unsent_bytes() > 0;
        pending = pending || (!answers_wait && !b.room_awaited_until && b.link.pending() > 0);
        // One awaiting room is polled for nothing: only its hang-up wakes the loop.
        const short events = b.room_awaited_until ? short{0} : answers_wait ? short{POLLOUT} : short{POLLIN};
        fds_.push_back({b.link.native_handle(), events, 0});
      }
      const auto now = clock_type::now();
      const auto until_check = std::chrono::ceil<std::chrono::milliseconds>(next_check - now);
      // Within poll_spin_ of the last request served, look without sleeping,
      // while the borrowers that may spin for their replies leave it cores.
      const bool spinning = now - last_served < poll_spin_ && borrower_count_.load() <= spinning_borrowers_limit_;
      auto wait =
          pending || spinning ? 0 : std::clamp<std::int64_t>(until_check.count(), 0, orphan_check_interval.count());
      for (const auto due : {next_wait_expiry().value_or(clock_type::time_point::max()), next_preemption_check(),
                             next_behind_lapse(now)}) {
        if (due == clock_type::time_point::max()) continue;
        wait = std::min<std::int64_t>(wait, std::max<std::int64_t>(
                                                std::chrono::ceil<std::chrono::milliseconds>(due - now).count(), 0));
      }
      const int ready = ::poll(fds_.data(), fds_.size(), static_cast<int>(wait));
      if (ready < 0 && errno != EINTR) break;  // nothing sensible left to wait on
      if (stopping_.load()) break;
      if (ready > 0 && (fds_[1].revents & POLLIN) != 0) {
        std::uint64_t count = 0;
        (void)!::read(wake_.get(), &count, sizeof count);
      }
      send_revocations();
      // Borrowers accepted now go to the end of the list, past those polled.
      const std::size_t polled = fds_.size() - 2;
      if (ready > 0 && (fds_[0].revents & POLLIN) != 0) accept_one();
      auto b = borrowers_.begin();
      for (std::size_t i = 0; i < polled; ++i, ++b) {
        const short revents = fds_[i + 2].revents;
        if (b->room_awaited_until) {
          if (revents != 0) b->failed = true;  // it hung up while its answer waited: no error of its
          continue;
        }
        if (revents != 0 && b->link.unsent_bytes() > 0) flush_one(*b);  // a hang-up makes the flush fail
        if (b->link.unsent_bytes() > 0) continue;  // its answers go first
        if ((revents & ~POLLOUT) != 0 || b->link.pending() > 0) {
          serve_one(*b);
          last_served = clock_type::now();
        }
      }
      if (clock_type::now() >= next_check) {
        hang_up_stalled();
        note_missed_revocations();
        reclaim_orphans();
        // The device may have memory back that other processes freed: a head
        // it refused is tried again (one the capacity refused waits for a
        // give back).
        room_changed_ = room_changed_ || head_refused_by_device_;
        next_check = clock_type::now() + orphan_check_interval;
      }
      std::erase_if(borrowers_, [&](borrower_entry& e) {
        if (!e.failed && !e.link.broken()) return false;
        if (e.failed_why != nullptr) close_for_error(e, e.failed_why);
        hang_up(e);
        return true;
      });
      admit_awaiting_room();
      store_counts();
      serve_waiting();
      preempt_for_head();
      check_books();
    }
    std::lock_guard lock(mutex_);
    std::vector<lender_event> ignored;  // the lender is going: no more events
    for (auto& b : borrowers_) hang_up_locked(b, ignored);
    borrowers_.clear();
    borrower_count_.store(0);
    observer_count_.store(0);
    connection_count_.store(0);
    waiting_ = {};
    regions_.clear();
    spares_.clear();
    lent_bytes_ = 0;
  }

  // Takes on the borrower waiting to connect, if any. One the lender cannot
  // take on, for its limit or for lack of memory, is refused: its
  // connection closes before the hello (the borrower's connect fails).
  void accept_one() noexcept {
    try {
      accept_or_throw();
    } catch (const std::exception& e) {
      count_refusal();
      try {
        emit(lender_event::kind::refused, {}, 0, 0, std::string("a borrower could not be taken on: ") + e.what());
      } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to say so; counted
      }
    }
  }

  void accept_or_throw() {
    std::optional<channel::connection> accepted;
    try {
      accepted = listener_.accept_for(std::chrono::milliseconds(0));
    } catch (const backend_error&) {
      // The system refused the accept (out of descriptors, say): the client
      // stays in the backlog, the listener readable, so look again after a
      // pause instead of spinning on it while the borrowers wait.
      accept_paused_until_ = clock_type::now() + accept_pause;
      count_refusal();
      return;
    } catch (const error&) {
      count_refusal();  // a uid not allowed (accept drops a peer gone before it was identified)
      return;
    }
    if (!accepted) return;
    // Connections of the lender's own uid and root are bounded apart from
    // the others' (and so are their borrowers and observers), so another
    // admitted uid cannot keep the operator out.
    const bool operator_uid = is_operator(accepted->peer().uid);
    const std::size_t of_class = connections_of(operator_uid);
    const std::size_t most = config_.max_borrowers > SIZE_MAX - config_.max_observers
                                 ? SIZE_MAX
                                 : config_.max_borrowers + config_.max_observers;
    if (of_class >= most) {
      emit(lender_event::kind::refused, accepted->peer(), 0, 0,
           "already " + std::to_string(of_class) + " connections of " +
               (operator_uid ? "the lender's uid and root" : "other uids") +
               ", the most allowed (max_borrowers + max_observers)");
      count_refusal();  // after: when the text above cannot be made, accept_one counts it
      return;  // closed at once: the client sees end of stream instead of a hello
    }
    // The other uids share that bound: one of them could fill it with idle
    // connections (a greeted one is never timed out) and keep the rest out.
    if (const std::size_t cap = config_.max_connections_per_uid; cap != 0 && !operator_uid) {
      const uid_t uid = accepted->peer().uid;
      const std::size_t of_uid = live_count([&](const borrower_entry& b) { return b.link.peer().uid == uid; });
      if (of_uid >= cap) {
        emit(lender_event::kind::refused, accepted->peer(), 0, 0,
             "already " + std::to_string(of_uid) + " connections of uid " + std::to_string(uid) +
                 ", the most one uid may have (max_connections_per_uid)");
        count_refusal();
        return;
      }
    }
    // Greeted at once while both kinds have room for it and every other
    // connection greeted at once whose hello has not come (a client of
    // another protocol then learns what it reached before it sends).
    // Otherwise held back: its hello is read first, and it is served only if
    // its kind has room, or turned away before any hello (peer_refused at
    // connect).
    const bool held_back = counted_borrowers(operator_uid) >= config_.max_borrowers ||
                           observers_of(operator_uid) + unannounced_of(operator_uid) >= config_.max_observers;
    // The hello is sent (under the peer timeout), not posted: a fresh
    // socket has room for it. Every later answer is posted.
    accepted->set_send_timeout(shoal::detail::channel_timeout(config_.peer_timeout));
    // No borrower or observer ever sends a descriptor: one that does cannot
    // hold any here while its batch stalls (the lender's table is its chunks').
    accepted->refuse_descriptors();
    fds_.reserve(borrowers_.size() + 3);  // its place in the next poll set, made now
    borrowers_.push_back({last_serial_ + 1, std::move(*accepted), clock_type::now()});
    ++last_serial_;
    borrower_entry& b = borrowers_.back();
    b.operator_uid = operator_uid;
    b.held_back = held_back;
    store_counts();  // counted before its client can learn it was taken on
    if (!held_back) {
      try {
        channel::send_hello(b.link, lending_protocol);
      } catch (const error&) {
        borrowers_.pop_back();
        store_counts();
      }
    }
  }

  // Checked builds: every connection's counts match the holds and kept
  // mappings that name it (the quotas read the counts). A breach is a bug
  // in this file, never a borrower's doing; going on would refuse or lend
  // against wrong books.
  void check_books() const noexcept {
    if constexpr (!check_books_each_turn) return;
    std::lock_guard lock(mutex_);
    for (const auto& b : borrowers_) {
      std::size_t held = 0;
      std::size_t regions = 0;
      std::size_t kept = 0;
      for (const auto& [id, r] : regions_) {
        for (const auto& h : r.holds) {
          if (h.borrower != b.serial) continue;
          held += r.info.bytes;
          ++regions;
        }
        if (r.chunk.kept_by(b.serial)) kept += r.chunk.memory->size();
      }
      for (const auto& spare : spares_.chunks()) {
        if (spare.chunk.kept_by(b.serial)) kept += spare.chunk.memory->size();
      }
      // What a connection holds and keeps mapped stays within its quota: a
      // borrow is weighed against both, and a keep moves bytes from one to
      // the other.
      if (held == b.held_bytes && regions == b.held_regions && kept == b.kept_bytes &&
          held + kept <= config_.quota_bytes) {
        continue;
      }
      std::fprintf(stderr,
                   "shoal: the lender's books are broken: connection %llu counts %zu bytes in %zu regions held and "
                   "%zu kept mapped, its holds and kept mappings add up to %zu, %zu and %zu (quota %zu)\n",
                   static_cast<unsigned long long>(b.serial), b.held_bytes, b.held_regions, b.kept_bytes, held,
                   regions, kept, config_.quota_bytes);
      std::abort();
    }
  }

  static bool is_operator(uid_t uid) noexcept { return uid == ::geteuid() || uid == 0; }
  static constexpr const char* observer_note = "observer";

  // Counted in the limits: not failed nor hung up (those go at the end of
  // the loop's turn, and must not hold a place meanwhile).
  static bool live(const borrower_entry& b) noexcept { return !b.failed && !b.link.broken(); }

  template <class Which>
  std::size_t live_count(Which&& which) const noexcept {
    return static_cast<std::size_t>(
        std::count_if(borrowers_.begin(), borrowers_.end(), [&](const borrower_entry& b) { return live(b) && which(b); }));
  }

  std::size_t connections_of(bool operator_uid) const noexcept {
    return live_count([&](const borrower_entry& b) { return b.operator_uid == operator_uid; });
  }

  // A class's borrowers, and its connections greeted at once whose hello has
  // not come (each may be one): all but observers and the held back.
  std::size_t counted_borrowers(bool operator_uid) const noexcept {
    return live_count([&](const borrower_entry& b) {
      return !b.observer && !b.held_back && b.operator_uid == operator_uid;
    });
  }

  std::size_t observers_of(bool operator_uid) const noexcept {
    return live_count([&](const borrower_entry& b) { return b.observer && b.operator_uid == operator_uid; });
  }

  // Connections of a class greeted at once whose hello has not come: each
  // may turn out an observer.
  std::size_t unannounced_of(bool operator_uid) const noexcept {
    return live_count(
        [&](const borrower_entry& b) { return !b.greeted && !b.held_back && b.operator_uid == operator_uid; });
  }

  void store_counts() noexcept {
    borrower_count_.store(static_cast<std::size_t>(std::count_if(
        borrowers_.begin(), borrowers_.end(), [](const borrower_entry& b) { return b.greeted && !b.observer; })));
    observer_count_.store(static_cast<std::size_t>(
        std::count_if(borrowers_.begin(), borrowers_.end(), [](const borrower_entry& b) { return b.observer; })));
    connection_count_.store(borrowers_.size());
  }

  // `b`'s hello, a borrower's or an observer's. A held-back connection is
  // served (the lender's hello sent now) if its kind has room, else turned
  // away before any hello; one greeted at once had room for either kind.
  void greet(borrower_entry& b, const channel::frame& f) {
    static constexpr std::array<channel::protocol_id, 2> hellos{lending_protocol, detail::observer_protocol};
    bool observer = false;
    try {
      observer = channel::check_hello_one_of(f, hellos) == 1;
    } catch (const protocol_error&) {
      // A client of another protocol or version is told what it reached (its
      // own check of this hello names both), then closed for the error.
      if (b.held_back) {
        try {
          channel::send_hello(b.link, lending_protocol);
        } catch (const error&) {  // NOLINT(bugprone-empty-catch): closed all the same
        }
      }
      throw;
    }
    // One greeted at once had room for either kind when it was accepted (and
    // is among those counted as borrowers): only a held-back one can find none.
    // A held-back observer also leaves room to every connection greeted at
    // once whose hello has not come: each was promised room for either kind.
    const std::size_t now = class_count(b, observer);
    const std::size_t most = observer ? config_.max_observers : config_.max_borrowers;
    if (now >= most) {
      if (!b.held_back) throw peer_refused("lender: " + class_full(b, observer, now));  // not expected: past a bound
      // One with no room but for connections whose hello has not come waits
      // for them: each says which it is, or is hung up on, within the peer
      // timeout (a borrower's room comes if one turns out an observer, an
      // observer's if one turns out a borrower).
      if (settled_count(b, observer) < most) {
        await_room(b, observer);
        return;
      }
      turn_away(b, class_full(b, observer, now));
      return;
    }
    // Room comes to those awaiting it first, in the order they came.
    if (b.held_back && awaiting_room(b.operator_uid, observer)) {
      await_room(b, observer);
      return;
    }
    welcome(b, observer);
  }

  // Whether a connection of the class, of that kind, waits for room (admit_awaiting_room).
  bool awaiting_room(bool operator_uid, bool observer) const noexcept {
    return std::any_of(borrowers_.begin(), borrowers_.end(), [&](const borrower_entry& e) {
      return live(e) && e.room_awaited_until && e.operator_uid == operator_uid && e.awaits_as_observer == observer;
    });
  }

  void await_room(borrower_entry& b, bool observer) {
    b.room_awaited_until = clock_type::now() + config_.peer_timeout;
    b.awaits_as_observer = observer;
  }

  // What `b`'s kind has taken of its class's room, `b` left out: a
  // borrower's, every counted borrower (those greeted at once whose hello
  // has not come among them); a held-back observer's, the observers and
  // every connection greeted at once whose hello has not come; one greeted at
  // once had its room at the accept, so only the observers count.
  std::size_t class_count(const borrower_entry& b, bool observer) const noexcept {
    if (!observer) return counted_borrowers(b.operator_uid) - (b.held_back ? 0 : 1);
    return observers_of(b.operator_uid) + (b.held_back ? unannounced_of(b.operator_uid) : 0);
  }

  // What is taken of the class's room for good, for a held-back `b`: the
  // connections whose hello has not come left out (room beyond it may yet come).
  std::size_t settled_count(const borrower_entry& b, bool observer) const noexcept {
    return observer ? observers_of(b.operator_uid) : counted_borrowers(b.operator_uid) - unannounced_of(b.operator_uid);
  }

  std::string class_full(const borrower_entry& b, bool observer, std::size_t now) const {
    return "already " + std::to_string(now) +
           (observer ? " observers" : " borrowers (and connections yet to say which)") + " of " +
           (b.operator_uid ? "the lender's uid and root" : "other uids") + ", the most allowed";
  }

  // Hangs up on held-back `b` before any hello of the lender's: its connect is refused.
  void turn_away(borrower_entry& b, const std::string& why) {
    b.failed = true;
    emit(lender_event::kind::refused, b.link.peer(), 0, 0, why);
    count_refusal();
  }

  // Takes `b` on as an observer or a borrower; a held-back one is sent the
  // lender's hello now (a fresh socket has room for it).
  void welcome(borrower_entry& b, bool observer) {
    if (b.held_back) channel::send_hello(b.link, lending_protocol);
    b.held_back = false;
    b.greeted = true;
    b.observer = observer;
    store_counts();
    // Connected once its hello said which it is: the log tells observers apart.
    emit_noted(lender_event::kind::connected, b.link.peer(), observer ? observer_note : "");
  }

  // Held-back connections whose answer waits for room (greet), in the order
  // they came: each is taken on once its class has room for its kind, and
  // turned away once no connection whose hello has not come is left to make
  // room, or its wait is over. Once a turn, after the hang-ups.
  void admit_awaiting_room() {
    const auto now = clock_type::now();
    for (auto& b : borrowers_) {
      if (!b.room_awaited_until || b.failed) continue;
      const bool observer = b.awaits_as_observer;
      const std::size_t most = observer ? config_.max_observers : config_.max_borrowers;
      const std::size_t counted = class_count(b, observer);
      const bool may_come = settled_count(b, observer) < most;
      if (counted >= most && may_come && now < *b.room_awaited_until) continue;
      b.room_awaited_until.reset();
      if (counted >= most) {
        turn_away(b, class_full(b, observer, counted));
        continue;
      }
      try {
        welcome(b, observer);
      } catch (const error&) {
        b.failed = true;  // it hung up while its answer waited: no error of its
      }
    }
  }

  // The frames of `b` that have come whole (at most one batch's worth, so
  // that a flooding borrower leaves room for the others), until an answer
  // finds its socket full; a borrower that breaks the protocol or hangs up
  // ends up failed or broken, and the loop hangs up on it.
  void serve_one(borrower_entry& b) {
    try {
      // Nothing more is read from one awaiting room (frames after its hello wait).
      for (std::size_t served = 0; served < channel::max_batch_frames && !b.failed && !b.room_awaited_until;
           ++served) {
        // Once its batch's frames are handled, the socket is polled again
        // rather than read at once: no read that finds nothing. Once an
        // answer waits, the rest wait for it to go.
        if (served > 0 && (b.link.pending() == 0 || b.link.unsent_bytes() > 0)) return;
        std::optional<channel::frame> f = b.link.try_receive();
        if (!f) return;  // the rest of its batch has not come: read on when it does
        handle(b, *f);
      }
    } catch (const connection_closed&) {
      // It hung up: the loop reclaims.
    } catch (const std::exception& e) {
      // Malformed, not allowed, or a reply it did not read in time: this borrower only.
      close_for_error(b, e.what());
    }
  }

  void handle(borrower_entry& b, const channel::frame& f) {
    if (!b.greeted) return greet(b, f);
    if (b.observer && f.type != static_cast<std::uint16_t>(message_type::query_metrics) &&
        f.type != static_cast<std::uint16_t>(message_type::revoke_request)) {
      throw protocol_error("lender: an observer connection may send query_metrics and revoke_request only, not frame type " +
                           std::to_string(f.type));
    }
    if (f.type == static_cast<std::uint16_t>(message_type::cancel_wait)) {
      const std::uint64_t request = detail::decode_cancel_wait(f.payload);
      std::uint64_t waiting_request = 0;
      {
        std::lock_guard lock(mutex_);
        const auto* w = waiting_.find(b.serial);
        waiting_request = w != nullptr ? w->request.request : 0;
      }
      // A cancel for a borrow answered already crossed its answer: dropped.
      if (b.waiting && request == waiting_request) end_wait(b, "its borrower stopped waiting", true);
      return;
    }
    if (b.waiting) end_wait(b, "its borrower sent another request behind it", true);  // answers stay in order
    switch (static_cast<message_type>(f.type)) {
      case message_type::borrow:
        return lend(b, detail::decode_borrow(f.payload));
      case message_type::give_back:
        return take_back(b, detail::decode_give_back(f.payload));
      case message_type::publish:
        return publish(b, detail::decode_publish(f.payload));
      case message_type::borrow_shared:
        return lend_shared(b, detail::decode_borrow_shared(f.payload));
      case message_type::revoke_request:
        return revoke_for(b, detail::decode_revoke_request(f.payload));
      case message_type::query_metrics: {
        if (!f.payload.empty()) throw protocol_error("lender: query_metrics carries no payload");
        const std::string text = detail::prometheus_text(status(), detail::max_metrics_text);
        return post(b, {{static_cast<std::uint16_t>(message_type::metrics), std::as_bytes(std::span(text))}});
      }
      default:
        throw protocol_error(
            "lender: a borrower may send borrow, give_back, query_metrics, publish, borrow_shared, revoke_request and "
            "cancel_wait only, not "
            "frame type " +
            std::to_string(f.type));
    }
  }

  // Fails `b` (the loop hangs up on it) and names it with `why`, as far as
  // memory allows.
  void close_for_error(borrower_entry& b, std::string_view why) noexcept {
    b.failed = true;
    b.failed_why = nullptr;
    try {
      count_error();
      emit(lender_event::kind::closed_for_error, b.link.peer(), 0, 0, std::string(why));
    } catch (...) {  // NOLINT(bugprone-empty-catch): failed all the same
    }
  }

  // close_for_error with the text `why()` makes, or `fallback` when making
  // it runs out of memory.
  template <class Why>
  void close_for_error_saying(borrower_entry& b, const char* fallback, Why&& why) noexcept {
    try {
      const std::string text = why();
      close_for_error(b, text);
    } catch (...) {
      close_for_error(b, fallback);
    }
  }

  // Under mutex_: the keepers of `chunk` keep mapped memory that is
  // released without their being told (no memory left to tell them): each
  // is failed, and the loop hangs up on it.
  void fail_keepers_locked(const detail::chunk_record& chunk) noexcept {
    for (auto& b : borrowers_) {
      if (!chunk.kept_by(b.serial)) continue;
      b.kept_bytes -= chunk.memory->size();
      if (b.failed) continue;
      b.failed = true;
      b.failed_why = "memory it keeps mapped was released when the lender ran out of memory to keep it as a spare";
    }
  }

  // An event for `events`, made by `make`; left out when memory runs out
  // (an event only reports: the change it reports stands).
  template <class Make>
  static void note(std::vector<lender_event>& events, Make&& make) noexcept {
    try {
      events.push_back(make());
    } catch (...) {  // NOLINT(bugprone-empty-catch)
    }
  }

  // is_alive, or true when it cannot be told (out of memory): an orphaned
  // hold is checked again later.
  // Whether `link` has something to read now (its hello, say, not served yet).
  static bool readable(const channel::connection& link) noexcept {
    pollfd p{link.native_handle(), POLLIN, 0};
    return link.pending() > 0 || ::poll(&p, 1, 0) > 0;
  }

  static bool alive_or_unknown(const process_identity& process) noexcept {
    try {
      return is_alive(process);
    } catch (...) {
      return true;
    }
  }

  // Sends `frames` to `b` without waiting on it (connection::post): what
  // its socket does not take waits in its queue, written out as the loop
  // finds it writable. Nothing more is sent to a failed one.
  void post(borrower_entry& b, std::span<const channel::outgoing_frame> frames) {
    if (b.failed) return;
    b.link.post(frames);
  }
  void post(borrower_entry& b, std::initializer_list<channel::outgoing_frame> frames) {
    post(b, std::span(frames.begin(), frames.size()));
  }

  // Writes what `b`'s socket takes of its queued answers.
  void flush_one(borrower_entry& b) {
    try {
      (void)b.link.flush();
    } catch (const connection_closed&) {
      // It hung up: the loop reclaims.
    } catch (const std::exception& e) {
      close_for_error(b, e.what());
    }
  }

  // Fails each borrower that sent no hello, sent part of a batch and not
  // the rest, or left an answer queued (read in part or not at all), for
  // peer_timeout: the loop hangs up on it and reclaims its regions. (Silent
  // connections would otherwise hold borrower slots for ever.)
  void hang_up_stalled() noexcept {
    const auto now = clock_type::now();
    const auto timeout_ms = [&] { return std::to_string(config_.peer_timeout.count()); };
    for (auto& b : borrowers_) {
      if (b.failed) continue;
      if (!b.greeted && !b.room_awaited_until && now - b.accepted >= config_.peer_timeout && !readable(b.link)) {
        close_for_error_saying(b, "it sent no hello within the peer timeout", [&] {
          return "it sent no hello within the peer timeout of " + timeout_ms() + " ms";
        });
        continue;
      }
      const auto since = b.link.incomplete_since();
      if (since && now - *since >= config_.peer_timeout) {
        close_for_error_saying(b, "it sent part of a batch and not the rest within the peer timeout", [&] {
          return "it sent part of a batch and not the rest within the peer timeout of " + timeout_ms() + " ms";
        });
        continue;
      }
      const auto queued = b.link.unsent_since();
      if (queued && now - *queued >= config_.peer_timeout) {
        close_for_error_saying(b, "it left an answer unread for longer than the peer timeout", [&] {
          return "it left an answer unread for longer than the peer timeout of " + timeout_ms() + " ms (" +
                 std::to_string(b.link.unsent_bytes()) + " bytes of answers still wait for it)";
        });
      }
    }
  }

  void lend(borrower_entry& b, const detail::borrow_message& m) {
    {
      std::lock_guard lock(mutex_);
      ++counters_.requests;
    }
    const std::size_t granularity = device_.granularity();
    const std::size_t bytes = detail::round_up(static_cast<std::size_t>(m.bytes), granularity);
    if (bytes == 0 || bytes > config_.capacity_bytes) {
      const std::string rounded = bytes == m.bytes ? std::string()
                                                    : " (" + std::to_string(bytes) +
                                                          " rounded up to the device's granularity)";
      return send_refusal(b, m.request, refusal::cannot_fit,
                          std::to_string(m.bytes) + " bytes" + rounded + " is more than the lender's capacity of " +
                              std::to_string(config_.capacity_bytes));
    }
    if (m.wait_ms > 0 && b.held_bytes + bytes > config_.capacity_bytes) {
      return send_refusal(b, m.request, refusal::cannot_fit,
                          "this borrower holds " + std::to_string(b.held_bytes) + " bytes, and " +
                              std::to_string(bytes) + " more would pass the lender's capacity of " +
                              std::to_string(config_.capacity_bytes) +
                              ": waiting cannot make it fit (nothing is given back on a connection while its borrow "
                              "waits)");
    }
    if (auto refused = quota_refusal(b, bytes)) return send_refusal(b, m.request, refused->reason, refused->why);
    // The serving thread, the line's only writer, reads it unlocked. Borrows
    // waiting behind hold up only their own uid's.
    refresh_behind();
    // Read once: the borrow goes in line marked as it was weighed here.
    const bool asker_behind = behind(b.link.peer().uid, clock_type::now());
    const bool others_wait = waiting_.first_waits() || (!waiting_.empty() && asker_behind);
    if (others_wait && m.wait_ms == 0) {
      return send_refusal(b, m.request, refusal::others_waiting,
                          "borrows wait for memory ahead of this one, which does not wait: memory given back goes "
                          "to them first (borrow with a wait to take a place in line)");
    }
    bool refused_by_device = false;
    if (!others_wait) {
      const auto no_room = try_lend(b, m, bytes);
      if (!no_room) return;
      if (m.wait_ms == 0) {
        return send_refusal(b, m.request, refusal::capacity,
                            no_room->why + "; the lender refuses at once, as this borrow asked (borrow with a wait to "
                                       "wait for memory to be given back), or revoke a region");
      }
      refused_by_device = no_room->device_refused;
    }
    if (const std::uint64_t revoking = region_being_revoked_from(b.serial); revoking != 0) {
      return send_refusal(b, m.request, refusal::cannot_fit,
                          "this borrower is asked to give region " + std::to_string(revoking) +
                              " back; it may not wait for memory until it has (nothing is given back on a "
                              "connection while its borrow waits)");
    }
    wait_for_room(b, m, bytes, asker_behind);
    // With no one ahead (borrows behind at most) it is the head: when the
    // device (not the capacity) refused it, no give back would bring it round
    // again, so the periodic check tries it (other processes may free the
    // device's memory).
    if (!others_wait) head_refused_by_device_ = refused_by_device;
  }

  // Why `b` may not hold an exclusive region of `bytes` more (its region
  // count, its quota, its uid's quota); nullopt when it may. Memory kept
  // mapped counts, but only as far as dropping it could not make the room:
  // it is dropped when the region is lent (forget_kept_for, from try_lend),
  // not for a borrow that is refused or waits.
  std::optional<refused_request> quota_refusal(const borrower_entry& b, std::size_t bytes) const {
    if (b.held_regions >= config_.max_regions_per_borrower) {
      return refused_request{refusal::quota,
                             "this borrower holds " + std::to_string(b.held_regions) + " regions, the most it may"};
    }
    const kept_room room = room_in_kept(b, exclusive_cost(b, bytes));
    if (room.borrower_over > room.borrower_may_drop) {
      return refused_request{refusal::quota, "this borrower holds " + std::to_string(b.held_bytes) + " bytes" +
                                                 kept_note(b) + "; " + std::to_string(bytes) +
                                                 " more would pass its quota of " +
                                                 std::to_string(config_.quota_bytes)};
    }
    if (room.uid_over > room.uid_may_drop) {
      // What its other connections wait for counts too: a uid cannot fill
      // the line past its quota.
      const uid_t uid = b.link.peer().uid;
      const std::size_t waits = waiting_by_uid(uid, b.serial);
      return refused_request{
          refusal::quota, "uid " + std::to_string(uid) + " holds " + std::to_string(held_by_uid(uid)) +
                              " bytes over all its connections, orphaned regions and memory they keep mapped" +
                              (waits > 0 ? " and waits for " + std::to_string(waits) + " more" : "") + "; " +
                              std::to_string(bytes) + " more would pass its per-uid quota of " +
                              std::to_string(config_.quota_bytes_per_uid)};
    }
    return std::nullopt;
  }

  // What `b` keeps mapped, for a quota refusal: empty when nothing.
  static std::string kept_note(const borrower_entry& b) {
    if (b.kept_bytes == 0) return {};
    return " and keeps " + std::to_string(b.kept_bytes) + " more mapped (given back, kept for reuse)";
  }

  // What a new hold adds to what its borrower counts against its quota and
  // to what its uid counts against the per-uid quota: its bytes, or nothing
  // where the count has its memory already (a spare lent again to a
  // connection that keeps it mapped; for the uid, one any of its
  // connections keeps mapped).
  struct hold_cost {
    std::size_t to_borrower = 0;
    std::size_t to_uid = 0;
    const detail::lendable_memory* reused = nullptr;  // the spare it would be lent, if any
  };

  // An exclusive region of `bytes` for `b`: acquire() lends it the spare
  // spares_.find() names, when reuse is on and one fits.
  hold_cost exclusive_cost(const borrower_entry& b, std::size_t bytes) const {
    hold_cost cost{bytes, bytes, nullptr};
    if (config_.reuse != reuse_policy::same_uid) return cost;
    std::lock_guard lock(mutex_);
    const detail::spare_chunk* spare = spares_.find(bytes, b.link.peer().uid, b.serial);
    if (spare == nullptr) return cost;
    cost.reused = spare->chunk.memory.get();
    if (spare->chunk.kept_by(b.serial)) cost.to_borrower = 0;
    if (!spare->chunk.keepers.empty()) cost.to_uid = 0;
    return cost;
  }

  // How far a new hold of `cost` would take `b` past its quota and its uid
  // past the per-uid quota, and how much of each count dropping kept
  // mappings could free (never the spare the hold gets).
  struct kept_room {
    std::size_t borrower_over = 0;
    std::size_t uid_over = 0;
    std::size_t borrower_may_drop = 0;  // what b keeps mapped
    std::size_t uid_may_drop = 0;       // its uid's spares kept mapped
  };
  kept_room room_in_kept(const borrower_entry& b, const hold_cost& cost) const {
    const auto over = [](std::size_t count, std::size_t quota) { return count > quota ? count - quota : 0; };
    const uid_t uid = b.link.peer().uid;
    kept_room room;
    room.borrower_over = over(b.held_bytes + b.kept_bytes + cost.to_borrower, config_.quota_bytes);
    // A hold that adds nothing to what its uid counts passes the per-uid quota.
    if (config_.quota_bytes_per_uid != 0 && cost.to_uid != 0) {
      room.uid_over =
          over(held_by_uid(uid) + waiting_by_uid(uid, b.serial) + cost.to_uid, config_.quota_bytes_per_uid);
    }
    std::lock_guard lock(mutex_);
    const std::size_t reused_by_b = cost.reused != nullptr && cost.to_borrower == 0 ? cost.reused->size() : 0;
    room.borrower_may_drop = b.kept_bytes - reused_by_b;
    for (const auto& spare : spares_.chunks()) {
      const bool counted = spare.uid == uid && !spare.chunk.keepers.empty();
      room.uid_may_drop += counted && spare.chunk.memory.get() != cost.reused ? spare.chunk.memory->size() : 0;
    }
    return room;
  }

  // A kept mapping forget_kept_for drops: its memory, and the connections
  // told to forget it (empty: the borrower alone).
  struct kept_drop {
    const detail::lendable_memory* memory;
    std::vector<std::uint64_t> keepers;
  };
  // Room for every drop forget_kept_for could make for `b`: its uid's spares
  // kept mapped and the regions `b` keeps mapped (keepers only go until it
  // runs, and no spare or region comes).
  std::vector<kept_drop> room_for_drops(const borrower_entry& b) const {
    std::vector<kept_drop> drops;
    std::lock_guard lock(mutex_);
    const uid_t uid = b.link.peer().uid;
    std::size_t candidates = 0;
    for (const auto& spare : spares_.chunks()) candidates += spare.uid == uid && !spare.chunk.keepers.empty() ? 1 : 0;
    for (const auto& [id, r] : regions_) candidates += r.chunk.kept_by(b.serial) ? 1 : 0;
    drops.reserve(candidates);
    return drops;
  }

  // Makes room for `cost` within `b`'s quota and its uid's by dropping kept
  // mappings, oldest first, as many as it takes: `b`'s own for its quota
  // (spares, then regions lent to its uid's other connections), every
  // keeper of its uid's spares for the uid's. Each keeper dropped is told to
  // forget the memory, as when a spare is released; the spare stays, and is
  // lent again with its chunk. Drops none when dropping all would not make
  // the room (quota_refusal refuses such a hold), and never the spare the
  // hold gets.
  // `forgotten`: room_for_drops(), taken before the hold's memory was (the
  // drops allocate nothing, so memory running out cannot part a lend from
  // its drops).
  void forget_kept_for(borrower_entry& b, const hold_cost& cost, std::vector<kept_drop>& forgotten) {
    const kept_room room = room_in_kept(b, cost);
    const std::size_t borrower_over = room.borrower_over;
    const std::size_t uid_over = room.uid_over;
    if ((borrower_over == 0 && uid_over == 0) || room.borrower_may_drop < borrower_over ||
        room.uid_may_drop < uid_over) {
      return;
    }
    const uid_t uid = b.link.peer().uid;
    {
      std::lock_guard lock(mutex_);
      std::size_t borrower_freed = 0;
      std::size_t uid_freed = 0;
      spares_.visit_keepers([&](const detail::spare_chunk& spare, std::vector<std::uint64_t>& keepers) {
        if (borrower_freed >= borrower_over && uid_freed >= uid_over) return false;
        const std::size_t size = spare.chunk.memory->size();
        if (spare.chunk.memory.get() == cost.reused || keepers.empty()) return true;
        const bool kept_by_b = spare.chunk.kept_by(b.serial);  // then it is of b's uid
        if (uid_freed < uid_over && spare.uid == uid) {
          forgotten.push_back({spare.chunk.memory.get(), std::move(keepers)});
          keepers.clear();
        } else if (borrower_freed < borrower_over && kept_by_b) {
          forgotten.push_back({spare.chunk.memory.get(), {}});
          std::erase(keepers, b.serial);
        } else {
          return true;
        }
        borrower_freed += kept_by_b ? size : 0;
        uid_freed += keepers.empty() ? size : 0;
        return true;
      });
      for (auto& [id, r] : regions_) {
        if (borrower_freed >= borrower_over) break;
        if (!r.chunk.drop_keeper(b.serial)) continue;
        forgotten.push_back({r.chunk.memory.get(), {}});
        borrower_freed += r.chunk.memory->size();
      }
    }
    for (const auto& d : forgotten) {
      tell_to_forget(d.keepers.empty() ? std::span<const std::uint64_t>(&b.serial, 1) : d.keepers, *d.memory);
    }
  }

  // Lends `bytes` for `m` to `b` when memory allows (the answer posted, a
  // device failure refused); otherwise answers nothing and says why there is
  // no room. A borrow `from_line` (`m` not in the line: it goes) leaves the
  // line in the step that answers it.
  struct no_room {
    std::string why;
    bool device_refused = false;  // the device, not the capacity
  };
  std::optional<no_room> try_lend(borrower_entry& b, const detail::borrow_message& m, std::size_t bytes,
                                  bool from_line = false) {
    std::vector<kept_drop> drops = room_for_drops(b);
    std::optional<detail::chunk_record> chunk;
    try {
      chunk = acquire(b, bytes);
    } catch (const out_of_memory& e) {
      return no_room{std::string("the device has not that much: ") + e.what(), true};
    } catch (const error& e) {
      if (from_line) leave_line(b.serial);
      send_refusal(b, m.request, refusal::device_error, e.what());
      return std::nullopt;
    }
    if (!chunk) {
      std::size_t left = 0;
      {
        std::lock_guard lock(mutex_);
        left = config_.capacity_bytes - lent_bytes_;
      }
      return no_room{std::to_string(bytes) + " bytes asked (rounded up to whole chunks), " + std::to_string(left) +
                     " left of the lender's capacity of " + std::to_string(config_.capacity_bytes) +
                     " (after releasing the given-back memory it kept for reuse)"};
    }
    // A spare a connection of the uid keeps mapped counted for the uid
    // already: lent again, it adds nothing there (as exclusive_cost weighed it).
    const bool uid_keeps = !chunk->keepers.empty();
    // The connection's kept mapping, if it has one, becomes the region's.
    const bool kept = chunk->drop_keeper(b.serial);
    const detail::lendable_memory& memory = *chunk->memory;
    if (kept) b.kept_bytes -= memory.size();  // counted in held_bytes below instead
    // The room quota_refusal found within the quotas is made now that the
    // region is lent: its chunk, out of the pools, counts for the borrower in
    // full, and for the uid unless the uid kept it mapped.
    forget_kept_for(b, {bytes, uid_keeps ? 0 : bytes, nullptr}, drops);
    const std::uint64_t id = next_region_++;
    {
      std::lock_guard lock(mutex_);
      region_entry r;
      r.chunk = std::move(*chunk);
      try {
        r.info = {id, memory.id(), bytes, m.purpose, m.mode, region_state::lent, b.link.peer().process,
                  b.link.peer().uid, {}};
        r.since = clock_type::now();
        r.holds.push_back({b.serial, b.link.peer().process, b.link.peer().uid});
        regions_.emplace(id, std::move(r));
      } catch (const std::bad_alloc&) {
        // Not lent: its memory goes with r (b is closed for the error), and
        // whoever kept it mapped as a spare cannot be told to forget it.
        fail_keepers_locked(r.chunk);
        throw;
      }
      lent_bytes_ += bytes;
      counters_.kept_mappings_used += kept ? 1 : 0;
      if (from_line) leave_line_locked(b.serial);
    }
    b.held_bytes += bytes;
    ++b.held_regions;
    // Counted before it goes: a hang-up now is reclaimed. The event comes
    // after the reply (also when sending fails), so a slow log does not delay it.
    try {
      send_region(b, m.request, id, memory, kept ? nullptr : &memory.handle(), nullptr);
    } catch (...) {
      emit(lender_event::kind::lent, b.link.peer(), id, bytes, m.purpose);
      throw;
    }
    emit(lender_event::kind::lent, b.link.peer(), id, bytes, m.purpose);
    return std::nullopt;
  }

  // Puts `b`'s borrow last in line, its wait cut to config_.max_wait — behind
  // the other uids' when its uid is behind: the loop reads `b` no further
  // until it is answered (serve_waiting).
  void wait_for_room(borrower_entry& b, const detail::borrow_message& m, std::size_t bytes, bool goes_behind) {
    const auto now = clock_type::now();
    const auto wait = std::min(std::chrono::milliseconds(m.wait_ms), config_.max_wait);
    {
      std::lock_guard lock(mutex_);
      const std::uint64_t head = waiting_.empty() ? 0 : waiting_.head().serial;
      waiting_.push({b.serial, b.link.peer().process, b.link.peer().uid, m, bytes, now, now + wait, goes_behind});
      ++counters_.waits;
      // Ahead of the borrows marked behind (its uid's stretch lapsed since they
      // came): it was not tried, so it is. (Into an empty line it just was.)
      if (head != 0) note_head_change(head);
    }
    b.waiting = true;
    emit(lender_event::kind::waiting, b.link.peer(), 0, bytes,
         m.purpose + ": waits up to " + std::to_string(wait.count()) + " ms for memory to be given back" +
             (goes_behind ? ", behind other uids' borrows (a wait of its uid ran out lately)" : ""));
  }

  // Whether `uid`'s borrows wait behind the other uids' at `now`. Serving
  // thread only.
  bool behind(uid_t uid, clock_type::time_point now) const noexcept {
    const auto it = behind_.find(uid);
    return it != behind_.end() && now < it->second.until;
  }

  // Waiting borrow `w` ended unserved at `end` (it ran out, its borrower
  // ended it, or it was refused at its turn): its uid's borrows go behind
  // the other uids' for as long as it held the line — its wait less the time
  // its uid already waited behind meanwhile (the last such stretch; earlier
  // ones count as held, which errs against the uid). Serving thread only.
  void put_behind(const detail::waiting_borrow& w, clock_type::time_point end) noexcept {
    const auto now = clock_type::now();
    // A stretch over for longer than any wait lasts overlaps no wait again.
    std::erase_if(behind_, [&](const auto& entry) { return entry.second.until + config_.max_wait <= now; });
    clock_type::duration held = std::min(end, w.until) - w.since;  // a wait lasts until its `until` at most
    const auto it = behind_.find(w.uid);
    if (it != behind_.end()) {
      const auto from = std::max(w.since, it->second.start);
      const auto to = std::min(end, it->second.until);
      if (to > from) held -= to - from;
    }
    if (held <= clock_type::duration::zero()) return;
    try {
      behind_period& p = behind_[w.uid];
      if (now < p.until) {
        p.until = std::max(p.until, now + held);
      } else {
        p = {now, now + held};
      }
    } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): no memory: the uid keeps its place
    }
  }

  // Marks the waiting borrows behind or not as their uids are now (a
  // stretch behind may have begun or lapsed); a new head may fit. Under
  // mutex_ (status reads the marks), on the serving thread.
  void mark_behind_locked() noexcept {
    const auto now = clock_type::now();
    if (waiting_.mark_behind([&](uid_t uid) { return behind(uid, now); })) room_changed_ = true;
  }
  void refresh_behind() noexcept {
    if (waiting_.empty()) return;  // the serving thread, the line's only writer, reads it unlocked
    std::lock_guard lock(mutex_);
    mark_behind_locked();
  }

  // Refuses `b`'s waiting borrow now and takes it out of the line: it
  // stopped waiting (`why`). One its borrower ended (`by_borrower`) puts its
  // uid behind as one that ran out would: else ending each wait just before
  // it runs out and asking again would keep a uid at the head for good.
  void end_wait(borrower_entry& b, const char* why, bool by_borrower) {
    std::optional<detail::waiting_borrow> w;
    {
      std::lock_guard lock(mutex_);
      const std::uint64_t head = waiting_.empty() ? 0 : waiting_.head().serial;
      w = waiting_.take(b.serial);
      note_head_change(head);
    }
    if (w && by_borrower) {
      put_behind(*w, clock_type::now());
      refresh_behind();
    }
    b.waiting = false;
    if (w) send_refusal(b, w->request.request, refusal::stopped_waiting, std::string("stopped waiting for memory: ") + why);
  }

  // Refuses each waiting borrow whose wait has run out, then serves the
  // line in order while memory allows: the head first, the rest behind it.
  void serve_waiting() noexcept {
    // The serving thread is the line's only writer: it reads it unlocked.
    if (waiting_.empty()) return;
    std::vector<detail::waiting_borrow> expired;
    {
      std::lock_guard lock(mutex_);
      const std::uint64_t head = waiting_.head().serial;
      try {
        expired = waiting_.take_expired(clock_type::now());
      } catch (const std::bad_alloc&) {
        return;  // looked at again on the next turn
      }
      counters_.waits_expired += expired.size();
      note_head_change(head);
    }
    for (const auto& w : expired) put_behind(w, w.until);
    refresh_behind();
    for (auto& w : expired) {
      borrower_entry* b = connected(w.serial);
      if (b == nullptr) continue;
      b->waiting = false;
      answer_waiting(*b, [&] {
        const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(w.until - w.since).count();
        const bool cut = waited < static_cast<std::int64_t>(w.request.wait_ms);
        send_refusal(*b, w.request.request, refusal::wait_expired,
                     std::to_string(w.bytes) + " bytes asked (rounded up to whole chunks); waited " +
                         std::to_string(waited) + " ms" +
                         (cut ? " (the lender's longest wait; " + std::to_string(w.request.wait_ms) + " asked)" : "") +
                         " and not that much was given back (" + room_left() + ")");
      });
    }
    while (room_changed_ && !waiting_.empty()) {
      // Read in place: only this thread changes the line, and `head` is not
      // read once its answer took it out (leave_line).
      const detail::waiting_borrow& head = waiting_.head();
      const std::uint64_t serial = head.serial;
      borrower_entry* b = connected(serial);
      bool served = b == nullptr;  // one gone since is skipped
      if (b != nullptr) {
        answer_waiting(*b, [&] {
          // Copied: an answer takes `head` out of the line as it goes.
          const detail::borrow_message request = head.request;
          const std::size_t bytes = head.bytes;
          if (auto refused = quota_refusal(*b, bytes)) {
            // Ended unserved at its turn, as one that ran out (else a uid could
            // have its head wait refused so, just before it runs out).
            put_behind(head, clock_type::now());
            leave_line(serial);
            send_refusal(*b, request.request, refused->reason, refused->why);
            served = true;
            return;
          }
          const auto no_room = try_lend(*b, request, bytes, true);
          served = !no_room;
          head_refused_by_device_ = no_room && no_room->device_refused;
        });
        // A failure above closes b: its place goes too.
        served = served || b->failed;
      }
      if (!served) {
        // Tried again when memory is given back, the head changes, or —
        // when the device refused — at the next periodic check.
        room_changed_ = false;
        break;
      }
      if (b != nullptr) b->waiting = false;
      head_refused_by_device_ = false;
      if (b == nullptr || b->failed) leave_line(serial);  // gone or closed above: answered ones left already
    }
  }

  // Takes connection `serial`'s borrow out of the line; before its answer
  // goes, so that status never shows a borrow both answered and waiting.
  void leave_line(std::uint64_t serial) noexcept {
    std::lock_guard lock(mutex_);
    leave_line_locked(serial);
  }
  void leave_line_locked(std::uint64_t serial) noexcept {
    (void)waiting_.take(serial);
    mark_behind_locked();  // a refusal may have put its uid behind
  }

  // Under mutex_: the head was `before`; memory may fit a new one.
  void note_head_change(std::uint64_t before) noexcept {
    if (waiting_.empty() || waiting_.head().serial != before) {
      room_changed_ = true;
      head_refused_by_device_ = false;
    }
  }

  // Runs `answer` for the waiting borrower `b`; an error closes `b` only.
  template <class Answer>
  void answer_waiting(borrower_entry& b, Answer&& answer) noexcept {
    try {
      answer();
    } catch (const connection_closed&) {
      b.failed = true;  // it hung up: the loop reclaims
    } catch (const std::exception& e) {
      close_for_error(b, e.what());
    } catch (...) {
      close_for_error(b, "answering its waiting borrow failed");
    }
  }

  // The connected, usable borrower of connection `serial`, or nullptr.
  borrower_entry* connected(std::uint64_t serial) noexcept {
    for (auto& b : borrowers_) {
      if (b.serial == serial) return b.failed || b.link.broken() ? nullptr : &b;
    }
    return nullptr;
  }

  // When the first waiting borrow's wait runs out; nullopt when none waits.
  std::optional<clock_type::time_point> next_wait_expiry() const {
    if (waiting_.empty()) return std::nullopt;  // the serving thread, its only writer, reads it unlocked
    std::lock_guard lock(mutex_);
    return waiting_.next_expiry();
  }

  // When the first stretch behind that a waiting borrow is marked with
  // lapses (serve_waiting then marks it first-class: it may be the new
  // head); time_point::max() when none. Serving thread only.
  clock_type::time_point next_behind_lapse(clock_type::time_point now) const noexcept {
    auto first = clock_type::time_point::max();
    if (waiting_.empty()) return first;  // the serving thread, the line's only writer, reads it unlocked
    for (const auto& [uid, period] : behind_) {
      if (period.until > now && waiting_.marked_behind(uid)) first = std::min(first, period.until);
    }
    return first;
  }

  // The capacity's state, for a refusal.
  std::string room_left() const {
    std::lock_guard lock(mutex_);
    return std::to_string(config_.capacity_bytes - lent_bytes_) + " of the capacity of " +
           std::to_string(config_.capacity_bytes) + " not lent";
  }

  // Memory of `bytes` for `b`: a spare of its uid when reuse allows, else a
  // prepared chunk of that size, else a fresh chunk (fresh_chunk). nullopt
  // when it does not fit even so; the device's errors propagate.
  std::optional<detail::chunk_record> acquire(const borrower_entry& b, std::size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      if (config_.reuse == reuse_policy::same_uid) {
        if (auto spare = spares_.take(bytes, b.link.peer().uid, b.serial)) {
          ++counters_.reuses;
          return std::move(spare->chunk);
        }
      }
      if (auto prepared = prepared_.take(bytes)) {
        ++counters_.prepared_used;
        return prepared;
      }
    }
    return fresh_chunk(bytes);
  }

  // A fresh chunk of `bytes`, room made within the capacity by releasing
  // spares (oldest first), then prepared chunks when that makes it fit;
  // nullopt when it does not fit even so. When the device refuses it, every spare and prepared
  // chunks of `bytes` are released and it is tried once more.
  std::optional<detail::chunk_record> fresh_chunk(std::size_t bytes) {
    {
      // Past what releasing every spare and prepared chunk could make room
      // for: nothing is released for it.
      std::lock_guard lock(mutex_);
      if (lent_bytes_ + bytes > config_.capacity_bytes) return std::nullopt;
    }
    const std::string why = "a fresh region of " + std::to_string(bytes) + " bytes needed the room";
    // One at a time, each released (its keepers told) as it leaves the pool:
    // none is lost unannounced when memory runs out.
    for (;;) {
      std::optional<detail::spare_chunk> oldest;
      {
        std::lock_guard lock(mutex_);
        if (lent_bytes_ + spares_.bytes() + prepared_.bytes() + bytes <= config_.capacity_bytes) break;
        oldest = spares_.take_oldest();
      }
      if (!oldest) break;
      release_spare(std::move(*oldest), why);
    }
    std::vector<detail::chunk_record> unused;
    {
      std::lock_guard lock(mutex_);
      // Prepared chunks go only when that makes the region fit.
      const std::size_t without_prepared = lent_bytes_ + spares_.bytes() + bytes;
      const std::size_t with_prepared = without_prepared + prepared_.bytes();
      if (with_prepared > config_.capacity_bytes && without_prepared <= config_.capacity_bytes) {
        unused = prepared_.take_at_least(with_prepared - config_.capacity_bytes);
      }
    }
    release_prepared(std::move(unused), why);
    {
      std::lock_guard lock(mutex_);
      if (lent_bytes_ + spares_.bytes() + prepared_.bytes() + bytes > config_.capacity_bytes) return std::nullopt;
    }
    std::unique_ptr<detail::lendable_memory> memory;
    try {
      memory = std::make_unique<detail::lendable_memory>(device_, bytes, next_memory_++);
    } catch (const out_of_memory&) {
      // The device has less than the capacity (other processes use it): what
      // the lender keeps unlent goes back, and the chunk is tried once more.
      const std::string refused = "the device refused a fresh chunk of " + std::to_string(bytes) + " bytes";
      for (;;) {
        std::optional<detail::spare_chunk> spare;
        {
          std::lock_guard lock(mutex_);
          spare = spares_.take_oldest();
        }
        if (!spare) break;
        release_spare(std::move(*spare), refused);
      }
      std::vector<detail::chunk_record> prepared;
      {
        std::lock_guard lock(mutex_);
        prepared = prepared_.take_at_least(bytes);
      }
      release_prepared(std::move(prepared), refused);
      memory = std::make_unique<detail::lendable_memory>(device_, bytes, next_memory_++);
    }
    std::lock_guard lock(mutex_);
    ++counters_.chunks_made;
    return detail::chunk_record{std::move(memory), {}};
  }

  // Releases a spare chunk taken out of the pool, telling each connection
  // that keeps it mapped to forget it (one that cannot be told is hung up
  // on). On the serving thread.
  void release_spare(detail::spare_chunk spare, const std::string& why) noexcept {
    const std::uint64_t memory = spare.chunk.memory->id();
    const std::size_t size = spare.chunk.memory->size();
    tell_to_forget(spare.chunk.keepers, *spare.chunk.memory);
    spare.chunk.memory.reset();
    try {
      emit(lender_event{lender_event::kind::spare_released, {}, spare.uid, 0, size,
                        "memory " + std::to_string(memory) + ": " + why});
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to say so
    }
  }

  // Releases prepared chunks taken out of their pool (never lent: nobody
  // keeps them mapped). On the serving thread.
  void release_prepared(std::vector<detail::chunk_record> unused, const std::string& why) noexcept {
    for (auto& chunk : unused) {
      const std::uint64_t memory = chunk.memory->id();
      const std::size_t size = chunk.memory->size();
      chunk.memory.reset();
      try {
        emit(lender_event{lender_event::kind::spare_released, {}, 0, 0, size,
                          "prepared memory " + std::to_string(memory) + ": " + why});
      } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to say so
      }
    }
  }

  // Sends forget for `memory` to each connection in `keepers`, which keep
  // it mapped no more (taken out of its keepers already). On the serving
  // thread; a broken link is hung up on by the loop.
  void tell_to_forget(std::span<const std::uint64_t> keepers, const detail::lendable_memory& chunk) noexcept {
    const std::uint64_t memory = chunk.id();
    for (auto& b : borrowers_) {
      if (std::find(keepers.begin(), keepers.end(), b.serial) == keepers.end()) continue;
      b.kept_bytes -= chunk.size();
      try {
        const auto forget = detail::encode_forget(memory);
        post(b, {{static_cast<std::uint16_t>(message_type::forget), view(forget)}});
      } catch (const connection_closed&) {
        // It hung up: the loop reclaims.
      } catch (const std::exception& e) {
        // Not sent (the system refused it, or memory ran out): the borrower
        // would keep the mapping unknowingly, so the loop hangs up on it.
        close_for_error_saying(b, "a forget could not be sent to it", [&] {
          return "forget for memory " + std::to_string(memory) + " could not be sent: " + e.what();
        });
      }
      std::lock_guard lock(mutex_);
      ++counters_.forgets;
    }
  }

  // Sends lent, the chunk frame (none when `handle` is null: the borrower
  // keeps the memory mapped) and, for a reader, the layout frame, in one batch.
  void send_region(borrower_entry& b, std::uint64_t request, std::uint64_t id, const detail::lendable_memory& memory,
                   const backend::shareable_handle* handle, const region_layout* layout) {
    const auto lent = detail::encode(
        detail::lent_message{request, id, memory.id(), memory.size(), handle != nullptr ? 1u : 0u});
    std::vector<channel::outgoing_frame> frames{{static_cast<std::uint16_t>(message_type::lent), view(lent)}};
    std::vector<std::byte> chunk;
    if (handle != nullptr) {
      chunk = handle->serialize();
      frames.push_back({static_cast<std::uint16_t>(message_type::chunk), view(chunk),
                        backend::carries_fd(handle->kind) ? handle->fd.get() : -1});
    }
    std::vector<std::byte> described;
    if (layout != nullptr) {
      described = detail::encode(detail::layout_message{request, *layout});
      frames.push_back({static_cast<std::uint16_t>(message_type::layout), view(described)});
    }
    post(b, frames);
  }

  // The writer's exclusive region becomes shared under its purpose, with the
  // layout it sent; the writer (who unmapped it first) gets it back to map
  // read-only, its hold unchanged.
  void publish(borrower_entry& b, const detail::publish_message& m) {
    {
      std::lock_guard lock(mutex_);
      ++counters_.requests;
    }
    auto refuse = [&](refusal reason, std::string why) { send_refusal(b, m.request, reason, why); };
    std::string why;  // set when it is refused, for `reason`
    refusal reason = refusal::bad_request;
    std::size_t bytes = 0;
    std::string name;
    {
      std::lock_guard lock(mutex_);
      const auto it = regions_.find(m.region);
      const bool held = it != regions_.end() && it->second.holds.front().borrower == b.serial;
      if (!held || it->second.info.mode != region_mode::exclusive) {
        why = "region " + std::to_string(m.region) + " is not an exclusive region this borrower holds";
      } else if (it->second.info.state != region_state::lent) {
        why = "region " + std::to_string(m.region) + " is being revoked; give it back instead of publishing it";
      } else if (const auto other = published_named(it->second.info.purpose); other != 0) {
        why = "region " + std::to_string(other) + " is published as '" + it->second.info.purpose +
              "' already; borrow the region under another purpose to publish it, or wait until that one is gone";
      } else if (auto problem = layout_problem(m.layout, it->second.info.bytes); !problem.empty()) {
        why = "the layout is malformed: " + problem;
      } else {
        bytes = it->second.info.bytes;
        name = it->second.info.purpose;
      }
    }
    if (!why.empty()) return refuse(reason, why);
    if (before_publish_commits()) before_publish_commits()(m.region);
    std::vector<std::uint64_t> keepers;
    const detail::lendable_memory* memory = nullptr;
    region_layout layout = m.layout;  // copied here: nothing below fails for memory once the region changes
    {
      std::lock_guard lock(mutex_);
      region_entry& r = regions_.at(m.region);
      // revoke() may have come from another thread since the checks above:
      // a shared region is never revoked, so a region being revoked stays exclusive.
      if (r.info.state != region_state::lent) {
        why = "region " + std::to_string(m.region) + " is being revoked; give it back instead of publishing it";
      } else {
        r.info.mode = region_mode::shared;
        r.layout = std::move(layout);
        keepers.swap(r.chunk.keepers);
        memory = r.chunk.memory.get();
        ++counters_.published;
      }
    }
    if (!why.empty()) return refuse(refusal::bad_request, why);
    // Shared memory is never lent again: whoever of the writer's uid kept a
    // writable mapping of it drops it (the region is read-only from now on).
    tell_to_forget(keepers, *memory);
    emit(lender_event::kind::published, b.link.peer(), m.region, bytes,
         "'" + name + "', content hash " + to_hex(m.layout.hash));
    send_region(b, m.request, m.region, *memory, &memory->handle(), nullptr);
  }

  // A new hold of the region published under m.name, for a reader.
  void lend_shared(borrower_entry& b, const detail::borrow_shared_message& m) {
    {
      std::lock_guard lock(mutex_);
      ++counters_.requests;
    }
    auto refuse = [&](refusal reason, std::string why) { send_refusal(b, m.request, reason, why); };
    std::uint64_t id = 0;
    std::size_t bytes = 0;
    uid_t writer = 0;
    region_layout layout;
    {
      std::lock_guard lock(mutex_);
      id = published_named(m.name);
      if (id != 0) {
        bytes = regions_.at(id).info.bytes;
        writer = regions_.at(id).info.uid;
        layout = regions_.at(id).layout;
      }
    }
    if (id == 0) return refuse(refusal::bad_request, "no region is published as '" + m.name + "'");
    if (m.writer_uid && *m.writer_uid != writer) {
      return refuse(refusal::writer_mismatch, "region '" + m.name + "' was published by uid " +
                                                  std::to_string(writer) + "; this borrower expects uid " +
                                                  std::to_string(*m.writer_uid));
    }
    if (m.expected && *m.expected != layout.hash) {
      return refuse(refusal::hash_mismatch, "region '" + m.name + "' has content hash " + to_hex(layout.hash) +
                                                "; this borrower expects " + to_hex(*m.expected));
    }
    if (b.held_regions >= config_.max_regions_per_borrower) {
      return refuse(refusal::quota,
                    "this borrower holds " + std::to_string(b.held_regions) + " regions, the most it may");
    }
    const uid_t uid = b.link.peer().uid;
    bool uid_holds_it = false;  // then this hold adds nothing to what the uid holds
    {
      std::lock_guard lock(mutex_);
      const auto& holds = regions_.at(id).holds;
      uid_holds_it = std::any_of(holds.begin(), holds.end(), [&](const hold& h) { return h.uid == uid; });
    }
    const hold_cost cost{bytes, uid_holds_it ? 0 : bytes, nullptr};
    const kept_room room = room_in_kept(b, cost);
    if (room.borrower_over > room.borrower_may_drop) {
      return refuse(refusal::quota, "this borrower holds " + std::to_string(b.held_bytes) + " bytes" + kept_note(b) +
                                        "; shared region '" + m.name + "' (" + std::to_string(bytes) +
                                        " bytes, counted in full for each holder) would pass its quota of " +
                                        std::to_string(config_.quota_bytes));
    }
    if (room.uid_over > room.uid_may_drop) {
      const std::size_t held = held_by_uid(uid);
      const std::size_t waits = waiting_by_uid(uid, b.serial);  // as an exclusive borrow counts them
      return refuse(refusal::quota, "uid " + std::to_string(uid) + " holds " + std::to_string(held) +
                                        " bytes over all its connections, orphaned regions and memory they keep "
                                        "mapped" +
                                        (waits > 0 ? " and waits for " + std::to_string(waits) + " more" : "") +
                                        "; shared region '" + m.name + "' (" + std::to_string(bytes) +
                                        " bytes) would pass its per-uid quota of " +
                                        std::to_string(config_.quota_bytes_per_uid));
    }
    std::vector<kept_drop> drops = room_for_drops(b);  // nothing has changed yet if memory runs out here
    forget_kept_for(b, cost, drops);
    const detail::lendable_memory* memory = nullptr;
    {
      std::lock_guard lock(mutex_);
      region_entry& r = regions_.at(id);
      r.holds.push_back({b.serial, b.link.peer().process, b.link.peer().uid});
      r.settle_state();
      memory = r.chunk.memory.get();
    }
    b.held_bytes += bytes;
    ++b.held_regions;
    emit(lender_event::kind::lent, b.link.peer(), id, bytes, m.name);
    send_region(b, m.request, id, *memory, &memory->handle(), &layout);
  }

  // The id of the shared region published under `name`, or 0. Under mutex_.
  std::uint64_t published_named(const std::string& name) const {
    for (const auto& [id, r] : regions_) {
      if (r.info.mode == region_mode::shared && r.info.purpose == name) return id;
    }
    return 0;
  }

  // Bytes uid's connections other than `except` wait for. On the serving
  // thread (the line's only writer: read unlocked).
  std::size_t waiting_by_uid(uid_t uid, std::uint64_t except) const {
    std::size_t bytes = 0;
    waiting_.visit([&](const detail::waiting_borrow& w) {
      if (w.uid == uid && w.serial != except) bytes += w.bytes;
    });
    return bytes;
  }

  // A region connection `serial` is asked to give back (revoking), or 0.
  std::uint64_t region_being_revoked_from(std::uint64_t serial) const {
    std::lock_guard lock(mutex_);
    for (const auto& [id, r] : regions_) {
      if (r.info.state == region_state::revoking && r.holds.front().borrower == serial) return id;
    }
    return 0;
  }

  // Under mutex_: the bytes each uid holds — a region once per uid holding
  // it, and the spares a uid keeps mapped (memory it has given back but may
  // still use until it unmaps it).
  detail::holdings held_by_each_uid_locked() const {
    detail::holdings held;
    for (const auto& spare : spares_.chunks()) {
      if (!spare.chunk.keepers.empty()) detail::holding_of(held, spare.uid) += spare.chunk.memory->size();
    }
    std::vector<uid_t> uids;
    for (const auto& [id, r] : regions_) {
      uids.clear();
      for (const hold& h : r.holds) {
        if (std::find(uids.begin(), uids.end(), h.uid) == uids.end()) uids.push_back(h.uid);
      }
      for (const uid_t uid : uids) detail::holding_of(held, uid) += r.info.bytes;
    }
    return held;
  }

  // Bytes `uid` counts against its quota, as held_by_each_uid_locked: the
  // regions its borrowers hold (lent, revoking or orphaned; a shared region
  // once, however many of its holds are the uid's) and its spares that a
  // connection keeps mapped (a region's keepers are of its holder's uid:
  // counted with it).
  std::size_t held_by_uid(uid_t uid) const {
    std::lock_guard lock(mutex_);
    std::size_t held = 0;
    for (const auto& spare : spares_.chunks()) {
      held += spare.uid == uid && !spare.chunk.keepers.empty() ? spare.chunk.memory->size() : 0;
    }
    for (const auto& [id, r] : regions_) {
      const bool holds = std::any_of(r.holds.begin(), r.holds.end(), [&](const hold& h) { return h.uid == uid; });
      held += holds ? r.info.bytes : 0;
    }
    return held;
  }

  // Drops one of `b`'s holds of region m.region; the region goes with its
  // last hold. b keeps its mapping when it asked to and the memory becomes
  // a spare (an exclusive region, reuse on). A kept mapping still counts
  // against b's quota and its uid's, so a keep needs no quota check of its
  // own: its bytes move from what b holds to what it keeps, and for the uid
  // from a region to a spare kept mapped, neither count rising. The room a
  // later borrow needs is made then, by dropping kept mappings
  // (forget_kept_for).
  void take_back(borrower_entry& b, const detail::give_back_message& m) {
    const std::uint64_t id = m.region;
    bool held = false;
    bool kept = false;
    std::size_t bytes = 0;
    {
      std::lock_guard lock(mutex_);
      const auto it = regions_.find(id);
      if (it != regions_.end()) {
        auto& holds = it->second.holds;
        const auto h = std::find_if(holds.begin(), holds.end(), [&](const hold& x) { return x.borrower == b.serial; });
        held = h != holds.end();
        if (held) {
          // The one step that can fail (for memory) first, before anything changed.
          kept = m.keep_mapping && holds.size() == 1 && reusable(it->second);
          if (kept) it->second.chunk.keepers.push_back(b.serial);
          b.kept_bytes += kept ? it->second.chunk.memory->size() : 0;
          bytes = it->second.info.bytes;
          b.held_bytes -= bytes;
          --b.held_regions;
          holds.erase(h);
          ++counters_.given_back;
          release_if_unheld(it);
        }
      }
    }
    if (!held) {
      return send_refusal(b, id, refusal::bad_request,
                          "region " + std::to_string(id) + " is not one this borrower holds");
    }
    emit(lender_event::kind::given_back, b.link.peer(), id, bytes);
    const auto answer = detail::encode(detail::given_back_message{id, kept});
    post(b, {{static_cast<std::uint16_t>(message_type::given_back), view(answer)}});
  }

  // Whether a region's memory becomes a spare when its last hold goes.
  bool reusable(const region_entry& r) const {
    return config_.reuse == reuse_policy::same_uid && r.info.mode == region_mode::exclusive;
  }

  // A revoke asked over the socket (`shoal daemon revoke`): only its
  // operator — a process of the lender's own uid, or root — may ask one; any
  // region lent to a connected borrower, as revoke() from this process.
  void revoke_for(borrower_entry& b, const detail::revoke_request_message& m) {
    const uid_t own = ::geteuid();
    if (b.link.peer().uid != own && b.link.peer().uid != 0) {
      return send_refusal(b, m.request, refusal::not_permitted,
                          "only a process of the lender's own uid (" + std::to_string(own) +
                              ") or root may revoke regions; this one is of uid " + std::to_string(b.link.peer().uid));
    }
    if (auto why = start_revoke(m.region, std::chrono::milliseconds(m.deadline_ms))) {
      return send_refusal(b, m.request, refusal::bad_request, *why);
    }
    const auto accepted = detail::encode_revoke_accepted(m.request);
    post(b, {{static_cast<std::uint16_t>(message_type::revoke_accepted), view(accepted)}});
  }

  void send_refusal(borrower_entry& b, std::uint64_t request, refusal reason, const std::string& why) {
    {
      std::lock_guard lock(mutex_);
      ++counters_.refusals;
    }
    emit(lender_event::kind::refused, b.link.peer(), 0, 0, why);
    const auto refused = detail::encode(detail::refused_message{request, reason, why});
    post(b, {{static_cast<std::uint16_t>(message_type::refused), view(refused)}});
  }

  // The loop removes `b` after this; its regions are reclaimed or orphaned.
  void hang_up(borrower_entry& b) noexcept {
    std::vector<lender_event> events;
    {
      std::lock_guard lock(mutex_);
      hang_up_locked(b, events);
    }
    if (b.greeted) emit_noted(lender_event::kind::disconnected, b.link.peer(), b.observer ? observer_note : "");
    for (const auto& e : events) emit(e);
  }

  // Each of `b`'s holds is orphaned (it still runs and may map the region)
  // or reclaimed (it is gone); a region goes with its last hold.
  // Its kept mappings are forgotten: nothing more is lent to this connection.
  void hang_up_locked(borrower_entry& b, std::vector<lender_event>& events) noexcept {
    const bool alive = alive_or_unknown(b.link.peer().process);
    spares_.drop_keeper(b.serial);
    if (!waiting_.empty()) {
      const std::uint64_t head = waiting_.head().serial;
      // A hang-up ends a wait as the borrower's cancel does (end_wait).
      if (auto w = waiting_.take(b.serial)) {
        put_behind(*w, clock_type::now());
        mark_behind_locked();
      }
      note_head_change(head);
    }
    for (auto it = regions_.begin(); it != regions_.end();) {
      region_entry& r = it->second;
      r.chunk.drop_keeper(b.serial);
      drop_holds_of(b.serial, alive, r, events);
      it = release_if_unheld(it);
    }
  }

  // Orphans (its process alive) or drops `serial`'s holds of `r`, in one
  // pass over its holds: many connections' many holds of one shared region
  // cost each hang-up the list once. Under mutex_.
  void drop_holds_of(std::uint64_t serial, bool alive, region_entry& r, std::vector<lender_event>& events) noexcept {
    auto& holds = r.holds;
    auto h = std::find_if(holds.begin(), holds.end(), [&](const hold& o) { return o.borrower == serial; });
    if (h == holds.end()) return;
    // A process that still runs keeps one orphaned hold of the region
    // however many of its connections held it: a process looping on
    // connect, borrow, hang up would otherwise grow the list (and the
    // loop's walks of it) without end. Its process (one per connection)
    // holds an orphaned hold of it already, or not.
    const process_identity process = h->process;
    bool orphaned_already = alive && std::any_of(holds.begin(), holds.end(), [&](const hold& o) {
                              return o.borrower == 0 && o.process == process;
                            });
    auto kept = h;
    for (; h != holds.end(); ++h) {
      if (h->borrower != serial) {
        if (kept != h) *kept = std::move(*h);
        ++kept;
        continue;
      }
      if (orphaned_already) continue;  // dropped
      note(events, [&] {
        return lender_event{alive ? lender_event::kind::orphaned : lender_event::kind::reclaimed,
                            h->process,
                            h->uid,
                            r.info.id,
                            r.info.bytes,
                            r.info.purpose};
      });
      if (alive) {
        h->borrower = 0;
        orphaned_already = true;
        if (kept != h) *kept = std::move(*h);
        ++kept;
      } else {
        ++counters_.reclaimed;  // dropped
      }
    }
    holds.erase(kept, holds.end());
  }

  // Erases the region at `it` when it has no hold left (returning the next
  // one), its memory kept as a spare when reusable, or settles its state;
  // under mutex_. A spare still fits the capacity: its bytes were lent.
  // Never fails: memory that cannot be kept as a spare (no memory for its
  // entry) is released, and whoever keeps it mapped is hung up on.
  std::map<std::uint64_t, region_entry>::iterator release_if_unheld(
      std::map<std::uint64_t, region_entry>::iterator it) noexcept {
    if (it->second.holds.empty()) {
      lent_bytes_ -= it->second.info.bytes;
      room_changed_ = true;
      if (reusable(it->second)) {
        try {
          spares_.put(std::move(it->second.chunk), it->second.info.uid, clock_type::now());
        } catch (const std::bad_alloc&) {
          fail_keepers_locked(it->second.chunk);
        }
      }
      return regions_.erase(it);
    }
    it->second.settle_state();
    return std::next(it);
  }

  // Under mutex_: lent region `r` is being revoked, due back within `deadline`.
  static void mark_revoking(region_entry& r, std::chrono::milliseconds deadline) noexcept {
    r.info.state = region_state::revoking;
    r.info.revoke_deadline = clock_type::now() + deadline;
  }

  // Preemption (config_.preempt_after): revokes regions of other borrowers
  // for the head of the waiting line once it has waited long enough and the
  // capacity has no room for it (preemption.h chooses which, among the
  // regions this may take). Looks at a head once it has waited
  // preempt_after, then at most once a periodic check interval while it
  // stays the head.
  void preempt_for_head() noexcept {
    // The serving thread is the line's only writer: it reads it unlocked.
    if (!config_.preempt_after || waiting_.empty()) return;
    const auto now = clock_type::now();
    if (now < next_preemption_check()) return;
    const detail::waiting_borrow& head = waiting_.head();
    last_preemption_check_ = now;
    last_preemption_head_ = {head.serial, head.since};
    std::vector<std::uint64_t> chosen;
    std::vector<std::uint64_t> waits_to_end;  // connections of chosen regions whose own borrow waits
    std::string why;  // made while `head` is valid: ending waits below may move the line
    try {
      std::vector<std::uint64_t> waiting_serials;
      waiting_.visit([&](const detail::waiting_borrow& w) { waiting_serials.push_back(w.serial); });
      std::sort(waiting_serials.begin(), waiting_serials.end());
      const auto waits = [&](std::uint64_t serial) {
        return std::binary_search(waiting_serials.begin(), waiting_serials.end(), serial);
      };
      std::lock_guard lock(mutex_);
      std::size_t coming = 0;  // revoked, its deadline not passed, its borrower free to give it back
      std::vector<detail::preemption_candidate> candidates;
      for (const auto& [id, r] : regions_) {
        const std::uint64_t holder = r.holds.front().borrower;
        if (r.info.state == region_state::revoking && !r.missed && now <= r.info.revoke_deadline && !waits(holder)) {
          coming += r.info.bytes;
        }
        if (r.info.mode != region_mode::exclusive || r.info.state != region_state::lent) continue;
        if (holder == head.serial) continue;
        // Each holder keeps a region for preempt_after at least: a turn is
        // not taken the moment it began, nor one region revoked again and
        // again by borrows that join the line and leave.
        if (now - r.since < *config_.preempt_after) continue;
        candidates.push_back({id, r.info.bytes, r.since, r.info.uid});
      }
      const std::size_t room = config_.capacity_bytes - lent_bytes_;
      const std::size_t shortfall = head.bytes > room + coming ? head.bytes - room - coming : 0;
      // Across uids only while the other holds more (preemption.h).
      chosen = detail::choose_preempted(std::move(candidates), shortfall, head.uid, held_by_each_uid_locked());
      if (chosen.empty()) return;
      why = "preempted for the borrow of " + std::to_string(head.bytes) + " bytes ('" + head.request.purpose +
            "') of pid " + std::to_string(head.process.pid) + " waiting first in line";
      for (const std::uint64_t id : chosen) {
        const std::uint64_t holder = regions_.at(id).holds.front().borrower;
        if (waits(holder) && std::find(waits_to_end.begin(), waits_to_end.end(), holder) == waits_to_end.end()) {
          waits_to_end.push_back(holder);
        }
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to choose: looked at again at the next check
      return;
    }
    std::vector<queued_revocation> queued;  // made first: nothing changes unless all can be queued
    try {
      queued.reserve(chosen.size());
      for (const std::uint64_t id : chosen) queued.push_back({id, config_.preempt_deadline, why});
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory: looked at again at the next check
      return;
    }
    // A borrower gives nothing back while its own borrow waits: that wait
    // ends first (refused, stopped_waiting), then the revoke goes.
    for (const std::uint64_t serial : waits_to_end) {
      if (borrower_entry* b = connected(serial)) {
        answer_waiting(*b, [&] { end_wait(*b, "its regions are preempted for the borrow first in line", false); });
      }
    }
    try {
      std::lock_guard lock(mutex_);
      revocations_.reserve(revocations_.size() + queued.size());
      for (auto& q : queued) {
        const auto it = regions_.find(q.region);
        // The operator's revoke() may have come meanwhile (another thread).
        if (it == regions_.end() || it->second.info.state != region_state::lent) continue;
        mark_revoking(it->second, q.deadline);
        revocations_.push_back(std::move(q));  // room reserved: does not throw
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory: looked at again at the next check
      return;
    }
    send_revocations();
  }

  // When preempt_for_head() next looks at the head: once it has waited
  // preempt_after, then each periodic check interval; max() when it need not.
  clock_type::time_point next_preemption_check() const noexcept {
    if (!config_.preempt_after || waiting_.empty()) return clock_type::time_point::max();
    const detail::waiting_borrow& head = waiting_.head();
    const auto due = head.since + *config_.preempt_after;
    const bool looked_at = last_preemption_head_ == std::pair{head.serial, head.since};
    return looked_at ? std::max(due, last_preemption_check_ + orphan_check_interval) : due;
  }

  // Sends what revoke() and preempt_for_head() queued, to each region's borrower.
  void send_revocations() noexcept {
    std::vector<queued_revocation> queued;
    {
      std::lock_guard lock(mutex_);
      queued.swap(revocations_);
    }
    for (const auto& entry : queued) {
      // Named copies rather than a structured binding: lambdas below use them,
      // which some compilers still refuse for bindings.
      const std::uint64_t id = entry.region;
      const auto deadline = entry.deadline;
      std::uint64_t serial = 0;
      process_identity process;
      uid_t uid = 0;
      std::size_t bytes = 0;
      {
        std::lock_guard lock(mutex_);
        const auto it = regions_.find(id);
        if (it == regions_.end() || it->second.info.state != region_state::revoking) continue;  // given back meanwhile
        serial = it->second.holds.front().borrower;
        process = it->second.info.borrower;
        uid = it->second.info.uid;
        bytes = it->second.info.bytes;
        ++counters_.revocations;
        counters_.preemptions += entry.preempted_for.empty() ? 0 : 1;
      }
      for (auto& b : borrowers_) {
        if (b.serial != serial) continue;
        try {
          const auto revoke = detail::encode(detail::revoke_message{id, static_cast<std::uint32_t>(deadline.count())});
          post(b, {{static_cast<std::uint16_t>(message_type::revoke), view(revoke)}});
        } catch (const connection_closed&) {
          // It hung up: the loop reclaims.
        } catch (const std::exception& e) {
          // Not sent (the system refused it, or memory ran out): the loop hangs up and reclaims.
          close_for_error_saying(b, "a revoke could not be sent to it", [&] {
            return "the revoke of region " + std::to_string(id) + " could not be sent: " + e.what();
          });
        }
        try {
          emit(lender_event{lender_event::kind::revoke_requested, process, uid, id, bytes,
                            "give it back within " + std::to_string(deadline.count()) + " ms" +
                                (entry.preempted_for.empty() ? "" : " (" + entry.preempted_for + ")")});
        } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to say so
        }
      }
    }
  }

  // Names, once, each borrower that let a revocation's deadline pass; its
  // region stays its own (and counted) until it gives it back or exits.
  void note_missed_revocations() noexcept {
    std::vector<lender_event> events;
    {
      std::lock_guard lock(mutex_);
      const auto now = clock_type::now();
      for (auto& entry : regions_) {
        const std::uint64_t id = entry.first;
        auto& r = entry.second;  // a reference, not a binding: the lambda below uses it
        if (r.info.state == region_state::revoking && !r.missed && now > r.info.revoke_deadline) {
          r.missed = true;
          ++counters_.revocations_missed;
          note(events, [&] {
            return lender_event{lender_event::kind::revoke_missed, r.info.borrower, r.info.uid, id, r.info.bytes,
                                "the deadline passed; the region stays lent until it is given back or its borrower "
                                "exits"};
          });
        }
      }
    }
    for (const auto& e : events) emit(e);
  }

  // Drops the orphaned holds whose process has exited. A pass looks up
  // each process once however many regions it holds, at most
  // orphan_lookups_per_check of them (orphan_checks.h), without the lock.
  // No room for the lists: nothing is dropped this pass.
  void reclaim_orphans() noexcept {
    std::vector<lender_event> events;
    try {
      std::vector<process_identity> holders;
      {
        std::lock_guard lock(mutex_);
        for (const auto& [id, r] : regions_) {
          for (const hold& h : r.holds) {
            if (h.borrower == 0) holders.push_back(h.process);
          }
        }
      }
      const std::vector<process_identity> chosen = orphan_checks_.next(holders);
      if (!chosen.empty() && detail::before_orphan_lookups()) detail::before_orphan_lookups()(chosen);
      std::vector<process_identity> gone;
      for (const process_identity& p : chosen) {
        if (!alive_or_unknown(p)) gone.push_back(p);
      }
      if (gone.empty()) return;
      // A process that has exited stays so (its identity has its start time).
      std::lock_guard lock(mutex_);
      for (auto it = regions_.begin(); it != regions_.end();) {
        const region_info& info = it->second.info;
        std::erase_if(it->second.holds, [&](const hold& h) noexcept {
          if (h.borrower != 0 || std::find(gone.begin(), gone.end(), h.process) == gone.end()) return false;
          note(events, [&] {
            return lender_event{lender_event::kind::reclaimed, h.process, h.uid, info.id, info.bytes, info.purpose};
          });
          ++counters_.reclaimed;
          return true;
        });
        it = release_if_unheld(it);
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): std::bad_alloc; the next pass tries again
    }
    for (const auto& e : events) emit(e);
  }

  void emit(const lender_event& event) noexcept {
    if (!config_.on_event) return;
    try {
      config_.on_event(event);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a log that fails must not stop the lender
    }
  }

  void emit(lender_event::kind what, const channel::peer_credentials& who, std::uint64_t region = 0,
            std::size_t bytes = 0, std::string detail = {}) noexcept {
    if (!config_.on_event) return;
    try {
      config_.on_event(lender_event{what, who.process, who.uid, region, bytes, std::move(detail)});  // NOLINT
    } catch (...) {  // NOLINT(bugprone-empty-catch): a log that fails must not stop the lender
    }
  }

  // emit with a fixed note, its text made inside (a caller that may not
  // throw can pass one).
  void emit_noted(lender_event::kind what, const channel::peer_credentials& who, const char* note) noexcept {
    try {
      emit(what, who, 0, 0, std::string(note));
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory for the note: the event is left out
    }
  }

  void count_refusal() {
    std::lock_guard lock(mutex_);
    ++counters_.refusals;
  }
  void count_error() {
    std::lock_guard lock(mutex_);
    ++counters_.connections_closed_for_errors;
  }

  backend::device& device_;
  const lender_config config_;
  const std::chrono::microseconds poll_spin_;  // config_.poll_spin resolved
  const std::size_t spinning_borrowers_limit_;  // poll_spin_ applies up to this many borrowers
  channel::listener listener_;
  unique_fd wake_;
  std::atomic<bool> stopping_{false};

  // The serving thread's own; status() reads the count.
  std::list<borrower_entry> borrowers_;
  // accept_or_throw: when a refused accept (the system's) may be tried again.
  clock_type::time_point accept_paused_until_{};
  std::vector<pollfd> fds_;  // the listener, the wake-up, then borrowers_ in order
  std::atomic<std::size_t> borrower_count_{0};
  std::atomic<std::size_t> observer_count_{0};
  std::atomic<std::size_t> connection_count_{0};
  std::uint64_t last_serial_ = 0;
  std::uint64_t next_region_ = 1;
  std::uint64_t next_memory_ = 1;

  mutable std::mutex mutex_;  // guards what status() reads
  std::map<std::uint64_t, region_entry> regions_;
  struct queued_revocation {
    std::uint64_t region = 0;
    std::chrono::milliseconds deadline{0};
    std::string preempted_for;  // the waiting borrow it preempts for; empty for revoke()
  };
  std::vector<queued_revocation> revocations_;  // queued by revoke() and preempt_for_head()
  std::size_t lent_bytes_ = 0;
  detail::spare_pool spares_;  // lent_bytes_ + spares_.bytes() + prepared_.bytes() <= config_.capacity_bytes
  detail::prepared_chunks prepared_;
  lender_status counters_;
  detail::waiting_borrows waiting_;  // borrows that wait for memory, in the order they are served
  // Serving thread only: each uid's last stretch behind the other uids
  // (put_behind); kept max_wait past its end, to tell how long a wait of it
  // held the line.
  struct behind_period {
    clock_type::time_point start;
    clock_type::time_point until;
  };
  std::map<uid_t, behind_period> behind_;
  detail::orphan_checks orphan_checks_{orphan_lookups_per_check};  // serving thread only
  // Serving thread only: memory may have come free since the head of
  // waiting_ was last tried (a region released, a new head, the periodic
  // check after the device refused the head: it may have memory back).
  bool room_changed_ = false;
  bool head_refused_by_device_ = false;  // serving thread only
  // Serving thread only: when preempt_for_head() last looked, and at which
  // head (its connection and when it began to wait).
  clock_type::time_point last_preemption_check_{};
  std::pair<std::uint64_t, clock_type::time_point> last_preemption_head_{};

  const shoal::detail::fork_epoch epoch_;
  std::thread thread_;  // last: started once everything above exists
};

// Out of the class body, so not inline: a lambda's closure inside an inline
// function gets default visibility from GCC, and the thread's state type made
// of it would be exported from a shared library.
void lender::state::start_serving() {
  thread_ = std::thread([this] { serve(); });
}

void test_hook::set_before_publish_commits(std::function<void(std::uint64_t region)> hook) {
  before_publish_commits() = std::move(hook);
}

lender::lender(backend::device& device, const channel::channel_address& address, lender_config config) {
  for (const auto& [name, zero] : {std::pair{"capacity_bytes", config.capacity_bytes == 0},
                                    std::pair{"quota_bytes", config.quota_bytes == 0},
                                    std::pair{"max_borrowers", config.max_borrowers == 0},
                                    std::pair{"max_regions_per_borrower", config.max_regions_per_borrower == 0},
                                    std::pair{"peer_timeout", config.peer_timeout <= std::chrono::milliseconds(0)}}) {
    if (zero) throw invalid_argument(std::string("lender: ") + name + " must be > 0");
  }
  // Compared with clock differences in nanoseconds: a longer one would
  // overflow there and hang up on every borrower at once.
  if (config.max_wait <= std::chrono::milliseconds(0) ||
      config.max_wait.count() > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument("lender: max_wait must be 1 ms to about 49 days");
  }
  if ((config.preempt_after && (*config.preempt_after < std::chrono::milliseconds(0) ||
                                config.preempt_after->count() > std::numeric_limits<std::uint32_t>::max())) ||
      config.preempt_deadline <= std::chrono::milliseconds(0) ||
      config.preempt_deadline.count() > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument("lender: preempt_after must be 0 ms to about 49 days and preempt_deadline 1 ms to about "
                           "49 days");
  }
  if (config.preempt_after && *config.preempt_after >= config.max_wait) {
    throw invalid_argument("lender: preempt_after (" + std::to_string(config.preempt_after->count()) +
                           " ms) must be below max_wait (" + std::to_string(config.max_wait.count()) +
                           " ms): every wait would run out before preemption");
  }
  if (config.peer_timeout > longest_peer_timeout) {
    throw invalid_argument("lender: peer_timeout of " + std::to_string(config.peer_timeout.count()) +
                           " ms is over a day; a borrower that waits longer is as good as gone");
  }
  const auto prepared = detail::prepared_total(config.prepared_chunks, device.granularity());
  if (!prepared || *prepared > config.capacity_bytes) {
    throw invalid_argument("lender: prepared_chunks must each be > 0 and hold at most capacity_bytes (" +
                           std::to_string(config.capacity_bytes) + ") in all, each rounded up to " +
                           std::to_string(device.granularity()) + " bytes" +
                           (prepared ? "; they hold " + std::to_string(*prepared) : std::string()));
  }
  // Every chunk it may lend again keeps its exported handle open (a
  // descriptor on every backend): the default soft limit (1024) would stop
  // it, its accepts and its /proc checks near a thousand regions.
  shoal::detail::raise_descriptor_limit();
  state_ = std::make_unique<state>(device, address, std::move(config));
}

lender::~lender() {
  // A fork() child leaves the parent's lender be: its thread is not there to
  // join (glibc lets a join return; ThreadSanitizer's waits forever), and
  // closing its connections or giving its regions back would act for the parent.
  if (state_ && state_->forked_since()) (void)state_.release();
}

lender_status lender::status() const { return state_->status(); }

std::string lender::metrics_text() const {
  return detail::prometheus_text(state_->status(), detail::max_metrics_text);
}

void lender::revoke(std::uint64_t region, std::chrono::milliseconds deadline) { state_->revoke(region, deadline); }

const channel::channel_address& lender::address() const noexcept { return state_->address(); }

}  // namespace shoal::lending
