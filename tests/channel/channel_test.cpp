// The channel: addresses, the private directory rule, credentials on both
// sides, frames, malformed input from a peer, and process identities.
//
// Children are made with fork() and run only async-signal-safe calls
// (socket, connect, read, write, setresuid, execv, _exit), since the test
// binary may have other threads.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support/descriptors.h"
#include "shoal/core/error.h"
#include "shoal/channel/channel.h"
#include "shoal/core/process_identity.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::access_policy;
using channel::channel_address;
using channel::connection;
using channel::listener;
using shoal::process_identity;

constexpr uid_t nobody = 65534;

std::vector<std::byte> bytes_of(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

class temp_dir {
 public:
  temp_dir() {
    char name[] = "/tmp/shoal-channel-XXXXXX";
    EXPECT_NE(::mkdtemp(name), nullptr) << std::strerror(errno);
    path_ = name;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::string operator/(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

channel_address fresh_abstract_name() {
  static std::atomic<int> counter{0};
  return channel_address::abstract("shoal-channel-test-" + std::to_string(::getpid()) + "-" +
                                   std::to_string(counter++));
}

// Built independently of the library, so the tests pin the address format.
struct raw_address {
  sockaddr_un address{};
  socklen_t length = 0;
};

raw_address raw_address_of(const channel_address& where) {
  raw_address out;
  out.address.sun_family = AF_UNIX;
  const std::size_t skip = where.is_abstract() ? 1 : 0;
  std::memcpy(out.address.sun_path + skip, where.name().data(), where.name().size());
  out.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + where.name().size());
  return out;
}

unique_fd raw_connect(const channel_address& where) {
  unique_fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const raw_address target = raw_address_of(where);
  EXPECT_EQ(::connect(s.get(), reinterpret_cast<const sockaddr*>(&target.address), target.length), 0)
      << std::strerror(errno);
  return s;
}

// Writes `bytes` as one sendmsg with `fds` attached (SCM_RIGHTS).
void write_raw(int socket, const std::vector<std::byte>& bytes, const std::vector<int>& fds = {}) {
  iovec part{const_cast<std::byte*>(bytes.data()), bytes.size()};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    header.msg_control = control.data();
    header.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ASSERT_EQ(::sendmsg(socket, &header, MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size())) << std::strerror(errno);
}

struct raw_frame {
  std::uint16_t type = 0;
  std::vector<std::byte> payload;
  std::uint16_t descriptors = 0;  // what the frame says it carries
};

// A batch as the wire layout documents it, built without the library: the
// header, the frames, then zero bytes up to `padded_to`.
std::vector<std::byte> raw_batch(std::string_view magic, std::uint16_t version, const std::vector<raw_frame>& frames,
                                 std::size_t padded_to = 256) {
  std::vector<std::byte> out(12);
  std::memcpy(out.data(), magic.data(), 4);
  const auto count = static_cast<std::uint16_t>(frames.size());
  std::memcpy(out.data() + 4, &version, 2);
  std::memcpy(out.data() + 6, &count, 2);
  for (const raw_frame& f : frames) {
    const auto length = static_cast<std::uint32_t>(f.payload.size());
    std::byte header[8];
    std::memcpy(header, &f.type, 2);
    std::memcpy(header + 2, &f.descriptors, 2);
    std::memcpy(header + 4, &length, 4);
    out.insert(out.end(), header, header + 8);
    out.insert(out.end(), f.payload.begin(), f.payload.end());
  }
  if (out.size() < padded_to) out.resize(padded_to);
  const auto body = static_cast<std::uint32_t>(out.size() - 12);
  std::memcpy(out.data() + 8, &body, 4);
  return out;
}

std::chrono::nanoseconds thread_cpu_time() {
  timespec t{};
  EXPECT_EQ(::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t), 0);
  return std::chrono::seconds(t.tv_sec) + std::chrono::nanoseconds(t.tv_nsec);
}

// True when the other end has closed: a read gives end of stream.
bool reads_end_of_stream(int socket) {
  char c;
  return ::recv(socket, &c, 1, 0) == 0;
}

// A forked child running `body`, whose result becomes the exit status.
// `body` must call only async-signal-safe functions.
class forked_child {
 public:
  template <typename Body>
  explicit forked_child(Body body) {
    pid_ = ::fork();
    if (pid_ == 0) ::_exit(body());
    EXPECT_GT(pid_, 0) << std::strerror(errno);
  }
  forked_child(const forked_child&) = delete;
  forked_child& operator=(const forked_child&) = delete;
  ~forked_child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  [[nodiscard]] pid_t pid() const { return pid_; }
  /// Waits for the child; its exit status, or 128 + the signal that ended it.
  int wait() {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
};

// Child bodies (async-signal-safe). Exit statuses name the step that failed.

int become_nobody() {
  if (::setresgid(nobody, nobody, nobody) != 0 || ::setresuid(nobody, nobody, nobody) != 0) return 2;
  return 0;
}

// Connects and holds the connection until the other side closes it.
int connect_and_hold(const raw_address& target) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (s < 0) return 3;
  if (::connect(s, reinterpret_cast<const sockaddr*>(&target.address), target.length) != 0) return 4;
  char c;
  while (::read(s, &c, 1) > 0) {
  }
  return 0;
}

// Listens, tells the parent through `ready`, accepts one connection and holds
// it until the other side closes it.
int listen_and_hold(const raw_address& local, int ready) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (s < 0) return 3;
  if (::bind(s, reinterpret_cast<const sockaddr*>(&local.address), local.length) != 0) return 5;
  if (::listen(s, 1) != 0) return 6;
  if (::write(ready, "r", 1) != 1) return 7;
  const int accepted = ::accept(s, nullptr, nullptr);
  if (accepted < 0) return 8;
  char c;
  while (::read(accepted, &c, 1) > 0) {
  }
  return 0;
}

struct pipe_ends {
  pipe_ends() {
    int ends[2];
    EXPECT_EQ(::pipe2(ends, O_CLOEXEC), 0);
    read.reset(ends[0]);
    write.reset(ends[1]);
  }
  unique_fd read, write;
};

// process_identity --------------------------------------------------------------

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

// channel_address ---------------------------------------------------------------

TEST(channel_address, refuses_what_cannot_be_a_unix_socket_address) {
  EXPECT_THROW((void)channel_address::at_path("relative/sock"), invalid_argument);
  EXPECT_THROW((void)channel_address::at_path(""), invalid_argument);
  EXPECT_THROW((void)channel_address::at_path("/tmp/dir/"), invalid_argument);
  EXPECT_THROW((void)channel_address::at_path("/" + std::string(107, 'x')), invalid_argument);
  EXPECT_THROW((void)channel_address::at_path(std::string("/tmp/a\0b", 8)), invalid_argument);
  EXPECT_THROW((void)channel_address::abstract(""), invalid_argument);
  EXPECT_THROW((void)channel_address::abstract(std::string(108, 'x')), invalid_argument);
  EXPECT_NO_THROW((void)channel_address::abstract(std::string(107, 'x')));
  EXPECT_NO_THROW((void)channel_address::at_path("/" + std::string(106, 'x')));
  EXPECT_EQ(channel_address::at_path("/run/x/sock").to_string(), "/run/x/sock");
  EXPECT_EQ(channel_address::abstract("name").to_string(), "@name");
}

// connections -------------------------------------------------------------------

void expect_both_sides_see_this_process(const channel_address& address) {
  listener server(address, {});
  connection client = connection::connect(address, {});
  connection accepted = server.accept();
  const process_identity me = process_identity::self();
  for (const connection* side : {&client, &accepted}) {
    EXPECT_EQ(side->peer().process, me);
    EXPECT_EQ(side->peer().uid, ::geteuid());
    EXPECT_EQ(side->peer().gid, ::getegid());
  }
  client.send(1, bytes_of("ping"));
  const channel::frame ping = accepted.receive();
  EXPECT_EQ(ping.type, 1);
  EXPECT_EQ(text_of(ping.payload), "ping");
  accepted.send(2, bytes_of("pong"));
  EXPECT_EQ(text_of(client.receive().payload), "pong");
}

TEST(channel, connects_over_a_path_and_both_sides_see_their_peer) {
  temp_dir dir;
  expect_both_sides_see_this_process(channel_address::at_path(dir / "sock"));
}

TEST(channel, connects_over_an_abstract_name_and_both_sides_see_their_peer) {
  expect_both_sides_see_this_process(fresh_abstract_name());
}

TEST(channel, the_server_sees_a_client_in_another_process) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  listener server(address, {});
  const raw_address target = raw_address_of(address);
  forked_child client([&] { return connect_and_hold(target); });
  {
    const connection accepted = server.accept();
    const std::optional<process_identity> expected = shoal::identify_process(client.pid());
    ASSERT_TRUE(expected.has_value());
    EXPECT_EQ(accepted.peer().process, *expected);
    EXPECT_NE(accepted.peer().process, process_identity::self());
    EXPECT_EQ(accepted.peer().uid, ::geteuid());
  }
  EXPECT_EQ(client.wait(), 0);
}

TEST(channel, the_client_sees_a_server_in_another_process) {
  const auto address = fresh_abstract_name();
  const raw_address local = raw_address_of(address);
  pipe_ends ready;
  forked_child server([&] { return listen_and_hold(local, ready.write.get()); });
  char c;
  ASSERT_EQ(::read(ready.read.get(), &c, 1), 1) << "the child listens";
  {
    const connection client = connection::connect(address, {});
    const std::optional<process_identity> expected = shoal::identify_process(server.pid());
    ASSERT_TRUE(expected.has_value());
    EXPECT_EQ(client.peer().process, *expected);
    EXPECT_EQ(client.peer().uid, ::geteuid());
  }
  EXPECT_EQ(server.wait(), 0);
}

TEST(channel, connecting_where_no_one_listens_is_connection_closed) {
  temp_dir dir;
  EXPECT_THROW((void)connection::connect(channel_address::at_path(dir / "nobody-here"), {}), connection_closed);
  EXPECT_THROW((void)connection::connect(fresh_abstract_name(), {}), connection_closed);
}

TEST(channel, adopt_takes_only_a_connected_unix_stream_socket) {
  socket_pair pair;
  const connection adopted = connection::adopt(std::move(pair.a), {});
  EXPECT_EQ(adopted.peer().process, process_identity::self()) << "a socketpair's creator is the peer of both ends";

  EXPECT_THROW((void)connection::adopt(unique_fd(), {}), invalid_argument);
  EXPECT_THROW((void)connection::adopt(unique_fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)), {}),
               invalid_argument);
  int datagram[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, datagram), 0);
  unique_fd datagram_other(datagram[1]);
  EXPECT_THROW((void)connection::adopt(unique_fd(datagram[0]), {}), invalid_argument);
  EXPECT_THROW((void)connection::adopt(unique_fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)), {}),
               invalid_argument)
      << "not connected";
  pipe_ends not_a_socket;
  EXPECT_THROW((void)connection::adopt(std::move(not_a_socket.read), {}), invalid_argument);
}

TEST(channel, a_frame_carries_its_type_payload_and_descriptor) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {}, 16);
  connection b = connection::adopt(std::move(pair.b), {}, 16);
  pipe_ends pipe;
  a.send(7, bytes_of("hello"), pipe.write.get());
  a.send(0xffff, {});
  a.send(3, std::vector<std::byte>(16, std::byte{0x5a}));

  channel::frame first = b.receive();
  EXPECT_EQ(first.type, 7);
  EXPECT_EQ(text_of(first.payload), "hello");
  ASSERT_TRUE(first.fd.valid());
  ASSERT_EQ(::write(first.fd.get(), "x", 1), 1) << "the received descriptor is the pipe's write end";
  char c = 0;
  ASSERT_EQ(::read(pipe.read.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  const channel::frame empty = b.receive();
  EXPECT_EQ(empty.type, 0xffff);
  EXPECT_TRUE(empty.payload.empty());
  EXPECT_FALSE(empty.fd.valid());
  EXPECT_EQ(b.receive().payload, std::vector<std::byte>(16, std::byte{0x5a})) << "exactly max_payload is allowed";
  EXPECT_FALSE(b.broken());

  EXPECT_THROW(a.send(1, {}, 12345), invalid_argument) << "not an open descriptor";
  EXPECT_FALSE(a.broken()) << "nothing was sent, so the stream is still in step";
}

TEST(channel, a_frame_is_laid_out_as_documented) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  sender.send(0x1234, bytes_of("ab"));
  const auto xyz = bytes_of("xyz");
  const std::vector<channel::outgoing_frame> two = {{7, xyz}, {8, {}}};
  sender.send(two);
  std::vector<std::byte> wire(2 * 256);
  ASSERT_EQ(::recv(pair.b.get(), wire.data(), wire.size(), MSG_WAITALL), static_cast<ssize_t>(wire.size()));
  EXPECT_EQ(std::vector(wire.begin(), wire.begin() + 256), raw_batch("SHOL", 2, {{0x1234, bytes_of("ab")}}));
  EXPECT_EQ(std::vector(wire.begin() + 256, wire.end()), raw_batch("SHOL", 2, {{7, bytes_of("xyz")}, {8, {}}}))
      << "frames sent together share one padded batch";
  EXPECT_EQ(::recv(pair.b.get(), wire.data(), 1, MSG_DONTWAIT), -1) << "nothing else was sent";
}

TEST(channel, frames_sent_together_arrive_in_order_with_their_descriptors) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  // 100 frames, 20 of them with a descriptor: more than one batch may hold.
  std::vector<pipe_ends> pipes(20);
  std::vector<std::vector<std::byte>> payloads;
  for (int i = 0; i < 100; ++i) payloads.push_back(bytes_of("frame " + std::to_string(i)));
  std::vector<channel::outgoing_frame> frames;
  for (int i = 0; i < 100; ++i) {
    frames.push_back({static_cast<std::uint16_t>(i), payloads[i], i % 5 == 0 ? pipes[i / 5].write.get() : -1});
  }
  a.send(frames);
  for (int i = 0; i < 100; ++i) {
    SCOPED_TRACE(i);
    const channel::frame f = b.receive();
    ASSERT_EQ(f.type, i);
    EXPECT_EQ(text_of(f.payload), "frame " + std::to_string(i));
    ASSERT_EQ(f.fd.valid(), i % 5 == 0);
    if (f.fd.valid()) {
      ASSERT_EQ(::write(f.fd.get(), "x", 1), 1);
      char c = 0;
      EXPECT_EQ(::read(pipes[i / 5].read.get(), &c, 1), 1) << "the descriptor is its own frame's pipe";
    }
  }
  EXPECT_EQ(b.pending(), 0U);
}

TEST(channel, frames_past_the_packing_limit_go_in_separate_batches) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  const std::vector<std::byte> big(channel::batch_packing_bytes / 2 + 1, std::byte{7});
  const std::vector<channel::outgoing_frame> two = {{1, big}, {2, big}};
  sender.send(two);
  // Read raw: a batch header, then its frames; each batch here holds one.
  for (std::uint16_t type = 1; type <= 2; ++type) {
    std::vector<std::byte> header(12 + 8);
    ASSERT_EQ(::recv(pair.b.get(), header.data(), header.size(), MSG_WAITALL), static_cast<ssize_t>(header.size()));
    std::uint16_t frames = 0, first_type = 0;
    std::memcpy(&frames, header.data() + 6, 2);
    std::memcpy(&first_type, header.data() + 12, 2);
    EXPECT_EQ(frames, 1) << "two payloads over the packing limit together do not share a batch";
    EXPECT_EQ(first_type, type);
    std::vector<std::byte> rest(big.size());
    ASSERT_EQ(::recv(pair.b.get(), rest.data(), rest.size(), MSG_WAITALL), static_cast<ssize_t>(rest.size()));
  }
}

TEST(channel, frames_with_a_closed_descriptor_are_not_sent_at_all) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  pipe_ends pipe;
  int closed_fd = ::dup(pipe.write.get());
  ::close(closed_fd);
  const auto payload = bytes_of("x");
  const std::vector<channel::outgoing_frame> three = {{1, payload}, {2, payload, pipe.write.get()}, {3, payload, closed_fd}};
  EXPECT_THROW(a.send(three), invalid_argument);
  EXPECT_FALSE(a.broken()) << "nothing was sent, so the stream is still in step";
  pollfd waiting{b.native_handle(), POLLIN, 0};
  EXPECT_EQ(::poll(&waiting, 1, 0), 0) << "not even the frames before the bad one went out";
  a.send(4, payload);
  EXPECT_EQ(b.receive().type, 4);
}

TEST(channel, a_batch_is_read_whole_and_never_past_its_end) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  const auto abc = bytes_of("abc");
  const std::vector<channel::outgoing_frame> three = {{1, std::span(abc).first(1)}, {2, std::span(abc).subspan(1, 1)},
                                                  {3, std::span(abc).subspan(2)}};
  a.send(three);
  a.send(4, bytes_of("next batch"));
  const auto readable = [&] {
    pollfd waiting{b.native_handle(), POLLIN, 0};
    return ::poll(&waiting, 1, 0) == 1;
  };
  EXPECT_EQ(b.receive().type, 1);
  EXPECT_EQ(b.pending(), 2U) << "the batch's other frames came with it";
  EXPECT_TRUE(readable()) << "the next batch is still in the socket";
  EXPECT_EQ(b.receive().type, 2);
  EXPECT_EQ(b.receive().type, 3);
  EXPECT_EQ(b.pending(), 0U);
  EXPECT_EQ(text_of(b.receive().payload), "next batch");
  EXPECT_FALSE(readable()) << "nothing is left once every batch is read";
}

TEST(channel, a_spinning_receive_takes_what_comes_during_the_spin_and_blocks_after_it) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  // Arrives while the receiver still spins (a 2 s spin; sent after 20 ms).
  b.set_receive_spin(2s);
  std::thread early([&] {
    std::this_thread::sleep_for(20ms);
    a.send(1, bytes_of("early"));
  });
  EXPECT_EQ(text_of(b.receive().payload), "early");
  early.join();
  // Arrives long after a 1 ms spin: the receive blocks and still gets it, with
  // its descriptor, and the socket stays a blocking one.
  b.set_receive_spin(1ms);
  pipe_ends pipe;
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    a.send(2, bytes_of("late"), pipe.write.get());
  });
  const auto start = std::chrono::steady_clock::now();
  const std::chrono::nanoseconds cpu_before = thread_cpu_time();
  const channel::frame f = b.receive();
  EXPECT_GE(std::chrono::steady_clock::now() - start, 150ms) << "returned before the frame was sent";
  EXPECT_LT(thread_cpu_time() - cpu_before, 50ms) << "it kept spinning instead of blocking";
  EXPECT_EQ(text_of(f.payload), "late");
  EXPECT_TRUE(f.fd.valid());
  late.join();
  EXPECT_EQ(::fcntl(b.native_handle(), F_GETFL) & O_NONBLOCK, 0);
}

TEST(channel, pending_answers_while_another_thread_waits_in_receive) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  std::thread waiting([&] { EXPECT_EQ(b.receive().type, 5); });
  std::this_thread::sleep_for(50ms);  // the receive is blocked by now
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(b.pending(), 0U);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20ms) << "pending() waited for the blocked receive";
  a.send(5, {});
  waiting.join();
}

TEST(channel, the_largest_max_payload_still_takes_ordinary_frames) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {}, SIZE_MAX);
  connection b = connection::adopt(std::move(pair.b), {}, SIZE_MAX);
  a.send(1, std::vector<std::byte>(100000, std::byte{3}));
  EXPECT_EQ(b.receive().payload.size(), 100000U);
}

TEST(channel, a_peer_that_is_gone_gives_connection_closed_not_sigpipe) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  {
    const connection b = connection::adopt(std::move(pair.b), {});
  }
  EXPECT_THROW(a.send(1, bytes_of("late")), connection_closed);
  EXPECT_TRUE(a.broken());
  EXPECT_THROW((void)a.receive(), connection_closed);
}

TEST(channel, the_peer_closing_is_connection_closed_and_breaks_the_connection) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  pair.b.reset();
  EXPECT_THROW((void)a.receive(), connection_closed);
  EXPECT_TRUE(a.broken());
  EXPECT_THROW(a.send(1, {}), connection_closed);
}

TEST(channel, accept_for_returns_nothing_when_no_one_connects) {
  listener server(fresh_abstract_name(), {});
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(server.accept_for(30ms).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - start, 30ms);
  EXPECT_FALSE(server.accept_for(0ms).has_value());
  const connection client = connection::connect(server.address(), {});
  EXPECT_TRUE(server.accept_for(1s).has_value());
}

TEST(channel, frames_sent_from_many_threads_arrive_whole) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {});
  constexpr std::uint16_t threads = 4;
  constexpr std::uint32_t frames_each = 300;
  const auto payload_size = [](std::uint32_t i) { return std::size_t{4} + (i * 37) % 3000; };
  const auto fill = [](std::uint16_t t, std::uint32_t i) { return static_cast<std::byte>(t * 16 + i % 16); };
  std::vector<std::thread> senders;
  for (std::uint16_t t = 0; t < threads; ++t) {
    senders.emplace_back([&, t] {
      try {
        for (std::uint32_t i = 0; i < frames_each; ++i) {
          std::vector<std::byte> payload(payload_size(i), fill(t, i));
          std::memcpy(payload.data(), &i, 4);
          sender.send(t, payload);
        }
      } catch (const connection_closed&) {  // the receiver gave up; it reports why
      }
    });
  }
  const auto receive_all = [&]() -> ::testing::AssertionResult {
    std::vector<std::uint32_t> next(threads, 0);
    for (std::uint32_t n = 0; n < threads * frames_each; ++n) {
      const channel::frame f = receiver.receive();
      if (f.type >= threads || f.payload.size() < 4) return ::testing::AssertionFailure() << "a foreign frame";
      std::uint32_t i;
      std::memcpy(&i, f.payload.data(), 4);
      if (i != next[f.type]++) return ::testing::AssertionFailure() << "thread " << f.type << "'s frames out of order";
      if (f.payload.size() != payload_size(i)) return ::testing::AssertionFailure() << "a frame of the wrong size";
      for (std::size_t k = 4; k < f.payload.size(); ++k) {
        if (f.payload[k] != fill(f.type, i)) return ::testing::AssertionFailure() << "frames interleaved";
      }
    }
    return ::testing::AssertionSuccess();
  };
  const ::testing::AssertionResult received = receive_all();
  if (!received) ::shutdown(receiver.native_handle(), SHUT_RDWR);  // unblock the senders
  for (auto& s : senders) s.join();
  EXPECT_TRUE(received);
}

// the private directory and the socket file ------------------------------------

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

TEST(listener_directory, a_directory_of_another_user_is_refused) {
  if (::geteuid() != 0) GTEST_SKIP() << "making a directory owned by another user needs root";
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
  EXPECT_THROW((void)listener(channel_address::at_path(dir / "missing/deeper/sock"), {}), invalid_argument);
}

TEST(listener_file, a_stale_socket_file_is_replaced) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  {  // a listener that died without removing its file
    const unique_fd dead(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    const raw_address local = raw_address_of(address);
    ASSERT_EQ(::bind(dead.get(), reinterpret_cast<const sockaddr*>(&local.address), local.length), 0);
    ASSERT_EQ(::listen(dead.get(), 1), 0);
  }
  ASSERT_EQ(::access((dir / "sock").c_str(), F_OK), 0) << "the stale file is there";
  listener server(address, {});
  const connection client = connection::connect(address, {});
  EXPECT_EQ(server.accept().peer().process, process_identity::self());
}

TEST(listener_file, an_address_in_use_is_refused_and_its_listener_keeps_working) {
  temp_dir dir;
  for (const auto& address : {channel_address::at_path(dir / "sock"), fresh_abstract_name()}) {
    SCOPED_TRACE(address.to_string());
    listener first(address, {});
    try {
      const listener second(address, {});
      ADD_FAILURE() << "a second listener took the address";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("already in use"), std::string::npos) << e.what();
    }
    if (!address.is_abstract()) {
      // The path's check connected once: the first listener sees that probe close at once.
      connection probe = first.accept();
      EXPECT_THROW((void)probe.receive(), connection_closed);
    }
    connection client = connection::connect(address, {});
    connection accepted = first.accept();
    client.send(1, bytes_of("still here"));
    EXPECT_EQ(text_of(accepted.receive().payload), "still here");
  }
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

// malformed input from a peer ---------------------------------------------------

struct malformed_case {
  const char* name;
  std::vector<std::byte> bytes;
  int extra_descriptors;  // attached with the bytes
  const char* said;       // part of the protocol_error's message
};

TEST(channel_protocol, malformed_frames_close_only_their_connection) {
  constexpr std::size_t max_payload = 64;
  std::vector<std::byte> over_body = raw_batch("SHOL", 2, {{1, {}}});
  const std::uint32_t huge_body = 1u << 30;
  std::memcpy(over_body.data() + 8, &huge_body, 4);
  const raw_frame full{1, std::vector<std::byte>(max_payload)};
  std::vector<std::byte> runs_past = raw_batch("SHOL", 2, {full, full, full, full});
  const std::uint16_t one_more_than_sent = 5;
  std::memcpy(runs_past.data() + 6, &one_more_than_sent, 2);
  // Version 1 sent each frame alone: length u32, "SHOL", version u16, type u16, payload.
  std::vector<std::byte> version_1_frame = bytes_of("....SHOL....x");
  const std::uint32_t v1_length = 9;
  const std::uint16_t v1_version = 1, v1_type = 3;
  std::memcpy(version_1_frame.data(), &v1_length, 4);
  std::memcpy(version_1_frame.data() + 8, &v1_version, 2);
  std::memcpy(version_1_frame.data() + 10, &v1_type, 2);
  std::vector<std::byte> dirty_padding = raw_batch("SHOL", 2, {{1, bytes_of("x")}});
  dirty_padding.back() = std::byte{1};
  const std::vector<malformed_case> cases = {
      {"wrong magic", raw_batch("SHOX", 2, {{1, bytes_of("x")}}), 0, "not the magic \"SHOL\""},
      {"wrong version", raw_batch("SHOL", 1, {{1, bytes_of("x")}}), 0, "frame version 1; this build speaks version 2"},
      {"a version-1 frame", version_1_frame, 0, "frame version 1; this build speaks version 2"},
      {"shorter than the minimum", raw_batch("SHOL", 2, {{1, bytes_of("x")}}, 0), 0, "shorter than the 256-byte minimum"},
      {"no frames", raw_batch("SHOL", 2, {}), 0, "a batch of 0 frames"},
      {"a body over the limit", over_body, 0, "over the"},
      {"a frame over the payload limit", raw_batch("SHOL", 2, {{1, std::vector<std::byte>(max_payload + 1)}}), 0,
       "over the 64-byte limit"},
      {"a frame past the batch's end", runs_past, 0, "runs past the end of its batch"},
      {"padding that is not zero", dirty_padding, 0, "not all zero bytes"},
      {"a frame that claims two descriptors", raw_batch("SHOL", 2, {{1, {}, 2}}), 2, "a frame carries at most one"},
      {"more descriptors than claimed", raw_batch("SHOL", 2, {{1, {}, 1}}), 2, "came with 2 descriptors and its frames claim 1"},
      {"fewer descriptors than claimed", raw_batch("SHOL", 2, {{1, {}, 1}, {2, {}, 1}}), 1, "claim more descriptors than"},
      {"more descriptors than a batch holds", raw_batch("SHOL", 2, {{1, {}}}), 17, "more than 16 descriptors"},
  };

  const auto address = fresh_abstract_name();
  listener server(address, {}, max_payload);
  connection good_client = connection::connect(address, {});
  connection good_server = server.accept();
  pipe_ends pipe;
  const std::size_t descriptors_before = open_descriptor_count();

  for (const malformed_case& c : cases) {
    SCOPED_TRACE(c.name);
    {
      const unique_fd bad_client = raw_connect(address);
      connection bad_server = server.accept();
      write_raw(bad_client.get(), c.bytes, std::vector<int>(c.extra_descriptors, pipe.write.get()));
      try {
        (void)bad_server.receive();
        ADD_FAILURE() << "a malformed frame was accepted";
      } catch (const protocol_error& e) {
        EXPECT_NE(std::string(e.what()).find(c.said), std::string::npos) << e.what();
      }
      EXPECT_TRUE(bad_server.broken());
      EXPECT_THROW((void)bad_server.receive(), connection_closed) << "no reading past garbage";
      EXPECT_THROW(bad_server.send(1, {}), connection_closed);
      EXPECT_TRUE(reads_end_of_stream(bad_client.get())) << "the peer sees its connection closed";
    }
    good_client.send(9, bytes_of(c.name));
    EXPECT_EQ(text_of(good_server.receive().payload), c.name) << "another connection is unharmed";
  }
  EXPECT_EQ(open_descriptor_count(), descriptors_before) << "received descriptors were closed";
  const connection later = connection::connect(address, {});
  EXPECT_TRUE(server.accept_for(1s).has_value()) << "the listener still accepts";
}

TEST(channel_protocol, more_descriptors_than_a_batch_carries_are_refused_over_several_writes) {
  socket_pair pair;
  connection victim = connection::adopt(std::move(pair.b), {});
  pipe_ends pipe;
  const std::size_t descriptors_before = open_descriptor_count();
  // A batch that says it is 4 KiB long, written in pieces of one byte each
  // with 16 descriptors: together more than one batch may carry.
  const auto batch = raw_batch("SHOL", 2, {{1, std::vector<std::byte>(4000)}});
  for (std::size_t i = 0; i < 12; ++i) write_raw(pair.a.get(), {batch[i]}, std::vector<int>(16, pipe.write.get()));
  pair.a.reset();  // end of stream after that: a receiver that took them all would find the batch cut short
  try {
    (void)victim.receive();
    ADD_FAILURE() << "the batch was accepted";
  } catch (const protocol_error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 16 descriptors"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(victim.broken());
  EXPECT_EQ(open_descriptor_count(), descriptors_before - 1) << "every descriptor that came was closed (and the writer's end)";
}

// Random and mutated byte strings, written raw with stray descriptors, give
// frames, protocol_error or connection_closed, and nothing else: no crash, no
// hang, no leaked descriptor.
TEST(channel_protocol, fuzzed_input_is_refused_cleanly) {
  constexpr int rounds = 3000;
  constexpr std::size_t max_payload = 64;
  std::mt19937 random(20240611);
  const auto below = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(random); };
  const auto random_bytes = [&](std::size_t n) {
    std::vector<std::byte> out(n);
    for (auto& b : out) b = static_cast<std::byte>(below(256));
    return out;
  };
  const unique_fd stray(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(stray.valid());
  const std::size_t descriptors_before = open_descriptor_count();
  int frames = 0, refused = 0, closed = 0;

  for (int round = 0; round < rounds; ++round) {
    std::vector<std::byte> input;
    if (below(4) == 0) {
      input = random_bytes(below(80));
    } else {
      for (std::size_t n = 1 + below(3); n > 0; --n) {
        std::vector<raw_frame> frames(1 + below(3));
        for (raw_frame& f : frames) {
          f = {static_cast<std::uint16_t>(below(65536)), random_bytes(below(80)), static_cast<std::uint16_t>(below(3) == 0)};
        }
        const auto batch = raw_batch("SHOL", 2, frames);
        input.insert(input.end(), batch.begin(), batch.end());
      }
      for (std::size_t flips = below(4); flips > 0; --flips) {
        input[below(input.size())] = static_cast<std::byte>(below(256));
      }
      if (below(4) == 0) input.resize(below(input.size() + 1));
    }
    socket_pair pair;
    connection victim = connection::adopt(std::move(pair.b), {}, max_payload);
    // Write in up to three pieces, each perhaps with stray descriptors.
    std::size_t done = 0;
    while (done < input.size()) {
      const std::size_t piece = std::min(input.size() - done, 1 + below(input.size()));
      const auto from = input.begin() + static_cast<std::ptrdiff_t>(done);
      write_raw(pair.a.get(), {from, from + static_cast<std::ptrdiff_t>(piece)},
                std::vector<int>(below(6) == 0 ? 1 + below(3) : 0, stray.get()));
      done += piece;
    }
    pair.a.reset();
    for (;;) {
      try {
        (void)victim.receive();
        ++frames;
      } catch (const protocol_error&) {
        ++refused;
        break;
      } catch (const connection_closed&) {
        ++closed;
        break;
      }
    }
    ASSERT_TRUE(victim.broken());
  }
  EXPECT_EQ(open_descriptor_count(), descriptors_before);
  EXPECT_GT(frames, 0) << "some inputs held valid frames";
  EXPECT_GT(refused, 0);
  EXPECT_GT(closed, 0);
}

// peers of another uid (root only) --------------------------------------------

constexpr const char* needs_root = "running a peer as uid 65534 (nobody) needs root";

TEST(channel_uid, a_client_of_another_uid_is_refused_and_the_listener_keeps_working) {
  if (::geteuid() != 0) GTEST_SKIP() << needs_root;
  const auto address = fresh_abstract_name();
  listener server(address, {});
  const raw_address target = raw_address_of(address);
  forked_child intruder([&] {
    const int switched = become_nobody();
    return switched != 0 ? switched : connect_and_hold(target);
  });
  try {
    (void)server.accept();
    ADD_FAILURE() << "uid 65534 was accepted";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("uid 65534"), std::string::npos) << e.what();
  }
  EXPECT_EQ(intruder.wait(), 0) << "the intruder connected, then saw its socket closed";

  connection client = connection::connect(address, {});
  connection accepted = server.accept();
  client.send(1, bytes_of("allowed"));
  EXPECT_EQ(text_of(accepted.receive().payload), "allowed");
}

TEST(channel_uid, a_client_of_an_allowed_uid_is_accepted) {
  if (::geteuid() != 0) GTEST_SKIP() << needs_root;
  const auto address = fresh_abstract_name();
  listener server(address, access_policy{{nobody}});
  const raw_address target = raw_address_of(address);
  forked_child guest([&] {
    const int switched = become_nobody();
    return switched != 0 ? switched : connect_and_hold(target);
  });
  {
    const connection accepted = server.accept();
    EXPECT_EQ(accepted.peer().uid, nobody);
    EXPECT_EQ(accepted.peer().gid, nobody);
    EXPECT_EQ(accepted.peer().process.pid, guest.pid());
  }
  EXPECT_EQ(guest.wait(), 0);
}

TEST(channel_uid, a_server_of_another_uid_is_refused) {
  if (::geteuid() != 0) GTEST_SKIP() << needs_root;
  const auto address = fresh_abstract_name();
  const raw_address local = raw_address_of(address);
  pipe_ends ready;
  forked_child impostor([&] {
    const int switched = become_nobody();
    return switched != 0 ? switched : listen_and_hold(local, ready.write.get());
  });
  char c;
  ASSERT_EQ(::read(ready.read.get(), &c, 1), 1) << "the impostor listens";
  EXPECT_THROW((void)connection::connect(address, {}), peer_refused);
  EXPECT_EQ(impostor.wait(), 0) << "the impostor saw the refused connection closed";
}

TEST(channel_uid, a_path_in_a_0700_directory_keeps_other_users_out) {
  if (::geteuid() != 0) GTEST_SKIP() << needs_root;
  temp_dir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0711), 0) << "so that only the 0700 directory stands in the way";
  const auto address = channel_address::at_path(dir / "private/sock");
  listener server(address, access_policy{{nobody}});
  const raw_address target = raw_address_of(address);
  forked_child outsider([&] {
    const int switched = become_nobody();
    if (switched != 0) return switched;
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (::connect(s, reinterpret_cast<const sockaddr*>(&target.address), target.length) == 0) return 9;
    return errno == EACCES ? 0 : 10;
  });
  EXPECT_EQ(outsider.wait(), 0) << "the filesystem refused the connection (EACCES)";
  EXPECT_FALSE(server.accept_for(0ms).has_value());
}

}  // namespace
}  // namespace shoal::testing
