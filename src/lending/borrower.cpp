#include "shoal/lending/borrower.h"

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <limits>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "core/deadline.h"
#include "core/fork_epoch.h"
#include "core/printable_text.h"
#include "lending/automatic_spin.h"
#include "lending/mapping_cache.h"
#include "lending/messages.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"

namespace shoal::lending {

namespace {

using detail::lending_protocol;
using detail::message_type;
using detail::refusal;
using clock_type = std::chrono::steady_clock;

// A region dropped without give_back waits this long for the lender's answer.
constexpr std::chrono::milliseconds drop_timeout{1000};

// What the channel may wait for until `deadline` (saturating: a deadline at the
// clock's end stays far off, never wraps into the past).
std::chrono::milliseconds left_until(clock_type::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
  return shoal::detail::channel_timeout(left);
}

using shoal::detail::deadline_after;

std::string address_text(const channel::channel_address& address) {
  return (address.is_abstract() ? "@" : "") + address.name();
}

// Takes `lock` by `deadline`, or false. Polled: contention is rare here (a
// request in progress on another thread), and std::timed_mutex's timed lock
// is not one ThreadSanitizer follows.
bool lock_by(std::unique_lock<std::mutex>& lock, clock_type::time_point deadline) {
  while (!lock.try_lock()) {
    if (clock_type::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// revocations() looks at what other threads' requests read (and stashed) at
// least this often while it waits.
constexpr std::chrono::milliseconds revocation_slice{10};
// A borrow with an interrupt check calls it at least this often while it waits.
constexpr std::chrono::milliseconds interrupt_check_interval{50};

// Waits until `conn` may have something to read, or `until`. Reads nothing:
// a batch that came in part stays for the next try_receive (revocations()
// is called with short waits, in a loop: one that ends mid-batch must not
// break the link).
void wait_readable(const channel::connection& conn, clock_type::time_point until) {
  if (conn.pending() > 0) return;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - clock_type::now());
  if (left.count() <= 0) return;
  pollfd readable{conn.native_handle(), POLLIN, 0};
  (void)::poll(&readable, 1, static_cast<int>(std::min<std::int64_t>(left.count(), INT_MAX)));
}

}  // namespace

// The connection and what requests share. Requests go one at a time.
struct borrowed_region::link {
  link(backend::device& d, channel::connection c, const borrower_options& options)
      : device(d),
        conn(std::move(c)),
        kept(d, options.keep_mappings ? options.kept_mapping_bytes : 0),
        reply_spin(detail::spin_or_automatic(options.reply_spin, borrower_options::automatic_reply_spin)),
        observer(options.observer) {
    conn.set_receive_spin(reply_spin);
  }

  // An observer borrows nothing (borrower_options::observer).
  void may_borrow(const char* what) const {
    if (observer) {
      throw invalid_argument(std::string("borrower::") + what +
                             ": this connection is an observer's (borrower_options::observer): metrics and revoke only");
    }
  }

  backend::device& device;
  const shoal::detail::fork_epoch epoch;
  mutable std::mutex mutex;
  channel::connection conn;
  detail::mapping_cache kept;  // under mutex
  const std::chrono::nanoseconds reply_spin;  // how long a request polls for its answer before it sleeps
  const bool observer;
  std::uint64_t next_request = 1;
  // The link cannot be trusted any more (the lender broke the protocol, or
  // an answer stopped part-way): nothing more is asked.
  bool out_of_step = false;
  // Answers still owed for requests no caller waits for any more: a borrow
  // or borrow_shared whose answer had not begun to come by its deadline (the
  // lender may still lend: that region is given back unmapped), and the
  // confirmations of give backs sent meanwhile. Answers come in the order
  // asked, so every later call reads these first (settle_owed) and the link
  // stays in step. A give back's mapping offered to be kept waits here until
  // its answer says where it goes.
  struct owed_answer {
    enum class kind : std::uint8_t { region, given_back } what = kind::region;
    std::uint64_t request = 0;  // region: the borrow's or borrow_shared's request
    bool shared = false;        // region: a layout frame follows its chunks
    std::uint64_t region = 0;   // given_back: the region given back
    bool keep = false;          // given_back: its mapping was offered to be kept
    std::uint64_t memory = 0;   // given_back: that mapping's memory
    void* data = nullptr;       // given_back: that mapping (nullptr: it stays in `kept`)
    std::size_t size = 0;
  };
  std::deque<owed_answer> owed;
  // What receive_region records as owed when a borrow's answer has not
  // begun to come by its deadline.
  struct late_borrow {
    std::uint64_t request = 0;
    bool shared = false;
    bool waits = false;  // it may wait at the lender: told to stop (cancel_wait)
  };
  // Past this many, a lender that answers nothing any more is given up on.
  static constexpr std::size_t max_owed = 64;

  // When a wait for owed answers last ran out (settle_owed).
  clock_type::time_point gave_up_waiting{};

  ~link() {
    // A fork() child's copy: the connection, the regions and their mappings
    // are the parent's (its threads may hold the link's locks); the child
    // tells the lender nothing and unmaps nothing.
    if (epoch.forked_since()) {
      kept.abandon();
      return;
    }
    // The last holder of the link is going: what is still owed is read now,
    // or the lender would keep a region lent late until this process ends
    // (it cannot know it was never mapped) — unless a wait for them ran out
    // within the last drop_timeout (the drop of a region that led here), so
    // that a slow lender costs a drop one such wait, not two.
    if ((!owed.empty() || give_backs_deferred()) && !out_of_step && !conn.broken() &&
        clock_type::now() - gave_up_waiting >= drop_timeout) {
      try {
        std::lock_guard lock(mutex);
        settle_owed(deadline_after(drop_timeout), "close");
      } catch (...) {  // NOLINT(bugprone-empty-catch): the lender reclaims on this process's exit
      }
    }
    for (const owed_answer& o : owed) {
      if (o.data != nullptr) device.close_import(o.data);
    }
  }
  link(const link&) = delete;
  link& operator=(const link&) = delete;

  void usable(const char* operation) const {
    if (out_of_step) {
      throw connection_closed(std::string("borrower::") + operation +
                              ": the lender broke the protocol, or an answer stopped part-way; connect again");
    }
  }

  // Give backs of regions dropped while another call held the connection
  // (a borrow waiting for memory): each region was unmapped at once; the
  // next call sends them (send_deferred, from settle_owed). Their own lock,
  // never held while waiting: a drop never waits behind a call.
  std::mutex deferred_mutex;
  std::vector<std::uint64_t> deferred;  // under deferred_mutex

  void defer_give_back(std::uint64_t id) noexcept {
    try {
      std::lock_guard lock(deferred_mutex);
      deferred.push_back(id);
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to keep it; the lender reclaims at hang-up
    }
  }
  bool give_backs_deferred() {
    std::lock_guard lock(deferred_mutex);
    return !deferred.empty();
  }
  // Under mutex: sends the deferred give backs, their answers owed. Each
  // leaves the list only once sent (taking it out allocates nothing), so a
  // send that throws — host memory refused, say — leaves it and the rest for
  // the next call.
  void send_deferred() {
    for (;;) {
      std::uint64_t id = 0;
      {
        std::lock_guard lock(deferred_mutex);
        if (deferred.empty()) return;
        id = deferred.front();  // others only append: the front stays this one
      }
      send_give_back({.what = owed_answer::kind::given_back, .region = id});
      std::lock_guard lock(deferred_mutex);
      deferred.erase(deferred.begin());
    }
  }

  // The connection, for a call that gives up at `deadline`: timeout_error
  // naming `operation` when another call holds it past that (a borrow
  // waiting for memory holds it for its whole wait).
  std::unique_lock<std::mutex> take_for(clock_type::time_point deadline, const char* operation) {
    std::unique_lock lock(mutex, std::defer_lock);
    if (!lock_by(lock, deadline)) {
      throw timeout_error(std::string("borrower::") + operation +
                          ": another call holds the connection past this call's timeout (a borrow waiting for "
                          "memory?); calls that must not wait behind it go through another borrower");
    }
    return lock;
  }

  // Runs `request` (under `mutex`): a protocol_error anywhere in it (an
  // answer that does not decode, or does not fit what was asked) leaves the
  // link out of step, so nothing more is read from a lender that broke the
  // protocol: what else it sent would be taken for later answers.
  template <class Request>
  decltype(auto) exchange(Request&& request) {
    try {
      return request();
    } catch (const protocol_error&) {
      out_of_step = true;
      throw;
    }
  }

  // Regions lent on this link and not yet confirmed given back, and those of
  // them the lender asked back (under mutex). Revocations that arrived while
  // a call waited for its answer wait in `stashed`, under its own lock so
  // that revocations() takes them while another call holds the connection
  // (a borrow waiting for memory):
  //   stashed.size() <= revoked.size() <= held.size()
  std::set<std::uint64_t> held;
  std::mutex stash_mutex;  // taken inside mutex, never around it
  std::set<std::uint64_t> revoked;            // under mutex and stash_mutex (either guards a read)
  std::vector<borrower::revocation> stashed;  // under stash_mutex

  std::vector<borrower::revocation> take_stashed() {
    std::lock_guard lock(stash_mutex);
    return std::exchange(stashed, {});
  }

  // Keeps a revoke frame for revocations(): one per region held, so a
  // flooding lender cannot grow it. Anything else closes the link.
  void stash(const channel::frame& f) {
    try {
      const auto m = detail::decode_revoke(f.payload);
      if (!held.contains(m.region)) {
        throw protocol_error("borrower: the lender revoked region " + std::to_string(m.region) +
                             ", which this borrower does not hold");
      }
      std::lock_guard lock(stash_mutex);
      if (!revoked.insert(m.region).second) {
        throw protocol_error("borrower: the lender revoked region " + std::to_string(m.region) + " a second time");
      }
      stashed.push_back({m.region, clock_type::now() + std::chrono::milliseconds(m.deadline_ms)});
    } catch (const protocol_error&) {
      out_of_step = true;
      throw;
    }
  }

  // The lender confirmed `id` given back: no longer held, nor revoked.
  void given_back_confirmed(std::uint64_t id) {
    held.erase(id);
    std::lock_guard lock(stash_mutex);
    revoked.erase(id);
    std::erase_if(stashed, [id](const borrower::revocation& r) { return r.region == id; });
  }

  // Handles a frame the lender sends unasked: a revoke is kept for
  // revocations(), a forget unmaps the kept mapping it names. False for any
  // other frame.
  bool unasked(const channel::frame& f, const char* operation) {
    if (f.type == static_cast<std::uint16_t>(message_type::revoke)) {
      stash(f);
      return true;
    }
    if (f.type != static_cast<std::uint16_t>(message_type::forget)) return false;
    const auto memory = detail::decode_forget(f.payload);
    if (!kept.forget(memory)) {
      out_of_step = true;
      throw protocol_error(std::string("borrower::") + operation + ": the lender said to forget memory " +
                           std::to_string(memory) + ", which this borrower does not keep mapped");
    }
    return true;
  }

  // The next answer, within the deadline (revokes and forgets that come
  // first are handled); timeout_error when none has begun to come (the
  // link stays in step only where the caller records what is late).
  channel::frame next_or_timeout(clock_type::time_point deadline, const char* operation,
                                 const std::function<void()>* interrupt_check = nullptr) {
    if (interrupt_check != nullptr && *interrupt_check) return next_checking(deadline, operation, *interrupt_check);
    for (;;) {
      channel::frame f;
      try {
        f = conn.receive_for(left_until(deadline));
      } catch (const timeout_error&) {
        throw timeout_error(std::string("borrower::") + operation + ": the lender did not answer in time");
      }
      if (!unasked(f, operation)) return f;
    }
  }

  // next_or_timeout, calling `interrupt_check` at least every
  // interrupt_check_interval while nothing has come (what it throws ends the
  // wait as a timeout would: the link stays in step, the answer the caller's
  // to record). Reads only whole batches, so an interruption or the deadline
  // never cuts one.
  channel::frame next_checking(clock_type::time_point deadline, const char* operation,
                               const std::function<void()>& interrupt_check) {
    const auto start = clock_type::now();
    const auto spin_until = start + reply_spin;  // the answer usually comes within the spin: no sleep
    auto next_check = start + interrupt_check_interval;
    for (;;) {
      while (std::optional<channel::frame> f = conn.try_receive()) {
        if (!unasked(*f, operation)) return std::move(*f);
      }
      const auto now = clock_type::now();
      if (now >= deadline) throw timeout_error(std::string("borrower::") + operation + ": the lender did not answer in time");
      if (now < spin_until) continue;
      if (now >= next_check) {
        interrupt_check();
        next_check = now + interrupt_check_interval;
      }
      wait_readable(conn, std::min(deadline, next_check));
    }
  }

  // next_or_timeout, where a timeout leaves the link out of step (the answer
  // was under way, or nothing records it as late).
  channel::frame next(clock_type::time_point deadline, const char* operation) {
    try {
      return next_or_timeout(deadline, operation);
    } catch (const timeout_error&) {
      out_of_step = true;
      throw;
    }
  }

  // Records an answer no caller waits for (owed). Past max_owed the link is
  // given up (out of step): the lender reclaims on hang-up.
  void owe(owed_answer o) {
    if (owed.size() >= max_owed) {
      if (o.data != nullptr) device.close_import(o.data);
      out_of_step = true;
      return;
    }
    owed.push_back(o);
  }

  // Sends the give back `o` names (region, keep, and the mapping offered to
  // be kept) and owes its answer. A send that throws owes nothing: the
  // mapping in `o` is still the caller's. Owed before it is sent: nothing
  // that may throw comes after the send, so a give back that went is always
  // owed its answer.
  void send_give_back(const owed_answer& o) {
    const bool room = owed.size() < max_owed;  // past it, sent all the same, then the link given up (owe)
    if (room) owed.push_back(o);
    try {
      conn.send(static_cast<std::uint16_t>(message_type::give_back),
                detail::encode(detail::give_back_message{o.region, o.keep}));
    } catch (...) {
      if (room) owed.pop_back();
      throw;
    }
    if (!room) owe(o);
  }

  // Gives region `id`, mapped here no more, back: its answer is read now,
  // within `deadline`, or by a later call. Throws nothing (a link that
  // breaks meanwhile is reclaimed by the lender on hang-up).
  void give_back_unmapped(std::uint64_t id, clock_type::time_point deadline, const char* operation) noexcept {
    try {
      send_give_back({.what = owed_answer::kind::given_back, .region = id});
      settle_owed(deadline, operation);
    } catch (...) {  // NOLINT(bugprone-empty-catch): owed for the next call, or reclaimed on hang-up
    }
  }

  // Bytes of the mappings owed answers may still put into `kept`.
  [[nodiscard]] std::size_t owed_keep_bytes() const noexcept {
    std::size_t bytes = 0;
    for (const owed_answer& o : owed) bytes += o.data != nullptr ? o.size : 0;
    return bytes;
  }

  // Reads every owed answer within `deadline`. timeout_error, what is left
  // still owed and the link in step, when the next has not begun to come.
  // Under `mutex`, before a call sends its own request.
  void settle_owed(clock_type::time_point deadline, const char* operation) {
    send_deferred();
    while (!owed.empty()) {
      channel::frame f;
      try {
        f = next_or_timeout(deadline, operation);
      } catch (const timeout_error&) {
        if (conn.broken()) out_of_step = true;
        gave_up_waiting = clock_type::now();
        throw timeout_error(std::string("borrower::") + operation + ": the lender has not yet answered " +
                            std::to_string(owed.size()) +
                            " earlier request(s) no call waits for any more; they are read first, at the next call");
      }
      take_owed(std::move(f), deadline, operation);
    }
  }

  // The first owed answer, whose first frame is `f`: a region lent late is
  // read whole and given back unmapped (a kept mapping it came on offered
  // back to be kept; that give back's answer owed in turn, not waited for), a
  // refusal dropped; a give back's confirmation puts its mapping where the
  // lender says. Anything else leaves the link out of step.
  void take_owed(channel::frame f, clock_type::time_point deadline, const char* operation) {
    const owed_answer o = owed.front();
    owed.pop_front();
    const auto who = [operation] { return std::string("borrower::") + operation; };
    try {
      if (o.what == owed_answer::kind::given_back) return take_given_back(o, f, who);
      if (f.type == static_cast<std::uint16_t>(message_type::refused)) {
        if (detail::decode_refused(f.payload).request == o.request) return;
        throw protocol_error(who() + ": a refusal that answers no request; request " + std::to_string(o.request) +
                             " was the one left unanswered");
      }
      if (f.type != static_cast<std::uint16_t>(message_type::lent)) {
        throw protocol_error(who() + ": the lender answered request " + std::to_string(o.request) +
                             ", which timed out, with frame type " + std::to_string(f.type));
      }
      const auto lent = detail::decode_lent(f.payload);
      if (lent.request != o.request || lent.bytes == 0) {
        throw protocol_error(who() + ": the lender lent " + std::to_string(lent.bytes) + " bytes for request " +
                             std::to_string(lent.request) + "; request " + std::to_string(o.request) +
                             " was the one left unanswered");
      }
      held.insert(lent.region);  // the lender may revoke it until it confirms the give back
      // Its chunks are dropped unmapped (their descriptors close with them).
      // Lent with none, it is memory this borrower keeps mapped: that
      // mapping is offered back with it.
      const bool on_kept_mapping = lent.chunks == 0;
      if (on_kept_mapping && (o.shared || !kept.contains(lent.memory))) {
        throw protocol_error(who() + ": region " + std::to_string(lent.region) +
                             " was lent with no chunks, as memory this borrower does not keep mapped");
      }
      for (std::uint32_t i = 0; i < lent.chunks; ++i) {
        if (next(deadline, operation).type != static_cast<std::uint16_t>(message_type::chunk)) {
          throw protocol_error(who() + ": expected chunk " + std::to_string(i) + " of region " +
                               std::to_string(lent.region));
        }
      }
      if (o.shared && next(deadline, operation).type != static_cast<std::uint16_t>(message_type::layout)) {
        throw protocol_error(who() + ": expected the layout of region " + std::to_string(lent.region));
      }
      send_give_back({.what = owed_answer::kind::given_back, .region = lent.region, .keep = on_kept_mapping,
                      .memory = lent.memory});
    } catch (const protocol_error&) {
      out_of_step = true;
      throw;
    }
  }

  // A give back's confirmation (or refusal), owed as `o`.
  template <class Who>
  void take_given_back(const owed_answer& o, const channel::frame& f, const Who& who) {
    const auto drop_mapping = [&] {
      if (o.data != nullptr) device.close_import(o.data);  // offered, not kept
    };
    if (f.type == static_cast<std::uint16_t>(message_type::refused)) {
      drop_mapping();
      throw_refusal(detail::decode_refused(f.payload), 0);
    }
    const auto answer = f.type == static_cast<std::uint16_t>(message_type::given_back)
                            ? std::optional(detail::decode_given_back(f.payload))
                            : std::nullopt;
    if (!answer || answer->region != o.region || (answer->kept && !o.keep)) {
      drop_mapping();
      throw protocol_error(who() + ": the lender answered the give back of region " + std::to_string(o.region) +
                           " with frame type " + std::to_string(f.type) +
                           (o.keep ? "" : " (with no kept mapping: none was asked)"));
    }
    if (answer->kept && o.data != nullptr && kept.contains(o.memory)) {
      // Two regions of one memory id both kept: a lender that lent one
      // memory twice; the second mapping would never be unmapped.
      drop_mapping();
      throw protocol_error(who() + ": the lender recorded region " + std::to_string(o.region) + "'s memory " +
                           std::to_string(o.memory) + " as kept, which this borrower keeps already");
    }
    if (answer->kept) {
      if (o.data != nullptr) kept.keep(o.memory, {o.data, o.size});  // room was set aside when it was offered
    } else if (o.data != nullptr) {
      device.close_import(o.data);
    } else if (o.keep) {
      (void)kept.forget(o.memory);  // the kept mapping a late region came on: the lender no longer records it
    }
    given_back_confirmed(o.region);
  }

  // The kept mapping of a region lent with no chunks: the lender knows this
  // borrower keeps its memory mapped (read-write: only exclusive regions'
  // mappings are kept). protocol_error when it does not, or not as lent.
  void* kept_mapping(const detail::lent_message& lent, backend::memory_access access, const char* operation) {
    const auto m = access == backend::memory_access::read_write ? kept.take(lent.memory) : std::nullopt;
    if (m && m->size == lent.bytes) return m->data;
    if (m) device.close_import(m->data);
    out_of_step = true;
    throw protocol_error(std::string("borrower::") + operation + ": region " + std::to_string(lent.region) +
                         " was lent with no chunks, as memory " +
                         std::to_string(lent.memory) + " of " + std::to_string(lent.bytes) +
                         " bytes this borrower keeps mapped; " +
                         (m ? "it keeps " + std::to_string(m->size) + " bytes of it"
                            : access == backend::memory_access::read_write ? "it keeps no mapping of it"
                                                                            : "a read-only region needs its chunks"));
  }

  [[noreturn]] static void throw_refusal(const detail::refused_message& m, std::size_t bytes) {
    // The lender's text, its bytes outside printable ASCII as \xNN escapes.
    const std::string said = shoal::detail::printable(m.why);
    const std::string why = "the lender refused: " + said;
    switch (m.reason) {
      case refusal::capacity:
        throw memory_refused(why, bytes, shortage::capacity);
      case refusal::wait_expired:
        throw memory_refused(why, bytes, shortage::wait_expired);
      case refusal::others_waiting:
        throw memory_refused(why, bytes, shortage::others_waiting);
      case refusal::cannot_fit:
        throw memory_refused(why, bytes, shortage::cannot_fit);
      case refusal::stopped_waiting:
        throw memory_refused(why, bytes, shortage::stopped_waiting);
      case refusal::quota:
      case refusal::not_permitted:
        throw peer_refused(why);
      case refusal::device_error:
        throw backend_error("the lender's device", said);
      case refusal::hash_mismatch:
      case refusal::writer_mismatch:
        throw content_mismatch(why);
      case refusal::bad_request:
        break;
    }
    throw invalid_argument(why);
  }

  // Gives region `id` (mapped at `data`, `size` bytes of memory `memory`)
  // back and waits for the answer. An exclusive region's mapping is kept
  // when there is room and the lender records it; otherwise it is unmapped
  // before the lender hears of it.
  // Another call holding the connection past `deadline` (a borrow waiting
  // for memory) unmaps the region now and defers its give back to the next
  // call: timeout_error says so.
  void give_back(std::uint64_t id, std::uint64_t memory, void* data, std::size_t size, bool exclusive,
                 clock_type::time_point deadline) {
    if (epoch.forked_since()) return;  // a fork() child's drop of a region it inherited: the parent's (~link)
    std::unique_lock lock(mutex, std::defer_lock);
    if (!lock_by(lock, deadline)) {
      device.close_import(data);
      defer_give_back(id);
      throw timeout_error("borrower::give_back: another call holds the connection (a borrow waiting for memory?); "
                          "region " + std::to_string(id) + " is unmapped and given back at this borrower's next call");
    }
    exchange([&] { give_back_locked(id, memory, data, size, exclusive, deadline); });
  }

  void give_back_locked(std::uint64_t id, std::uint64_t memory, void* data, std::size_t size, bool exclusive,
                        clock_type::time_point deadline) {
    // Room for the mapping is set aside now, past what owed answers may keep.
    const bool keep = exclusive && !out_of_step && kept.room_for(size + owed_keep_bytes());
    if (!keep) device.close_import(data);
    try {
      usable("give_back");
      send_give_back({.what = owed_answer::kind::given_back, .region = id, .keep = keep, .memory = memory,
                      .data = keep ? data : nullptr, .size = size});
    } catch (...) {
      if (keep) device.close_import(data);
      throw;
    }
    // Sent: the answer is read now (after any owed before it) or, past the
    // deadline, by a later call.
    settle_owed(deadline, "give_back");
  }

  struct mapped {
    detail::lent_message lent;
    void* data = nullptr;
  };

  // Reads the answer to `request` — refused (thrown as its typed error), or
  // lent of at least `min_bytes` and its chunk frames — and maps the chunks
  // with `access`. Under `mutex`. A region lent but not mappable is given
  // back at once. With `late_if_unanswered`, an answer that has not begun
  // to come by the deadline is recorded as owed (settle_owed takes it).
  mapped receive_region(std::uint64_t request, std::size_t min_bytes, backend::memory_access access,
                        clock_type::time_point deadline, const char* operation,
                        std::optional<late_borrow> late_if_unanswered = std::nullopt,
                        const std::function<void()>* interrupt_check = nullptr) {
    // Named only when something is wrong: the answer's path allocates nothing for it.
    const auto who = [operation] { return std::string("borrower::") + operation; };
    channel::frame f;
    // No caller waits for the answer any more: it is owed, and a borrow that
    // may still wait in the lender's line is told to stop, so the lender
    // answers it now and the next call does not wait behind it.
    const auto owe_region = [&] {
      owe({.what = owed_answer::kind::region, .request = late_if_unanswered->request,
           .shared = late_if_unanswered->shared});
      if (!late_if_unanswered->waits || out_of_step) return;
      try {
        conn.send(static_cast<std::uint16_t>(message_type::cancel_wait),
                  detail::encode_cancel_wait(late_if_unanswered->request));
      } catch (...) {
        // Not told (or told in part): the borrow may wait on, and the next
        // call would wait behind it; nothing more is asked on this link.
        out_of_step = true;
      }
    };
    try {
      f = late_if_unanswered ? next_or_timeout(deadline, operation, interrupt_check) : next(deadline, operation);
    } catch (const timeout_error& e) {
      if (!late_if_unanswered) throw;
      if (conn.broken()) {  // a batch stopped part-way: the link is closed
        out_of_step = true;
        throw;
      }
      owe_region();
      throw timeout_error(std::string(e.what()) +
                          "; if the lender lends it later, the region is given back unmapped at this borrower's next call");
    } catch (const protocol_error&) {
      throw;
    } catch (...) {
      // The interrupt check ended the wait: the answer is owed, as after a timeout.
      if (!conn.broken() && !out_of_step) owe_region();
      throw;
    }
    if (f.type == static_cast<std::uint16_t>(message_type::refused)) {
      const auto refused = detail::decode_refused(f.payload);
      if (refused.request != request) {
        out_of_step = true;
        throw protocol_error(who() + ": a refusal of request " + std::to_string(refused.request) + ", not " +
                             std::to_string(request));
      }
      throw_refusal(refused, min_bytes);
    }
    if (f.type != static_cast<std::uint16_t>(message_type::lent)) {
      out_of_step = true;
      throw protocol_error(who() + ": the lender answered with frame type " + std::to_string(f.type));
    }
    const auto lent = detail::decode_lent(f.payload);
    if (lent.request != request || lent.bytes < min_bytes || lent.bytes == 0) {
      out_of_step = true;
      throw protocol_error(who() + ": the lender lent " + std::to_string(lent.bytes) + " bytes for request " +
                           std::to_string(lent.request) + "; asked " + std::to_string(min_bytes) + " for request " +
                           std::to_string(request));
    }
    held.insert(lent.region);  // from now on the lender may revoke it
    if (lent.chunks == 0) return {lent, kept_mapping(lent, access, operation)};
    if (kept.contains(lent.memory)) {
      out_of_step = true;
      throw protocol_error(who() + ": the lender sent the chunks of memory " + std::to_string(lent.memory) +
                           ", which this borrower keeps mapped (it should have sent none)");
    }
    std::vector<backend::shareable_handle> chunks;
    std::uint64_t total = 0;
    for (std::uint32_t i = 0; i < lent.chunks; ++i) {
      channel::frame c = next(deadline, operation);
      if (c.type != static_cast<std::uint16_t>(message_type::chunk)) {
        out_of_step = true;
        throw protocol_error(who() + ": expected chunk " + std::to_string(i) + " of region " +
                             std::to_string(lent.region) + ", got frame type " + std::to_string(c.type));
      }
      chunks.push_back(backend::shareable_handle::deserialize(c.payload, std::move(c.fd)));
      total += chunks.back().size;
    }
    if (chunks.front().offset != 0 || total != lent.bytes) {
      out_of_step = true;
      throw protocol_error(who() + ": region " + std::to_string(lent.region) + "'s chunks hold " +
                           std::to_string(total) + " bytes from offset " + std::to_string(chunks.front().offset) +
                           "; the lender said " + std::to_string(lent.bytes) + " from 0");
    }
    try {
      void* mapped = device.import_memory(chunks, access);
      // Imported, so each is the device's own kind of descriptor (a sealed
      // memfd, a driver's export), whose close cannot block: closed in place.
      for (auto& c : chunks) c.fd.mark_safe_to_close();
      return {lent, mapped};
    } catch (...) {
      give_back_unmapped(lent.region, deadline, operation);  // not mapped: given back at once
      throw;
    }
  }
};

borrowed_region::borrowed_region(borrowed_region&& other) noexcept
    : link_(std::move(other.link_)),
      id_(std::exchange(other.id_, 0)),
      memory_(std::exchange(other.memory_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      layout_(std::move(other.layout_)) {}

borrowed_region& borrowed_region::operator=(borrowed_region&& other) noexcept {
  if (this != &other) {
    release();
    link_ = std::move(other.link_);
    id_ = std::exchange(other.id_, 0);
    memory_ = std::exchange(other.memory_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    layout_ = std::move(other.layout_);
  }
  return *this;
}

borrowed_region::~borrowed_region() { release(); }

const void* borrowed_region::address_of(std::string_view name) const {
  if (!layout_) {
    throw invalid_argument("borrowed_region::address_of: region " + std::to_string(id_) +
                           " is exclusive and has no layout; entries are named in published regions");
  }
  return static_cast<const std::byte*>(data_) + layout_->at(name).offset;
}

void borrowed_region::release() noexcept {
  if (data_ == nullptr) return;
  try {
    link_->give_back(id_, memory_, std::exchange(data_, nullptr), size_, mode() == region_mode::exclusive,
                     deadline_after(drop_timeout));
  } catch (...) {  // NOLINT(bugprone-empty-catch): the lender reclaims what it is not told of when we hang up
  }
  data_ = nullptr;
  link_.reset();
}

borrower::borrower(backend::device& device, const channel::channel_address& address,
                   const channel::access_policy& policy, std::chrono::milliseconds timeout, borrower_options options) {
  const auto deadline = deadline_after(timeout);
  auto conn = channel::connection::connect(address, policy, detail::max_frame_payload, left_until(deadline));
  conn.set_send_timeout(shoal::detail::channel_timeout(timeout));
  try {
    channel::send_hello(conn, options.observer ? detail::observer_protocol : lending_protocol);
    channel::check_hello(conn.receive_for(left_until(deadline)), lending_protocol);
  } catch (const connection_closed&) {
    // A lender hangs up before its hello on a borrower it turns away.
    throw peer_refused("borrower: the lender at " + address_text(address) +
                       " closed the connection before its hello: it turned this " +
                       (options.observer ? "observer away (as many observers" : "borrower away (as many borrowers") +
                       " as it admits are connected, or this user is not one it admits; its log says which), or it "
                       "is stopping");
  } catch (const timeout_error&) {
    throw timeout_error("borrower: the lender at " + address_text(address) + " took the connection but did not greet "
                        "within " + std::to_string(timeout.count()) + " ms (a lender stopped or too busy, or a "
                        "process that is no lender: a sharing consumer, for one, answers only while it takes "
                        "batches)");
  }
  link_ = std::make_shared<borrowed_region::link>(device, std::move(conn), options);
}

borrower::~borrower() = default;

borrowed_region borrower::borrow(std::size_t bytes, std::string_view purpose, region_mode mode,
                                 std::chrono::milliseconds timeout, const borrow_wait& wait) {
  link_->may_borrow("borrow");
  if (bytes == 0) throw invalid_argument("borrower::borrow: a region of 0 bytes");
  if (!detail::valid_purpose(purpose)) {
    throw invalid_argument("borrower::borrow: the purpose must be 1 to 64 bytes of printable ASCII");
  }
  if (mode != region_mode::exclusive) {
    throw invalid_argument("borrower::borrow: only exclusive regions are borrowed fresh; publish one to share it, "
                           "and map a published one with borrow_shared");
  }
  if (wait.for_memory.count() < 0 || wait.for_memory.count() > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument("borrower::borrow: the wait for memory must be 0 to about 49 days");
  }
  // The lender answers within the wait; the timeout is for the rest.
  const auto deadline = deadline_after(timeout > std::chrono::milliseconds::max() - wait.for_memory
                                           ? std::chrono::milliseconds::max()
                                           : wait.for_memory + timeout);
  auto& l = *link_;
  const auto lock = l.take_for(deadline_after(timeout), "borrow");
  l.usable("borrow");
  l.exchange([&] { l.settle_owed(deadline_after(timeout), "borrow"); });
  const std::uint64_t request = l.next_request++;
  l.conn.send(static_cast<std::uint16_t>(message_type::borrow),
              detail::encode(detail::borrow_message{request, bytes, mode, std::string(purpose),
                                                    static_cast<std::uint32_t>(wait.for_memory.count())}));
  const auto m = l.exchange([&] {
    return l.receive_region(request, bytes, backend::memory_access::read_write, deadline, "borrow",
                            borrowed_region::link::late_borrow{request, false, wait.for_memory.count() > 0},
                            &wait.interrupt_check);
  });
  return borrowed_region(link_, m.lent.region, m.lent.memory, m.data, static_cast<std::size_t>(m.lent.bytes));
}

borrowed_region borrower::publish(borrowed_region&& region, const region_layout& layout,
                                  std::chrono::milliseconds timeout) {
  if (!region.valid()) throw invalid_argument("borrower::publish: the region is empty (moved from or given back)");
  if (region.link_ != link_) {
    throw invalid_argument("borrower::publish: the region was borrowed through another borrower");
  }
  if (region.mode() != region_mode::exclusive) {
    throw invalid_argument("borrower::publish: region " + std::to_string(region.id()) + " is shared already");
  }
  if (auto problem = layout_problem(layout, region.size()); !problem.empty()) {
    throw invalid_argument("borrower::publish: the layout is malformed: " + problem);
  }
  const auto deadline = deadline_after(timeout);
  auto& l = *link_;
  const auto lock = l.take_for(deadline, "publish");
  l.usable("publish");
  l.exchange([&] { l.settle_owed(deadline, "publish"); });
  const std::uint64_t id = region.id_;
  const std::size_t size = region.size_;
  // From here on the region object holds nothing: the writable mapping goes
  // before the lender makes the region shared, and the lender is told below.
  l.device.close_import(std::exchange(region.data_, nullptr));
  region.link_.reset();
  const std::uint64_t request = l.next_request++;
  try {
    l.conn.send(static_cast<std::uint16_t>(message_type::publish),
                detail::encode(detail::publish_message{request, id, layout}));
    const auto m = l.exchange(
        [&] { return l.receive_region(request, size, backend::memory_access::read_only, deadline, "publish"); });
    if (m.lent.region != id) {
      l.device.close_import(m.data);
      l.out_of_step = true;
      throw protocol_error("borrower::publish: the lender answered with region " + std::to_string(m.lent.region) +
                           " for region " + std::to_string(id));
    }
    return borrowed_region(link_, id, m.lent.memory, m.data, size, std::make_shared<const region_layout>(layout));
  } catch (const error&) {
    // Refused, or the link broke: the region is not mapped here any more.
    if (!l.out_of_step && !l.conn.broken()) l.give_back_unmapped(id, deadline, "publish");
    throw;
  }
}

borrowed_region borrower::borrow_shared(std::string_view name, std::optional<content_hash> expected,
                                        std::optional<uid_t> expected_writer_uid, std::chrono::milliseconds timeout) {
  link_->may_borrow("borrow_shared");
  if (!detail::valid_purpose(name)) {
    throw invalid_argument("borrower::borrow_shared: the name must be 1 to 64 bytes of printable ASCII");
  }
  const auto deadline = deadline_after(timeout);
  auto& l = *link_;
  const auto lock = l.take_for(deadline, "borrow_shared");
  l.usable("borrow_shared");
  l.exchange([&] { l.settle_owed(deadline, "borrow_shared"); });
  const std::uint64_t request = l.next_request++;
  l.conn.send(static_cast<std::uint16_t>(message_type::borrow_shared),
              detail::encode(detail::borrow_shared_message{request, std::string(name), expected, expected_writer_uid}));
  const auto m = l.exchange([&] {
    return l.receive_region(request, 0, backend::memory_access::read_only, deadline, "borrow_shared",
                            borrowed_region::link::late_borrow{request, true});
  });
  // The layout frame follows. Anything wrong with it unmaps the region and
  // leaves the link out of step (the lender reclaims the hold on hang-up).
  try {
    channel::frame f = l.next(deadline, "borrow_shared");
    if (f.type != static_cast<std::uint16_t>(message_type::layout)) {
      throw protocol_error("expected the layout of region " + std::to_string(m.lent.region) + ", got frame type " +
                           std::to_string(f.type));
    }
    auto described = detail::decode_layout(f.payload);
    if (described.request != request) {
      throw protocol_error("a layout for request " + std::to_string(described.request) + ", not " +
                           std::to_string(request));
    }
    if (auto problem = layout_problem(described.layout, m.lent.bytes); !problem.empty()) {
      throw protocol_error("region " + std::to_string(m.lent.region) + "'s layout is malformed: " + problem);
    }
    if (expected && described.layout.hash != *expected) {
      throw protocol_error("region " + std::to_string(m.lent.region) + "'s layout has hash " +
                           to_hex(described.layout.hash) + " after the lender accepted the expected " +
                           to_hex(*expected));
    }
    return borrowed_region(link_, m.lent.region, m.lent.memory, m.data, static_cast<std::size_t>(m.lent.bytes),
                           std::make_shared<const region_layout>(std::move(described.layout)));
  } catch (const protocol_error& e) {
    l.device.close_import(m.data);
    l.out_of_step = true;
    throw protocol_error(std::string("borrower::borrow_shared: ") + e.what());
  } catch (...) {
    l.device.close_import(m.data);
    throw;
  }
}

void borrower::give_back(borrowed_region region, std::chrono::milliseconds timeout) {
  if (!region.valid()) throw invalid_argument("borrower::give_back: the region is empty (moved from or given back)");
  if (region.link_ != link_)
    throw invalid_argument("borrower::give_back: the region was borrowed through another borrower");
  const auto deadline = deadline_after(timeout);
  const bool exclusive = region.mode() == region_mode::exclusive;
  link_->give_back(region.id_, region.memory_, std::exchange(region.data_, nullptr), region.size_, exclusive, deadline);
}

borrower::kept_mappings borrower::kept() const {
  std::lock_guard lock(link_->mutex);
  return {link_->kept.count(), link_->kept.bytes()};
}

std::vector<borrower::revocation> borrower::revocations(std::chrono::milliseconds wait) {
  const auto deadline = deadline_after(wait);
  auto& l = *link_;
  for (;;) {
    // What another thread's request read (a borrow waiting for memory reads
    // the revokes that come meanwhile) first, without the connection.
    if (auto stashed = l.take_stashed(); !stashed.empty()) return stashed;
    bool read = false;
    {
      // Another thread's request may hold the connection for long (a borrow
      // waiting for memory): looked at again every slice, never waited for.
      std::unique_lock lock(l.mutex, std::try_to_lock);
      if (lock.owns_lock()) {
        read = true;
        l.usable("revocations");
        l.exchange([&] {
          while (std::optional<channel::frame> f = l.conn.try_receive()) {
            if (l.unasked(*f, "revocations")) continue;
            if (!l.owed.empty()) {  // the rest of its batch came with it; a give back it sends is owed in turn
              l.take_owed(std::move(*f), std::max(deadline, deadline_after(drop_timeout)), "revocations");
              continue;
            }
            throw protocol_error("borrower::revocations: the lender sent frame type " + std::to_string(f->type) +
                                 " unasked; only revoke and forget may come so");
          }
        });
      }
    }
    if (auto stashed = l.take_stashed(); !stashed.empty() || clock_type::now() >= deadline) return stashed;
    // The wait holds no lock: another thread's request (a give_back
    // answering a revoke) goes ahead meanwhile, and a revoke it reads is
    // stashed for the next look, within one slice.
    const auto until = std::min(deadline, clock_type::now() + revocation_slice);
    if (read) {
      wait_readable(l.conn, until);
    } else {
      std::this_thread::sleep_until(until);
    }
  }
}

void borrower::return_revocations(std::span<const revocation> unhandled) {
  auto& l = *link_;
  std::lock_guard lock(l.stash_mutex);  // never the connection: a waiting borrow may hold it
  for (const revocation& r : unhandled) {
    const bool stashed = std::any_of(l.stashed.begin(), l.stashed.end(),
                                     [&](const revocation& s) { return s.region == r.region; });
    if (l.revoked.contains(r.region) && !stashed) l.stashed.push_back(r);  // given back meanwhile: dropped
  }
}

void borrower::revoke(std::uint64_t region, std::chrono::milliseconds deadline, std::chrono::milliseconds timeout) {
  if (deadline.count() < 1 || deadline.count() > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument("borrower::revoke: the deadline must be 1 ms to about 49 days");
  }
  const auto until = deadline_after(timeout);
  auto& l = *link_;
  const auto lock = l.take_for(until, "revoke");
  l.usable("revoke");
  l.exchange([&] { l.settle_owed(until, "revoke"); });
  const std::uint64_t request = l.next_request++;
  l.conn.send(static_cast<std::uint16_t>(message_type::revoke_request),
              detail::encode(detail::revoke_request_message{request, region,
                                                            static_cast<std::uint32_t>(deadline.count())}));
  l.exchange([&] {
    channel::frame f = l.next(until, "revoke");
    if (f.type == static_cast<std::uint16_t>(message_type::refused)) {
      const auto refused = detail::decode_refused(f.payload);
      if (refused.request == request) l.throw_refusal(refused, 0);
    } else if (f.type == static_cast<std::uint16_t>(message_type::revoke_accepted) &&
               detail::decode_revoke_accepted(f.payload) == request) {
      return;
    }
    l.out_of_step = true;
    throw protocol_error("borrower::revoke: the lender answered request " + std::to_string(request) +
                         " with frame type " + std::to_string(f.type));
  });
}

std::string borrower::metrics(std::chrono::milliseconds timeout) {
  const auto deadline = deadline_after(timeout);
  auto& l = *link_;
  const auto lock = l.take_for(deadline, "metrics");
  l.usable("metrics");
  l.exchange([&] { l.settle_owed(deadline, "metrics"); });
  l.conn.send(static_cast<std::uint16_t>(message_type::query_metrics), {});
  channel::frame f = l.exchange([&] { return l.next(deadline, "metrics"); });
  if (f.type != static_cast<std::uint16_t>(message_type::metrics) || f.payload.size() > detail::max_metrics_text) {
    l.out_of_step = true;
    throw protocol_error("borrower::metrics: the lender answered with frame type " + std::to_string(f.type) + " of " +
                         std::to_string(f.payload.size()) + " bytes");
  }
  // Prometheus text is printable ASCII in lines: anything else (a NUL, a
  // terminal escape) would reach the operator's terminal or log as it is.
  const auto odd = std::find_if(f.payload.begin(), f.payload.end(), [](std::byte b) {
    const auto c = static_cast<unsigned char>(b);
    return c != '\n' && (c < 0x20 || c >= 0x7f);
  });
  if (odd != f.payload.end()) {
    throw protocol_error("borrower::metrics: the lender's metrics hold byte " +
                         std::to_string(static_cast<unsigned>(*odd)) + " at offset " +
                         std::to_string(odd - f.payload.begin()) + ", which is no printable text");
  }
  return std::string(reinterpret_cast<const char*>(f.payload.data()), f.payload.size());
}

}  // namespace shoal::lending
