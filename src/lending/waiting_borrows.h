// The lender's borrows that wait for memory: a borrow that does not fit,
// sent with a wait (borrow_message::wait_ms > 0), is kept here instead of
// refused, and served when regions are given back, in the order the borrows
// came — or refused once its wait runs out.
//
// Choice: strictly in order. A borrow waiting at the head is served before
// any later one, however small: a large borrow (the next model's turn) is
// never starved by small ones that keep fitting. While any borrow waits, a
// borrow sent without a wait is refused at once (the memory given back goes
// to the waiting ones first).
//
// But a uid whose wait ended unserved lately waits behind the other uids
// (the lender marks its borrows `behind` while that lasts, and clears the
// mark when it lapses): the line is served first-class borrows first, in
// the order they came, then the borrows behind, in the order they came; a
// borrow behind holds up only its own uid's borrows without a wait. So a uid
// that keeps asking for more than will come free holds the other uids up
// for one wait, then waits behind them. Within one uid the order is the
// order the borrows came (its borrows share one mark).
//
// Invariants, next to the data:
//   a connection (serial) appears at most once: anything it sends while its
//   borrow waits ends that wait first (the lender refuses it);
//   until >= since for every entry.
//
// Not thread-safe: the lender guards it with its mutex.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "lending/messages.h"
#include "shoal/core/process_identity.h"

namespace shoal::lending::detail {

struct waiting_borrow {
  std::uint64_t serial = 0;  ///< the connection that asked
  process_identity process;  ///< its process and uid, for the lender's status
  uid_t uid = 0;
  borrow_message request;
  std::size_t bytes = 0;  ///< request.bytes rounded up to the device's granularity
  std::chrono::steady_clock::time_point since;
  std::chrono::steady_clock::time_point until;  ///< refused once this passes
  bool behind = false;                          ///< its uid waits behind the others now (mark_behind)
};

class waiting_borrows {
 public:
  /// Keeps `w` last in line. When memory runs out (bad_alloc) nothing changed.
  void push(waiting_borrow&& w) { line_.push_back(std::move(w)); }
  [[nodiscard]] bool empty() const noexcept { return line_.empty(); }
  /// Whether a borrow not behind waits.
  [[nodiscard]] bool first_waits() const noexcept;
  /// The borrow served next: the first not behind, else the first; empty()
  /// must be false.
  [[nodiscard]] const waiting_borrow& head() const noexcept;
  /// Marks each borrow behind or not as `behind(uid)` says; whether the
  /// head changed.
  template <class Behind>
  bool mark_behind(Behind&& behind) noexcept {
    if (line_.empty()) return false;
    const std::uint64_t before = head().serial;
    for (auto& w : line_) w.behind = behind(w.uid);
    return head().serial != before;
  }
  /// Whether a borrow of `uid` waits marked behind.
  [[nodiscard]] bool marked_behind(uid_t uid) const noexcept;
  /// Connection `serial`'s waiting borrow, or nullptr.
  [[nodiscard]] const waiting_borrow* find(std::uint64_t serial) const noexcept;
  /// Takes connection `serial`'s borrow out of the line (it was served, hung
  /// up, or stopped waiting); nullopt when it had none.
  std::optional<waiting_borrow> take(std::uint64_t serial) noexcept;
  /// Takes out every borrow whose wait has run out by `now`, in line order.
  [[nodiscard]] std::vector<waiting_borrow> take_expired(std::chrono::steady_clock::time_point now);
  /// When the first wait runs out; nullopt when none waits.
  [[nodiscard]] std::optional<std::chrono::steady_clock::time_point> next_expiry() const noexcept;
  /// Calls `visit` with each waiting borrow, in the order they are served.
  template <class Visit>
  void visit(Visit&& visit) const {
    for (const auto& w : line_) {
      if (!w.behind) visit(w);
    }
    for (const auto& w : line_) {
      if (w.behind) visit(w);
    }
  }

 private:
  std::deque<waiting_borrow> line_;  // in the order the borrows came
};

}  // namespace shoal::lending::detail
