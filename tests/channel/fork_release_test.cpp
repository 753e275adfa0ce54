// A fork() child lets go of the sockets it inherited at once (each becomes a
// socket whose peer is gone, under the same number): a peer sees the parent's end close when
// the parent closes it, and an abstract name is free once the parent closes
// its listener, while the child lives on; the child's drop of an inherited
// connection closes the placeholder, never a descriptor it opened since, and
// its reads of one find it closed. A socket is registered before any fork
// can copy it, and a registration that outlived its socket leaves the file
// that took the number alone.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <thread>

#include "channel_fixtures.h"
#include "core/fork_released_sockets.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;
using channel::listener;

// A child that lives until the parent closes the pipe's write end; made
// once the child runs (its fork handlers have run by then).
class lingering_child {
 public:
  lingering_child() {
    int ready[2];
    EXPECT_EQ(::pipe2(ready, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(hold_, O_CLOEXEC), 0);
    child_.emplace([&] {
      ::close(hold_[1]);
      ::close(ready[0]);
      if (::write(ready[1], "r", 1) != 1) return 2;
      char c;
      return ::read(hold_[0], &c, 1) == 0 ? 0 : 1;
    });
    ::close(hold_[0]);
    ::close(ready[1]);
    char c;
    EXPECT_EQ(::read(ready[0], &c, 1), 1) << "the child did not start";
    ::close(ready[0]);
  }
  ~lingering_child() {
    if (hold_[1] >= 0) ::close(hold_[1]);
  }
  lingering_child(const lingering_child&) = delete;
  lingering_child& operator=(const lingering_child&) = delete;
  std::optional<int> let_go() {
    ::close(std::exchange(hold_[1], -1));
    return child_->wait_for(10s);
  }

 private:
  int hold_[2] = {-1, -1};
  std::optional<forked_child> child_;
};

TEST(fork_release, a_peer_sees_the_parents_end_close_while_a_forked_child_lives) {
  const auto where = fresh_abstract_name();
  listener server(where, {});
  connection client = connection::connect(where, {}, connection::default_max_payload, 2s);
  auto accepted = std::make_unique<connection>(server.accept());
  lingering_child child;
  accepted.reset();
  EXPECT_THROW((void)client.receive_for(2s), connection_closed)
      << "the child's inherited descriptor kept the parent's end open";
  EXPECT_EQ(child.let_go(), std::optional<int>(0));
}

TEST(fork_release, an_abstract_name_is_free_once_the_parent_closes_its_listener_while_a_forked_child_lives) {
  const auto where = fresh_abstract_name();
  auto server = std::make_unique<listener>(where, channel::access_policy{});
  lingering_child child;
  server.reset();
  EXPECT_NO_THROW(listener again(where, {})) << "the child's inherited descriptor kept the name bound";
  EXPECT_EQ(child.let_go(), std::optional<int>(0));
}

TEST(fork_release, a_childs_drop_of_an_inherited_connection_closes_no_descriptor_it_opened) {
  const auto where = fresh_abstract_name();
  listener server(where, {});
  connection client = connection::connect(where, {}, connection::default_max_payload, 2s);
  auto accepted = std::make_unique<connection>(server.accept());
  const int inherited = accepted->native_handle();
  forked_child child([&] {
    // Descriptors the child opens fill the lowest free numbers: past the
    // inherited one's, that number was free or it is still taken.
    int mine[1024];
    int opened = 0;
    while (opened < 1024) {
      mine[opened] = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (mine[opened] < 0) return 1;
      if (mine[opened++] > inherited) break;
    }
    accepted.reset();
    for (int i = 0; i < opened; ++i) {
      if (::fcntl(mine[i], F_GETFD) < 0) return 2;
    }
    return 0;
  });
  EXPECT_EQ(child.wait_for(10s), std::optional<int>(0)) << "2: the drop closed the child's own pipe";
  accepted->send(1, bytes_of("still here"));
  EXPECT_EQ(text_of(client.receive_for(2s).payload), "still here") << "the parent's end works as before";
}

// An adopted socketpair end waits for the other end's greeting, for seconds
// perhaps: a child forked by another thread meanwhile lets go of it too.
TEST(fork_release, a_socket_waiting_for_its_greeting_is_let_go_of_in_a_child_forked_meanwhile) {
  socket_pair pair;
  std::thread adopting([end = std::move(pair.a)]() mutable {
    EXPECT_THROW((void)connection::adopt_pair_end(std::move(end), {}, connection::default_max_payload, 600ms),
                 timeout_error);
  });
  std::this_thread::sleep_for(200ms);  // the greeting's wait has begun
  lingering_child child;
  adopting.join();  // the wait ran out: the parent closed its end
  // The other end reads the greeting, then end of stream, while the child lives.
  const auto until = std::chrono::steady_clock::now() + 3s;
  bool ended = false;
  while (!ended && std::chrono::steady_clock::now() < until) {
    pollfd ready{pair.b.get(), POLLIN, 0};
    if (::poll(&ready, 1, 100) != 1) continue;
    char bytes[256];
    ended = ::read(pair.b.get(), bytes, sizeof bytes) == 0;
  }
  EXPECT_TRUE(ended) << "the child kept the adopted end open";
  EXPECT_EQ(child.let_go(), std::optional<int>(0));
}

// What the child holds in the socket's place reads as a closed peer: end of
// stream, and POLLHUP for a poll loop (not readable for ever).
TEST(fork_release, a_childs_read_of_an_inherited_connection_finds_it_closed) {
  const auto where = fresh_abstract_name();
  listener server(where, {});
  connection client = connection::connect(where, {}, connection::default_max_payload, 2s);
  connection accepted = server.accept();
  forked_child child([&] {
    pollfd ready{client.native_handle(), POLLIN, 0};
    if (::poll(&ready, 1, 0) != 1 || (ready.revents & POLLHUP) == 0) return 1;
    try {
      (void)client.receive_for(0ms);
      return 2;
    } catch (const connection_closed&) {
      return 0;
    } catch (...) {
      return 3;
    }
  });
  EXPECT_EQ(child.wait_for(10s), std::optional<int>(0))
      << "1: poll saw no hang-up, 2: it read a frame, 3: another error than connection_closed";
}

// Another thread's fork() between a socket's opening and its registration
// would copy it live into the child: the fork waits for the registration.
TEST(fork_release, a_fork_during_an_opening_waits_for_its_registration) {
  unique_fd mine, peer;
  std::atomic<bool> opening{false};
  std::promise<void> forked;
  std::thread opener([&, child_made = forked.get_future()] {
    const shoal::detail::fork_released_socket registration([&] {
      int ends[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) return -1;
      mine.reset(ends[0]);
      peer.reset(ends[1]);
      opening = true;
      std::this_thread::sleep_for(300ms);  // as if accept4() had just returned
      return mine.get();
    });
    child_made.wait();  // still registered when the child was made
  });
  while (!opening) std::this_thread::sleep_for(1ms);
  const int number = mine.get();
  forked_child child([&] {
    char c;
    return ::recv(number, &c, 1, MSG_DONTWAIT) == 0 ? 0 : 1;  // a live socket: EAGAIN
  });
  forked.set_value();
  opener.join();
  EXPECT_EQ(child.wait_for(10s), std::optional<int>(0)) << "1: the child copied the socket live";
}

// A registration may outlive its socket's close for a moment (a connection
// refused after its opening); the number may then name another file, which
// a child keeps as it is.
TEST(fork_release, a_registration_left_after_its_socket_closed_replaces_nothing_in_a_child) {
  int number = -1;
  std::optional<shoal::detail::fork_released_socket> left;
  {
    socket_pair pair;
    number = pair.a.get();
    left.emplace(number);
  }
  int ends[2];
  ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
  const unique_fd read_end(ends[0]), write_end(ends[1]);
  unique_fd taken_over;  // the number names a pipe now
  if (read_end.get() != number) {
    ASSERT_EQ(::dup3(read_end.get(), number, O_CLOEXEC), number);
    taken_over.reset(number);
  }
  forked_child child([&] {
    struct stat st {};
    return ::fstat(number, &st) == 0 && S_ISFIFO(st.st_mode) ? 0 : 1;
  });
  EXPECT_EQ(child.wait_for(10s), std::optional<int>(0)) << "1: the child's pipe was replaced by a socket";
}

// A stale registration's end takes its own entry away, never that of a
// newer socket under the same number (which a child must still let go of),
// whatever order the entries are in.
TEST(fork_release, a_stale_registrations_end_leaves_a_newer_sockets_registration) {
  auto earlier = std::make_unique<socket_pair>();
  auto earlier_registration = std::make_unique<shoal::detail::fork_released_socket>(earlier->a.get());
  int number = -1;
  std::optional<shoal::detail::fork_released_socket> stale;
  {
    socket_pair gone;
    number = gone.a.get();
    stale.emplace(number);
  }
  socket_pair newer;  // a live socket at the stale number
  unique_fd moved;
  if (newer.a.get() != number) {
    ASSERT_EQ(::dup3(newer.a.get(), number, O_CLOEXEC), number);
    moved.reset(number);
  }
  const shoal::detail::fork_released_socket registration(number);
  earlier_registration.reset();  // the last entry (the newer one) moves ahead of the stale one
  stale.reset();
  forked_child child([&] {
    char c;
    return ::recv(number, &c, 1, MSG_DONTWAIT) == 0 ? 0 : 1;  // a live socket: EAGAIN
  });
  EXPECT_EQ(child.wait_for(10s), std::optional<int>(0)) << "1: the child kept the newer socket live";
}

}  // namespace
}  // namespace shoal::testing
