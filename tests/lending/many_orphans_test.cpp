// Many processes with orphaned holds, at the lender's level (host backend,
// the lender in this process, its holders forked children): each check for
// holders that exited looks up a bounded number of them (64), so the lender
// keeps serving however many there are; the checks go round them all, so
// every one that exits is reclaimed; and a hang-up drops all of a
// connection's holds of a region at once, however many it has.
//
// A holder process connects to the lender and leaves the talking to this
// process, on the socket they share: the lender knows a connection's process
// by who connected it (SO_PEERCRED), and the child runs async-signal-safe
// calls alone (connect, close, write, pause) until it is killed.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "lending/orphan_checks.h"
#include "shoal/backend/host_device.h"
#include "shoal/channel/protocol.h"
#include "shoal/lending/layout.h"

namespace shoal::testing {
namespace {

using clock_type = std::chrono::steady_clock;
using lending::detail::message_type;

constexpr std::size_t lookups_per_check = 64;  // lender.cpp's bound

/// Clears the lookups hook when the test ends, however it ends. Made before
/// the lender, so that it outlives the lender's serving thread.
struct lookups_hook {
  explicit lookups_hook(std::function<void(std::span<const process_identity>)> hook) {
    lending::detail::set_before_orphan_lookups(std::move(hook));
  }
  ~lookups_hook() { lending::detail::set_before_orphan_lookups({}); }
  lookups_hook(const lookups_hook&) = delete;
  lookups_hook& operator=(const lookups_hook&) = delete;
};

/// A child process connected to the lender at `socket_path`, and the
/// connection, greeted, that this process speaks on for it. The connection
/// hangs up when `link` closes (the child closed its copy of the socket).
struct connected_process {
  std::unique_ptr<forked_child> process;
  channel::connection link;
};

connected_process connect_child(const std::string& socket_path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, socket_path.c_str(), sizeof address.sun_path - 1);
  unique_fd socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_TRUE(socket) << std::strerror(errno);
  pipe_ends connected;
  const int fd = socket.get();
  const int said = connected.write.get();
  auto child = std::make_unique<forked_child>([fd, said, &address] {
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) return 1;
    ::close(fd);
    const char c = 'c';
    if (::write(said, &c, 1) != 1) return 1;
    ::close(said);
    for (;;) ::pause();  // until killed
  });
  connected.write.reset();
  pollfd ready{connected.read.get(), POLLIN, 0};
  char c = 0;
  if (::poll(&ready, 1, 5000) != 1 || ::read(connected.read.get(), &c, 1) != 1) {
    ADD_FAILURE() << "the child process did not connect within 5 s";
  }
  auto link = channel::connection::adopt(std::move(socket), {}, lending::detail::max_frame_payload);
  channel::send_hello(link, lending::detail::lending_protocol);
  channel::check_hello(link.receive_for(5000ms), lending::detail::lending_protocol);
  return {std::move(child), std::move(link)};
}

/// Borrows an exclusive region of `bytes` on `link`.
void borrow_on(channel::connection& link, std::size_t bytes) {
  link.send(static_cast<std::uint16_t>(message_type::borrow),
            lending::detail::encode(lending::detail::borrow_message{1, bytes, lending::region_mode::exclusive, "orphan"}));
  ASSERT_EQ(link.receive_for(5000ms).type, static_cast<std::uint16_t>(message_type::lent));
  (void)link.receive_for(5000ms);  // its chunk
}

/// Takes the shared region `name` `count` times on `link`, a window of
/// requests sent before their answers are read (each answered by its lent
/// frame, its chunk and its layout).
void take_shared(channel::connection& link, const std::string& name, std::size_t count) {
  constexpr std::size_t window = 64;
  std::uint64_t request = 0;
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = std::min(window, count - done);
    for (std::size_t i = 0; i < n; ++i) {
      link.send(static_cast<std::uint16_t>(message_type::borrow_shared),
                lending::detail::encode(lending::detail::borrow_shared_message{++request, name, {}, {}}));
    }
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(link.receive_for(5000ms).type, static_cast<std::uint16_t>(message_type::lent));
      (void)link.receive_for(5000ms);  // its chunk
      (void)link.receive_for(5000ms);  // its layout
    }
    done += n;
  }
}

/// `count` child processes, each of which borrowed a region of `bytes` and
/// hung up, and runs on: each leaves an orphaned hold.
std::vector<std::unique_ptr<forked_child>> orphan_holders(const lender& l, std::size_t count, std::size_t bytes) {
  std::vector<std::unique_ptr<forked_child>> holders;
  for (std::size_t i = 0; i < count; ++i) {
    auto [process, link] = connect_child(l.address().name());
    borrow_on(link, bytes);
    holders.push_back(std::move(process));
    if (::testing::Test::HasFailure()) break;
  }  // each link closes here: its child hung up, alive
  return holders;
}

std::size_t orphaned_regions(const lender& l) {
  const auto s = l.status();
  return static_cast<std::size_t>(std::count_if(s.regions.begin(), s.regions.end(), [](const auto& r) {
    return r.state == lending::region_state::orphaned;
  }));
}

// More live processes with orphaned holds than a check looks up, each
// lookup as slow as /proc on a loaded machine: another borrower's requests
// are still answered within about one check's 64 lookups (the serving
// thread does the checks), not after all of them.
TEST(lending_many_orphans, the_lender_serves_others_while_many_live_processes_hold_orphaned_regions) {
  constexpr std::size_t holders_count = 4 * lookups_per_check;
  constexpr auto lookup = 8ms;  // a check of 64: about 0.5 s; of all of them: about 2 s
  constexpr auto answer_within = 1250ms;
  std::mutex guard;
  bool slow = false;                // from when the holders are all there
  std::vector<std::size_t> checks;  // how many processes each check looked up since
  const lookups_hook slow_lookups([&](std::span<const process_identity> processes) {
    {
      std::lock_guard lock(guard);
      if (!slow) return;
      checks.push_back(processes.size());
    }
    std::this_thread::sleep_for(lookup * processes.size());
  });
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  const std::size_t unit = dev.granularity();
  auto holders = orphan_holders(l, holders_count, unit);
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(eventually([&] { return orphaned_regions(l) == holders_count; }))
      << "not every holder's region is orphaned: " << orphaned_regions(l);
  {
    std::lock_guard lock(guard);
    slow = true;
  }

  // Connected after the children were made: none of them has its socket.
  borrower other(dev, l.address());
  const auto checks_seen = [&] {
    std::lock_guard lock(guard);
    return checks.size();
  };
  const std::size_t checks_before = checks_seen();
  auto slowest = clock_type::duration::zero();
  std::size_t rounds = 0;
  const auto until = clock_type::now() + 60s;
  // Rounds until every holder was looked up at least once more (four checks
  // of 64), and one check past that.
  while (checks_seen() < checks_before + holders_count / lookups_per_check + 1 && clock_type::now() < until) {
    auto start = clock_type::now();
    auto region = other.borrow(unit, "meanwhile", lending::region_mode::exclusive, 10s);
    slowest = std::max(slowest, clock_type::now() - start);
    start = clock_type::now();
    other.give_back(std::move(region), 10s);
    slowest = std::max(slowest, clock_type::now() - start);
    ++rounds;
  }
  EXPECT_GE(checks_seen(), checks_before + holders_count / lookups_per_check + 1) << "the checks did not go on";
  EXPECT_LT(slowest, answer_within) << "a request of another borrower waited "
                                    << std::chrono::duration_cast<std::chrono::milliseconds>(slowest).count()
                                    << " ms, behind more than a check's " << lookups_per_check << " lookups ("
                                    << rounds << " rounds)";
  std::lock_guard lock(guard);
  ASSERT_FALSE(checks.empty());
  EXPECT_LE(*std::max_element(checks.begin(), checks.end()), lookups_per_check)
      << "a check looked up more processes than its bound";
  EXPECT_EQ(orphaned_regions(l), holders_count) << "a live holder's region was reclaimed";
}

// More processes with orphaned holds than a check looks up, the first ones
// in the checks' order (pid) staying alive and the rest exiting: the checks
// go round all of them, so every one that exited is reclaimed — over
// several checks — and no live one is.
TEST(lending_many_orphans, orphaned_holds_of_exited_processes_are_reclaimed_over_several_checks) {
  constexpr std::size_t live_count = lookups_per_check + 16;
  constexpr std::size_t exiting_count = lookups_per_check + 16;
  // Per check, in the serving thread's order, the holds it reclaimed: a
  // check calls the hook first and emits its reclaimed events after. While
  // `hold` is set, a check waits in the hook (up to 10 s), before it looks
  // anyone up.
  std::mutex guard;
  std::condition_variable changed;
  std::vector<std::size_t> reclaimed_by_check;
  bool hold = false;
  bool held = false;
  const lookups_hook observe([&](std::span<const process_identity>) {
    std::unique_lock lock(guard);
    reclaimed_by_check.push_back(0);
    if (!hold) return;
    held = true;
    changed.notify_all();
    changed.wait_for(lock, 10s, [&] { return !hold; });
  });
  lender_config config;
  config.on_event = [&](const lending::lender_event& e) {
    std::lock_guard lock(guard);
    if (e.what == lending::lender_event::kind::reclaimed && !reclaimed_by_check.empty()) ++reclaimed_by_check.back();
  };
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  const std::size_t unit = dev.granularity();
  auto holders = orphan_holders(l, live_count + exiting_count, unit);
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(eventually([&] { return orphaned_regions(l) == live_count + exiting_count; }));

  // The checks go in (pid, start time) order: the lowest pids stay.
  std::sort(holders.begin(), holders.end(), [](const auto& a, const auto& b) { return a->pid() < b->pid(); });
  std::set<pid_t> live;
  for (std::size_t i = 0; i < live_count; ++i) live.insert(holders[i]->pid());
  const auto reclaimed_before = l.status().reclaimed;
  // They all exit while a check waits to start: no check sees some gone and
  // not the others.
  bool check_waits = false;
  {
    std::unique_lock lock(guard);
    hold = true;
    check_waits = changed.wait_for(lock, 5s, [&] { return held; });
  }
  for (std::size_t i = live_count; i < holders.size(); ++i) {
    ::kill(holders[i]->pid(), SIGKILL);
    (void)holders[i]->wait();
  }
  holders.resize(live_count);
  {
    std::lock_guard lock(guard);
    hold = false;
  }
  changed.notify_all();
  ASSERT_TRUE(check_waits) << "no reclaim check came within 5 s";

  EXPECT_TRUE(eventually([&] { return l.status().reclaimed == reclaimed_before + exiting_count; }, 10000ms))
      << "reclaimed " << l.status().reclaimed - reclaimed_before << " of the " << exiting_count
      << " holds of processes that exited";
  const auto s = l.status();
  ASSERT_EQ(s.regions.size(), live_count);
  std::size_t of_exited = 0;
  for (const auto& r : s.regions) {
    if (r.state != lending::region_state::orphaned || !live.contains(r.borrower.pid)) ++of_exited;
  }
  EXPECT_EQ(of_exited, 0u) << "regions held other than the live processes' orphaned ones";
  std::lock_guard lock(guard);
  const auto reclaiming_checks =
      std::count_if(reclaimed_by_check.begin(), reclaimed_by_check.end(), [](std::size_t n) { return n > 0; });
  EXPECT_GE(reclaiming_checks, 2) << "the " << exiting_count << " processes that exited were reclaimed in one check";
}

/// A lender whose borrowers may take the shared region "model" (published
/// by `writer`) `takes` times over on one connection.
struct shared_model {
  explicit shared_model(std::size_t takes) {
    lender_config config;
    config.max_regions_per_borrower = takes;
    config.quota_bytes = std::size_t{1} << 50;  // a shared region counts in full for each take
    l = std::make_unique<lender>(dev, channel::channel_address::at_path(dir / "l.sock"), config);
    writer = std::make_unique<borrower>(dev, l->address());
    auto region = writer->borrow(2 * mib, "model");
    lending::region_layout layout;
    layout.entries = {{"w", 0, region.size() / 2, lending::dtype::float32, {region.size() / 8}}};
    layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
    model = writer->publish(std::move(region), layout);
  }
  [[nodiscard]] std::vector<lending::holder_info> holders() const { return l->status().regions.at(0).holders; }

  temp_dir dir;
  backend::device& dev = backend::host_device_instance();
  std::unique_ptr<lender> l;
  std::unique_ptr<borrower> writer;
  lending::borrowed_region model;
};

std::size_t holds_of(const std::vector<lending::holder_info>& holders, pid_t pid) {
  return static_cast<std::size_t>(
      std::count_if(holders.begin(), holders.end(), [&](const auto& h) { return h.process.pid == pid; }));
}

// A process that still runs holds a shared region many times over through
// one connection, behind many holds of another connection, and hangs up:
// all its holds but one go at once (the one left, orphaned, is reclaimed
// when it exits), and the lender answers the next request within a second.
TEST(lending_many_orphans, a_hang_up_drops_all_of_a_live_process_s_holds_but_one_at_once) {
  constexpr std::size_t takes = 20000;
  shared_model f(takes);
  // This process's connection takes it first: its holds come first in the list.
  auto reader = channel::connection::connect(f.l->address(), {}, lending::detail::max_frame_payload);
  channel::send_hello(reader, lending::detail::lending_protocol);
  channel::check_hello(reader.receive_for(5000ms), lending::detail::lending_protocol);
  take_shared(reader, "model", takes);
  auto [process, link] = connect_child(f.l->address().name());
  take_shared(link, "model", takes);
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(holds_of(f.holders(), process->pid()), takes);
  const auto hung_up = clock_type::now();
  { auto closing = std::move(link); }  // the child closed its copy already: the lender sees the hang-up

  borrower other(f.dev, f.l->address());
  EXPECT_NO_THROW(other.give_back(other.borrow(2 * mib, "meanwhile", lending::region_mode::exclusive, 10s), 10s));
  EXPECT_TRUE(eventually([&] { return holds_of(f.holders(), process->pid()) == 1; }, 10000ms))
      << holds_of(f.holders(), process->pid()) << " holds of the process that hung up are left";
  const auto took = clock_type::now() - hung_up;
  EXPECT_LT(took, 1000ms) << "the hang-up and the next request took "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  auto holders = f.holders();
  EXPECT_EQ(holders.size(), 1 + takes + 1) << "the writer's, this process's, and one orphaned hold";
  EXPECT_EQ(std::count_if(holders.begin(), holders.end(),
                          [](const auto& h) { return h.state == lending::region_state::orphaned; }),
            1)
      << "orphaned holds";

  ::kill(process->pid(), SIGKILL);
  (void)process->wait();
  EXPECT_TRUE(eventually([&] { return holds_of(f.holders(), process->pid()) == 0; }, 10000ms))
      << "the orphaned hold of the process that exited was not reclaimed";
}

// A process holds a shared region through one connection many times over,
// and exits: its hang-up drops every one of those holds at once.
TEST(lending_many_orphans, the_hang_up_of_an_exited_process_drops_all_its_holds_at_once) {
  constexpr std::size_t takes = 20000;
  shared_model f(takes);
  auto [process, link] = connect_child(f.l->address().name());
  take_shared(link, "model", takes);
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(f.holders().size(), takes + 1);
  const auto reclaimed_before = f.l->status().reclaimed;
  const pid_t pid = process->pid();
  ::kill(pid, SIGKILL);
  (void)process->wait();
  const auto hung_up = clock_type::now();
  { auto closing = std::move(link); }  // the connection's last end closes: the lender sees the hang-up

  borrower other(f.dev, f.l->address());
  EXPECT_NO_THROW(other.give_back(other.borrow(2 * mib, "meanwhile", lending::region_mode::exclusive, 10s), 10s));
  EXPECT_TRUE(eventually([&] { return f.l->status().reclaimed == reclaimed_before + takes; }, 10000ms))
      << "dropped " << f.l->status().reclaimed - reclaimed_before << " of its " << takes << " holds";
  const auto took = clock_type::now() - hung_up;
  EXPECT_LT(took, 1000ms) << "the hang-up and the next request took "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  const auto holders = f.holders();
  EXPECT_EQ(holds_of(holders, pid), 0u) << "holds of the process that exited are left";
  ASSERT_EQ(holders.size(), 1u);
  EXPECT_EQ(holders[0].process.pid, ::getpid()) << "the writer's hold";
}

}  // namespace
}  // namespace shoal::testing
