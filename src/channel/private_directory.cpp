#include "channel/private_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <memory>
#include <utility>

#include "core/fork_released_sockets.h"
#include "shoal/channel/listener_test_hook.h"
#include "shoal/core/error.h"

namespace shoal::channel {

namespace {

std::function<void(const std::string&)>& after_directory_check() {
  static std::function<void(const std::string&)> hook;
  return hook;
}

std::chrono::milliseconds& configured_start_lock_wait() noexcept {
  static std::chrono::milliseconds wait{2'000};
  return wait;
}

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "0%03o", static_cast<unsigned>(mode & 07777));
  return text;
}

}  // namespace

void test_hook::set_after_directory_check(std::function<void(const std::string& directory)> hook) {
  after_directory_check() = std::move(hook);
}

void test_hook::set_start_lock_wait(std::chrono::milliseconds wait) { configured_start_lock_wait() = wait; }

namespace detail {

// A socket file must lie in a directory that only its owner can enter, so no
// other user can reach it, replace it or race its creation.
private_directory::private_directory(std::string path) : path_(std::move(path)) {
  if (::mkdir(path_.c_str(), 0700) == 0) {
    created_ = true;
  } else if (errno == ENOENT) {
    throw os_error{ENOENT, "listener",
                   "cannot create the directory " + path_ +
                       " because its parent does not exist; create the parent first or choose another path"};
  } else if (errno != EEXIST) {
    throw os_error{errno, "mkdir(" + path_ + ")"};
  }
  // From here on only the descriptor: whatever the path names later, the
  // directory checked is the one bound in.
  fd_.reset(::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd_) {
    if (errno == ELOOP || errno == ENOTDIR) {
      throw invalid_argument("listener: " + path_ +
                             " is not a directory (a symbolic link is refused too); a channel's socket must lie in a "
                             "real directory of its own user with mode 0700");
    }
    throw os_error{errno, "open(" + path_ + ")"};
  }
  struct stat st{};
  if (::fstat(fd_.get(), &st) != 0) throw os_error{errno, "fstat(" + path_ + ")"};
  if (st.st_uid != ::geteuid()) {
    throw invalid_argument("listener: the directory " + path_ + " belongs to uid " + std::to_string(st.st_uid) +
                           ", not to this process's uid " + std::to_string(::geteuid()) +
                           "; a channel's socket must lie in a directory of its own user: choose another path");
  }
  if (created_ && (st.st_mode & 07777) != 0700) {
    // The umask may have taken bits away; the owner needs all three.
    if (::fchmod(fd_.get(), 0700) != 0) throw os_error{errno, "fchmod(" + path_ + ")"};
    st.st_mode = (st.st_mode & ~07777) | 0700;
  }
  if ((st.st_mode & 077) != 0) {
    const std::string own_directory = (path_ == "/" ? std::string() : path_) + "/<name>/<socket>";
    // A sticky directory (/tmp, /dev/shm) or the root is shared by design:
    // changing its mode would break the machine, so only a directory of the
    // socket's own is suggested there.
    const bool shared_by_design = (st.st_mode & S_ISVTX) != 0 || path_ == "/";
    throw invalid_argument("listener: the directory " + path_ + " has mode " + octal_mode(st.st_mode) +
                           ", which lets its group or others in; a channel's directory must have mode 0700: "
                           "give the socket a directory of its own (a path like " + own_directory +
                           " creates <name> with mode 0700)" +
                           (shared_by_design ? ", or use the runtime directory's address (channel_address::in_runtime_dir, Python's "
                                                   "shoal.runtime_dir_address); " + path_ +
                                                   " is shared by design, leave its mode alone"
                                             : ", or run chmod 700 " + path_ + " if only your user uses it"));
  }
  if (after_directory_check()) after_directory_check()(path_);
}

private_directory::~private_directory() {
  if (!created_) return;
  struct stat here{}, opened{};
  if (::lstat(path_.c_str(), &here) == 0 && ::fstat(fd_.get(), &opened) == 0 && here.st_dev == opened.st_dev &&
      here.st_ino == opened.st_ino) {
    ::rmdir(path_.c_str());  // fails, and keeps it, when something else was put there
  }
}

socket_address private_directory::address_of(const std::string& name) const {
  const std::string through = "/proc/self/fd/" + std::to_string(fd_.get()) + "/" + name;
  socket_address out;
  out.address.sun_family = AF_UNIX;
  if (through.size() >= sizeof out.address.sun_path) {
    throw invalid_argument("listener: the socket file's name \"" + name + "\" is too long to bind through its "
                           "directory's descriptor (" + through + " has " + std::to_string(through.size()) +
                           " bytes; a UNIX socket address holds at most " +
                           std::to_string(sizeof out.address.sun_path - 1) + "): choose a shorter name");
  }
  std::memcpy(out.address.sun_path, through.data(), through.size());
  out.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + through.size());
  return out;
}

std::optional<struct stat> private_directory::entry(const std::string& name) const {
  struct stat st{};
  if (::fstatat(fd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return st;
  if (errno == ENOENT) return std::nullopt;
  throw os_error{errno, "fstatat(" + path_ + "/" + name + ")"};
}

void private_directory::remove(const std::string& name) const {
  if (::unlinkat(fd_.get(), name.c_str(), 0) != 0 && errno != ENOENT) {
    throw os_error{errno, "unlinkat(" + path_ + "/" + name + ")"};
  }
}

bool private_directory::someone_listens(const std::string& name) const {
  const std::optional<struct stat> st = entry(name);
  if (!st) return false;
  if (!S_ISSOCK(st->st_mode)) {
    throw invalid_argument("listener: " + path_ + "/" + name +
                           " exists and is not a socket; remove it or choose another path");
  }
  // Asked with a datagram socket, which connects to no stream listener: the
  // kernel refuses it for its type (EPROTOTYPE) when a socket is bound to
  // the file, and as at a dead one's file (ECONNREFUSED) when none is. A
  // stream probe would be a connection the live listener's accept() hands
  // out as a peer while the probing process runs (a server that accepts one
  // client would serve the probe). Registered for fork() children as every
  // socket is.
  unique_fd probe;
  const shoal::detail::fork_released_socket while_probing([&] {
    probe.reset(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    return probe.get();
  });
  if (!probe) throw os_error{errno, "socket(AF_UNIX)"};
  const socket_address target = address_of(name);
  if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&target.address), target.length) == 0) {
    return true;  // a datagram socket is bound there: in use all the same
  }
  // A stream socket is bound there, listening or about to (EPROTOTYPE); or a
  // datagram socket connected to another (EPERM): in use either way.
  if (errno == EPROTOTYPE || errno == EPERM) return true;
  if (errno != ECONNREFUSED) throw os_error{errno, "connect(" + path_ + "/" + name + ")"};
  // Linux refuses a datagram as at a dead file only where no socket is
  // bound; a system that answers so for a stream socket too (gVisor) is
  // asked once more with a stream connect, which Linux refuses there as well
  // (no connection made), and which elsewhere a live listener accepts and
  // drops once this process ended.
  unique_fd stream_probe;
  const shoal::detail::fork_released_socket while_asking_again([&] {
    stream_probe.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    return stream_probe.get();
  });
  if (!stream_probe) throw os_error{errno, "socket(AF_UNIX)"};
  if (::connect(stream_probe.get(), reinterpret_cast<const sockaddr*>(&target.address), target.length) == 0) {
    return true;
  }
  if (errno == EAGAIN) return true;  // a listener whose backlog is full
  if (errno == ECONNREFUSED) return false;
  throw os_error{errno, "connect(" + path_ + "/" + name + ")"};
}

std::vector<std::string> private_directory::names() const {
  // A directory stream of its own (readdir moves the descriptor's offset).
  const int copy = ::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (copy < 0) throw os_error{errno, "openat(" + path_ + ")"};
  const std::unique_ptr<DIR, int (*)(DIR*)> stream(::fdopendir(copy), ::closedir);
  if (!stream) {
    ::close(copy);
    throw os_error{errno, "fdopendir(" + path_ + ")"};
  }
  std::vector<std::string> out;
  while (const dirent* e = ::readdir(stream.get())) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  return out;
}

std::chrono::milliseconds start_lock_wait() noexcept { return configured_start_lock_wait(); }

start_lock::start_lock(const private_directory& directory, const std::string& name)
    : directory_(directory), file_name_("." + name + ".lock") {
  const auto until = std::chrono::steady_clock::now() + start_lock_wait();
  while (!lock_the_file_named(until)) {
  }
}

bool start_lock::lock_the_file_named(std::chrono::steady_clock::time_point until) {
  // Registered as a socket is (any descriptor works): a fork() child's copy
  // is replaced, so a child that lives on never keeps the lock held.
  released_in_children_ = std::make_unique<shoal::detail::fork_released_socket>([&] {
    file_.reset(::openat(directory_.fd_.get(), file_name_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
    return file_.get();
  });
  const std::string path = directory_.path_ + "/" + file_name_;
  if (!file_) throw os_error{errno, "openat(" + path + ")"};
  // Polled, not waited for in flock(): a wait there has no deadline.
  auto pause = std::chrono::microseconds(50);
  while (::flock(file_.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) throw os_error{errno, "flock(" + path + ")"};
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) {
      throw timeout_error("flock(" + path + "): another process held the lock past " +
                          std::to_string(start_lock_wait().count()) +
                          " ms (a listener stopped between its bind and its listen?)");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, until - now));
    pause = std::min(pause * 2, std::chrono::microseconds(10'000));
  }
  struct stat locked{};
  if (::fstat(file_.get(), &locked) != 0) throw os_error{errno, "fstat(" + path + ")"};
  const std::optional<struct stat> named = directory_.entry(file_name_);
  return named && named->st_dev == locked.st_dev && named->st_ino == locked.st_ino;
}

start_lock::~start_lock() {
  // Removed before it is unlocked (closed): one who locks it later sees it gone.
  ::unlinkat(directory_.fd_.get(), file_name_.c_str(), 0);
}

}  // namespace detail
}  // namespace shoal::channel
