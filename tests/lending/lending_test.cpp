// The lender and its borrowers on both backends: regions lent, mapped,
// written and given back; refusals typed (capacity, quota, bad requests)
// with the connection still usable; hostile and broken peers closed alone;
// a borrower SIGKILLed or hung up reclaimed (at once when it is gone, on its
// exit when it still runs); a lender that stops answering or goes away.
//
// In-process borrowers run on the host backend only (CUDA refuses to import
// memory in the process that exported it); borrower processes run on both.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "channel/channel_fixtures.h"
#include "lending/lendable_memory.h"
#include "lending/messages.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/stream.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/child_process.h"
#include "shoal/core/error.h"
#include "shoal/lending/adopted_region.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/lender.h"
#include "lending/lending_fixture.h"

namespace shoal::testing {
namespace {

TYPED_TEST_SUITE(lending_test, backend_types, backend_names);

TYPED_TEST(lending_test, regions_are_lent_mapped_written_and_given_back) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  auto first = b.borrow(3 * mib, "parameters");
  auto second = b.borrow(1, "computation");
  EXPECT_GE(first.size(), 3 * mib);
  EXPECT_EQ(second.size(), this->unit()) << "rounded up to the device's granularity";
  dev.fill({}, first.data(), 0xA1, first.size());
  dev.fill({}, second.data(), 0xB2, second.size());
  EXPECT_TRUE(all_equal(this->read(first.data(), first.size()), 0xA1));
  EXPECT_TRUE(all_equal(this->read(second.data(), second.size()), 0xB2)) << "regions are distinct memory";
  auto s = l.status();
  ASSERT_EQ(s.regions.size(), 2u);
  EXPECT_EQ(s.lent_bytes, first.size() + second.size());
  EXPECT_EQ(s.borrowers, 1u);
  EXPECT_EQ(s.regions[0].purpose, "parameters");
  EXPECT_EQ(s.regions[0].borrower, process_identity::self());
  EXPECT_EQ(s.regions[0].state, lending::region_state::lent);
  b.give_back(std::move(first));
  EXPECT_EQ(l.status().lent_bytes, second.size());
  { auto dropped = std::move(second); }  // its destructor gives it back
  s = l.status();
  EXPECT_EQ(s.lent_bytes, 0u);
  EXPECT_EQ(s.given_back, 2u);
  EXPECT_TRUE(s.regions.empty());
}

TYPED_TEST(lending_test, refusals_are_typed_and_leave_the_connection_usable) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l =
      this->start({.capacity_bytes = 7 * this->unit(), .quota_bytes = 4 * this->unit(), .max_regions_per_borrower = 3});
  borrower b(dev, l.address()), other(dev, l.address());
  EXPECT_THROW((void)b.borrow(9 * this->unit(), "too big"), out_of_memory);
  EXPECT_THROW((void)b.borrow(5 * this->unit(), "over the quota"), peer_refused);
  auto r1 = b.borrow(this->unit(), "a");
  auto r2 = b.borrow(this->unit(), "b");
  auto r3 = b.borrow(this->unit(), "c");
  EXPECT_THROW((void)b.borrow(this->unit(), "a fourth region"), peer_refused);
  auto o1 = other.borrow(4 * this->unit(), "the other's");
  EXPECT_THROW((void)other.borrow(this->unit(), "past the capacity"), peer_refused) << "its quota is full first";
  b.give_back(std::move(r3));
  EXPECT_THROW((void)b.borrow(2 * this->unit(), "past the capacity"), out_of_memory);
  EXPECT_THROW((void)b.borrow(0, "nothing"), invalid_argument);
  EXPECT_THROW((void)b.borrow(1, ""), invalid_argument);
  EXPECT_THROW((void)b.borrow(1, std::string(65, 'x')), invalid_argument);
  EXPECT_THROW((void)b.borrow(1, "bad\ncharacter"), invalid_argument);
  auto r4 = b.borrow(this->unit(), "after the refusals");
  EXPECT_TRUE(r4.valid());
  const auto s = l.status();
  EXPECT_EQ(s.lent_bytes, 7 * this->unit());
  EXPECT_EQ(s.refusals, 5u);
}

TYPED_TEST(lending_test, a_uids_quota_counts_all_its_connections_and_orphaned_regions) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  const std::size_t unit = this->unit();
  auto& l = this->start({.quota_bytes = 4 * unit, .quota_bytes_per_uid = 6 * unit});
  borrower first(dev, l.address()), second(dev, l.address());  // one uid: this process's
  auto a = first.borrow(4 * unit, "first connection");
  auto b = second.borrow(2 * unit, "second connection");
  try {
    (void)second.borrow(unit, "past the uid's quota");
    ADD_FAILURE() << "a seventh unit over two connections of one uid was lent";
  } catch (const peer_refused& e) {
    const std::string why = e.what();
    EXPECT_NE(why.find("uid " + std::to_string(::getuid()) + " holds " + std::to_string(6 * unit)), std::string::npos)
        << why;
    EXPECT_NE(why.find("per-uid quota"), std::string::npos) << why;
  }
  second.give_back(std::move(b));
  // A third connection borrows and hangs up alive: its region is orphaned, still the uid's.
  {
    auto raw = channel::connection::connect(l.address(), {});
    channel::send_hello(raw, lending::detail::lending_protocol);
    (void)raw.receive_for(2000ms);
    raw.send(static_cast<std::uint16_t>(lending::detail::message_type::borrow),
             lending::detail::encode(lending::detail::borrow_message{1, unit, lending::region_mode::exclusive, "x"}));
    ASSERT_EQ(raw.receive_for(2000ms).type, static_cast<std::uint16_t>(lending::detail::message_type::lent));
  }
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 2; }));
  EXPECT_THROW((void)second.borrow(2 * unit, "past the quota with the orphan"), peer_refused);
  auto last = second.borrow(unit, "what is left of the uid's quota");
  EXPECT_TRUE(last.valid());
  EXPECT_EQ(l.status().lent_bytes, 6 * unit);
}

TYPED_TEST(lending_test, a_hostile_peer_is_closed_alone) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower good(dev, l.address());
  auto kept = good.borrow(this->unit(), "kept");
  const channel::protocol_id& protocol = lending::detail::lending_protocol;
  using lending::detail::message_type;
  const std::vector<std::pair<std::uint16_t, std::vector<std::byte>>> attacks{
      {static_cast<std::uint16_t>(message_type::borrow), std::vector<std::byte>(3)},        // short
      {static_cast<std::uint16_t>(message_type::lent), lending::detail::encode_forget(1)},  // not a borrower's message
      {static_cast<std::uint16_t>(message_type::borrow),
       lending::detail::encode(lending::detail::borrow_message{1, 4096, static_cast<lending::region_mode>(9), "x"})},
      {static_cast<std::uint16_t>(message_type::borrow),
       lending::detail::encode(lending::detail::borrow_message{1, 0, lending::region_mode::exclusive, "x"})},
  };
  for (const auto& [type, payload] : attacks) {
    auto raw = channel::connection::connect(l.address(), {});
    channel::send_hello(raw, protocol);
    channel::check_hello(raw.receive_for(2000ms), protocol);
    raw.send(type, payload);
    EXPECT_THROW((void)raw.receive_for(2000ms), connection_closed) << "frame type " << type << " was not refused";
  }
  // Another protocol's hello.
  auto stranger = channel::connection::connect(l.address(), {});
  channel::send_hello(stranger, channel::protocol_id{"shoal.sharing", 1});
  (void)stranger.receive_for(2000ms);  // the lender's hello
  EXPECT_THROW((void)stranger.receive_for(2000ms), connection_closed);
  // Giving back a region it does not hold: refused, connection kept.
  auto raw = channel::connection::connect(l.address(), {});
  channel::send_hello(raw, protocol);
  (void)raw.receive_for(2000ms);
  raw.send(static_cast<std::uint16_t>(message_type::give_back),
           lending::detail::encode(lending::detail::give_back_message{kept.id(), false}));
  EXPECT_EQ(raw.receive_for(2000ms).type, static_cast<std::uint16_t>(message_type::refused));
  EXPECT_TRUE(eventually([&] { return l.status().connections_closed_for_errors == 5; }));
  EXPECT_EQ(l.status().regions.size(), 1u) << "the good borrower's region stays";
  auto more = good.borrow(this->unit(), "still served");
  EXPECT_TRUE(more.valid());
}

TYPED_TEST(lending_test, a_killed_borrowers_regions_are_reclaimed_and_lent_again) {
  auto& l = this->start({.capacity_bytes = 4 * mib});
  auto holder = this->borrower_process({"hold", std::to_string(4 * mib), "90"});
  ASSERT_EQ(line_from(*holder).rfind("held ", 0), 0u);
  ASSERT_EQ(l.status().lent_bytes, 4 * mib);
  auto refused = this->borrower_process({"hold", std::to_string(mib), "91"});
  EXPECT_EQ(line_from(*refused).rfind("error ", 0), 0u) << "the capacity is lent out";
  EXPECT_EQ(refused->wait(), 1);
  ASSERT_EQ(::kill(holder->pid(), SIGKILL), 0);
  EXPECT_EQ(holder->wait(), 128 + SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  EXPECT_TRUE(eventually([&] { return l.status().lent_bytes == 0; }, 2000ms)) << "not reclaimed";
  const auto reclaim_time = std::chrono::steady_clock::now() - killed;
  EXPECT_LT(reclaim_time, 500ms);
  EXPECT_EQ(l.status().reclaimed, 1u);
  auto next = this->borrower_process({"hold", std::to_string(4 * mib), "92"});
  EXPECT_EQ(line_from(*next).rfind("held ", 0), 0u) << "the next borrower is served";
}

TYPED_TEST(lending_test, a_borrower_that_hangs_up_alive_keeps_its_region_counted_until_it_exits) {
  auto& l = this->start();
  auto child = this->borrower_process({"hang-up", std::to_string(2 * mib)});
  ASSERT_EQ(line_from(*child), "hung up");
  ASSERT_TRUE(eventually([&] {
    const auto s = l.status();
    return s.borrowers == 0 && s.regions.size() == 1 && s.regions[0].state == lending::region_state::orphaned;
  })) << "the region was not kept as orphaned";
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(l.status().lent_bytes, 2 * mib) << "released while its borrower may still map it";
  ::shutdown(child->socket(), SHUT_RDWR);  // the child unmaps and exits
  EXPECT_EQ(child->wait(), 0);
  EXPECT_TRUE(eventually([&] { return l.status().lent_bytes == 0; }, 2000ms));
}

TYPED_TEST(lending_test, a_lender_that_stops_answering_gives_timeouts_and_one_that_goes_gives_closed) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  const auto address = channel::channel_address::at_path(this->dir_ / "mute.sock");
  channel::listener mute(address, {});
  std::thread server([&] {
    auto link = mute.accept();
    const channel::protocol_id& protocol = lending::detail::lending_protocol;
    channel::send_hello(link, protocol);
    try {
      for (;;) (void)link.receive();  // never answers
    } catch (const error&) {          // NOLINT(bugprone-empty-catch): the borrower hung up
    }
  });
  {
    borrower b(dev, address);
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW((void)b.borrow(4096, "unanswered", lending::region_mode::exclusive, 200ms), timeout_error);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
    // The first request's answer comes first: the next call waits for it.
    EXPECT_THROW((void)b.borrow(4096, "after a timeout", lending::region_mode::exclusive, 200ms), timeout_error);
  }
  server.join();

  auto& l = this->start();
  auto b = std::make_unique<borrower>(dev, l.address());
  auto region = b->borrow(this->unit(), "outlives its lender");
  dev.fill({}, region.data(), 0x3C, region.size());
  this->lender_.reset();
  EXPECT_TRUE(all_equal(this->read(region.data(), region.size()), 0x3C)) << "the mapping stays valid";
  EXPECT_THROW((void)b->borrow(this->unit(), "no lender"), connection_closed);
}

TYPED_TEST(lending_test, a_borrower_that_spins_for_its_answers_is_answered_and_still_keeps_its_deadline) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  const lending::borrower_options spinning{.reply_spin = std::chrono::microseconds(5s)};
  const auto address = channel::channel_address::at_path(this->dir_ / "mute.sock");
  channel::listener mute(address, {});
  std::thread server([&] {
    auto link = mute.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    try {
      for (;;) (void)link.receive();  // never answers
    } catch (const error&) {          // NOLINT(bugprone-empty-catch): the borrower hung up
    }
  });
  {
    borrower b(dev, address, {}, borrower::default_timeout, spinning);
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW((void)b.borrow(4096, "unanswered", lending::region_mode::exclusive, 200ms), timeout_error);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "the spin outlasted the request's deadline";
  }
  server.join();

  auto& l = this->start();
  borrower b(dev, l.address(), {}, borrower::default_timeout, spinning);
  for (int i = 0; i < 3; ++i) b.give_back(b.borrow(this->unit(), "answered while spinning"));
  EXPECT_EQ(l.status().given_back, 3u);
}

TYPED_TEST(lending_test, borrowers_past_the_limit_are_turned_away) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start({.max_borrowers = 2});
  borrower a(dev, l.address()), b(dev, l.address());
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 2; }));
  try {
    borrower turned_away(dev, l.address(), {}, 2000ms);
    ADD_FAILURE() << "a third borrower was admitted";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("turned this borrower away"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(a.borrow(1, "a").valid());
}

TYPED_TEST(lending_test, metrics_are_prometheus_text_in_process_and_over_the_socket) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start({.capacity_bytes = 16 * this->unit()});
  borrower b(dev, l.address());
  auto r = b.borrow(3 * this->unit(), "measured");
  EXPECT_THROW((void)b.borrow(64 * this->unit(), "refused"), out_of_memory);
  const std::string text = b.metrics();
  EXPECT_EQ(text, l.metrics_text());
  for (const std::string& line : std::vector<std::string>{
           "# TYPE shoal_lending_lent_bytes gauge", "shoal_lending_lent_bytes " + std::to_string(3 * this->unit()),
           "shoal_lending_free_bytes " + std::to_string(13 * this->unit()), "shoal_lending_regions 1",
           "shoal_lending_borrowers 1", "shoal_lending_requests_total 2", "shoal_lending_refusals_total 1",
           "# TYPE shoal_lending_reclaimed_total counter"}) {
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << line << " missing from:\n" << text;
  }
}

TYPED_TEST(lending_test, every_event_reaches_the_log_with_who_and_what) {
  const event_recorder recorder;
  const auto& [events, guard] = recorder;
  lender_config config;
  config.capacity_bytes = 4 * mib;
  recorder.attach(config);
  auto& l = this->start(config);
  auto holder = this->borrower_process({"hold", std::to_string(4 * mib), "5"});
  ASSERT_EQ(line_from(*holder).rfind("held ", 0), 0u);
  auto refused = this->borrower_process({"hold", std::to_string(mib), "6"});
  (void)line_from(*refused);
  const pid_t holder_pid = holder->pid(), refused_pid = refused->pid();
  ASSERT_EQ(::kill(holder_pid, SIGKILL), 0);
  (void)holder->wait();
  // Counters change before the events that tell of them go out: wait for the event.
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(*guard);
    return std::any_of(events->begin(), events->end(), [&](const auto& e) {
      return e.what == lending::lender_event::kind::reclaimed && e.borrower.pid == holder_pid;
    });
  }));
  std::vector<std::string> seen;
  {
    std::lock_guard lock(*guard);
    for (const auto& e : *events) {
      if (e.borrower.pid == holder_pid) seen.push_back(lending::to_string(e.what));
      if (e.what == lending::lender_event::kind::lent) {
        EXPECT_EQ(e.bytes, 4 * mib);
        EXPECT_EQ(e.detail, "held by a test");
      }
    }
    EXPECT_TRUE(std::any_of(events->begin(), events->end(), [&](const auto& e) {
      return e.what == lending::lender_event::kind::refused && e.borrower.pid == refused_pid &&
             e.detail.find("capacity") != std::string::npos;
    })) << "the refusal was not logged with its reason";
  }
  // An exiting process can close its socket a moment before it reads as gone: then its
  // region is orphaned first, and reclaimed at the next check.
  std::erase(seen, "orphaned");
  EXPECT_EQ(seen, (std::vector<std::string>{"connected", "lent", "disconnected", "reclaimed"}));
}

TYPED_TEST(lending_test, an_adopted_region_serves_allocations_in_its_sub_pools_and_clears_in_stream_order) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  alloc::caching_allocator allocator(dev, {});
  backend::stream s(dev);
  const std::size_t part = 2 * mib;
  lending::adopted_region region(allocator, b.borrow(2 * part, "model A"),
                                 {{"parameters", part}, {"computation", part}});
  const auto base = reinterpret_cast<std::uintptr_t>(region.region().data());
  void* weights = nullptr;
  void* scratch = nullptr;
  {
    alloc::private_pool_scope scope(allocator, region.pool(), "parameters");
    weights = allocator.allocate(mib, s);
  }
  {
    alloc::private_pool_scope scope(allocator, region.pool(), "computation");
    scratch = allocator.allocate(mib, s);
  }
  EXPECT_GE(reinterpret_cast<std::uintptr_t>(weights), base);
  EXPECT_LT(reinterpret_cast<std::uintptr_t>(weights), base + part);
  EXPECT_GE(reinterpret_cast<std::uintptr_t>(scratch), base + part);
  try {
    region.clear("computation");
    ADD_FAILURE() << "a sub-pool with a live block was cleared";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'computation' still has 1 live block"), std::string::npos) << e.what();
  }
  // A slow write on s, then the free on the same stream: the block is free at
  // once, but the stream still writes it. clear() returns only once s passed.
  dev.delay(s, 50ms);
  dev.fill(s, scratch, 0x77, mib);
  allocator.deallocate(scratch, s);
  region.clear("computation");
  EXPECT_TRUE(dev.query(s)) << "cleared while a stream still wrote the memory";
  EXPECT_THROW((void)region.release(), invalid_argument) << "the parameters are still allocated";
  EXPECT_TRUE(region.adopted());
  allocator.deallocate(weights, s);
  b.give_back(region.release());
  EXPECT_FALSE(region.adopted());
  EXPECT_EQ(l.status().lent_bytes, 0u);
}

TYPED_TEST(lending_test, an_adopted_region_destroyed_with_live_blocks_stays_mapped_under_them) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  alloc::caching_allocator allocator(dev, {});
  void* block = nullptr;
  {
    lending::adopted_region region(allocator, b.borrow(mib, "leaked on purpose"));
    alloc::private_pool_scope scope(allocator, region.pool());
    block = allocator.allocate(4096, {});
  }
  dev.fill({}, block, 0x42, 4096);
  EXPECT_TRUE(all_equal(this->read(block, 4096), 0x42)) << "the memory vanished under a live block";
  EXPECT_EQ(l.status().regions.size(), 1u) << "given back while a block lives in it";
}

TYPED_TEST(lending_test, a_revoked_region_is_asked_back_and_given_back_in_time) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  auto first = b.borrow(this->unit(), "model A");
  auto second = b.borrow(this->unit(), "model A scratch");
  EXPECT_TRUE(b.revocations().empty());
  l.revoke(first.id(), 2000ms);
  EXPECT_THROW(l.revoke(first.id(), 2000ms), invalid_argument) << "revoked twice";
  EXPECT_THROW(l.revoke(999, 2000ms), invalid_argument) << "an unknown region";
  EXPECT_THROW(l.revoke(second.id(), 0ms), invalid_argument) << "no time to give it back";
  EXPECT_EQ(l.status().regions[0].state, lending::region_state::revoking);
  // The request arrives while the borrower waits for another answer: kept for revocations().
  auto third = b.borrow(this->unit(), "while revoked");
  const auto asked = b.revocations(2000ms);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].region, first.id());
  EXPECT_GT(asked[0].deadline, std::chrono::steady_clock::now() + 1000ms);
  b.give_back(std::move(first));
  const auto s = l.status();
  EXPECT_EQ(s.revocations, 1u);
  EXPECT_EQ(s.revocations_missed, 0u);
  EXPECT_EQ(s.regions.size(), 2u);
  EXPECT_TRUE(b.revocations().empty());
}

TYPED_TEST(lending_test, a_borrower_that_misses_the_deadline_is_named_and_keeps_its_region_until_it_exits) {
  const event_recorder recorder;
  const auto& [events, guard] = recorder;
  lender_config config;
  recorder.attach(config);
  auto& l = this->start(config);
  auto holder = this->borrower_process({"hold", std::to_string(2 * mib), "3"});
  ASSERT_EQ(line_from(*holder).rfind("held ", 0), 0u);
  const auto id = l.status().regions.at(0).id;
  l.revoke(id, 100ms);
  ASSERT_TRUE(eventually([&] { return l.status().revocations_missed == 1; }, 2000ms)) << "the miss was not noted";
  const auto missed_events = [&] {
    std::lock_guard lock(*guard);
    return std::count_if(events->begin(), events->end(), [&](const auto& e) {
      return e.what == lending::lender_event::kind::revoke_missed && e.region == id && e.borrower.pid == holder->pid();
    });
  };
  ASSERT_TRUE(eventually([&] { return missed_events() >= 1; })) << "the miss's event (emitted after its count)";
  std::this_thread::sleep_for(200ms);
  auto s = l.status();
  ASSERT_EQ(s.regions.size(), 1u);
  EXPECT_EQ(s.regions[0].state, lending::region_state::revoking) << "the region left its borrower";
  EXPECT_EQ(s.lent_bytes, 2 * mib);
  EXPECT_EQ(s.revocations_missed, 1u) << "named more than once";
  EXPECT_EQ(missed_events(), 1) << "named more than once in the log";
  ASSERT_EQ(::kill(holder->pid(), SIGKILL), 0);
  (void)holder->wait();
  EXPECT_TRUE(eventually([&] { return l.status().lent_bytes == 0; }, 2000ms)) << "not reclaimed once it died";
}

TEST(lending_messages, random_bytes_decode_or_are_refused_and_never_read_past_the_payload) {
  std::mt19937 rng(20261124);
  for (int round = 0; round < 5000; ++round) {
    std::vector<std::byte> payload(std::uniform_int_distribution<int>(0, 96)(rng));
    for (auto& b : payload) b = static_cast<std::byte>(rng());
    // Often a valid-looking length prefix, so the decoders get past their first fields.
    if (payload.size() >= 21 && round % 2 == 0) payload[17] = payload[18] = payload[19] = payload[20] = std::byte{0};
    const auto refused_or_decoded = [&](auto decode) {
      try {
        decode();
      } catch (const protocol_error&) {  // NOLINT(bugprone-empty-catch): refused is what hostile bytes get
      }
    };
    refused_or_decoded([&] { (void)lending::detail::decode_borrow(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_lent(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_refused(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_revoke(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_give_back(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_given_back(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_forget(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_publish(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_borrow_shared(payload); });
    refused_or_decoded([&] { (void)lending::detail::decode_layout(payload); });
  }
}

TYPED_TEST(lending_test, random_frames_from_hostile_peers_close_only_them_and_leak_nothing) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start({.peer_timeout = 200ms});
  borrower good(dev, l.address());
  auto kept = good.borrow(this->unit(), "the good borrower's");
  const channel::protocol_id& protocol = lending::detail::lending_protocol;
  std::mt19937 rng(7);
  for (int peer = 0; peer < 40; ++peer) {
    auto raw = channel::connection::connect(l.address(), {});
    channel::send_hello(raw, protocol);
    (void)raw.receive_for(2000ms);
    try {
      if (peer % 3 == 0) {  // a real region first, so that hanging up has something to reclaim
        raw.send(
            static_cast<std::uint16_t>(lending::detail::message_type::borrow),
            lending::detail::encode(lending::detail::borrow_message{1, 4096, lending::region_mode::exclusive, "x"}));
      }
      for (int frame = 0; frame < 4; ++frame) {
        std::vector<std::byte> payload(std::uniform_int_distribution<int>(0, 40)(rng));
        for (auto& b : payload) b = static_cast<std::byte>(rng());
        raw.send(static_cast<std::uint16_t>(std::uniform_int_distribution<int>(0, 12)(rng)), payload);
      }
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the lender may hang up first
    }
  }  // every hostile connection closed here, whatever it got to send
  // The hostile peers are this process, which still runs: a region one got before it
  // hung up is kept as orphaned (it might still map it), never left lent.
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 1; })) << "hostile peers' connections were left open";
  const auto s = l.status();
  std::size_t orphaned_bytes = 0;
  for (const auto& r : s.regions) {
    if (r.id == kept.id()) continue;
    EXPECT_EQ(r.state, lending::region_state::orphaned) << "region " << r.id << " of a hung-up peer";
    orphaned_bytes += r.bytes;
  }
  EXPECT_EQ(s.lent_bytes, kept.size() + orphaned_bytes);
  auto more = good.borrow(this->unit(), "still served");
  EXPECT_TRUE(more.valid());
}

TYPED_TEST(lending_test, a_timeout_too_long_for_the_clock_means_no_deadline) {
  if (this->in_process_only()) return;
  auto& l = this->start();
  borrower b(this->device(), l.address(), {}, std::chrono::milliseconds::max());
  auto region = b.borrow(this->unit(), "waits as long as it takes", lending::region_mode::exclusive,
                         std::chrono::milliseconds::max());
  EXPECT_TRUE(region.valid());
  b.give_back(std::move(region), std::chrono::milliseconds::max());
}

TYPED_TEST(lending_test, parts_that_do_not_fit_are_refused_and_the_region_goes_back) {
  if (this->in_process_only()) return;
  auto& l = this->start();
  borrower b(this->device(), l.address());
  alloc::caching_allocator allocator(this->device(), {});
  auto region = b.borrow(mib, "too small");
  const std::size_t size = region.size();
  EXPECT_THROW(lending::adopted_region(allocator, std::move(region), {{"a", size}, {"b", 4096}}), invalid_argument);
  EXPECT_TRUE(eventually([&] { return l.status().lent_bytes == 0; })) << "the refused region was not given back";
}

TYPED_TEST(lending_test, clearing_waits_for_a_free_pending_on_another_stream) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  alloc::caching_allocator allocator(dev, {});
  backend::stream s(dev), other(dev);
  lending::adopted_region region(allocator, b.borrow(2 * mib, "model A"));
  void* block = nullptr;
  {
    alloc::private_pool_scope scope(allocator, region.pool());
    block = allocator.allocate(mib, s);
  }
  allocator.record_stream(block, other);
  dev.delay(other, 50ms);
  dev.fill(other, block, 0x55, mib);
  allocator.deallocate(block, s);  // pending until `other` passes its use
  region.clear();
  EXPECT_TRUE(dev.query(other)) << "cleared while another stream still wrote the memory";
  b.give_back(region.release());
}

TYPED_TEST(lending_test, a_malformed_answer_is_a_protocol_error_and_closes_the_borrower) {
  if (this->in_process_only()) return;
  const auto address = channel::channel_address::at_path(this->dir_ / "liar.sock");
  channel::listener liar(address, {});
  std::thread server([&] {
    auto link = liar.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    try {
      (void)link.receive();  // the hello
      (void)link.receive();  // the borrow request, answered with a frame that is no answer to it
      link.send(static_cast<std::uint16_t>(lending::detail::message_type::given_back),
                lending::detail::encode(lending::detail::given_back_message{7, false}));
      for (;;) (void)link.receive();
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the borrower hung up
    }
  });
  {
    borrower b(this->device(), address);
    EXPECT_THROW((void)b.borrow(4096, "lied to"), protocol_error);
    EXPECT_THROW((void)b.borrow(4096, "after the lie"), connection_closed);
  }
  server.join();
}

/// A lender that lends one real region on the first borrow request, then
/// runs `after` on the connection (the region's id is 5).
template <class After>
std::jthread hostile_lender(backend::device& dev, channel::listener& listener, After after) {
  return std::jthread([&dev, &listener, after] {
    using lending::detail::message_type;
    try {
      auto link = listener.accept();
      link.set_send_timeout(5000ms);
      channel::send_hello(link, lending::detail::lending_protocol);
      (void)link.receive();  // the hello
      const auto asked = lending::detail::decode_borrow(link.receive().payload);
      const lending::detail::lendable_memory memory(dev, lending::detail::round_up(asked.bytes, dev.granularity()), 1);
      const auto& handle = memory.handle();
      const auto lent =
          lending::detail::encode(lending::detail::lent_message{asked.request, 5, memory.id(), memory.size(), 1});
      const auto chunk = handle.serialize();
      const channel::outgoing_frame frames[] = {
          {static_cast<std::uint16_t>(message_type::lent), lent},
          {static_cast<std::uint16_t>(message_type::chunk), chunk,
           backend::carries_fd(handle.kind) ? handle.fd.get() : -1}};
      link.send(frames);
      after(link);
      for (;;) (void)link.receive();
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the borrower hung up
    }
  });
}

void send_revoke(channel::connection& link, std::uint64_t region) {
  link.send(static_cast<std::uint16_t>(lending::detail::message_type::revoke),
            lending::detail::encode(lending::detail::revoke_message{region, 1000}));
}

TYPED_TEST(lending_test, a_lender_flooding_revokes_is_a_protocol_error_and_nothing_of_it_is_kept) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  const auto address = channel::channel_address::at_path(this->dir_ / "flood.sock");
  channel::listener listener(address, {});
  // Revokes for regions the borrower does not hold, thousands of them, while it waits for an answer.
  std::jthread flood = hostile_lender(dev, listener, [](channel::connection& link) {
    (void)link.receive();  // the second borrow request, never answered
    for (std::uint64_t region = 100; region < 10100; ++region) send_revoke(link, region);
  });
  {
    borrower b(dev, address);
    auto held = b.borrow(4096, "the one region");
    try {
      (void)b.borrow(4096, "flooded");
      ADD_FAILURE() << "a revoke for a region the borrower does not hold was taken";
    } catch (const protocol_error& e) {
      EXPECT_NE(std::string(e.what()).find("region 100, which this borrower does not hold"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW((void)b.revocations(), connection_closed) << "the connection stayed in use after the flood";
  }
  flood.join();
  // The same region revoked twice.
  std::jthread twice = hostile_lender(dev, listener, [](channel::connection& link) {
    send_revoke(link, 5);
    send_revoke(link, 5);
  });
  {
    borrower b(dev, address);
    auto held = b.borrow(4096, "revoked twice");
    EXPECT_EQ(held.id(), 5u);
    // The first revoke is taken (by this call, or by the first of two when the second had not come yet).
    std::string caught;
    for (int call = 0; call < 2 && caught.empty(); ++call) {
      try {
        const auto asked = b.revocations(2000ms);
        EXPECT_EQ(asked.size(), 1u);
      } catch (const protocol_error& e) {
        caught = e.what();
      }
    }
    EXPECT_NE(caught.find("region 5 a second time"), std::string::npos) << "caught: " << caught;
    EXPECT_THROW((void)b.borrow(4096, "after"), connection_closed);
  }
  twice.join();
}

TYPED_TEST(lending_test, a_wait_for_revocations_that_ends_mid_message_keeps_the_link) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  const auto address = channel::channel_address::at_path(this->dir_ / "halves.sock");
  channel::listener listener(address, {});
  std::atomic<int> step{0};  // 1: the first half is out; 2: the borrower waited and gave up
  std::jthread lender = hostile_lender(dev, listener, [&step](channel::connection& link) {
    const std::vector<std::byte> revoke = raw_batch(
        "SHOL", 2,
        {{static_cast<std::uint16_t>(lending::detail::message_type::revoke),
          lending::detail::encode(lending::detail::revoke_message{5, 1000})}});
    const std::size_t half = revoke.size() / 2;
    write_raw(link.native_handle(), {revoke.begin(), revoke.begin() + static_cast<std::ptrdiff_t>(half)});
    step = 1;
    while (step.load() != 2) std::this_thread::sleep_for(1ms);
    write_raw(link.native_handle(), {revoke.begin() + static_cast<std::ptrdiff_t>(half), revoke.end()});
  });
  {
    borrower b(dev, address);
    auto held = b.borrow(4096, "revoked in two halves");
    while (step.load() != 1) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(20ms);  // the first half is in the borrower's socket
    EXPECT_TRUE(b.revocations(50ms).empty());
    step = 2;
    const auto asked = b.revocations(2000ms);
    ASSERT_EQ(asked.size(), 1u) << "the half that came first was lost";
    EXPECT_EQ(asked[0].region, 5u);
  }
  lender.join();
}

TYPED_TEST(lending_test, a_revoke_crossing_its_give_back_is_answered_by_it) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  auto region = b.borrow(this->unit(), "given back as it is revoked");
  const auto id = region.id();
  l.revoke(id, 2000ms);
  b.give_back(std::move(region));  // the revoke arrives while give_back waits: kept, then settled by it
  EXPECT_TRUE(b.revocations(100ms).empty()) << "a revocation of a region already given back was handed out";
  auto next = b.borrow(this->unit(), "still in step");
  l.revoke(next.id(), 2000ms);
  const auto asked = b.revocations(2000ms);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].region, next.id());
}

TEST(lender_config, out_of_range_settings_are_refused) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  const auto address = channel::channel_address::at_path(dir / "l.sock");
  // Each refusal names the one setting at fault.
  const auto refusal = [&](const lender_config& config) {
    try {
      lender l(dev, address, config);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(refusal({.capacity_bytes = 0}), "lender: capacity_bytes must be > 0");
  EXPECT_EQ(refusal({.quota_bytes = 0}), "lender: quota_bytes must be > 0");
  EXPECT_EQ(refusal({.max_borrowers = 0}), "lender: max_borrowers must be > 0");
  EXPECT_EQ(refusal({.max_regions_per_borrower = 0}), "lender: max_regions_per_borrower must be > 0");
  EXPECT_EQ(refusal({.peer_timeout = 0ms}), "lender: peer_timeout must be > 0");
}

// Each chunk a lender may lend again keeps a descriptor open: it raises a
// low soft limit to the hard one, on any backend, as the host backend does.
TEST(lender_config, a_lender_raises_the_soft_descriptor_limit) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();  // made before: its own raise is done
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max < 2048) GTEST_SKIP() << "the hard limit is " << saved.rlim_max;
  rlimit low = saved;
  low.rlim_cur = 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  {
    lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
    rlimit now{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &now), 0);
    EXPECT_EQ(now.rlim_cur, saved.rlim_max);
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
}

}  // namespace
}  // namespace shoal::testing
