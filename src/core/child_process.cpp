#include "shoal/core/child_process.h"

#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include "shoal/core/error.h"

extern char** environ;  // NOLINT: POSIX declares it nowhere else

namespace shoal {

child_process::child_process(const std::string& program, const std::vector<std::string>& arguments) {
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) throw os_error{errno, "socketpair"};
  socket_.reset(ends[0]);
  unique_fd child_end(ends[1]);

  std::vector<std::string> argv_strings{program};
  argv_strings.insert(argv_strings.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (auto& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  // dup2 onto fd 3 clears close-on-exec for the child's copy only.
  posix_spawn_file_actions_adddup2(&actions, child_end.get(), child_socket_fd);
  const int rc = ::posix_spawn(&pid_, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    pid_ = -1;
    throw os_error{rc, "posix_spawn(" + program + ")"};
  }
}

child_process::~child_process() {
  if (pid_ > 0) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
  }
}

int child_process::wait() {
  if (pid_ <= 0) throw invalid_argument("child_process::wait: the child was already waited for");
  socket_.reset();  // a child reading its socket sees end of stream
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, 0);
  } while (r < 0 && errno == EINTR);
  if (r < 0) throw os_error{errno, "waitpid"};
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace shoal
