// What the lender does when its own heap runs out while it serves: the
// borrower whose connection or request it was working on is refused or
// closed, and nothing else — the process goes on, its counts stay whole
// (lent bytes = the regions' bytes, within the capacity, no region without
// a hold), and once memory comes back every borrower is served as before.
// The serving thread's allocations are refused from the test
// (refusing_allocations_elsewhere, joined from the lender's event callback,
// which runs on that thread): all of them while a borrower connects, then
// every n-th one while borrowers borrow, give back (keeping mappings, so
// spares and forgets come into it), ask for metrics and are revoked.
//
// In-process borrowers: the host backend only (CUDA refuses to import
// memory in the process that exported it).
#include <gtest/gtest.h>

#include <chrono>
#include <iterator>
#include <memory>
#include <numeric>
#include <thread>
#include <string>
#include <vector>

#include "lending/lending_fixture.h"
#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

template <class Backend>
class out_of_memory_test : public lending_test<Backend> {
 protected:
  /// `config` with its events recorded and the serving thread joined to
  /// refusing_allocations_elsewhere at its first event.
  lender_config joining(lender_config config = {}) const {
    recorder_.attach(config);
    config.on_event = [record = config.on_event](const lending::lender_event& e) {
      refusing_allocations_elsewhere::join();
      record(e);
    };
    return config;
  }

  /// The lender's counts agree with its regions.
  static void expect_whole(const lending::lender_status& s) {
    const std::size_t regions_bytes = std::accumulate(
        s.regions.begin(), s.regions.end(), std::size_t{0},
        [](std::size_t sum, const lending::region_info& r) { return sum + r.bytes; });
    EXPECT_EQ(s.lent_bytes, regions_bytes) << "lent bytes that no region holds, or a region not counted";
    EXPECT_LE(s.lent_bytes + s.spare_bytes + s.prepared_bytes, s.capacity_bytes);
    std::size_t spare_bytes = 0;
    for (const auto& spare : s.spares) spare_bytes += spare.bytes;
    EXPECT_EQ(s.spare_bytes, spare_bytes);
  }

  event_recorder recorder_;
};
TYPED_TEST_SUITE(out_of_memory_test, backend_types, backend_names);

TYPED_TEST(out_of_memory_test, a_borrower_that_connects_while_the_lender_has_no_memory_is_refused_and_the_rest_served) {
  if (this->in_process_only()) return;
  auto& l = this->start(this->joining());
  borrower first(this->device(), l.address());  // its connected event joins the serving thread
  auto kept = first.borrow(this->unit(), "kept");
  const auto before = l.status();
  {
    const refusing_allocations_elsewhere no_heap(1);
    try {
      borrower refused(this->device(), l.address(), {}, 2000ms);
      ADD_FAILURE() << "a borrower was taken on by a lender with no memory";
    } catch (const error& e) {
      SUCCEED() << e.what();
    }
    EXPECT_GE(refusing_allocations_elsewhere::refused(), 1);
    std::this_thread::sleep_for(150ms);  // its periodic checks run with no memory too
  }
  const auto s = l.status();
  EXPECT_GT(s.refusals, before.refusals) << "the refused connection was not counted";
  EXPECT_EQ(s.borrowers, 1u);
  EXPECT_EQ(s.connections_closed_for_errors, 0u);
  this->expect_whole(s);
  first.give_back(std::move(kept));
  first.give_back(first.borrow(this->unit(), "after"));
  borrower later(this->device(), l.address());
  later.give_back(later.borrow(this->unit(), "later"));
  EXPECT_EQ(l.status().borrowers, 2u);
}

TYPED_TEST(out_of_memory_test, every_nth_allocation_refused_closes_only_the_borrower_served_and_keeps_the_counts_whole) {
  if (this->in_process_only()) return;
  lender_config config = this->joining();
  // Small enough that fresh regions release spares (forgets go out); the
  // regions of borrowers closed meanwhile stay orphaned (this process runs).
  config.capacity_bytes = 64 * this->unit();
  auto& l = this->start(config);
  {
    borrower join(this->device(), l.address());  // joins the serving thread
  }
  int failures = 0;
  int done = 0;
  int refused = 0;
  constexpr int periods[] = {2, 3, 5, 7, 11, 17, 29, 53};
  for (const int period : periods) {
    const refusing_allocations_elsewhere some(period);
    std::vector<std::unique_ptr<borrower>> borrowers(3);
    std::vector<std::vector<lending::borrowed_region>> held(borrowers.size());
    // 150 ms of turns; the last (and mildest) period goes on, up to 10 s,
    // until some turn has succeeded: on a loaded machine a connect alone can
    // outlast the 150 ms of every period.
    const auto start = std::chrono::steady_clock::now();
    const bool last = period == periods[std::size(periods) - 1];
    const auto go_on = [&] {
      const auto now = std::chrono::steady_clock::now();
      return now < start + 150ms || (last && done == 0 && now < start + 10s);
    };
    for (std::size_t turn = 0; go_on(); ++turn) {
      const std::size_t i = turn % borrowers.size();
      try {
        if (!borrowers[i]) {
          held[i].clear();
          borrowers[i] = std::make_unique<borrower>(this->device(), l.address(), channel::access_policy{}, 2000ms);
        }
        borrower& b = *borrowers[i];
        switch (turn % 5) {
          case 0:
          case 1:
            held[i].push_back(b.borrow((1 + turn % 3) * this->unit(), "turn", lending::region_mode::exclusive, 2000ms));
            break;
          case 2:
            if (!held[i].empty()) {
              b.give_back(std::move(held[i].back()), 2000ms);  // its mapping kept: a spare
              held[i].pop_back();
            }
            break;
          case 3:
            (void)b.metrics(2000ms);
            break;
          case 4:
            if (!held[i].empty()) {
              try {
                l.revoke(held[i].front().id(), 1000ms);
              } catch (const invalid_argument&) {
                // Revoked already, or its borrower was closed meanwhile.
              }
              (void)b.revocations();
            }
            break;
        }
        ++done;
      } catch (const error&) {
        ++failures;  // closed or refused for the lender's lack of memory: connect again
        held[i].clear();
        borrowers[i].reset();
      }
    }
    refused += refusing_allocations_elsewhere::refused();
  }
  EXPECT_GT(refused, 0) << "no allocation of the serving thread was refused";
  EXPECT_GT(done, 0);
  // Every borrower is gone: the lender went on, and its counts are whole.
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 0; }, 5000ms));
  this->expect_whole(l.status());
  borrower after(this->device(), l.address());
  const auto s = l.status();
  if (s.capacity_bytes - s.lent_bytes >= this->unit()) {
    after.give_back(after.borrow(this->unit(), "after"));
  } else {
    EXPECT_THROW((void)after.borrow(this->unit(), "after"), out_of_memory) << "orphaned regions fill the capacity";
  }
  EXPECT_FALSE(after.metrics().empty());
  this->expect_whole(l.status());
  this->RecordProperty("refused_allocations", refused);
  this->RecordProperty("borrower_failures", failures);
}

}  // namespace
}  // namespace shoal::testing
