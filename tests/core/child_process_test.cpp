// child_process: a helper process that gets its end of a socketpair as
// descriptor 3, whose exit status wait() reports, and that never outlives its
// object as a zombie.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "shoal/core/child_process.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

// A shell runs each child's script; every Linux CI image has one here.
constexpr const char* shell = "/bin/sh";

// Everything the child writes on its socket, until it closes its end.
std::string read_until_end(int socket) {
  std::string out;
  char buffer[256];
  for (;;) {
    const ssize_t n = ::recv(socket, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buffer, static_cast<std::size_t>(n));
  }
}

TEST(child_process, a_child_never_outlives_its_object_as_a_zombie) {
  pid_t pid;
  {
    child_process sleeper("/bin/sleep", {"30"});
    pid = sleeper.pid();
    ASSERT_GT(pid, 0);
  }  // destroyed while the child still runs: killed and reaped
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
}

TEST(child_process, the_child_gets_its_end_of_the_socket_as_descriptor_3) {
  static_assert(child_process::child_socket_fd == 3);
  child_process child(shell, {"-c", "printf 'over fd 3' >&3"});
  EXPECT_EQ(read_until_end(child.socket()), "over fd 3");
  EXPECT_EQ(child.wait(), 0);
}

TEST(child_process, wait_closes_the_parents_end_so_a_reading_child_sees_end_of_stream) {
  // The child reads its socket to the end, then exits 5: wait() returns
  // only if the parent's end closed and the child held no copy of it.
  child_process child(shell, {"-c", "cat <&3 >/dev/null; exit 5"});
  EXPECT_EQ(child.wait(), 5);
}

TEST(child_process, wait_reports_the_exit_status_or_128_plus_the_signal) {
  child_process exits(shell, {"-c", "exit 7"});
  EXPECT_EQ(exits.wait(), 7);
  child_process killed(shell, {"-c", "kill -TERM $$"});
  EXPECT_EQ(killed.wait(), 128 + SIGTERM);
}

TEST(child_process, waiting_twice_is_invalid_argument) {
  child_process child(shell, {"-c", "exit 0"});
  EXPECT_EQ(child.wait(), 0);
  EXPECT_THROW((void)child.wait(), invalid_argument);
}

TEST(child_process, a_program_that_cannot_start_is_backend_error) {
  try {
    child_process missing("/nonexistent/shoal-no-such-program", {});
    ADD_FAILURE() << "a missing program was started as pid " << missing.pid();
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/shoal-no-such-program"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shoal::testing
