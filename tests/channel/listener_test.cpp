// The listener's private directory and its socket file: created 0700,
// refused when open to others or not ours, bound in the directory checked
// even when another takes its name, removed when the listener made it; a
// stale file replaced, an address in use refused, and only its own file
// removed.
#include <gtest/gtest.h>

#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/channel/listener_test_hook.h"
#include "shoal/core/error.h"
#include "shoal/core/process_identity.h"
#include "support/other_uids.h"

namespace shoal::testing {
namespace {

using channel::channel_address;
using channel::connection;
using channel::listener;
using shoal::process_identity;
using namespace std::chrono_literals;

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// Clears the listener's test hooks when it goes, whatever the test did.
struct hook_cleared_after {
  ~hook_cleared_after() {
    channel::test_hook::set_after_directory_check({});
    channel::test_hook::set_between_bind_and_listen({});
  }
};

TEST(listener_directory, a_missing_directory_is_created_with_mode_0700) {
  temp_dir dir;
  const mode_t old_umask = ::umask(0);  // the mode must not depend on the umask
  {
    const listener server(channel_address::at_path(dir / "private/sock"), {});
    struct stat st{};
    ASSERT_EQ(::stat((dir / "private").c_str(), &st), 0);
    EXPECT_TRUE(S_ISDIR(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    EXPECT_EQ(st.st_uid, ::geteuid());
  }
  ::umask(old_umask);
}

TEST(listener_directory, a_directory_open_to_its_group_is_refused) {
  temp_dir dir;
  const std::string shared = dir / "shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 0770), 0);
  try {
    const listener server(channel_address::at_path(shared + "/sock"), {});
    ADD_FAILURE() << "a group-writable directory was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("chmod 700 " + shared), std::string::npos) << e.what();
  }
  EXPECT_NE(::access((shared + "/sock").c_str(), F_OK), 0) << "no socket file was made";
}

// /tmp and its kind are shared by design: the refusal must not tell the user
// to chmod them (as it does a directory that is theirs alone), only to give
// the socket a directory of its own.
TEST(listener_directory, a_sticky_directory_is_refused_without_advice_to_change_its_mode) {
  temp_dir dir;
  const std::string sticky = dir / "sticky";
  ASSERT_EQ(::mkdir(sticky.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(sticky.c_str(), 01777), 0);
  try {
    const listener server(channel_address::at_path(sticky + "/sock"), {});
    ADD_FAILURE() << "a sticky directory open to all was accepted";
  } catch (const invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find("chmod"), std::string::npos) << message;
    EXPECT_NE(message.find("a path like " + sticky + "/<name>/<socket>"), std::string::npos) << message;
    EXPECT_NE(message.find("leave its mode alone"), std::string::npos) << message;
  }
  // What the message advises works: a directory of its own inside it.
  const listener server(channel_address::at_path(sticky + "/mine/sock"), {});
  struct stat st{};
  ASSERT_EQ(::stat((sticky + "/mine").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
}

TEST(listener_directory, a_directory_of_another_user_is_refused) {
  if (!may_act_as({65534})) GTEST_SKIP() << "making a directory owned by another user needs root and the uid mapped";
  temp_dir dir;
  const std::string theirs = dir / "theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), nobody, nobody), 0);
  try {
    const listener server(channel_address::at_path(theirs + "/sock"), {});
    ADD_FAILURE() << "a directory of uid 65534 was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to uid 65534"), std::string::npos) << e.what();
  }
}

TEST(listener_directory, a_symbolic_link_or_a_missing_parent_is_refused) {
  temp_dir dir;
  ASSERT_EQ(::mkdir((dir / "real").c_str(), 0700), 0);
  ASSERT_EQ(::symlink((dir / "real").c_str(), (dir / "link").c_str()), 0);
  EXPECT_THROW((void)listener(channel_address::at_path(dir / "link/sock"), {}), invalid_argument);
  try {
    (void)listener(channel_address::at_path(dir / "missing/deeper/sock"), {});
    ADD_FAILURE() << "a listener was made below a missing directory";
  } catch (const os_error& e) {
    EXPECT_EQ(e.code(), ENOENT) << e.what();
  }
}

TEST(listener_directory, the_socket_lands_in_the_directory_that_was_checked_when_another_takes_its_name) {
  temp_dir dir;
  const std::string home = dir / "home", checked = dir / "checked";
  ASSERT_EQ(::mkdir(home.c_str(), 0700), 0);
  const hook_cleared_after cleared;
  channel::test_hook::set_after_directory_check([&](const std::string& directory) {
    EXPECT_EQ(directory, home);
    // Someone who may rename in the parent moves the checked directory away
    // and puts one open to everyone in its place, between check and bind.
    ASSERT_EQ(::rename(home.c_str(), checked.c_str()), 0);
    ASSERT_EQ(::mkdir(home.c_str(), 0700), 0);
    ASSERT_EQ(::chmod(home.c_str(), 0777), 0);
  });
  {
    listener server(channel_address::at_path(home + "/sock"), {});
    channel::test_hook::set_after_directory_check({});
    EXPECT_FALSE(exists(home + "/sock")) << "the socket is not in the directory that was never checked";
    struct stat st{};
    ASSERT_EQ(::lstat((checked + "/sock").c_str(), &st), 0) << "the socket is in the directory that was checked";
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    const connection client = connection::connect(channel_address::at_path(checked + "/sock"), {});
    EXPECT_TRUE(server.accept_for(10s).has_value()) << "and it is the listener's";
  }
  EXPECT_FALSE(exists(checked + "/sock")) << "the destructor removed its file where it made it";
  EXPECT_TRUE(exists(home)) << "a directory the listener did not make is left";
}

TEST(listener_directory, a_directory_the_listener_made_is_removed_with_it_and_one_it_found_is_left) {
  temp_dir dir;
  {
    const listener server(channel_address::at_path(dir / "made/sock"), {});
    EXPECT_TRUE(exists(dir / "made"));
  }
  EXPECT_FALSE(exists(dir / "made")) << "the listener made it, so it removed it";

  ASSERT_EQ(::mkdir((dir / "found").c_str(), 0700), 0);
  { const listener server(channel_address::at_path(dir / "found/sock"), {}); }
  EXPECT_TRUE(exists(dir / "found")) << "the listener found it there, so it stays";
  EXPECT_FALSE(exists(dir / "found/sock"));

  {
    const listener server(channel_address::at_path(dir / "shared/sock"), {});
    std::ofstream(dir / "shared/other") << "someone else's";
  }
  EXPECT_TRUE(exists(dir / "shared/other")) << "a directory it made is removed only when empty";
}

TEST(listener_directory, the_runtime_dir_is_the_recommended_home) {
  const char* saved = std::getenv("XDG_RUNTIME_DIR");
  const std::string saved_value = saved != nullptr ? saved : "";
  temp_dir dir;
  ASSERT_EQ(::setenv("XDG_RUNTIME_DIR", dir.path().c_str(), 1), 0);
  EXPECT_EQ(channel_address::in_runtime_dir("feed.sock"), channel_address::at_path(dir / "feed.sock"));
  {
    listener server(channel_address::in_runtime_dir("feed.sock"), {});
    const connection client = connection::connect(channel_address::in_runtime_dir("feed.sock"), {});
    EXPECT_TRUE(server.accept_for(10s).has_value());
  }
  ASSERT_EQ(::unsetenv("XDG_RUNTIME_DIR"), 0);
  EXPECT_EQ(channel_address::in_runtime_dir("feed.sock"),
            channel_address::at_path("/tmp/shoal-" + std::to_string(::geteuid()) + "/feed.sock"));
  if (saved != nullptr) ::setenv("XDG_RUNTIME_DIR", saved_value.c_str(), 1);
  EXPECT_THROW((void)channel_address::in_runtime_dir("a/b"), invalid_argument);
  EXPECT_THROW((void)channel_address::in_runtime_dir(""), invalid_argument);
  EXPECT_THROW((void)channel_address::in_runtime_dir("."), invalid_argument);
  EXPECT_THROW((void)channel_address::in_runtime_dir(".."), invalid_argument);
}

TEST(listener_directory, a_name_too_long_to_bind_through_the_directory_is_refused) {
  char short_name[] = "/tmp/sXXXXXX";
  ASSERT_NE(::mkdtemp(short_name), nullptr);
  const std::string dir = short_name;
  // The longest name the path allows; "/proc/self/fd/<n>/" is longer than the directory.
  const std::string name(107 - dir.size() - 1, 'n');
  try {
    const listener server(channel_address::at_path(dir + "/" + name), {});
    ADD_FAILURE() << "a socket name of " << name.size() << " bytes was bound";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("choose a shorter name"), std::string::npos) << e.what();
  }
  ::unlink((dir + "/" + name).c_str());
  EXPECT_EQ(::rmdir(dir.c_str()), 0);
}

// Leaves at `address` the socket file of a listener that died without
// removing it: no one listens there.
void leave_a_dead_listeners_file(const channel_address& address) {
  const unique_fd dead(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const raw_address local = raw_address_of(address);
  ASSERT_EQ(::bind(dead.get(), reinterpret_cast<const sockaddr*>(&local.address), local.length), 0);
  ASSERT_EQ(::listen(dead.get(), 1), 0);
}

TEST(listener_file, a_stale_socket_file_is_replaced) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  leave_a_dead_listeners_file(address);
  ASSERT_EQ(::access((dir / "sock").c_str(), F_OK), 0) << "the stale file is there";
  listener server(address, {});
  const connection client = connection::connect(address, {});
  EXPECT_EQ(server.accept().peer().process, process_identity::self());
}

// A pid that no longer runs: a child's, ended and reaped.
pid_t a_dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  EXPECT_EQ(::waitpid(child, &status, 0), child);
  return child;
}

// A socket file bound at `path` a minute ago and listened on; closed (as by
// a SIGKILL) unless `keep` takes the socket. `fresh`: made now.
void bound_socket(const std::string& path, unique_fd* keep = nullptr, bool fresh = false) {
  unique_fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const raw_address local = raw_address_of(channel_address::at_path(path));
  ASSERT_EQ(::bind(s.get(), reinterpret_cast<const sockaddr*>(&local.address), local.length), 0) << path;
  ASSERT_EQ(::listen(s.get(), 1), 0);
  if (!fresh) {
    const timespec minute_ago{::time(nullptr) - 60, 0};
    const timespec times[2] = {minute_ago, minute_ago};
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW), 0);
  }
  if (keep != nullptr) *keep = std::move(s);
}

TEST(listener_file, abandoned_sockets_of_processes_that_are_gone_are_removed_and_nothing_else) {
  temp_dir dir;
  const std::string dead = std::to_string(a_dead_pid()), alive = std::to_string(::getpid());
  const auto at = [&](const std::string& name) { return dir / name; };
  bound_socket(at("srv-" + dead + "-abandoned.sock"));
  bound_socket(at("srv-" + dead + "-also-abandoned.sock"));
  bound_socket(at("srv-" + alive + "-a-live-pid.sock"));
  bound_socket(at("other-" + dead + "-another-prefix.sock"));
  bound_socket(at("srv-" + dead + ".sock"));  // no dash after the pid: not this naming
  bound_socket(at("srv-" + dead + "-fresh.sock"), nullptr, true);  // may be a listener about to listen
  unique_fd listening;
  bound_socket(at("srv-" + dead + "-someone-listens.sock"), &listening);
  std::ofstream(at("srv-" + dead + "-a-file.sock")) << "precious";
  ASSERT_EQ(::symlink(at("srv-" + alive + "-a-live-pid.sock").c_str(), at("srv-" + dead + "-a-link.sock").c_str()), 0);
  const listener server(channel_address::at_path(at("srv-" + alive + "-own.sock")), {});

  EXPECT_EQ(server.remove_abandoned_sockets("srv-"), 2u);
  EXPECT_FALSE(exists(at("srv-" + dead + "-abandoned.sock")));
  EXPECT_FALSE(exists(at("srv-" + dead + "-also-abandoned.sock")));
  for (const std::string& kept : {"srv-" + alive + "-a-live-pid.sock", "other-" + dead + "-another-prefix.sock",
                                  "srv-" + dead + ".sock", "srv-" + dead + "-fresh.sock",
                                  "srv-" + dead + "-someone-listens.sock",
                                  "srv-" + dead + "-a-file.sock", "srv-" + dead + "-a-link.sock",
                                  "srv-" + alive + "-own.sock"}) {
    EXPECT_TRUE(exists(at(kept))) << kept << " was removed";
  }
  EXPECT_EQ(listener(fresh_abstract_name(), {}).remove_abandoned_sockets("srv-"), 0u) << "no directory, nothing to do";
}

// A socket file of another user in the folder (this user's folder, made
// shared by hand, or root's view of any folder) is never this user's to
// remove, however abandoned it looks.
TEST(listener_file, an_abandoned_socket_of_another_user_is_left) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "giving a file to another uid (chown to 65534) needs root and the uid mapped";
  temp_dir dir;
  const std::string dead = std::to_string(a_dead_pid());
  const std::string theirs = dir / ("srv-" + dead + "-of-another-user.sock");
  bound_socket(theirs);
  ASSERT_EQ(::lchown(theirs.c_str(), 65534, 65534), 0);
  const listener server(channel_address::at_path(dir / ("srv-" + std::to_string(::getpid()) + "-own.sock")), {});
  EXPECT_EQ(server.remove_abandoned_sockets("srv-"), 0u);
  EXPECT_TRUE(exists(theirs)) << "another user's socket file was removed";
}

TEST(listener_file, an_address_in_use_is_refused_and_its_listener_keeps_working) {
  temp_dir dir;
  for (const auto& address : {channel_address::at_path(dir / "sock"), fresh_abstract_name()}) {
    SCOPED_TRACE(address.to_string());
    listener first(address, {});
    try {
      const listener second(address, {});
      ADD_FAILURE() << "a second listener took the address";
    } catch (const os_error& e) {
      EXPECT_EQ(e.code(), EADDRINUSE);
      EXPECT_NE(std::string(e.what()).find("already in use"), std::string::npos) << e.what();
    }
    // The check of who listens made no connection: a server that accepts
    // one client gets its client, not the check.
    EXPECT_FALSE(first.accept_for(100ms).has_value()) << "the second listener's check was handed out as a peer";
    connection client = connection::connect(address, {});
    connection accepted = first.accept();
    client.send(1, bytes_of("still here"));
    EXPECT_EQ(text_of(accepted.receive().payload), "still here");
  }
}

// What starting a listener at `address` came to: "started" (it is closed
// again at once), "in use", or the error.
std::string start_of(const channel_address& address) {
  try {
    const listener l(address, {});
    return "started";
  } catch (const os_error& e) {
    return e.code() == EADDRINUSE ? "in use" : e.what();
  }
}

// A datagram socket bound at the path is in use, and so is one connected
// to another socket (a datagram sent to it is refused with EPERM, not as at
// a dead file): the file is kept, not taken for stale.
TEST(listener_file, a_datagram_socket_bound_at_the_path_is_in_use_connected_elsewhere_or_not) {
  temp_dir dir;
  const auto bind_datagram = [&](const std::string& name) {
    unique_fd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    const raw_address at = raw_address_of(channel_address::at_path(dir / name));
    EXPECT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&at.address), at.length), 0) << std::strerror(errno);
    return std::make_pair(std::move(fd), at);
  };
  const auto alone = bind_datagram("alone");
  EXPECT_EQ(start_of(channel_address::at_path(dir / "alone")), "in use");
  const auto talker = bind_datagram("talker");
  const auto peer = bind_datagram("peer");
  ASSERT_EQ(::connect(talker.first.get(), reinterpret_cast<const sockaddr*>(&peer.second.address), peer.second.length), 0)
      << std::strerror(errno);
  EXPECT_EQ(start_of(channel_address::at_path(dir / "talker")), "in use");
  EXPECT_TRUE(exists(dir / "talker"));
}

// Between bind() and listen() a stream connect is refused as at a dead
// listener's file: a second listener that probed so then would take the
// first's socket file for stale, replace it, and leave the first listening
// on a removed file.
TEST(listener_file, a_listener_started_while_another_is_between_bind_and_listen_is_refused) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  const hook_cleared_after cleared;
  std::atomic<bool> paused{false};
  std::future<std::string> second;
  channel::test_hook::set_between_bind_and_listen([&](const std::string&) {
    if (paused.exchange(true)) return;  // the first listener alone pauses
    second = std::async(std::launch::async, [&] { return start_of(address); });
    // Time enough for the second to probe, remove and bind, were it let.
    (void)second.wait_for(500ms);
  });
  listener first(address, {});
  EXPECT_EQ(second.get(), "in use");
  connection client = connection::connect(address, {}, connection::default_max_payload, 2s);
  connection accepted = first.accept();  // the client: the second's check made no connection
  client.send(1, bytes_of("reachable"));
  EXPECT_EQ(text_of(accepted.receive().payload), "reachable") << "the first listener is the one at the path";
}

// Holds the start lock of the socket file `name` in `dir` as another
// process would (flock on an open file description of its own) while it lives.
struct start_lock_held_elsewhere {
  start_lock_held_elsewhere(const std::string& dir, const std::string& name)
      : file(::open((dir + "/." + name + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600)) {
    EXPECT_TRUE(file) << "the lock file could not be made";
    EXPECT_EQ(::flock(file.get(), LOCK_EX | LOCK_NB), 0) << "the lock was taken";
  }
  unique_fd file;
};

// Sets the start lock's wait for one test, and the default back after.
struct start_lock_wait_for_test {
  explicit start_lock_wait_for_test(std::chrono::milliseconds wait) { channel::test_hook::set_start_lock_wait(wait); }
  ~start_lock_wait_for_test() { channel::test_hook::set_start_lock_wait(2s); }
};

// A process of this uid stopped (or hostile) while it holds a socket file's
// start lock holds no listener's start, end or sweep past the lock's wait.
// Waited for in flock() as before, each of these hung.
TEST(listener_file, a_start_lock_held_elsewhere_is_waited_for_only_until_its_deadline) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  const start_lock_wait_for_test wait(200ms);
  {
    const start_lock_held_elsewhere held(dir.path(), "sock");
    const auto start = std::chrono::steady_clock::now();
    try {
      const listener blocked(address, {});
      ADD_FAILURE() << "a listener started while another process held the start lock";
    } catch (const timeout_error& e) {
      EXPECT_NE(std::string(e.what()).find(".sock.lock"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("another process held the lock past 200 ms"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  }
  auto server = std::make_optional<listener>(address, channel::access_policy{});  // the lock is free again
  {
    const start_lock_held_elsewhere held(dir.path(), "sock");
    const auto start = std::chrono::steady_clock::now();
    server.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
    EXPECT_TRUE(exists(dir / "sock")) << "the socket file was removed without the lock";
  }
  const listener later(address, {});  // a later start replaces the file left as a leftover
  const std::string dead = std::to_string(a_dead_pid());
  bound_socket(dir / ("srv-" + dead + "-abandoned.sock"));
  {
    const start_lock_held_elsewhere held(dir.path(), "srv-" + dead + "-abandoned.sock");
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(later.remove_abandoned_sockets("srv-"), 0u);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
    EXPECT_TRUE(exists(dir / ("srv-" + dead + "-abandoned.sock"))) << "removed without the lock";
  }
  EXPECT_EQ(later.remove_abandoned_sockets("srv-"), 1u) << "once the lock is free";
}

// Listeners started at once over one stale socket file: one starts, and it
// is the one at the path; the others are refused.
TEST(listener_file, of_listeners_racing_over_a_stale_socket_file_one_starts_and_is_reachable) {
  constexpr int racers = 6;
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    temp_dir dir;
    const auto address = channel_address::at_path(dir / "sock");
    leave_a_dead_listeners_file(address);
    ASSERT_EQ(::access((dir / "sock").c_str(), F_OK), 0) << "the stale file is there";
    std::vector<std::optional<listener>> started(racers);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (auto& slot : started) {
      threads.emplace_back([&] {
        ready.fetch_add(1);
        while (ready.load() < racers) {
        }
        try {
          slot.emplace(address, channel::access_policy{});
        } catch (const os_error& e) {
          EXPECT_EQ(e.code(), EADDRINUSE) << e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(std::count_if(started.begin(), started.end(), [](const auto& l) { return l.has_value(); }), 1);
    listener& winner = **std::find_if(started.begin(), started.end(), [](const auto& l) { return l.has_value(); });
    connection client = connection::connect(address, {}, connection::default_max_payload, 2s);
    client.send(1, bytes_of("reachable"));
    std::optional<connection> accepted = winner.accept_for(2s);  // the others' checks made no connection
    ASSERT_TRUE(accepted.has_value()) << "the winner is not the listener at the path";
    EXPECT_EQ(text_of(accepted->receive_for(2s).payload), "reachable");
  }
}

// A client that hangs up before it is identified (and whose process then
// ended) costs the server nothing: accept() drops it and waits for the next
// within its deadline.
TEST(listener_file, a_client_gone_before_it_was_identified_is_dropped_and_accept_goes_on) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  listener server(address, {});
  const raw_address target = raw_address_of(address);
  const auto connect_and_exit = [&] {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
      ::_exit(s >= 0 && ::connect(s, reinterpret_cast<const sockaddr*>(&target.address), target.length) == 0 ? 0 : 3);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child could not connect";
  };
  connect_and_exit();
  std::optional<connection> none;
  EXPECT_NO_THROW(none = server.accept_for(200ms));
  EXPECT_FALSE(none.has_value()) << "a connection of a process that is gone was handed out";
  connect_and_exit();
  const connection client = connection::connect(address, {});
  std::optional<connection> accepted;
  EXPECT_NO_THROW(accepted.emplace(server.accept()));
  ASSERT_TRUE(accepted.has_value());
  EXPECT_EQ(accepted->peer().process, process_identity::self()) << "the next client's, the gone one's dropped";
}

TEST(listener_file, a_file_that_is_not_a_socket_is_refused_and_kept) {
  temp_dir dir;
  std::ofstream(dir / "sock") << "precious";
  EXPECT_THROW((void)listener(channel_address::at_path(dir / "sock"), {}), invalid_argument);
  std::string kept;
  std::getline(std::ifstream(dir / "sock"), kept);
  EXPECT_EQ(kept, "precious");
}

TEST(listener_file, the_destructor_removes_its_socket_file_and_no_other) {
  temp_dir dir;
  const std::string path = dir / "sock";
  {
    const listener server(channel_address::at_path(path), {});
    struct stat st{};
    ASSERT_EQ(::lstat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
  }
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the socket file was removed";
  {
    const listener server(channel_address::at_path(path), {});
    ASSERT_EQ(::unlink(path.c_str()), 0);
    std::ofstream(path) << "someone else's";
  }
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "a file that took the socket's place is left alone";
}

// A child forked while the listener lives ends with the listener's
// destructor run in it too (a Python process exiting runs them): the file is
// the parent's, which still listens, and stays.
TEST(listener_file, a_forked_child_that_destroys_it_leaves_the_parents_socket_file) {
  temp_dir dir;
  const std::string path = dir / "sock";
  auto server = std::make_unique<listener>(channel_address::at_path(path), channel::access_policy{});
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    server.reset();
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "the child removed the parent's socket file";
  EXPECT_NO_THROW((void)connection::connect(channel_address::at_path(path), {}, connection::default_max_payload, std::chrono::seconds(2)))
      << "no one listens at the parent's address any more";
  server.reset();
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the parent's own end removes it";
}

}  // namespace
}  // namespace shoal::testing
