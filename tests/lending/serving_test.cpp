// How the lender serves its borrowers when one of them misbehaves: a
// borrower that stalls in the middle of a batch, or stops reading its
// answers, holds no one else up and is hung up on after the peer timeout
// (an answer, a revoke too, that waits unread for it, counted from when it
// was posted however slowly the borrower reads some of it); while its answers
// wait, nothing more is served to it, so one that asks without reading pins
// neither descriptors nor memory in the lender; answers queued for it arrive
// whole and in order, chunk descriptors included, once it reads; one killed
// with a chunk answer queued is hung up on at once and its regions and that
// answer's descriptor released; a revoke that comes while a publish is
// being checked keeps the region exclusive. A lender that polls without
// sleeping still serves and still notices a missed revocation deadline, and
// sleeps while more borrowers are connected than its spin's limit.
//
// In-process borrowers: the host backend only (CUDA refuses to import
// memory in the process that exported it).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lending/automatic_spin.h"
#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/layout.h"
#include "support/descriptors.h"

namespace shoal::testing {
namespace {

using lending::detail::message_type;

template <class Backend>
class serving_test : public lending_test<Backend> {};
TYPED_TEST_SUITE(serving_test, backend_types, backend_names);

/// A raw connection to the lender that said hello and borrowed one region
/// of `bytes` (its lent and chunk frames read); returns the region's id.
std::uint64_t greet_and_borrow(channel::connection& raw, std::size_t bytes) {
  channel::send_hello(raw, lending::detail::lending_protocol);
  channel::check_hello(raw.receive_for(2000ms), lending::detail::lending_protocol);
  raw.send(static_cast<std::uint16_t>(message_type::borrow),
           lending::detail::encode(lending::detail::borrow_message{1, bytes, lending::region_mode::exclusive, "raw"}));
  const channel::frame lent = raw.receive_for(2000ms);
  EXPECT_EQ(lent.type, static_cast<std::uint16_t>(message_type::lent));
  while (raw.pending() > 0) (void)raw.receive_for(2000ms);  // its chunk
  return lending::detail::decode_lent(lent.payload).region;
}

/// How many batches of `batch_bytes` a fresh UNIX stream socket of this
/// machine takes without its peer reading: the lender's socket to a
/// borrower that never reads fills after as many of its answers of that size.
std::size_t batches_a_socket_holds(std::size_t batch_bytes) {
  std::array<int, 2> pair{};
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair.data()), 0);
  const unique_fd sender(pair[0]), receiver(pair[1]);
  ::fcntl(sender.get(), F_SETFL, O_NONBLOCK);
  const std::vector<std::byte> batch(batch_bytes);
  std::size_t count = 0;
  while (::send(sender.get(), batch.data(), batch.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(batch.size())) ++count;
  return count;
}

std::size_t bytes_waiting(const channel::connection& c) {
  int bytes = 0;
  ::ioctl(c.native_handle(), FIONREAD, &bytes);
  return static_cast<std::size_t>(bytes);
}

// Borrow + give back turns of `b` for `window`, and the slowest of them.
struct borrow_turns {
  std::chrono::steady_clock::duration slowest{};
  int turns = 0;
};
borrow_turns turns_for(borrower& b, std::size_t bytes, std::chrono::milliseconds window) {
  borrow_turns t;
  const auto until = std::chrono::steady_clock::now() + window;
  while (std::chrono::steady_clock::now() < until) {
    const auto start = std::chrono::steady_clock::now();
    b.give_back(b.borrow(bytes, "turn"));
    t.slowest = std::max(t.slowest, std::chrono::steady_clock::now() - start);
    ++t.turns;
  }
  return t;
}

// The spin path runs in CI only when asked for (automatic spins on 8 CPUs or
// more): the loop that never sleeps must still serve and still run its
// periodic checks (here: the revocation deadline).
TYPED_TEST(serving_test, a_lender_that_polls_without_sleeping_serves_every_turn_and_still_notes_a_missed_revocation) {
  if (this->in_process_only()) return;
  const event_recorder recorder;
  lender_config config;
  config.poll_spin = std::chrono::microseconds(60'000'000);  // never sleeps once it served a request
  recorder.attach(config);
  auto& l = this->start(config);
  borrower b(this->device(), l.address());
  // A second of turns: under a sanitizer on two loaded cores, with the lender
  // spinning on one of them, 200 ms held as few as 7.
  const auto [slowest, turns] = turns_for(b, this->unit(), 1000ms);
  EXPECT_GT(turns, 10) << "turns served while the lender spins";
  EXPECT_LT(slowest, 1000ms);

  auto kept = b.borrow(this->unit(), "kept past its deadline");
  l.revoke(kept.id(), 100ms);
  ASSERT_TRUE(eventually([&] { return l.status().revocations_missed == 1; }, 2000ms))
      << "the deadline passed unnoticed while the lender spun";
  b.give_back(std::move(kept));
  EXPECT_TRUE(eventually([&] { return l.status().lent_bytes == 0; }, 2000ms));
}

std::chrono::nanoseconds process_cpu_time() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return std::chrono::seconds(t.tv_sec) + std::chrono::nanoseconds(t.tv_nsec);
}

/// CPU time this process spends while the calling thread sleeps for `window`.
std::chrono::milliseconds cpu_while_sleeping(std::chrono::milliseconds window) {
  const auto before = process_cpu_time();
  std::this_thread::sleep_for(window);
  return std::chrono::duration_cast<std::chrono::milliseconds>(process_cpu_time() - before);
}

/// Whether this process spends `cpu` of CPU time, while the calling thread
/// sleeps, before `limit` of wall time passes: a spinning thread does on any
/// machine, a loaded one (parallel tests) just takes it longer to.
bool spends_cpu_while_sleeping(std::chrono::milliseconds cpu, std::chrono::milliseconds limit) {
  const auto before = process_cpu_time();
  const auto until = std::chrono::steady_clock::now() + limit;
  while (process_cpu_time() - before < cpu) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// The spin is limited to as many borrowers as half the CPUs: past that, each
// may spin for its own reply and a lender that never sleeps waits behind
// them. Its CPU time while nothing is asked shows whether it spins.
TYPED_TEST(serving_test, a_lender_that_polls_without_sleeping_sleeps_once_more_borrowers_are_connected_than_its_limit) {
  if (this->in_process_only()) return;
  lender_config config;
  config.poll_spin = std::chrono::microseconds(60'000'000);  // spins on and on while the limit allows
  auto& l = this->start(config);
  std::vector<std::unique_ptr<borrower>> borrowers;
  const std::size_t limit = lending::detail::spinning_borrowers_limit();
  for (std::size_t i = 0; i < limit; ++i) borrowers.push_back(std::make_unique<borrower>(this->device(), l.address()));
  borrowers.front()->give_back(borrowers.front()->borrow(this->unit(), "starts the spin"));
  // Control: at the limit it spins, a core's worth of CPU time (a loaded
  // machine gives it less, never almost none).
  EXPECT_TRUE(spends_cpu_while_sleeping(250ms, 5000ms)) << "the lender did not spin with " << limit << " borrowers";

  borrowers.push_back(std::make_unique<borrower>(this->device(), l.address()));
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == limit + 1; }, 2000ms));
  borrowers.back()->give_back(borrowers.back()->borrow(this->unit(), "served past the limit"));
  EXPECT_LT(cpu_while_sleeping(500ms), 100ms) << "the lender spun with " << limit + 1 << " borrowers";

  borrowers.pop_back();  // back at the limit: the next request starts the spin again
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == limit; }, 2000ms));
  borrowers.front()->give_back(borrowers.front()->borrow(this->unit(), "spins again"));
  EXPECT_TRUE(spends_cpu_while_sleeping(250ms, 5000ms)) << "the lender did not spin again at the limit";
}

TYPED_TEST(serving_test, a_borrower_stalled_mid_batch_holds_no_one_else_up_and_is_hung_up_after_the_peer_timeout) {
  if (this->in_process_only()) return;
  const event_recorder recorder;
  lender_config config;
  config.peer_timeout = 2000ms;
  recorder.attach(config);
  auto& l = this->start(config);
  auto stalled = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  const std::uint64_t held = greet_and_borrow(stalled, this->unit());
  borrower b(this->device(), l.address());
  b.give_back(b.borrow(this->unit(), "warm-up"));

  // The first 100 bytes of a 256-byte batch, then nothing.
  std::array<std::byte, 100> half{};
  std::memcpy(half.data(), "SHOL", 4);
  const std::uint16_t version = channel::frame_version, frames = 1;
  const std::uint32_t body = channel::min_batch_bytes - channel::batch_header_bytes;
  std::memcpy(half.data() + 4, &version, 2);
  std::memcpy(half.data() + 6, &frames, 2);
  std::memcpy(half.data() + 8, &body, 4);
  ASSERT_EQ(::send(stalled.native_handle(), half.data(), half.size(), MSG_NOSIGNAL), 100);
  const auto stalled_at = std::chrono::steady_clock::now();

  const auto [slowest, turns] = turns_for(b, this->unit(), 500ms);
  // Served at once (well under 1 ms a turn here; the bound leaves room for a
  // loaded machine and sanitizers): held up behind the stalled one, a turn
  // would wait for the rest of its 2 s peer timeout, at least 1.5 s.
  EXPECT_LT(slowest, 1000ms) << "the slowest of " << turns << " borrow + give back turns while another borrower stalls";
  EXPECT_EQ(l.status().borrowers, 2u) << "hung up on before its peer timeout";

  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 1; }, 5000ms)) << "the stalled borrower was kept";
  EXPECT_GE(std::chrono::steady_clock::now() - stalled_at, 1900ms) << "hung up on before its peer timeout";
  const auto s = l.status();
  EXPECT_EQ(s.connections_closed_for_errors, 1u);
  ASSERT_EQ(s.regions.size(), 1u);
  EXPECT_EQ(s.regions[0].id, held);
  EXPECT_EQ(s.regions[0].state, lending::region_state::orphaned) << "its process still runs: orphaned until it exits";
  EXPECT_THROW((void)stalled.receive_for(2000ms), connection_closed);
  std::lock_guard lock(*recorder.guard);
  EXPECT_TRUE(std::any_of(recorder.events->begin(), recorder.events->end(), [](const lending::lender_event& e) {
    return e.what == lending::lender_event::kind::closed_for_error &&
           e.detail.find("part of a batch") != std::string::npos;
  }));
}

TYPED_TEST(serving_test, a_borrower_that_leaves_a_revoke_unread_for_the_peer_timeout_is_hung_up_on) {
  if (this->in_process_only()) return;
  const event_recorder recorder;
  lender_config config;
  config.peer_timeout = 300ms;
  recorder.attach(config);
  auto& l = this->start(config);
  auto deaf = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  const std::uint64_t region = greet_and_borrow(deaf, this->unit());
  // As many bad give-backs as the lender's socket holds refusals (one
  // 256-byte batch each); the borrower reads none of them.
  const std::size_t fill = batches_a_socket_holds(channel::min_batch_bytes);
  const auto bogus = lending::detail::encode(lending::detail::give_back_message{region + 1000, false});
  for (std::size_t i = 0; i < fill; ++i) deaf.send(static_cast<std::uint16_t>(message_type::give_back), bogus);
  ASSERT_TRUE(eventually([&] { return bytes_waiting(deaf) == fill * channel::min_batch_bytes; }))
      << bytes_waiting(deaf) << " bytes of refusals arrived, not " << fill * channel::min_batch_bytes;
  std::this_thread::sleep_for(2 * config.peer_timeout);
  ASSERT_EQ(l.status().borrowers, 1u) << "every refusal went: the lender's socket is full, not stuck";

  l.revoke(region, 5000ms);
  EXPECT_TRUE(eventually([&] { return l.status().borrowers == 0; }, 3000ms))
      << "a borrower that was never told of the revoke was kept";
  std::lock_guard lock(*recorder.guard);
  EXPECT_TRUE(std::any_of(recorder.events->begin(), recorder.events->end(), [](const lending::lender_event& e) {
    return e.what == lending::lender_event::kind::closed_for_error &&
           e.detail.find("left an answer unread for longer than the peer timeout of 300 ms") != std::string::npos;
  }));
}

/// Sends `count` query_metrics requests on `raw` at once, reading none of
/// the answers.
void ask_for_metrics(channel::connection& raw, std::size_t count) {
  const std::vector<channel::outgoing_frame> queries(count, {static_cast<std::uint16_t>(message_type::query_metrics)});
  raw.send(queries);
}

/// How many metrics answers from `l` fill `factor` times a borrower's
/// socket, and 64 more.
std::size_t answers_to_fill(const lender& l, std::size_t factor) {
  const std::size_t answer = l.metrics_text().size() + channel::batch_header_bytes + channel::frame_header_bytes;
  return factor * batches_a_socket_holds(answer) + 64;
}

bool closed_for_error_saying(const event_recorder& recorder, const std::string& words) {
  std::lock_guard lock(*recorder.guard);
  return std::any_of(recorder.events->begin(), recorder.events->end(), [&](const lending::lender_event& e) {
    return e.what == lending::lender_event::kind::closed_for_error && e.detail.find(words) != std::string::npos;
  });
}

TYPED_TEST(serving_test, a_borrower_that_reads_no_answers_holds_no_one_else_up_and_is_hung_up_after_the_peer_timeout) {
  if (this->in_process_only()) return;
  const event_recorder recorder;
  lender_config config;
  config.peer_timeout = 2000ms;
  recorder.attach(config);
  auto& l = this->start(config);
  auto deaf = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  (void)greet_and_borrow(deaf, this->unit());
  borrower b(this->device(), l.address());
  b.give_back(b.borrow(this->unit(), "warm-up"));

  // Three times what its socket holds: the lender cannot send the rest.
  ask_for_metrics(deaf, answers_to_fill(l, 3));
  const auto flooded_at = std::chrono::steady_clock::now();
  const auto [slowest, turns] = turns_for(b, this->unit(), 500ms);
  // Held up behind a send to the deaf borrower, a turn would wait for most
  // of its 2 s peer timeout.
  EXPECT_LT(slowest, 1000ms) << "the slowest of " << turns << " borrow + give back turns while another borrower reads nothing";
  EXPECT_EQ(l.status().borrowers, 2u) << "hung up on before its peer timeout";

  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 1; }, 5000ms)) << "the deaf borrower was kept";
  EXPECT_GE(std::chrono::steady_clock::now() - flooded_at, 1900ms) << "hung up on before its peer timeout";
  EXPECT_EQ(l.status().connections_closed_for_errors, 1u);
  EXPECT_TRUE(closed_for_error_saying(recorder, "left an answer unread for longer than the peer timeout of 2000 ms"));
  b.give_back(b.borrow(this->unit(), "after"));
}

TYPED_TEST(serving_test, a_borrower_that_reads_an_answer_slowly_is_closed_a_peer_timeout_after_it_was_posted) {
  if (this->in_process_only()) return;
  const event_recorder recorder;
  lender_config config;
  config.peer_timeout = 1500ms;
  config.max_regions_per_borrower = 1 << 14;
  config.capacity_bytes = config.quota_bytes = std::size_t{1} << 40;  // host memory files, never touched
  recorder.attach(config);
  // When the lender closed it (the recorder's events carry no time).
  const auto closed_at = std::make_shared<std::atomic<std::chrono::steady_clock::rep>>(0);
  config.on_event = [record = config.on_event, closed_at](const lending::lender_event& e) {
    if (e.what == lending::lender_event::kind::closed_for_error) {
      closed_at->store(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    record(e);
  };
  auto& l = this->start(config);
  auto slow = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  channel::send_hello(slow, lending::detail::lending_protocol);
  channel::check_hello(slow.receive_for(2000ms), lending::detail::lending_protocol);

  // Regions with long purposes (each backslash escaped in the text) until one
  // metrics answer is four times what the lender's socket to it holds.
  constexpr std::size_t probe = 16 * 1024;
  const std::size_t socket_bytes = batches_a_socket_holds(probe) * probe;
  ASSERT_LT(4 * socket_bytes, lending::detail::max_metrics_text - 64 * 1024)
      << "this machine's sockets hold too much for one metrics answer to outlast them";
  const std::string purpose(lending::max_purpose_bytes, '\\');
  std::uint64_t request = 1;
  auto borrow_regions = [&](std::size_t count) {
    while (count > 0) {
      std::vector<std::vector<std::byte>> payloads;
      for (; count > 0 && payloads.size() < 32; --count) {
        payloads.push_back(lending::detail::encode(
            lending::detail::borrow_message{request++, this->unit(), lending::region_mode::exclusive, purpose}));
      }
      std::vector<channel::outgoing_frame> asks;
      for (const auto& p : payloads) asks.push_back({static_cast<std::uint16_t>(message_type::borrow), p});
      slow.send(asks);
      for (std::size_t i = 0; i < payloads.size(); ++i) {
        ASSERT_EQ(slow.receive_for(2000ms).type, static_cast<std::uint16_t>(message_type::lent));
        ASSERT_EQ(slow.receive_for(2000ms).type, static_cast<std::uint16_t>(message_type::chunk));
      }
    }
  };
  const std::size_t empty_text = l.metrics_text().size();
  borrow_regions(100);
  const std::size_t per_region = (l.metrics_text().size() - empty_text) / 100;
  borrow_regions((4 * socket_bytes - empty_text) / per_region);
  const std::size_t answer = l.metrics_text().size();
  ASSERT_GE(answer, 4 * socket_bytes - per_region);
  ASSERT_EQ(slow.pending(), 0u);
  borrower b(this->device(), l.address());
  b.give_back(b.borrow(this->unit(), "warm-up"));

  // It reads 1.25 times its socket's worth a second from the answer's
  // first byte: bytes move well within a peer timeout of the last (the
  // lender writes more each time the socket has drained to a quarter, about
  // every 600 ms), but the lender's queue would empty only after 2.4 s.
  ask_for_metrics(slow, 1);
  const auto asked_at = std::chrono::steady_clock::now();
  const double bytes_per_second = 1.25 * static_cast<double>(socket_bytes);
  std::vector<std::byte> sink(socket_bytes);
  std::size_t read = 0;
  std::optional<std::chrono::steady_clock::time_point> first_byte_at;
  std::chrono::steady_clock::duration slowest{};
  int turns = 0;
  bool ended = false;
  while (!ended && std::chrono::steady_clock::now() - asked_at < 6000ms) {
    const auto now = std::chrono::steady_clock::now();
    std::size_t allowed = 4096;  // until the answer starts to come
    if (first_byte_at) {
      allowed += static_cast<std::size_t>(std::chrono::duration<double>(now - *first_byte_at).count() * bytes_per_second);
    }
    if (allowed > read) {
      const ssize_t got = ::recv(slow.native_handle(), sink.data(), std::min(allowed - read, sink.size()), MSG_DONTWAIT);
      if (got == 0) ended = true;  // the lender hung up and everything it wrote was read
      if (got > 0 && !first_byte_at) first_byte_at = now;
      if (got > 0) read += static_cast<std::size_t>(got);
    }
    // Timed while the lender waits on the slow one: from when its answer
    // was made (the lender's work for it, done in turn) until it is hung up
    // on (which orphans its thousands of regions, another matter).
    const bool waiting = first_byte_at && closed_at->load() == 0;
    const auto start = std::chrono::steady_clock::now();
    b.give_back(b.borrow(this->unit(), "turn"));
    if (waiting && closed_at->load() == 0) {
      slowest = std::max(slowest, std::chrono::steady_clock::now() - start);
      ++turns;
    }
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_TRUE(first_byte_at.has_value()) << "no answer came";
  ASSERT_NE(closed_at->load(), 0) << "a borrower that read " << read << " of " << answer << " bytes of one answer was kept";
  const auto closed = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(closed_at->load()));
  // Counted from when the answer was posted (when its first byte went), not
  // from the last byte the borrower read.
  EXPECT_GE(closed - asked_at, config.peer_timeout) << "hung up on before its peer timeout";
  EXPECT_LT(closed - *first_byte_at, config.peer_timeout + 750ms)
      << "the deadline was not counted from when the answer was posted";
  EXPECT_TRUE(ended) << "the lender's end of the connection stayed open";
  EXPECT_LT(read, answer) << "the whole answer went before the lender hung up";
  EXPECT_GT(turns, 0);
  // A lender that waited to send to it would hold a turn for its peer timeout.
  EXPECT_LT(slowest, config.peer_timeout / 2)
      << "the slowest of " << turns << " borrow + give back turns while another borrower reads slowly";
  EXPECT_EQ(l.status().connections_closed_for_errors, 1u);
  EXPECT_TRUE(closed_for_error_saying(recorder, "left an answer unread for longer than the peer timeout of 1500 ms"));
  b.give_back(b.borrow(this->unit(), "after"));
}

/// Bytes of the memory files (memfds) this process has open, each file
/// once: with an in-process lender, the host memory it pins.
std::size_t memory_file_bytes() {
  std::set<ino_t> seen;
  std::size_t bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code unreadable;
    const auto target = std::filesystem::read_symlink(entry.path(), unreadable).string();
    struct stat st {};
    if (unreadable || !target.starts_with("/memfd:") || ::stat(entry.path().c_str(), &st) != 0) continue;
    if (seen.insert(st.st_ino).second) bytes += static_cast<std::size_t>(st.st_size);
  }
  return bytes;
}

TYPED_TEST(serving_test, a_borrower_that_asks_without_reading_is_served_no_further_and_pins_nothing_past_the_capacity) {
  if (this->in_process_only()) return;
  lender_config config;
  config.peer_timeout = 60000ms;                // not hung up on while the test looks
  config.capacity_bytes = 4 * this->unit();
  config.reuse = lending::reuse_policy::never;  // memory given back is released: only a queued copy could keep it
  auto& l = this->start(config);
  auto greedy = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  const std::uint64_t first = greet_and_borrow(greedy, this->unit());
  const std::size_t descriptors_before = open_descriptor_count();
  const std::size_t pinned_before = memory_file_bytes();

  // Borrow and give back, again and again, more times than the lender's
  // socket holds answers, reading none: posted, so that the test is not
  // held up when the lender stops reading.
  const std::size_t socket_holds = batches_a_socket_holds(channel::min_batch_bytes);
  const std::size_t pairs = socket_holds + 200;
  std::vector<std::vector<std::byte>> payloads;
  for (std::uint64_t i = 0; i < pairs; ++i) {
    payloads.push_back(lending::detail::encode(
        lending::detail::borrow_message{2 + i, this->unit(), lending::region_mode::exclusive, "pipelined"}));
    payloads.push_back(lending::detail::encode(lending::detail::give_back_message{first + 1 + i, false}));
  }
  std::vector<channel::outgoing_frame> asks;
  for (std::size_t i = 0; i < payloads.size(); ++i) {
    asks.push_back({static_cast<std::uint16_t>(i % 2 == 0 ? message_type::borrow : message_type::give_back), payloads[i]});
  }
  greedy.post(asks);
  // Written out as the lender takes them, until it has served nothing new for 300 ms.
  std::uint64_t served = 0;
  auto last_change = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - last_change < 300ms) {
    if (greedy.unsent_bytes() > 0) {
      pollfd writable{greedy.native_handle(), POLLOUT, 0};
      (void)::poll(&writable, 1, 10);
      (void)greedy.flush();
    } else {
      std::this_thread::sleep_for(5ms);
    }
    if (const std::uint64_t now_served = l.status().requests; now_served != served) {
      served = now_served;
      last_change = std::chrono::steady_clock::now();
    }
  }

  // Each borrow it served put one answer or more into the socket, which
  // holds socket_holds of the smallest; the one after waits in the queue.
  EXPECT_LE(served, 1 + socket_holds + 1) << "the lender went on serving a borrower that reads none of its answers";
  // The region lent now, its export and the queued answer's copy: a few.
  EXPECT_LE(open_descriptor_count(), descriptors_before + 4) << "descriptors pile up in the queue of answers";
  EXPECT_LE(memory_file_bytes() - pinned_before, config.capacity_bytes - this->unit())
      << "memory given back stays pinned by queued answers, past the capacity";
  const auto s = l.status();
  EXPECT_LE(s.lent_bytes, config.capacity_bytes);
  EXPECT_EQ(s.borrowers, 1u);
  EXPECT_EQ(s.connections_closed_for_errors, 0u);
}

TYPED_TEST(serving_test, a_borrower_killed_with_a_chunk_answer_queued_is_hung_up_on_and_its_regions_and_descriptors_released) {
  if (std::string(TypeParam::name) == "cuda") {
    GTEST_SKIP() << "counts this process's descriptors, which the CUDA driver opens as it likes";
  }
  lender_config config;
  config.peer_timeout = 60000ms;                // hung up on for its hang-up, not its deadline
  config.reuse = lending::reuse_policy::never;  // reclaimed memory is released, not kept as a spare
  auto& l = this->start(config);
  {
    borrower warm_up(this->device(), l.address());  // whatever the device opens once is open before counting
    warm_up.give_back(warm_up.borrow(this->unit(), "warm-up"));
  }
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 0; }));
  const std::size_t descriptors_before = open_descriptor_count();
  {
    // Its refusals fill the lender's socket; the chunk answer of its second
    // borrow waits in the queue with a copy of the chunk's descriptor.
    auto deaf = this->borrower_process(
        {"deaf", std::to_string(this->unit()), std::to_string(batches_a_socket_holds(channel::min_batch_bytes))});
    ASSERT_EQ(line_from(*deaf), "deaf");
    ASSERT_TRUE(eventually([&] { return l.status().regions.size() == 2; })) << "its second borrow was not served";
    std::this_thread::sleep_for(50ms);  // its answer posted
    ASSERT_EQ(::kill(deaf->pid(), SIGKILL), 0);
    EXPECT_EQ(deaf->wait(), 128 + SIGKILL);
  }
  EXPECT_TRUE(eventually([&] { return l.status().borrowers == 0 && l.status().lent_bytes == 0; }, 2000ms))
      << "a borrower gone with an answer queued was kept, or its regions";
  const auto s = l.status();
  EXPECT_EQ(s.reclaimed, 2u);
  EXPECT_EQ(s.connections_closed_for_errors, 0u);
  EXPECT_TRUE(eventually([&] { return open_descriptor_count() == descriptors_before; }, 2000ms))
      << open_descriptor_count() - descriptors_before << " descriptors left behind, the queued copy among them";
}

TYPED_TEST(serving_test, answers_queued_for_a_borrower_arrive_in_order_with_their_chunks_once_it_reads) {
  if (this->in_process_only()) return;
  lender_config config;
  config.peer_timeout = 10000ms;
  auto& l = this->start(config);
  auto slow = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  (void)greet_and_borrow(slow, this->unit());
  const std::size_t queries = answers_to_fill(l, 3);
  ask_for_metrics(slow, queries);
  // Four borrows answered behind the metrics: lent and chunk frames, the
  // chunk with its memory's descriptor.
  constexpr std::uint64_t first_request = 100, borrows = 4;
  std::vector<channel::outgoing_frame> asks;
  std::vector<std::vector<std::byte>> payloads;
  for (std::uint64_t i = 0; i < borrows; ++i) {
    payloads.push_back(lending::detail::encode(lending::detail::borrow_message{
        first_request + i, (i + 1) * this->unit(), lending::region_mode::exclusive, "queued"}));
  }
  for (const auto& p : payloads) asks.push_back({static_cast<std::uint16_t>(message_type::borrow), p});
  slow.send(asks);

  for (std::size_t i = 0; i < queries; ++i) {
    const channel::frame f = slow.receive_for(5000ms);
    ASSERT_EQ(f.type, static_cast<std::uint16_t>(message_type::metrics)) << "answer " << i;
    EXPECT_FALSE(f.fd.valid());
  }
  std::vector<ino_t> memories;
  for (std::uint64_t i = 0; i < borrows; ++i) {
    const channel::frame lent = slow.receive_for(5000ms);
    ASSERT_EQ(lent.type, static_cast<std::uint16_t>(message_type::lent));
    const auto m = lending::detail::decode_lent(lent.payload);
    EXPECT_EQ(m.request, first_request + i) << "answers came out of order";
    ASSERT_EQ(m.chunks, 1u);
    const channel::frame chunk = slow.receive_for(5000ms);
    ASSERT_EQ(chunk.type, static_cast<std::uint16_t>(message_type::chunk));
    ASSERT_TRUE(chunk.fd.valid()) << "the chunk of request " << m.request << " came without its descriptor";
    struct stat st {};
    ASSERT_EQ(::fstat(chunk.fd.get(), &st), 0);
    EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), m.bytes) << "request " << m.request << " got another chunk's memory";
    memories.push_back(st.st_ino);
  }
  std::sort(memories.begin(), memories.end());
  EXPECT_EQ(std::unique(memories.begin(), memories.end()), memories.end()) << "two regions came with one memory";
  EXPECT_EQ(l.status().regions.size(), 1 + borrows);
  EXPECT_EQ(l.status().borrowers, 1u);
  EXPECT_EQ(l.status().connections_closed_for_errors, 0u);
}

TYPED_TEST(serving_test, a_revoke_that_comes_while_a_publish_is_checked_keeps_the_region_exclusive) {
  if (this->in_process_only()) return;
  auto& l = this->start();
  borrower writer(this->device(), l.address());
  auto region = writer.borrow(mib, "model R");
  lending::region_layout layout;
  layout.entries = {{"weights", 0, mib / 2, lending::dtype::float32, {mib / 8}}};
  layout.hash = lending::hash_entries(this->device(), region.data(), region.size(), layout);
  const publish_hook revoke_in_between([&l](std::uint64_t id) { l.revoke(id, 5000ms); });
  try {
    (void)writer.publish(std::move(region), layout);
    ADD_FAILURE() << "a region revoked while its publish was checked was published";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is being revoked"), std::string::npos) << e.what();
  }
  const auto s = l.status();
  EXPECT_EQ(s.published, 0u);
  EXPECT_TRUE(std::none_of(s.regions.begin(), s.regions.end(),
                           [](const lending::region_info& r) { return r.mode == lending::region_mode::shared; }))
      << "a shared region is never revoked";
}

}  // namespace
}  // namespace shoal::testing
