// Observer connections (borrower_options::observer, lender_config::
// max_observers): an operator's metrics and revokes served while the lender
// has all the borrowers it admits, never counted among them, bounded in
// number, and unable to borrow (host backend, in one process).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "shoal/backend/host_device.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/child_process.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"
#include "support/other_uids.h"

namespace shoal::testing {
namespace {

lending::borrower_options as_observer() {
  lending::borrower_options o;
  o.observer = true;
  return o;
}

struct observed_lender {
  temp_dir dir;
  lender l;
  explicit observed_lender(lender_config config)
      : l(backend::host_device_instance(), channel::channel_address::at_path(dir / "l.sock"), std::move(config)) {}
  /// A raw connection to the lender that has said nothing yet.
  [[nodiscard]] channel::connection connect() const {
    return channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  }
  /// A raw connection the lender greeted at once (a place was free), that has
  /// not said yet whether it borrows or observes.
  [[nodiscard]] channel::connection greeted_at_once() const {
    auto c = connect();
    channel::check_hello(c.receive_for(2000ms), lending::detail::lending_protocol);
    return c;
  }
};

lender_config limits(std::size_t borrowers, std::size_t observers,
                     std::chrono::milliseconds peer_timeout = lender_config{}.peer_timeout) {
  lender_config config;
  config.max_borrowers = borrowers;
  config.max_observers = observers;
  config.peer_timeout = peer_timeout;
  return config;
}

bool has_line(const std::string& text, const std::string& line) { return text.find("\n" + line + "\n") != std::string::npos; }

TEST(lending_observers, an_observer_is_served_while_the_lender_is_full_and_is_not_counted) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(1, 4));
  borrower holder(dev, o.l.address());
  auto region = holder.borrow(2 * mib, "held");
  borrower observer(dev, o.l.address(), {}, 2000ms, as_observer());
  const std::string text = observer.metrics();
  EXPECT_TRUE(has_line(text, "shoal_lending_borrowers 1")) << text;
  EXPECT_TRUE(has_line(text, "shoal_lending_observers 1")) << text;
  EXPECT_TRUE(has_line(text, "shoal_lending_connections 2")) << text;
  EXPECT_EQ(o.l.status().borrowers, 1u);
  EXPECT_EQ(o.l.status().observers, 1u);

  observer.revoke(region.id(), 5000ms);  // the operator's revoke, served at full
  const auto revoked = holder.revocations(2000ms);
  ASSERT_EQ(revoked.size(), 1u);
  EXPECT_EQ(revoked[0].region, region.id());

  try {
    borrower turned_away(dev, o.l.address(), {}, 2000ms);
    ADD_FAILURE() << "a second borrower was admitted past max_borrowers beside the observer";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("turned this borrower away"), std::string::npos) << e.what();
  }
  holder.give_back(std::move(region));
}

// The log tells observers apart: connected (once its hello said which it
// is) and disconnected events of an observer carry the note "observer".
TEST(lending_observers, the_log_names_observers) {
  auto& dev = backend::host_device_instance();
  const event_recorder recorder;
  lender_config config = limits(4, 4);
  recorder.attach(config);
  observed_lender o(config);
  const auto connections_seen = [&] {
    std::vector<std::string> seen;
    std::lock_guard lock(*recorder.guard);
    for (const auto& e : *recorder.events) {
      if (e.what == lending::lender_event::kind::connected || e.what == lending::lender_event::kind::disconnected) {
        seen.push_back(std::string(e.what == lending::lender_event::kind::connected ? "connected" : "disconnected") +
                       (e.detail.empty() ? "" : " " + e.detail));
      }
    }
    return seen;
  };
  { borrower b(dev, o.l.address()); }
  ASSERT_TRUE(eventually([&] { return connections_seen().size() == 2; }));  // its events first
  { borrower observer(dev, o.l.address(), {}, 2000ms, as_observer()); }
  ASSERT_TRUE(eventually([&] { return connections_seen().size() == 4; }));
  const auto seen = connections_seen();
  EXPECT_EQ(seen, (std::vector<std::string>{"connected", "disconnected", "connected observer", "disconnected observer"}));
}

TEST(lending_observers, an_observer_borrows_nothing_and_a_borrow_frame_from_one_closes_it) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(4, 4));
  borrower observer(dev, o.l.address(), {}, 2000ms, as_observer());
  EXPECT_THROW((void)observer.borrow(2 * mib, "x"), invalid_argument);
  EXPECT_THROW((void)observer.borrow_shared("x"), invalid_argument);
  EXPECT_FALSE(observer.metrics().empty()) << "the observer is still usable";

  // By hand: an observer's hello, then a borrow the library would not send.
  auto raw = o.connect();
  channel::send_hello(raw, lending::detail::observer_protocol);
  channel::check_hello(raw.receive_for(2000ms), lending::detail::lending_protocol);
  raw.send(static_cast<std::uint16_t>(lending::detail::message_type::borrow),
           lending::detail::encode(lending::detail::borrow_message{1, 2 * mib, lending::region_mode::exclusive, "x"}));
  EXPECT_THROW((void)raw.receive_for(2000ms), connection_closed) << "the lender answered an observer's borrow";
  EXPECT_EQ(o.l.status().connections_closed_for_errors, 1u);
  EXPECT_EQ(o.l.status().lent_bytes, 0u);
  // Nor a cancel_wait, which the lender reads before any other message.
  auto canceller = o.connect();
  channel::send_hello(canceller, lending::detail::observer_protocol);
  channel::check_hello(canceller.receive_for(2000ms), lending::detail::lending_protocol);
  canceller.send(static_cast<std::uint16_t>(lending::detail::message_type::cancel_wait),
                 lending::detail::encode_cancel_wait(1));
  EXPECT_THROW((void)canceller.receive_for(2000ms), connection_closed) << "an observer's cancel_wait was taken";
  EXPECT_TRUE(eventually([&] { return o.l.status().connections_closed_for_errors == 2; }));
}

TEST(lending_observers, past_the_limit_at_most_max_observers_are_served) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(1, 2));
  borrower holder(dev, o.l.address());
  std::vector<std::optional<borrower>> observers(2);
  for (auto& ob : observers) ob.emplace(dev, o.l.address(), channel::access_policy{}, 2000ms, as_observer());
  ASSERT_TRUE(eventually([&] { return o.l.status().observers == 2; }));
  try {
    borrower third(dev, o.l.address(), {}, 2000ms, as_observer());
    ADD_FAILURE() << "a third observer was admitted past max_observers";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("turned this observer away"), std::string::npos) << e.what();
  }
  observers[0].reset();  // one leaves: its place is free again
  ASSERT_TRUE(eventually([&] { return o.l.status().observers == 1; }));
  borrower again(dev, o.l.address(), {}, 2000ms, as_observer());
  EXPECT_FALSE(again.metrics().empty());
}

TEST(lending_observers, below_the_limit_an_observer_takes_no_borrowers_place) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(1, 1));
  borrower observer(dev, o.l.address(), {}, 2000ms, as_observer());
  ASSERT_TRUE(eventually([&] { return o.l.status().observers == 1; }));
  borrower holder(dev, o.l.address(), {}, 2000ms);  // the one borrower's place is still free
  EXPECT_TRUE(holder.borrow(2 * mib, "x").valid());
  EXPECT_EQ(o.l.status().borrowers, 1u);
}

TEST(lending_observers, an_observer_past_max_observers_is_turned_away_at_connect_while_borrowers_have_room) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(4, 1));
  borrower first(dev, o.l.address(), {}, 2000ms, as_observer());
  ASSERT_TRUE(eventually([&] { return o.l.status().observers == 1; }));
  try {
    borrower second(dev, o.l.address(), {}, 2000ms, as_observer());
    ADD_FAILURE() << "a second observer was admitted past max_observers";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("turned this observer away"), std::string::npos) << e.what();
  }
  EXPECT_EQ(o.l.status().observers, 1u);
  EXPECT_EQ(o.l.status().connections_closed_for_errors, 0u) << "a refusal counted as an error";
  EXPECT_FALSE(first.metrics().empty());
}

// A connection held back (the borrowers full) is served by what its hello
// says when it comes: a borrower if one has left meanwhile, an observer if
// observers have room, turned away before any hello otherwise.
TEST(lending_observers, a_held_back_connection_is_served_by_the_room_its_kind_has_when_its_hello_comes) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(1, 1));
  std::optional<borrower> holder(std::in_place, dev, o.l.address(), channel::access_policy{}, 2000ms);
  const auto held_back = [&] {
    auto c = o.connect();
    EXPECT_THROW((void)c.receive_for(100ms), timeout_error) << "greeted while the borrowers were full";
    return c;
  };
  auto turned_away = held_back();
  channel::send_hello(turned_away, lending::detail::lending_protocol);  // a borrower: no room
  EXPECT_THROW((void)turned_away.receive_for(2000ms), connection_closed) << "greeted past max_borrowers";
  auto waiting = held_back();
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 2; })) << "not accepted while the holder was there";
  holder.reset();  // the one borrower leaves
  ASSERT_TRUE(eventually([&] { return o.l.status().borrowers == 0; }));
  channel::send_hello(waiting, lending::detail::lending_protocol);  // a borrower: room now
  EXPECT_NO_THROW(channel::check_hello(waiting.receive_for(2000ms), lending::detail::lending_protocol));
  auto watching = held_back();  // full again
  channel::send_hello(watching, lending::detail::observer_protocol);  // an observer: room
  EXPECT_NO_THROW(channel::check_hello(watching.receive_for(2000ms), lending::detail::lending_protocol));
  EXPECT_TRUE(eventually([&] { return o.l.status().observers == 1 && o.l.status().borrowers == 1; }));
}

// Several connections at once, all observers: those past max_observers are
// held back as they are accepted and turned away before any hello — refused,
// not closed for an error.
TEST(lending_observers, observers_connecting_at_once_past_the_limit_are_refused_before_any_hello) {
  observed_lender o(limits(8, 2));
  std::vector<channel::connection> links;
  for (int i = 0; i < 3; ++i) links.push_back(o.connect());
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 3; }));
  for (auto& link : links) channel::send_hello(link, lending::detail::observer_protocol);
  int greeted = 0, turned_away = 0;
  for (auto& link : links) {
    try {
      channel::check_hello(link.receive_for(2000ms), lending::detail::lending_protocol);
      ++greeted;
    } catch (const connection_closed&) {
      ++turned_away;
    }
  }
  EXPECT_EQ(greeted, 2);
  EXPECT_EQ(turned_away, 1);
  EXPECT_EQ(o.l.status().connections_closed_for_errors, 0u) << "a refusal counted as an error";
  EXPECT_GE(o.l.status().refusals, 1u);
}

// A borrower leaving frees its place within the loop's turn: one held back
// whose hello comes in the same turn as the other's hang-up is served.
TEST(lending_observers, a_place_freed_in_the_same_turn_serves_the_held_back_borrower) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(2, 1));
  borrower writer(dev, o.l.address());
  std::optional<borrower> leaving(std::in_place, dev, o.l.address(), channel::access_policy{}, 2000ms);
  auto waiting = o.connect();
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 3; }));
  auto region = writer.borrow(2 * mib, "model");
  lending::region_layout layout;
  layout.entries = {{"w", 0, region.size() / 2, lending::dtype::float32, {region.size() / 8}}};
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  {
    // While the loop is busy with the publish, one borrower hangs up and the
    // held-back connection says hello: the loop sees both in one turn.
    const publish_hook both_at_once([&](std::uint64_t) {
      leaving.reset();
      channel::send_hello(waiting, lending::detail::lending_protocol);
      std::this_thread::sleep_for(50ms);
    });
    region = writer.publish(std::move(region), layout);
  }
  EXPECT_NO_THROW(channel::check_hello(waiting.receive_for(2000ms), lending::detail::lending_protocol))
      << "turned away while the place of a borrower that left was free";
}

// A connection held back while one greeted at once has not said which it is
// (that one was promised room for either kind) waits for that one's hello, or
// its hang-up: taken on if the other turns out the other kind, turned away
// at once if the same. `observes`: the held-back one is an observer (room for
// one observer, two borrowers) or a borrower (room for one of each).
// `other_observes`: what the one greeted at once then says it is.
void held_back_waits_for_a_connection_yet_to_say_which(bool observes, bool other_observes) {
  observed_lender o(limits(observes ? 2 : 1, 1, 5000ms));
  auto unannounced = o.greeted_at_once();
  auto waiting = o.connect();
  EXPECT_THROW((void)waiting.receive_for(100ms), timeout_error) << "greeted while its kind's place was promised";
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 2; }));
  const auto protocol_of = [](bool observer) {
    return observer ? lending::detail::observer_protocol : lending::detail::lending_protocol;
  };
  channel::send_hello(waiting, protocol_of(observes));
  EXPECT_THROW((void)waiting.receive_for(300ms), timeout_error) << "answered before the other said which it is";
  const auto asked = std::chrono::steady_clock::now();
  channel::send_hello(unannounced, protocol_of(other_observes));
  // The one greeted at once is served as what it said (before this change, a
  // held-back observer taken on first left it to be closed for an error).
  unannounced.send(static_cast<std::uint16_t>(lending::detail::message_type::query_metrics), {});
  EXPECT_EQ(unannounced.receive_for(2000ms).type, static_cast<std::uint16_t>(lending::detail::message_type::metrics));
  if (observes != other_observes) {
    EXPECT_NO_THROW(channel::check_hello(waiting.receive_for(2000ms), lending::detail::lending_protocol))
        << "turned away for the place of a connection that turned out the other kind";
    EXPECT_TRUE(eventually([&] { return o.l.status().borrowers == 1 && o.l.status().observers == 1; }));
    EXPECT_EQ(o.l.status().refusals, 0u);
  } else {
    EXPECT_THROW((void)waiting.receive_for(4000ms), connection_closed) << "served past its kind's limit";
    EXPECT_LT(std::chrono::steady_clock::now() - asked, 2000ms) << "turned away only at the end of its wait";
    EXPECT_TRUE(eventually([&] { return o.l.status().refusals == 1; }));
    EXPECT_EQ(observes ? o.l.status().observers : o.l.status().borrowers, 1u);
  }
}

TEST(lending_observers, a_held_back_borrower_waits_for_a_connection_yet_to_say_which_and_is_served_if_it_observes) {
  held_back_waits_for_a_connection_yet_to_say_which(false, true);
}

TEST(lending_observers, a_held_back_borrower_waiting_for_a_connection_yet_to_say_which_is_refused_if_it_borrows) {
  held_back_waits_for_a_connection_yet_to_say_which(false, false);
}

TEST(lending_observers, a_held_back_observer_waits_for_a_connection_yet_to_say_which_and_is_served_if_it_borrows) {
  held_back_waits_for_a_connection_yet_to_say_which(true, false);
}

TEST(lending_observers, a_held_back_observer_waiting_for_a_connection_yet_to_say_which_is_refused_if_it_observes) {
  held_back_waits_for_a_connection_yet_to_say_which(true, true);
}

// A borrower awaiting room is read no further: a borrow it sent in the same
// batch as its hello is not answered (nor taken for a second hello) until it
// is admitted, and is answered then.
TEST(lending_observers, a_borrower_awaiting_room_is_not_read_further_until_it_is_admitted) {
  observed_lender o(limits(1, 1, 5000ms));
  auto unannounced = o.greeted_at_once();
  auto waiting = o.connect();
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 2; }));
  const auto hello = channel::encode_hello(lending::detail::lending_protocol);
  const auto borrow = lending::detail::encode(
      lending::detail::borrow_message{7, 2 * mib, lending::region_mode::exclusive, "sent with its hello"});
  const std::vector<channel::outgoing_frame> batch{
      {channel::hello_frame_type, hello}, {static_cast<std::uint16_t>(lending::detail::message_type::borrow), borrow}};
  waiting.send(batch);  // one batch: both frames come in one read
  EXPECT_THROW((void)waiting.receive_for(300ms), timeout_error) << "answered while it awaited room";
  EXPECT_EQ(o.l.status().requests, 0u) << "its borrow was read while it awaited room";
  channel::send_hello(unannounced, lending::detail::observer_protocol);  // room: it is admitted
  EXPECT_NO_THROW(channel::check_hello(waiting.receive_for(2000ms), lending::detail::lending_protocol));
  const channel::frame answer = waiting.receive_for(2000ms);
  ASSERT_EQ(answer.type, static_cast<std::uint16_t>(lending::detail::message_type::lent)) << "its borrow not answered";
  EXPECT_EQ(lending::detail::decode_lent(answer.payload).request, 7u);
  EXPECT_EQ(o.l.status().connections_closed_for_errors, 0u);
}

// A held-back borrower whose hello finds room while another awaits it joins
// that wait: room goes in arrival order. Here one place comes free (a
// connection turns out an observer) in the same turn as the later borrower's
// hello: the earlier is admitted, and the later once the next place comes.
TEST(lending_observers, a_later_held_back_borrower_joins_the_wait_and_room_goes_in_arrival_order) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(3, 2, 5000ms));
  borrower writer(dev, o.l.address());
  auto unannounced = o.greeted_at_once();  // two connections yet to say which: the borrowers' places are taken
  auto unannounced_too = o.greeted_at_once();
  auto first = o.connect();
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 4; }));
  channel::send_hello(first, lending::detail::lending_protocol);  // awaits room, read before the writer's borrow
  auto second = o.connect();
  ASSERT_TRUE(eventually([&] { return o.l.status().connections == 5; }));
  auto region = writer.borrow(2 * mib, "model");
  lending::region_layout layout;
  layout.entries = {{"w", 0, region.size() / 2, lending::dtype::float32, {region.size() / 8}}};
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  {
    // While the loop is busy with the publish, a place comes free and the
    // second borrower says hello: the loop reads both in its next turn.
    const publish_hook both_at_once([&](std::uint64_t) {
      channel::send_hello(unannounced, lending::detail::observer_protocol);
      channel::send_hello(second, lending::detail::lending_protocol);
    });
    region = writer.publish(std::move(region), layout);
  }
  EXPECT_NO_THROW(channel::check_hello(first.receive_for(2000ms), lending::detail::lending_protocol))
      << "the place went past the borrower that awaited it first";
  EXPECT_THROW((void)second.receive_for(300ms), timeout_error) << "the later borrower was served past the wait";
  channel::send_hello(unannounced_too, lending::detail::observer_protocol);  // the next place
  EXPECT_NO_THROW(channel::check_hello(second.receive_for(2000ms), lending::detail::lending_protocol))
      << "the later borrower left the wait unserved";
  EXPECT_TRUE(eventually([&] { return o.l.status().borrowers == 3 && o.l.status().observers == 2; }));
  EXPECT_EQ(o.l.status().refusals, 0u);
}

// The lender's hello waits for the connection's: one that says nothing gets
// nothing, holds a place of its uid's class only until the peer timeout,
// and is then hung up on.
TEST(lending_observers, a_silent_connection_gets_no_hello_and_holds_its_place_only_until_the_peer_timeout) {
  auto& dev = backend::host_device_instance();
  observed_lender o(limits(1, 1, 3000ms));
  borrower holder(dev, o.l.address());
  auto silent = o.connect();
  EXPECT_THROW((void)silent.receive_for(100ms), timeout_error) << "the lender greeted a connection that said nothing";
  EXPECT_TRUE(eventually([&] { return o.l.status().connections == 2; }))
      << "the silent connection is not in the count of connections";
  EXPECT_EQ(o.l.status().borrowers, 1u);
  // The holder and the silent connection fill max_borrowers + max_observers.
  EXPECT_THROW(borrower(dev, o.l.address(), {}, 1000ms, as_observer()), peer_refused);
  EXPECT_THROW((void)silent.receive_for(6000ms), connection_closed) << "the silent connection was not hung up on";
  borrower observer(dev, o.l.address(), {}, 2000ms, as_observer());
  EXPECT_FALSE(observer.metrics().empty());
  EXPECT_EQ(o.l.status().borrowers, 1u);
}

// A lender of one borrower and one observer a class, at an abstract name,
// that admits uid 65534 too; `as_nobody` starts a test borrower process as
// that uid with `command` and its arguments.
struct lender_admitting_nobody {
  std::string name = "shoal-observers-test-" + std::to_string(::getpid());
  backend::device& dev = backend::host_device_instance();
  lender l{dev, channel::channel_address::abstract(name), [] {
             lender_config config = limits(1, 1);
             config.policy = channel::access_policy{{65534}, {}};
             return config;
           }()};
  [[nodiscard]] std::unique_ptr<child_process> as_nobody(const std::string& command,
                                                         const std::vector<std::string>& arguments = {}) const {
    std::vector<std::string> all{command, "host", "@" + name};
    all.insert(all.end(), arguments.begin(), arguments.end());
    all.push_back("nobody");
    return std::make_unique<child_process>(SHOAL_TEST_BORROWER, all);
  }
};

// Connections of another admitted uid cannot take the operator's places:
// observers of the lender's uid and root are counted apart.
TEST(lending_observers, another_uids_observers_cannot_keep_the_operator_out) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "observers of another uid (setresuid to 65534) need root and the uid mapped";
  lender_admitting_nobody o;
  auto& [name, dev, l] = o;
  const auto observer_as_nobody = [&] { return o.as_nobody("observe"); };
  auto first = observer_as_nobody();
  EXPECT_EQ(line_from(*first), "observing");
  auto second = observer_as_nobody();
  const std::string refused = line_from(*second);
  EXPECT_EQ(refused.rfind("refused", 0), 0u) << "a second observer of uid 65534: " << refused;
  borrower operator_(dev, l.address(), {}, 2000ms, as_observer());  // root: a place of its own
  EXPECT_FALSE(operator_.metrics().empty());
  EXPECT_EQ(l.status().observers, 2u);
}

// Borrowers are bounded per class too: another uid's idle borrowers (a
// region each, or none) leave the operator's borrowers their places.
TEST(lending_observers, another_uids_idle_borrowers_cannot_keep_the_operator_out) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "borrowers of another uid (setresuid to 65534) need root and the uid mapped";
  lender_admitting_nobody o;
  auto& [name, dev, l] = o;
  const auto borrower_as_nobody = [&] { return o.as_nobody("wait-borrow", {"4096", "0"}); };
  auto first = borrower_as_nobody();
  EXPECT_EQ(line_from(*first).rfind("lent", 0), 0u);
  auto second = borrower_as_nobody();
  const std::string refused = line_from(*second);
  EXPECT_NE(refused.find("closed the connection before its hello"), std::string::npos)
      << "a second borrower of uid 65534: " << refused;
  borrower operator_(dev, l.address(), {}, 2000ms);  // root: a place of its own
  const auto region = operator_.borrow(4096, "operator");
  EXPECT_GE(region.size(), 4096u);
  EXPECT_EQ(l.status().borrowers, 2u);
}

// Every uid but the lender's and root shares one bound: with
// max_connections_per_uid, one uid's idle connections (a borrower holding a
// region, an observer) cannot take all the places. Past its cap the next is
// refused at once, naming the option, while another uid still gets in; a
// place comes back when one of its connections goes.
TEST(lending_observers, past_max_connections_per_uid_a_uid_is_refused_and_another_uid_still_gets_in) {
  if (!may_act_as({65534, 65533}))
    GTEST_SKIP() << "borrowers of other uids (setresuid to 65534 and 65533) need root and the uid mapped";
  const std::string name = "shoal-uid-cap-test-" + std::to_string(::getpid());
  event_recorder log;
  lender_config config = limits(3, 2);  // room in the class for a third connection of one uid
  config.max_connections_per_uid = 2;
  config.policy = channel::access_policy{{65534, 65533}, {}};
  log.attach(config);
  lender l(backend::host_device_instance(), channel::channel_address::abstract(name), config);
  const auto as = [&](const std::string& uid, const std::string& command, std::vector<std::string> arguments = {}) {
    std::vector<std::string> all{command, "host", "@" + name};
    all.insert(all.end(), arguments.begin(), arguments.end());
    all.push_back(uid);
    return std::make_unique<child_process>(SHOAL_TEST_BORROWER, all);
  };
  auto holder = as("nobody", "wait-borrow", {"4096", "0"});
  EXPECT_EQ(line_from(*holder).rfind("lent", 0), 0u);
  auto idle = as("nobody", "observe");
  EXPECT_EQ(line_from(*idle), "observing");
  auto third = as("nobody", "observe");
  const std::string refused = line_from(*third);
  EXPECT_EQ(refused.rfind("refused", 0), 0u) << "a third connection of uid 65534: " << refused;
  {
    std::lock_guard lock(*log.guard);
    EXPECT_TRUE(std::any_of(log.events->begin(), log.events->end(), [](const lending::lender_event& e) {
      return e.what == lending::lender_event::kind::refused && e.uid == 65534 &&
             e.detail.find("max_connections_per_uid") != std::string::npos;
    })) << "no refusal naming max_connections_per_uid";
  }
  auto other = as("65533", "observe");
  EXPECT_EQ(line_from(*other), "observing") << "uid 65533 was kept out by uid 65534's connections";
  idle.reset();
  ASSERT_TRUE(eventually([&] { return l.status().connections == 2; }));
  auto again = as("nobody", "observe");
  EXPECT_EQ(line_from(*again), "observing") << "its place did not come back";
}

}  // namespace
}  // namespace shoal::testing
