// Process identities: a pid with its start time, so that a reused pid never
// reads as the process that held it before.
#include <gtest/gtest.h>

#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "shoal/core/error.h"
#include "shoal/core/process_identity.h"
#include "support/processes.h"
#include "support/refused_opendir.h"

namespace shoal::testing {
namespace {

using shoal::process_identity;

TEST(process_identity, self_is_this_process) {
  const process_identity me = process_identity::self();
  EXPECT_EQ(me.pid, ::getpid());
  EXPECT_EQ(shoal::identify_process(::getpid()), me);
  EXPECT_TRUE(shoal::is_alive(me));
  double uptime_seconds = 0;
  std::ifstream("/proc/uptime") >> uptime_seconds;
  const auto ticks_now = static_cast<std::uint64_t>(uptime_seconds * static_cast<double>(::sysconf(_SC_CLK_TCK)));
  EXPECT_LE(me.start_time, ticks_now + 1) << "the start time is in clock ticks after boot";
}

TEST(process_identity, a_wrong_start_time_reads_as_dead_as_a_reused_pid_would) {
  const process_identity me = process_identity::self();
  EXPECT_FALSE(shoal::is_alive({me.pid, me.start_time + 1}));
  EXPECT_FALSE(shoal::is_alive({me.pid, me.start_time - 1}));
}

TEST(process_identity, unused_pids_name_no_process) {
  EXPECT_EQ(shoal::identify_process(0), std::nullopt);
  EXPECT_EQ(shoal::identify_process(-1), std::nullopt);
  EXPECT_EQ(shoal::identify_process(INT_MAX), std::nullopt) << "beyond any pid_max";
  EXPECT_FALSE(shoal::is_alive({INT_MAX, 1}));
}

TEST(process_identity, a_child_reads_as_dead_once_it_exits_whether_reaped_or_not) {
  pipe_ends go;
  forked_child child([&] {
    ::close(go.write.get());
    char c;
    return ::read(go.read.get(), &c, 1) == 0 ? 0 : 1;  // exits when the parent closes `go`
  });
  go.read.reset();
  const std::optional<process_identity> running = shoal::identify_process(child.pid());
  ASSERT_TRUE(running.has_value());
  EXPECT_TRUE(shoal::is_alive(*running));

  go.write.reset();
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child.pid()), &info, WEXITED | WNOWAIT), 0) << "a zombie now";
  EXPECT_EQ(shoal::identify_process(child.pid()), std::nullopt) << "a zombie is not a running process";
  EXPECT_FALSE(shoal::is_alive(*running));

  EXPECT_EQ(child.wait(), 0);
  EXPECT_EQ(shoal::identify_process(running->pid), std::nullopt);
  EXPECT_FALSE(shoal::is_alive(*running));
}

// A leader that left by pthread_exit() is a zombie in /proc while the
// process runs on in another thread: that process is alive (its memory
// and connections are), until its last thread ends.
TEST(process_identity, a_process_whose_main_thread_exited_lives_while_another_thread_runs) {
  pipe_ends go;
  forked_child child([&]() -> int {
    ::close(go.write.get());
    pthread_t worker;
    const int read_end = go.read.get();
    if (::pthread_create(&worker, nullptr, [](void* fd) -> void* {
          char c;
          std::_Exit(::read(static_cast<int>(reinterpret_cast<std::intptr_t>(fd)), &c, 1) == 0 ? 0 : 1);
        }, reinterpret_cast<void*>(static_cast<std::intptr_t>(read_end))) != 0) {
      return 2;
    }
    ::syscall(SYS_exit, 0);  // this thread alone, as pthread_exit() ends it (which would unwind gtest's frames)
    return 3;
  });
  go.read.reset();
  const std::optional<process_identity> running = shoal::identify_process(child.pid());
  ASSERT_TRUE(running.has_value());
  const std::string stat_path = "/proc/" + std::to_string(child.pid()) + "/stat";
  const auto leader_state = [&] {
    std::string line;
    std::getline(std::ifstream(stat_path), line);
    const std::size_t end = line.rfind(')');
    return end == std::string::npos || end + 2 >= line.size() ? '?' : line[end + 2];
  };
  for (int i = 0; i < 500 && leader_state() != 'Z'; ++i) ::usleep(10'000);
  ASSERT_EQ(leader_state(), 'Z') << "the leader did not exit";
  EXPECT_EQ(shoal::identify_process(child.pid()), running) << "a process with a running thread was taken for dead";
  EXPECT_TRUE(shoal::is_alive(*running));

  go.write.reset();
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child.pid()), &info, WEXITED | WNOWAIT), 0) << "a zombie now";
  EXPECT_FALSE(shoal::is_alive(*running)) << "its last thread ended";
  EXPECT_EQ(child.wait(), 0);
}

// A zombie leader's threads are read from /proc/<pid>/task: a listing that
// fails for want of descriptors is no answer (the process may run on in
// another thread, and its memory must not go), one of a process gone
// meanwhile reads as dead.
TEST(process_identity, a_zombie_leader_whose_threads_cannot_be_listed_is_an_error_not_a_death) {
  pipe_ends go;
  forked_child child([&] {
    ::close(go.write.get());
    char c;
    return ::read(go.read.get(), &c, 1) == 0 ? 0 : 1;
  });
  go.read.reset();
  go.write.reset();
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child.pid()), &info, WEXITED | WNOWAIT), 0) << "a zombie now";
  {
    const refusing_opendir no_descriptors(EMFILE);
    try {
      (void)shoal::identify_process(child.pid());
      ADD_FAILURE() << "a listing that failed for want of descriptors read as an answer";
    } catch (const os_error& e) {
      EXPECT_EQ(e.code(), EMFILE);
    }
    EXPECT_EQ(no_descriptors.refused(), 1);
  }
  {
    const refusing_opendir gone(ENOENT);
    EXPECT_EQ(shoal::identify_process(child.pid()), std::nullopt);
    EXPECT_EQ(gone.refused(), 1);
  }
  EXPECT_EQ(child.wait(), 0);
}

TEST(process_identity, a_command_name_with_spaces_and_parentheses_is_parsed) {
  const char* sleep_program = ::access("/bin/sleep", X_OK) == 0 ? "/bin/sleep" : "/usr/bin/sleep";
  if (::access(sleep_program, X_OK) != 0) GTEST_SKIP() << "no sleep program to run under a strange name";
  // Read from the first ')', this name would give state 'Z' and shifted fields.
  const std::string strange_name = "a) Z 1 2 (b";
  temp_dir dir;
  const std::string link = dir / strange_name;
  ASSERT_EQ(::symlink(sleep_program, link.c_str()), 0) << std::strerror(errno);
  char* const argv[] = {const_cast<char*>(link.c_str()), const_cast<char*>("30"), nullptr};

  pipe_ends go, exec_done;  // exec closes the child's exec_done (close-on-exec)
  forked_child child([&] {
    char c;
    if (::read(go.read.get(), &c, 1) != 1) return 1;
    ::execv(argv[0], argv);
    return 127;
  });
  exec_done.write.reset();
  const std::optional<process_identity> before_exec = shoal::identify_process(child.pid());
  ASSERT_TRUE(before_exec.has_value());
  ASSERT_EQ(::write(go.write.get(), "g", 1), 1);
  char c;
  ASSERT_EQ(::read(exec_done.read.get(), &c, 1), 0) << "the child ran exec";

  std::string comm;
  std::getline(std::ifstream("/proc/" + std::to_string(child.pid()) + "/comm"), comm);
  ASSERT_EQ(comm, strange_name) << "the kernel names the process after the link";
  EXPECT_EQ(shoal::identify_process(child.pid()), before_exec) << "exec keeps the start time";
  EXPECT_TRUE(shoal::is_alive(*before_exec));
}

}  // namespace
}  // namespace shoal::testing
