// A peer's descriptor is closed on the closer thread: the thread that drops
// it goes on at once, however long the close takes; a descriptor checked
// safe closes in place; a fork() child closes through its own closer; with
// no thread to be had, the dropping thread closes it.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "core/descriptor_closer.h"
#include "shoal/core/unique_fd.h"
#include "support/lingering_socket.h"
#include "support/processes.h"
#include "support/refused_allocations.h"
#include "support/refused_threads.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using shoal::detail::off_thread_closes_done_within;

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(descriptor_closer, a_peers_descriptor_is_closed_off_the_thread_that_drops_it) {
  socket_holding_a_lingering_one held(2);
  expect_returns_while_the_close_lingers([&] { unique_fd::from_peer(held.holder.release()).reset(); },
                                         "the drop waited out the inner socket's linger");
}

// A close that does not return holds one closer thread; the next descriptor
// is closed by another.
TEST(descriptor_closer, a_held_close_holds_one_thread_not_the_descriptors_behind_it) {
  socket_holding_a_lingering_one held(2);
  const auto start = std::chrono::steady_clock::now();
  unique_fd::from_peer(held.holder.release()).reset();
  pipe_ends behind;
  const int behind_fd = behind.read.get();
  unique_fd::from_peer(behind.read.release()).reset();
  while (is_open(behind_fd) && std::chrono::steady_clock::now() - start < 1500ms) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(is_open(behind_fd)) << "the descriptor waited for the held close";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms) << "the close did not linger: this test shows nothing";
}

// While a peer's closes hold every closer thread it may have, its next
// descriptor waits behind them, and one checked safe is closed in place.
TEST(descriptor_closer, a_descriptor_checked_safe_closes_in_place_while_the_closers_are_held) {
  std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held;
  for (std::size_t i = 0; i < shoal::detail::max_closes_per_owner; ++i) {
    held.push_back(std::make_unique<socket_holding_a_lingering_one>(2));
    unique_fd::from_peer(held.back()->holder.release()).reset();
  }
  pipe_ends queued, checked;
  const int queued_fd = queued.read.get(), checked_fd = checked.read.get();
  unique_fd::from_peer(queued.read.release()).reset();
  unique_fd safe = unique_fd::from_peer(checked.read.release());
  safe.mark_safe_to_close();
  safe.reset();
  EXPECT_FALSE(is_open(checked_fd)) << "the checked descriptor was left to the closer";
  EXPECT_TRUE(is_open(queued_fd)) << "the peer's descriptor was closed in place";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_FALSE(is_open(queued_fd));
}

TEST(descriptor_closer, a_peers_mark_moves_with_the_descriptor_and_its_copies) {
  pipe_ends pipe;
  unique_fd peers = unique_fd::from_peer(pipe.read.release());
  EXPECT_TRUE(peers.closes_off_thread());
  unique_fd copy = peers.duplicate();
  EXPECT_TRUE(copy.closes_off_thread()) << "a copy of a peer's file is the peer's too";
  unique_fd moved = std::move(peers);
  EXPECT_TRUE(moved.closes_off_thread());
  EXPECT_FALSE(peers.closes_off_thread());  // NOLINT(bugprone-use-after-move): a moved-from one owns nothing
  unique_fd assigned;
  assigned = std::move(moved);
  EXPECT_TRUE(assigned.closes_off_thread());
  assigned.reset(::dup(pipe.write.get()));
  EXPECT_FALSE(assigned.closes_off_thread()) << "a descriptor of the caller's own took the peer's mark";
  const int raw = copy.release();
  EXPECT_FALSE(copy.closes_off_thread());
  ::close(raw);
  EXPECT_FALSE(unique_fd(::dup(pipe.write.get())).closes_off_thread());
}

// The uids of two peers, as the channel charges their descriptors.
constexpr std::uint32_t peer_a = 1001, peer_b = 1002;

// One peer's closes hold at most max_closes_per_owner threads: its further
// descriptors wait their turn, and another peer's are closed at once.
TEST(descriptor_closer, one_peers_held_closes_hold_a_few_threads_and_others_close_at_once) {
  constexpr std::size_t handed = shoal::detail::max_closes_per_owner + 2;
  std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held;
  std::vector<int> numbers;
  for (std::size_t i = 0; i < handed; ++i) held.push_back(std::make_unique<socket_holding_a_lingering_one>(2));
  pipe_ends others;
  const int others_fd = others.read.get();
  const auto start = std::chrono::steady_clock::now();
  for (auto& h : held) {
    numbers.push_back(h->holder.get());
    unique_fd::from_peer(h->holder.release(), peer_a).reset();
  }
  unique_fd::from_peer(others.read.release(), peer_b).reset();
  while (is_open(others_fd) && std::chrono::steady_clock::now() - start < 1500ms) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(is_open(others_fd)) << "another peer's descriptor waited for the held closes";
  std::this_thread::sleep_for(300ms);
  // A descriptor leaves the table when its close begins: the first ones are
  // being closed, those past the peer's share wait, open.
  for (std::size_t i = 0; i < handed; ++i) {
    EXPECT_EQ(is_open(numbers[i]), i >= shoal::detail::max_closes_per_owner) << "descriptor " << i;
  }
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 3500ms) << "the peer's closes did not take turns";
}

// A peer whose closes are held and whose descriptors wait past its limit is
// backlogged (its connections begin no batch that may bring more); another
// peer is not; and neither once the closes are done.
TEST(descriptor_closer, a_peer_whose_held_descriptors_pile_up_is_backlogged_alone) {
  using shoal::detail::closer_backlogged;
  const auto held = held_closes(peer_a, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  const std::size_t limit = shoal::detail::closer_owner_backlog_limit();
  for (std::size_t i = 0; i < limit; ++i) unique_fd::from_peer(::dup(pipe.read.get()), peer_a).reset();
  std::this_thread::sleep_for(150ms);
  EXPECT_FALSE(closer_backlogged(peer_a)) << "backlogged at its limit, not past it";
  unique_fd::from_peer(::dup(pipe.read.get()), peer_a).reset();
  EXPECT_TRUE(closer_backlogged(peer_a));
  EXPECT_FALSE(closer_backlogged(peer_b)) << "another peer paid for the held closes";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_FALSE(closer_backlogged(peer_a));
}

// Reads everything `lingering`'s peer holds: the data its close waited to
// send goes, and the close returns.
void let_the_close_return(lingering_socket& lingering) {
  ::fcntl(lingering.server.get(), F_SETFL, O_NONBLOCK);
  std::vector<char> sink(65536);
  const auto until = std::chrono::steady_clock::now() + 50ms;
  while (std::chrono::steady_clock::now() < until) {
    if (::read(lingering.server.get(), sink.data(), sink.size()) <= 0) std::this_thread::sleep_for(1ms);
  }
}

// A queue past its limit (within twice it) whose closes keep returning, one
// every 60 ms, is a burst the threads work through, not a backlog; once none
// has returned for 100 ms, it is one.
TEST(descriptor_closer, a_queue_past_its_limit_whose_closes_keep_returning_is_no_backlog) {
  using shoal::detail::closer_backlogged;
  const lowered_descriptor_limit low(128);
  ASSERT_EQ(shoal::detail::closer_owner_backlog_limit(), 8u);
  constexpr std::size_t waiting = 15;  // past 8, within 16
  std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held;
  for (std::size_t i = 0; i < shoal::detail::max_closes_per_owner + waiting; ++i) {
    held.push_back(std::make_unique<socket_holding_a_lingering_one>(30));
  }
  for (auto& h : held) unique_fd::from_peer(h->holder.release(), peer_a).reset();
  for (std::size_t returned = 0; returned < 6; ++returned) {  // 15 waiting down to 9: past the limit throughout
    std::this_thread::sleep_for(10ms);
    let_the_close_return(held[returned]->inner);
    EXPECT_FALSE(closer_backlogged(peer_a)) << "a queue whose closes returned every 60 ms was a backlog, after "
                                            << returned + 1 << " returned";
  }
  std::this_thread::sleep_for(150ms);
  EXPECT_TRUE(closer_backlogged(peer_a)) << "no close returned for 150 ms, and the queue was no backlog";
  for (auto& h : held) let_the_close_return(h->inner);
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_FALSE(closer_backlogged(peer_a));
}

// A queue past its limit whose closes return now and then is a burst for
// 100 ms; past twice the limit it is a backlog at once: a peer that lets one
// close return every so often cannot grow it without end.
TEST(descriptor_closer, a_peers_queue_past_twice_its_limit_is_backlogged_at_once) {
  using shoal::detail::closer_backlogged;
  // A low limit keeps the burst short: it must stay within the 100 ms after
  // the peer's first hand-over, under the sanitizers too.
  const lowered_descriptor_limit low(128);
  ASSERT_EQ(shoal::detail::closer_owner_backlog_limit(), 8u);
  const auto held = held_closes(peer_a, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  const std::size_t limit = shoal::detail::closer_owner_backlog_limit();
  for (std::size_t i = 0; i < 2 * limit; ++i) unique_fd::from_peer(::dup(pipe.read.get()), peer_a).reset();
  EXPECT_FALSE(closer_backlogged(peer_a)) << "a burst within twice the limit, just begun, was a backlog";
  unique_fd::from_peer(::dup(pipe.read.get()), peer_a).reset();
  EXPECT_TRUE(closer_backlogged(peer_a)) << "past twice its limit, the queue was no backlog until no close had returned for 100 ms";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_FALSE(closer_backlogged(peer_a));
}

// Many peers, each within its share, whose held descriptors together pass
// the process-wide limit: every peer is backlogged, one with none waiting too.
TEST(descriptor_closer, peers_within_their_shares_that_fill_the_process_limit_backlog_everyone) {
  using shoal::detail::closer_backlogged;
  const lowered_descriptor_limit low(128);
  ASSERT_EQ(shoal::detail::closer_backlog_limit(), 32u);
  ASSERT_EQ(shoal::detail::closer_owner_backlog_limit(), 8u);
  std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held;
  pipe_ends pipe;
  for (std::uint32_t peer = 2001; peer <= 2005; ++peer) {
    for (std::size_t i = 0; i < shoal::detail::max_closes_per_owner; ++i) {
      held.push_back(std::make_unique<socket_holding_a_lingering_one>(2));
      unique_fd::from_peer(held.back()->holder.release(), peer).reset();
    }
    for (int i = 0; i < 7; ++i) unique_fd::from_peer(::dup(pipe.read.get()), peer).reset();  // within its 8
  }
  std::this_thread::sleep_for(150ms);  // no close has returned for 100 ms anywhere
  EXPECT_TRUE(closer_backlogged(2001));
  EXPECT_TRUE(closer_backlogged(peer_b)) << "35 descriptors wait, past the process's 32, and a new peer was let on";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_FALSE(closer_backlogged(peer_b));
}

// The parent's closer thread is not in the child: the child starts its own.
TEST(descriptor_closer, a_fork_child_closes_through_its_own_closer) {
  if (!forked_child_may_start_threads) GTEST_SKIP() << "a forked child may not start threads under the sanitizers";
  pipe_ends started;
  unique_fd::from_peer(started.read.release()).reset();  // the parent's closer runs
  ASSERT_TRUE(off_thread_closes_done_within(30s));
  forked_child child([] {
    pipe_ends pipe;
    const int fd = pipe.read.get();
    unique_fd::from_peer(pipe.read.release()).reset();
    return off_thread_closes_done_within(10s) && !is_open(fd) ? 0 : 1;
  });
  EXPECT_EQ(child.wait(), 0) << "the child's close never happened";
}

// What the parent's closers held queued at the fork is a number in the
// child, which the child may close and reuse for a file of its own (as
// closefrom() then open() does): its closers never close it.
TEST(descriptor_closer, a_fork_child_never_closes_a_number_its_parent_held_queued) {
  if (!forked_child_may_start_threads) GTEST_SKIP() << "a forked child may not start threads under the sanitizers";
  const auto held = held_closes(peer_a, shoal::detail::max_closes_per_owner, 2);
  pipe_ends queued;
  const int queued_fd = queued.read.get();
  unique_fd::from_peer(queued.read.release(), peer_a).reset();  // waits behind the held closes
  ASSERT_TRUE(is_open(queued_fd));
  forked_child child([&] {
    const int own = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (own < 0 || ::dup2(own, queued_fd) != queued_fd) return 2;  // the number is the child's own file now
    ::close(own);
    pipe_ends pipe;
    unique_fd::from_peer(pipe.read.release(), peer_a).reset();  // the child's first hand-over
    if (!off_thread_closes_done_within(10s)) return 3;
    return is_open(queued_fd) ? 0 : 1;
  });
  EXPECT_EQ(child.wait(), 0) << "1: the child's closers closed a file of the child's own; 2: setup; 3: the "
                                "child's closes did not finish";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  EXPECT_FALSE(is_open(queued_fd));
}

// With no thread to be had (a pids cgroup at its limit), the thread that
// drops a peer's descriptor closes it itself: it is never left open.
TEST(descriptor_closer, a_drop_with_no_closer_thread_to_be_had_closes_in_place) {
  if (!forked_child_may_start_threads) GTEST_SKIP() << "a forked child may not start threads under the sanitizers";
  forked_child child([] {  // a fresh process: its closers have no thread yet
    const refusing_threads none(0);
    pipe_ends pipe;
    const int fd = pipe.read.get();
    unique_fd::from_peer(pipe.read.release()).reset();
    if (none.refused() != 1) return 2;
    return is_open(fd) ? 1 : 0;
  });
  EXPECT_EQ(child.wait(), 0) << "1: the descriptor was left open; 2: no closer thread was tried";
}

// No new thread to be had while every closer thread is held: a descriptor
// handed over waits for one of them (never closed in place, where its close
// could hold the dropping thread) and is closed once that one is free.
TEST(descriptor_closer, a_drop_while_every_closer_is_held_and_none_can_start_waits_for_one) {
  if (!forked_child_may_start_threads) GTEST_SKIP() << "a forked child may not start threads under the sanitizers";
  forked_child child([] {  // a fresh process: its closers have no thread yet
    const refusing_threads one(1);
    socket_holding_a_lingering_one held(1);
    const int holder = held.holder.get();
    unique_fd::from_peer(held.holder.release(), peer_a).reset();  // the one thread, held for 1 s
    // Begun (the number leaves the table): the thread would otherwise find
    // the next descriptor waiting as it takes this one, and start another.
    for (int waited_ms = 0; is_open(holder) && waited_ms < 5000; ++waited_ms) std::this_thread::sleep_for(1ms);
    if (is_open(holder)) return 5;
    pipe_ends pipe;
    const int fd = pipe.read.get();
    const auto start = std::chrono::steady_clock::now();
    unique_fd::from_peer(pipe.read.release(), peer_b).reset();
    if (one.refused() != 1) return 2;
    if (std::chrono::steady_clock::now() - start > 500ms || !is_open(fd)) return 3;
    if (!off_thread_closes_done_within(10s)) return 4;
    return is_open(fd) ? 1 : 0;
  });
  EXPECT_EQ(child.wait(), 0) << "1: the descriptor was left open; 2: no second thread was tried; 3: it was closed "
                                "in place; 5: the held close never began";
}

int open_descriptors() {
  int count = 0;
  DIR* const listing = ::opendir("/proc/self/fd");
  if (listing == nullptr) return -1;
  while (::readdir(listing) != nullptr) ++count;
  ::closedir(listing);
  return count;
}

// Whichever allocation of a hand-over fails (the owner's entry, its queue,
// its turn in the list of turns), the descriptor is closed once: in place or
// by a closer thread, never both, and never left open. Every closer thread
// is held meanwhile, so that what was queued stays queued; a number closed
// in place gets a stand-in descriptor at once, and a last hand-over of each
// owner lists whatever of its own was left queued: the stand-in, were the
// descriptor closed in place and queued as well.
TEST(descriptor_closer, a_hand_over_that_runs_out_of_memory_closes_its_descriptor_once) {
  std::vector<std::unique_ptr<socket_holding_a_lingering_one>> held;
  while (held.size() < shoal::detail::max_closer_threads) {
    held.push_back(std::make_unique<socket_holding_a_lingering_one>(2));
  }
  pipe_ends spare;
  const int before = open_descriptors();  // the holders among them, closed below
  std::vector<int> holders;
  for (std::size_t i = 0; i < held.size(); ++i) {
    holders.push_back(held[i]->holder.get());
    unique_fd::from_peer(held[i]->holder.release(), 3000 + i / shoal::detail::max_closes_per_owner).reset();
  }
  // Every close begun (its number leaves the table): every thread there may
  // be is started and held, and no hand-over below starts another.
  for (const int fd : holders) {
    for (int waited_ms = 0; is_open(fd) && waited_ms < 5000; ++waited_ms) std::this_thread::sleep_for(1ms);
    ASSERT_FALSE(is_open(fd)) << "a held close did not begin within 5 s";
  }
  std::vector<int> stand_ins;
  int refused_making = 0, made_a_fourth = 0;
  // A new owner's hand-over makes its entry and queue (three allocations,
  // refused in turn in the first hundred) and lists its turn, which
  // allocates nothing: a fourth allocation is never made (a list of turns
  // of its own would take a new block every 128 owners).
  constexpr std::uint32_t owners = 600;
  for (std::uint32_t owner = 0; owner < owners; ++owner) {
    pipe_ends pipe;
    const int fd = pipe.read.release();
    {
      const refusing_one_allocation refusal(owner < 100 ? static_cast<int>(owner % 3) + 1 : 4, [] {});
      shoal::detail::close_off_thread(fd, 5000 + owner);
      (owner < 100 ? refused_making : made_a_fourth) += refusal.refused() ? 1 : 0;
    }
    if (!is_open(fd)) {
      ASSERT_EQ(::dup2(spare.read.get(), fd), fd);
      stand_ins.push_back(fd);
    }
  }
  for (std::uint32_t owner = 0; owner < owners; ++owner) {
    pipe_ends last;
    shoal::detail::close_off_thread(last.read.release(), 5000 + owner);
  }
  EXPECT_EQ(refused_making, 100) << "a new owner's hand-over made fewer allocations than this test refuses";
  EXPECT_EQ(made_a_fourth, 0) << "listing an owner's turn allocated (and could fail)";
  EXPECT_TRUE(off_thread_closes_done_within(30s));
  for (const int fd : stand_ins) {
    EXPECT_TRUE(is_open(fd)) << "descriptor " << fd << " was closed in place and by the closer as well";
    ::close(fd);
  }
  EXPECT_EQ(open_descriptors(), before - static_cast<int>(held.size())) << "a handed-over descriptor was left open";
}

}  // namespace
}  // namespace shoal::testing
