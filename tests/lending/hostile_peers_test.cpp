// Borrowers and lenders that misbehave (host backend, in one process): a
// process piling up orphaned holds, connections that never say hello, a
// lender that stops accepting or answers what does not decode, and a
// thread waiting for revocations while another gives a region back.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "shoal/backend/host_device.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"
#include "support/stuck_listener.h"

namespace shoal::testing {
namespace {

using clock_type = std::chrono::steady_clock;
using lending::detail::message_type;

// A connection that says hello and then speaks the protocol by hand.
channel::connection raw_borrower(const channel::channel_address& address) {
  auto raw = channel::connection::connect(address, {}, lending::detail::max_frame_payload);
  channel::send_hello(raw, lending::detail::lending_protocol);
  channel::check_hello(raw.receive_for(2000ms), lending::detail::lending_protocol);
  return raw;
}

// A process that keeps connecting, taking a shared region many times over and
// hanging up (while it runs) leaves one orphaned hold of it, not one per take:
// the list, and the serving loop's walks of it, stay bounded.
TEST(lending_hostile_peers, a_running_process_leaves_one_orphaned_hold_of_a_region) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  borrower writer(dev, l.address());
  auto region = writer.borrow(2 * mib, "model");
  lending::region_layout layout;
  layout.entries = {{"w", 0, region.size() / 2, lending::dtype::float32, {region.size() / 8}}};
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  region = writer.publish(std::move(region), layout);

  const auto take = lending::detail::encode(lending::detail::borrow_shared_message{1, "model", {}, {}});
  for (int connection = 0; connection < 10; ++connection) {
    auto raw = raw_borrower(l.address());
    for (int i = 0; i < 20; ++i) {
      raw.send(static_cast<std::uint16_t>(message_type::borrow_shared), take);
      ASSERT_EQ(raw.receive_for(5000ms).type, static_cast<std::uint16_t>(message_type::lent));
      (void)raw.receive_for(5000ms);  // its chunk
      (void)raw.receive_for(5000ms);  // its layout
    }
  }  // each hangs up holding 20 takes of it, in a process that runs on
  ASSERT_TRUE(eventually([&] { return l.status().borrowers == 1; }));
  const auto status = l.status();
  ASSERT_EQ(status.regions.size(), 1u);
  EXPECT_EQ(status.regions[0].holders.size(), 2u) << "the writer's hold, and one orphaned hold for this process";
}

// The lender keeps a published layout for the region's life. One borrower,
// within its quota, published layouts of 4096 entries (64-byte names, eight
// extents, 0 bytes each) on regions of one granule: the lender kept ~1 MB of
// its heap per 2 MiB region, half a byte of host memory per byte lent, bounded
// by nothing but the capacity. A layout now has at most one entry per 16 KiB
// of its region (at least 128): such a publish is refused, the connection
// kept, and the largest the lender takes keeps its heap within 1/32 of what
// it lent. (The heap is glibc's count: under AddressSanitizer it reads 0.)
TEST(lending_hostile_peers, published_layouts_keep_lender_memory_in_proportion_to_the_regions) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  const std::size_t unit = dev.granularity();
  constexpr std::size_t regions = 64;
  lender_config config;
  config.capacity_bytes = regions * unit;
  config.quota_bytes = regions * unit;
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  auto raw = raw_borrower(l.address());
  const auto layout_of = [](std::size_t entries) {
    lending::region_layout layout;
    for (std::size_t i = 0; i < entries; ++i) {
      std::string name = std::to_string(i);
      name.resize(lending::max_entry_name_bytes, 'x');
      layout.entries.push_back({name, 0, 0, lending::dtype::uint8, {0, 1, 1, 1, 1, 1, 1, 1}});
    }
    return layout;
  };
  const auto largest = layout_of(lending::max_layout_entries);
  const auto allowed = layout_of(lending::max_entries_for(unit));
  const auto heap_in_use = [] { return ::mallinfo2().uordblks; };
  const std::size_t before = heap_in_use();
  std::uint64_t request = 0;
  for (std::size_t i = 0; i < regions; ++i) {
    raw.send(static_cast<std::uint16_t>(message_type::borrow),
             lending::detail::encode(lending::detail::borrow_message{++request, unit, lending::region_mode::exclusive,
                                                                     "model-" + std::to_string(i), 0}));
    const channel::frame lent_frame = raw.receive_for(2000ms);
    ASSERT_EQ(lent_frame.type, static_cast<std::uint16_t>(message_type::lent));
    const auto lent = lending::detail::decode_lent(lent_frame.payload);
    (void)raw.receive_for(2000ms);  // its chunk, dropped
    raw.send(static_cast<std::uint16_t>(message_type::publish),
             lending::detail::encode(lending::detail::publish_message{++request, lent.region, largest}));
    channel::frame answer = raw.receive_for(2000ms);
    if (answer.type == static_cast<std::uint16_t>(message_type::refused)) {
      const auto refused = lending::detail::decode_refused(answer.payload);
      EXPECT_EQ(refused.reason, lending::detail::refusal::bad_request);
      EXPECT_NE(refused.why.find("at most 128 entries"), std::string::npos) << refused.why;
      raw.send(static_cast<std::uint16_t>(message_type::publish),
               lending::detail::encode(lending::detail::publish_message{++request, lent.region, allowed}));
      answer = raw.receive_for(2000ms);
    } else {
      ADD_FAILURE() << "a layout of " << largest.entries.size() << " entries published on a region of " << unit
                    << " bytes";
    }
    ASSERT_EQ(answer.type, static_cast<std::uint16_t>(message_type::lent));
    (void)raw.receive_for(2000ms);  // its chunk, dropped
  }
  const std::size_t kept = heap_in_use() - before;
  EXPECT_LE(kept, config.capacity_bytes / 32) << "the lender keeps " << kept << " bytes of heap for " << regions
                                              << " published regions of " << unit << " bytes";
}

// A connection that never says hello is hung up on after the peer timeout:
// silent connections cannot hold every borrower slot. (They count against
// the connections of their uid's class, max_borrowers + max_observers, from
// when they are accepted.)
TEST(lending_hostile_peers, connections_that_never_say_hello_are_hung_up_on) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender_config config;
  config.max_borrowers = 4;
  config.max_observers = 0;
  config.peer_timeout = 1000ms;
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  std::vector<channel::connection> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(channel::connection::connect(l.address(), {}));
  // Accepted in the order they came: these four first, so this one finds no room.
  EXPECT_THROW(borrower(dev, l.address(), {}, 2000ms), peer_refused) << "admitted past four silent connections";
  EXPECT_TRUE(eventually(
      [&] {
        try {
          borrower honest(dev, l.address(), {}, 1000ms);
          return true;
        } catch (const peer_refused&) {
          return false;
        }
      },
      5000ms))
      << "they still hold the slots";
  for (auto& c : silent) EXPECT_THROW((void)c.receive_for(1000ms), connection_closed) << "greeted, or not hung up on";
}

// A hello that came within the peer timeout but waits unread while the
// serving loop is busy (here, in another borrower's publish) is served, not
// taken for silence.
TEST(lending_hostile_peers, a_hello_waiting_unread_while_the_lender_is_busy_is_served) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender_config config;
  config.peer_timeout = 250ms;
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  borrower writer(dev, l.address());
  auto region = writer.borrow(2 * mib, "model");
  lending::region_layout layout;
  layout.entries = {{"w", 0, region.size() / 2, lending::dtype::float32, {region.size() / 8}}};
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  // Accepted before the publish is served: the listener is readable first.
  auto late = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  const publish_hook stall([&late](std::uint64_t) {
    channel::send_hello(late, lending::detail::lending_protocol);
    std::this_thread::sleep_for(600ms);  // past the peer timeout, with the hello unread
  });
  region = writer.publish(std::move(region), layout);
  EXPECT_NO_THROW(channel::check_hello(late.receive_for(2000ms), lending::detail::lending_protocol))
      << "the lender hung up on a connection whose hello was waiting";
  EXPECT_EQ(l.status().connections_closed_for_errors, 0u);
}

// A thread waiting for revocations holds no lock while it waits: another
// thread's give_back (the usual answer to a revoke) keeps its own deadline.
TEST(lending_hostile_peers, give_back_does_not_wait_behind_a_revocations_wait) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  borrower b(dev, l.address());
  auto region = b.borrow(2 * mib, "x");
  auto watcher = std::async(std::launch::async, [&] { return b.revocations(1500ms); });
  std::this_thread::sleep_for(100ms);
  const auto start = clock_type::now();
  EXPECT_NO_THROW(b.give_back(std::move(region), 1000ms));
  EXPECT_LT(clock_type::now() - start, 900ms) << "give_back waited behind the revocations wait";
  EXPECT_NO_THROW(b.give_back(b.borrow(2 * mib, "after"))) << "the link is still usable";
  EXPECT_TRUE(watcher.get().empty());
}

// A revocations() call that waits without the lock still hears a revoke
// that comes meanwhile.
TEST(lending_hostile_peers, a_revoke_reaches_a_revocations_call_that_waits_for_it) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  borrower b(dev, l.address());
  auto region = b.borrow(2 * mib, "x");
  const std::uint64_t id = region.id();
  auto watcher = std::async(std::launch::async, [&] { return b.revocations(5000ms); });
  ASSERT_NO_THROW(l.revoke(id, 2000ms));
  const auto revoked = watcher.get();
  ASSERT_EQ(revoked.size(), 1u);
  EXPECT_EQ(revoked[0].region, id);
  b.give_back(std::move(region));
}

// A lender that stopped accepting (its backlog full) cannot hold a borrower
// past its timeout.
TEST(lending_hostile_peers, a_lender_that_takes_no_connection_times_the_borrower_out) {
  temp_dir dir;
  const std::string path = dir / "stuck.sock";
  const stuck_listener server(path);
  auto attempt = std::async(std::launch::async, [&] {
    EXPECT_THROW(borrower(backend::host_device_instance(), channel::channel_address::at_path(path), {}, 200ms),
                 timeout_error);
  });
  if (attempt.wait_for(3s) != std::future_status::ready) {
    ADD_FAILURE() << "borrower(..., 200 ms) still waits after 3 s";
    server.make_room();
  }
  attempt.get();
}

// A revoke request with no time to give the region back is malformed: the
// lender closes that connection, and only that one.
TEST(lending_hostile_peers, a_revoke_request_of_zero_milliseconds_closes_its_sender) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  borrower holder(dev, l.address());
  auto region = holder.borrow(2 * mib, "held");
  auto raw = raw_borrower(l.address());
  raw.send(static_cast<std::uint16_t>(message_type::revoke_request),
           lending::detail::encode(lending::detail::revoke_request_message{1, region.id(), 0}));
  ASSERT_TRUE(eventually([&] { return l.status().connections_closed_for_errors == 1; }));
  EXPECT_TRUE(holder.revocations(std::chrono::milliseconds(100)).empty()) << "the malformed request revoked";
  EXPECT_NO_THROW((void)holder.metrics());
}

// A process that takes the connection and never greets: the borrower's
// timeout says so, not what the channel's receive was for.
TEST(lending_hostile_peers, a_listener_that_never_greets_times_the_borrower_out_saying_so) {
  temp_dir dir;
  const auto address = channel::channel_address::at_path(dir / "mute.sock");
  channel::listener mute(address, {});
  auto server = std::async(std::launch::async, [&] {
    auto link = mute.accept();
    std::this_thread::sleep_for(1s);  // holds it, says nothing
  });
  try {
    borrower b(backend::host_device_instance(), address, {}, 200ms);
    ADD_FAILURE() << "a borrower was made without a lender's hello";
  } catch (const timeout_error& e) {
    EXPECT_NE(std::string(e.what()).find("did not greet within 200 ms"), std::string::npos) << e.what();
  }
  server.get();
}

// A lender's answer that does not decode closes the link: nothing more is
// asked of it, and nothing else it sent is taken for a later answer.
TEST(lending_hostile_peers, an_answer_that_does_not_decode_closes_the_link) {
  temp_dir dir;
  const auto address = channel::channel_address::at_path(dir / "liar.sock");
  channel::listener liar(address, {});
  auto server = std::async(std::launch::async, [&] {
    auto link = liar.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    (void)link.receive_for(5s);  // the hello
    (void)link.receive_for(5s);  // borrow 1
    link.send(static_cast<std::uint16_t>(message_type::lent),
              lending::detail::encode(lending::detail::lent_message{1, 5, 0, 4096, 1}));  // memory 0: malformed
    try {
      (void)link.receive_for(2s);  // a second request would come here
      return true;
    } catch (const error&) {
      return false;
    }
  });
  {
    borrower b(backend::host_device_instance(), address);
    EXPECT_THROW((void)b.borrow(4096, "one"), protocol_error);
    EXPECT_THROW((void)b.borrow(4096, "two"), connection_closed);
  }
  EXPECT_FALSE(server.get()) << "the borrower asked again on a link whose lender broke the protocol";
}

// A borrow that stops waiting tells the lender so (cancel_wait); a lender
// that stopped reading cannot be told, so its borrow may wait on there: the
// link is out of step, and the next call says so at once instead of waiting
// behind an answer that may never come.
TEST(lending_hostile_peers, a_cancel_the_lender_cannot_read_puts_the_link_out_of_step) {
  struct stop_waiting {};
  temp_dir dir;
  const auto address = channel::channel_address::at_path(dir / "deaf.sock");
  channel::listener deaf(address, {});
  auto server = std::async(std::launch::async, [&] {
    auto link = deaf.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    (void)link.receive_for(5s);  // the hello
    (void)link.receive_for(5s);  // the borrow, which would wait
    ::shutdown(link.native_handle(), SHUT_RD);  // reads nothing more: the cancel cannot be sent
    std::this_thread::sleep_for(1500ms);        // and answers nothing, the link kept open
  });
  {
    borrower b(backend::host_device_instance(), address, {}, 2s);
    int checks = 0;
    const lending::borrow_wait wait{10s, [&] {
                             if (++checks == 3) throw stop_waiting();
                           }};
    EXPECT_THROW((void)b.borrow(4096, "waits", lending::region_mode::exclusive, 2s, wait), stop_waiting);
    const auto start = clock_type::now();
    try {
      (void)b.metrics(2s);
      ADD_FAILURE() << "a call was served on a link whose lender was never told the borrow stopped waiting";
    } catch (const connection_closed& e) {
      EXPECT_NE(std::string(e.what()).find("connect again"), std::string::npos) << e.what();
    }
    EXPECT_LT(clock_type::now() - start, 500ms) << "the next call waited behind the abandoned borrow";
  }
  server.get();
}

// Out of descriptors, a client waits in the listener's backlog and keeps it
// readable: the lender pauses accepting instead of spinning a core on it,
// and takes the client once descriptors are free again.
TEST(lending_hostile_peers, a_lender_out_of_descriptors_does_not_spin) {
#if defined(__SANITIZE_ADDRESS__)
  // UBSan's type checks read /proc/self/maps: with no descriptor left they
  // report the lender's own (valid) exception as having no type.
  GTEST_SKIP() << "the sanitizers need descriptors of their own";
#endif
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  const auto cpu_now = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  std::chrono::microseconds spent{};
  {
    // The lowest free descriptor number is the last one allowed: the client's
    // socket takes it, and the lender's accept finds none.
    const int lowest_free = ::dup(0);
    ASSERT_GE(lowest_free, 0);
    ::close(lowest_free);
    rlimit tight = saved;
    tight.rlim_cur = static_cast<rlim_t>(lowest_free) + 1;
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
    const unique_fd client(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un at{};
    at.sun_family = AF_UNIX;
    l.address().to_string().copy(at.sun_path, sizeof at.sun_path - 1);
    const bool connected = ::connect(client.get(), reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0;
    const auto before = cpu_now();
    std::this_thread::sleep_for(500ms);
    spent = std::chrono::duration_cast<std::chrono::microseconds>(cpu_now() - before);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
    ASSERT_TRUE(connected);
  }
  EXPECT_LT(spent, 150ms) << "the lender spun on a listener it could not accept from";
  EXPECT_NO_THROW(borrower(dev, l.address(), {}, 2000ms)) << "it accepts again once descriptors are free";
}

// No borrower sends a descriptor: one that sends the first byte of a batch
// with 16 and stalls is closed at once, and the lender keeps none of them
// (they were kept until the peer timeout: 63 such connections filled a
// lender's descriptor table, and honest borrowers could not connect).
TEST(lending_hostile_peers, descriptors_a_borrower_sends_are_refused_not_kept) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender_config config;
  config.peer_timeout = 10000ms;
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  auto raw = raw_borrower(l.address());
  pipe_ends pipe;
  const std::size_t descriptors_before = open_descriptor_count();
  const int refused = send_raw(raw.native_handle(), {std::byte{'S'}}, std::vector<int>(16, pipe.write.get()));
  if (kernel_refuses_descriptors()) {
    // Linux 6.16 on: none reaches the lender (SO_PASSRIGHTS off), so none can
    // be kept, nor closed on its serving thread.
    EXPECT_EQ(refused, EPERM) << "a borrower's descriptors reached the lender";
    EXPECT_EQ(open_descriptor_count(), descriptors_before);
    EXPECT_NO_THROW(borrower(dev, l.address(), {}, 2000ms)) << "an honest borrower connects";
    return;
  }
  ASSERT_EQ(refused, 0) << std::strerror(refused);
  EXPECT_THROW((void)raw.receive_for(3000ms), connection_closed) << "the lender kept the connection open";
  // Its end of the connection closed, and none of the 16 kept.
  EXPECT_TRUE(eventually([&] { return open_descriptor_count() == descriptors_before - 1; }, 2000ms))
      << "the lender holds descriptors a borrower sent: " << open_descriptor_count() << " open, " << descriptors_before
      << " before";
  EXPECT_NO_THROW(borrower(dev, l.address(), {}, 2000ms)) << "an honest borrower connects";
}

// A peer timeout past a day is refused: compared with clock differences in
// nanoseconds, a huge one overflowed and hung up on every borrower at once.
TEST(lending_hostile_peers, a_peer_timeout_past_a_day_is_refused) {
  temp_dir dir;
  lender_config config;
  config.peer_timeout = std::chrono::hours(25);
  EXPECT_THROW(lender(backend::host_device_instance(), channel::channel_address::at_path(dir / "l.sock"), config),
               invalid_argument);
  config.peer_timeout = std::chrono::milliseconds(9'223'372'036'855);  // past int64 nanoseconds
  EXPECT_THROW(lender(backend::host_device_instance(), channel::channel_address::at_path(dir / "l.sock"), config),
               invalid_argument);
  config.peer_timeout = std::chrono::hours(24);
  EXPECT_NO_THROW(lender(backend::host_device_instance(), channel::channel_address::at_path(dir / "l.sock"), config));
}

// A lender that answers with text no terminal or log should get as it is: a
// refusal's reason is quoted with escapes (the part after a NUL kept), and
// metrics that are no printable text are refused.
TEST(lending_hostile_peers, a_lenders_text_reaches_no_message_or_caller_raw) {
  temp_dir dir;
  const auto address = channel::channel_address::at_path(dir / "odd.sock");
  channel::listener odd(address, {});
  auto server = std::async(std::launch::async, [&] {
    auto link = odd.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    (void)link.receive_for(5s);  // the hello
    const auto borrow = lending::detail::decode_borrow(link.receive_for(5s).payload);
    lending::detail::refused_message no;
    no.request = borrow.request;
    no.reason = lending::detail::refusal::bad_request;
    no.why = std::string("cut\0here\x1b[31m\nlevel=error\\", 26);
    link.send(static_cast<std::uint16_t>(message_type::refused), lending::detail::encode(no));
    (void)link.receive_for(5s);  // the metrics query
    const std::string text = "shoal_lending_regions 1\n\x1b[2J";
    link.send(static_cast<std::uint16_t>(message_type::metrics),
              std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                     reinterpret_cast<const std::byte*>(text.data()) + text.size()));
    EXPECT_THROW((void)link.receive_for(5s), connection_closed);  // the borrower hangs up
  });
  {
    borrower b(backend::host_device_instance(), address, {}, 2s);
    try {
      (void)b.borrow(4096, "odd", lending::region_mode::exclusive, 2s);
      ADD_FAILURE() << "the refusal did not come";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cut\\x00here\\x1b[31m\\x0alevel=error\\x5c"), std::string::npos)
          << e.what();
    }
    try {
      (void)b.metrics(2s);
      ADD_FAILURE() << "metrics holding a terminal escape were handed on";
    } catch (const protocol_error& e) {
      EXPECT_NE(std::string(e.what()).find("byte 27 at offset 24"), std::string::npos) << e.what();
    }
  }
  server.get();
}

}  // namespace
}  // namespace shoal::testing
