// Frames through a shared-memory ring (connection::start_ring): the order
// of ring entries and socket frames is kept; a spinning receiver takes them
// without a wake-up and a blocked one is woken; poll() and pending() keep
// their meaning; a full ring waits for the reader, by the send deadline; and
// a peer that writes the ring by hand, as a hostile one would, gets a
// protocol_error and a closed connection, on either side.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "channel/shared_ring.h"
#include "support/lingering_socket.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::channel::detail {
// publish()'s first step alone (the tail's store), or a tail no honest
// writer stores: for tests that play the two sides' steps by hand.
struct ring_writer_steps {
  static void store_tail(ring_writer& writer, std::uint64_t tail) { writer.map_.store_tail(tail); }
};
}  // namespace shoal::channel::detail

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;

constexpr std::uint16_t announce_type = 0xFFF0, wake_type = 0xFFF1, fields_type = 0xFFF2;
constexpr std::size_t header_bytes = 128, fields_bytes = 64;

std::pair<connection, connection> ring_pair(std::size_t ring_bytes = 4096) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  b.allow_peer_ring();
  a.start_ring(ring_bytes);
  return {std::move(a), std::move(b)};
}

// A connection pair with a ring each way.
std::pair<connection, connection> two_way_ring_pair(std::size_t ring_bytes) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  a.allow_peer_ring();
  b.allow_peer_ring();
  a.start_ring(ring_bytes);
  b.start_ring(ring_bytes);
  return {std::move(a), std::move(b)};
}

// The reader's side of `writer`'s ring, in this process.
channel::detail::ring_reader reader_of(const channel::detail::ring_writer& writer) {
  return channel::detail::ring_reader(unique_fd(::fcntl(writer.ring_fd(), F_DUPFD_CLOEXEC, 0)),
                                      unique_fd(::fcntl(writer.fields_fd(), F_DUPFD_CLOEXEC, 0)), writer.capacity());
}

std::size_t bytes_waiting(int socket) {
  int n = 0;
  EXPECT_EQ(::ioctl(socket, FIONREAD, &n), 0);
  return static_cast<std::size_t>(n);
}

bool readable_within(int socket, std::chrono::milliseconds wait) {
  pollfd p{socket, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(wait.count())) == 1;
}

TEST(channel_ring, frames_keep_their_order_through_the_ring_and_the_socket) {
  auto [a, b] = ring_pair(4096);
  unique_fd pipe_ends[2];
  int raw[2];
  ASSERT_EQ(::pipe(raw), 0);
  pipe_ends[0] = unique_fd(raw[0]);
  pipe_ends[1] = unique_fd(raw[1]);
  const std::vector<std::byte> large(3000, std::byte{9});  // over a quarter of the ring: on the socket
  const std::vector<std::byte> one = bytes_of("one"), three = bytes_of("three");
  const channel::outgoing_frame frames[] = {
      {1, one}, {2, {}, pipe_ends[1].get()}, {3, three}, {4, large}, {5, {}}};
  a.send(frames);
  a.send(6, bytes_of("six"));
  for (std::uint16_t type = 1; type <= 6; ++type) {
    channel::frame f = type % 2 == 0 ? b.receive() : *b.try_receive();
    EXPECT_EQ(f.type, type);
    if (type == 1) EXPECT_EQ(text_of(f.payload), "one");
    if (type == 2) EXPECT_TRUE(f.fd.valid());
    if (type == 3) EXPECT_EQ(text_of(f.payload), "three");
    if (type == 4) EXPECT_EQ(f.payload, large);
    if (type == 6) EXPECT_EQ(text_of(f.payload), "six");
    if (type != 2) EXPECT_FALSE(f.fd.valid());
  }
  EXPECT_FALSE(b.try_receive().has_value());
  EXPECT_EQ(b.pending(), 0u);
}

TEST(channel_ring, both_sides_may_send_through_rings_at_once) {
  auto [a, b] = two_way_ring_pair(8192);
  a.set_receive_spin(1ms);
  b.set_receive_spin(1ms);
  std::thread echo([&] {
    for (int i = 0; i < 2000; ++i) {
      channel::frame f = b.receive();
      b.send(f.type, f.payload);
    }
  });
  for (int i = 0; i < 2000; ++i) {
    const std::string text = std::to_string(i);
    a.send(static_cast<std::uint16_t>(i % 1000), bytes_of(text));
    channel::frame back = a.receive();
    ASSERT_EQ(back.type, i % 1000);
    ASSERT_EQ(text_of(back.payload), text);
  }
  echo.join();
}

TEST(channel_ring, a_spinning_receiver_takes_frames_without_a_wake_up) {
  auto [a, b] = ring_pair();
  b.set_receive_spin(10s);
  std::atomic<bool> got{false};
  std::thread receiver([&, &b = b] {
    EXPECT_EQ(text_of(b.receive().payload), "hello");
    got = true;
  });
  std::this_thread::sleep_for(500ms);  // the receiver is spinning by now
  a.send(1, bytes_of("hello"));
  receiver.join();
  EXPECT_TRUE(got);
  EXPECT_EQ(bytes_waiting(b.native_handle()), 0u) << "a wake-up went to a receiver that was spinning";
}

// The wake-ups the sender counted, read from its ring file's header (the
// one ring this process has open).
std::uint64_t wakes_sent() {
  for (int fd = 0; fd < 1024; ++fd) {
    char target[256] = {};
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    if (::readlink(link.c_str(), target, sizeof target - 1) <= 0) continue;
    if (std::string(target).find("memfd:shoal-channel-ring (") == std::string::npos) continue;
    void* header = ::mmap(nullptr, header_bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (header == MAP_FAILED) continue;
    const std::uint64_t wakes = std::atomic_ref<std::uint64_t>(static_cast<std::uint64_t*>(header)[8]).load();  // wakes sent: byte 64
    ::munmap(header, header_bytes);
    return wakes;
  }
  ADD_FAILURE() << "no ring found";
  return 0;
}

TEST(channel_ring, try_receive_with_a_spin_takes_a_frame_without_a_wake_up_and_then_lowers_its_flag) {
  auto [a, b] = ring_pair();
  EXPECT_FALSE(b.try_receive().has_value());  // takes in the ring's announce
  std::optional<channel::frame> got;
  std::thread receiver([&, &b = b] { got = b.try_receive(10s); });
  std::this_thread::sleep_for(300ms);  // the receiver is spinning by now
  a.send(1, bytes_of("spun"));
  receiver.join();
  ASSERT_TRUE(got.has_value()) << "the spin ended without the frame";
  EXPECT_EQ(text_of(got->payload), "spun");
  EXPECT_EQ(wakes_sent(), 0u) << "a wake-up went to a receiver that was spinning";

  a.send(2, bytes_of("after"));
  EXPECT_TRUE(readable_within(b.native_handle(), 1000ms)) << "the flag stayed up: no wake-up for a reader that sleeps";
  EXPECT_EQ(text_of(b.try_receive()->payload), "after");

  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(b.try_receive(20ms).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - start, 20ms);
}

TEST(channel_ring, try_receive_with_a_spin_on_a_connection_without_a_ring_does_not_spin) {
  socket_pair pair;
  connection b = connection::adopt(std::move(pair.b), {});
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(b.try_receive(10s).has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
}

TEST(channel_ring, a_receive_with_a_deadline_spins_no_longer_than_it) {
  auto [a, b] = ring_pair();
  EXPECT_FALSE(b.try_receive().has_value());  // takes in the ring's announce
  b.set_receive_spin(10s);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)b.receive_for(50ms), timeout_error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "the spin ran past the receive's deadline";
  EXPECT_FALSE(b.broken());
}

TEST(channel_ring, a_blocked_receiver_is_woken) {
  auto [a, b] = ring_pair();
  b.set_receive_spin(0ns);
  std::thread receiver([&, &b = b] { EXPECT_EQ(text_of(b.receive_for(5s).payload), "wake"); });
  std::this_thread::sleep_for(50ms);  // blocked on the socket by now
  a.send(1, bytes_of("wake"));
  receiver.join();
}

TEST(channel_ring, native_handle_is_readable_while_a_frame_waits_in_the_ring) {
  auto [a, b] = ring_pair();
  EXPECT_FALSE(b.try_receive().has_value());  // takes in the ring's announce
  EXPECT_FALSE(readable_within(b.native_handle(), 0ms));
  a.send(1, bytes_of("x"));
  EXPECT_TRUE(readable_within(b.native_handle(), 1000ms));
  EXPECT_EQ(b.pending(), 1u);
  ASSERT_TRUE(b.try_receive().has_value());
  EXPECT_EQ(b.pending(), 0u);
  EXPECT_FALSE(readable_within(b.native_handle(), 0ms)) << "the wake-up stayed in the socket";
}

TEST(channel_ring, pending_counts_what_a_receive_left_in_the_ring) {
  auto [a, b] = ring_pair();
  const std::vector<std::byte> first = bytes_of("1"), second = bytes_of("2");
  const channel::outgoing_frame two[] = {{1, first}, {2, second}};
  a.send(two);
  EXPECT_EQ(b.receive().type, 1);
  EXPECT_EQ(b.pending(), 1u);
  EXPECT_EQ(b.receive_for(0ms).type, 2);
  EXPECT_EQ(b.pending(), 0u);
}

TEST(channel_ring, a_full_ring_waits_for_its_reader) {
  auto [a, b] = ring_pair(4096);
  constexpr int count = 400;
  std::thread sender([&, &a = a] {
    for (int i = 0; i < count; ++i) a.send(static_cast<std::uint16_t>(i), std::vector<std::byte>(500, std::byte(i)));
  });
  for (int i = 0; i < count; ++i) {
    channel::frame f = b.receive_for(10s);
    ASSERT_EQ(f.type, i);
    ASSERT_EQ(f.payload, std::vector<std::byte>(500, std::byte(i)));
  }
  sender.join();
}

TEST(channel_ring, a_full_ring_times_out_and_the_connection_stays_usable_when_nothing_of_the_call_went) {
  auto [a, b] = ring_pair(4096);
  a.set_send_timeout(50ms);
  int sent = 0;
  const std::vector<std::byte> payload(500);
  try {
    for (;; ++sent) a.send(1, payload);
  } catch (const timeout_error& e) {
    EXPECT_NE(std::string(e.what()).find("stays usable"), std::string::npos) << e.what();
  }
  EXPECT_GT(sent, 0);
  EXPECT_FALSE(a.broken());
  for (int i = 0; i < sent; ++i) ASSERT_EQ(b.receive_for(1s).payload, payload);
  a.send(2, bytes_of("after"));
  EXPECT_EQ(text_of(b.receive_for(1s).payload), "after");
}

TEST(channel_ring, a_send_to_a_peer_that_hung_up_with_its_ring_full_ends) {
  auto [a, b] = ring_pair(4096);
  std::thread closer([&b = b] {
    std::this_thread::sleep_for(100ms);
    connection gone = std::move(b);
  });
  EXPECT_THROW(
      {
        for (;;) a.send(1, std::vector<std::byte>(500));
      },
      connection_closed);
  closer.join();
}

TEST(channel_ring, the_peer_ending_after_its_last_frames_leaves_them_readable) {
  auto [a, b] = ring_pair();
  a.send(1, bytes_of("last"));
  { connection gone = std::move(a); }
  EXPECT_EQ(text_of(b.receive_for(1s).payload), "last");
  EXPECT_THROW((void)b.receive_for(1s), connection_closed);
}

TEST(channel_ring, starting_twice_or_after_post_and_sending_a_reserved_type_are_refused) {
  auto [a, b] = ring_pair();
  EXPECT_THROW(a.start_ring(4096), invalid_argument);
  EXPECT_THROW(a.post(1, bytes_of("x")), invalid_argument);
  EXPECT_THROW(a.send(announce_type, {}), invalid_argument);
  EXPECT_THROW(b.send(wake_type, {}), invalid_argument);
  EXPECT_FALSE(a.broken());
  EXPECT_FALSE(b.broken());
  socket_pair other;
  connection c = connection::adopt(std::move(other.a), {});
  c.post(1, bytes_of("x"));
  EXPECT_THROW(c.start_ring(4096), invalid_argument);
}

// The two sides' steps interleaved by hand: the receiver reads wake-up 1
// late, after the sender's second publish stored the tail but before it
// looked whether wake-up 1 was read. The sender then sees it read and sends
// wake-up 2, for the tail the receiver already saw with wake-up 1.
TEST(channel_ring, a_wake_up_for_a_tail_the_receiver_saw_with_the_last_one_is_accepted) {
  channel::detail::ring_writer writer(4096);
  channel::detail::ring_reader reader = reader_of(writer);
  const std::vector<std::byte> one = bytes_of("1");
  writer.write(1, one, false);
  ASSERT_TRUE(writer.publish()) << "the receiver neither spins nor took it: wake-up 1 goes";
  writer.count_wake();
  writer.write(2, one, false);
  channel::detail::ring_writer_steps::store_tail(writer, 2 * channel::detail::ring_entry_bytes(one.size()));  // the second publish's first step
  reader.note_wake();  // wake-up 1 read, seeing both entries
  ASSERT_TRUE(writer.publish()) << "wake-up 1 read, entry 2 not taken: wake-up 2 goes";
  writer.count_wake();
  EXPECT_NO_THROW(reader.note_wake()) << "an honest sender refused";
  EXPECT_THROW(reader.note_wake(), protocol_error) << "a third wake-up for the same tail";
}

// try_receive in a loop takes ring entries before their wake-ups are read,
// which lets two wake-ups find one tail (the test above, by hand).
TEST(channel_ring, receivers_that_take_entries_before_their_wake_ups_keep_the_connection) {
  auto [a, b] = two_way_ring_pair(8192);
  const auto take = [](connection& c) {
    for (;;) {
      if (std::optional<channel::frame> f = c.try_receive()) return std::move(*f);
    }
  };
  constexpr int round_trips = 20000;
  std::string echo_error;
  std::thread echo([&] {
    try {
      for (int i = 0; i < round_trips; ++i) {
        channel::frame f = take(b);
        b.send(f.type, f.payload);
      }
    } catch (const std::exception& e) {
      echo_error = e.what();
    }
  });
  int done = 0;
  try {
    for (; done < round_trips; ++done) {
      a.send(static_cast<std::uint16_t>(done % 1000), bytes_of("x"));
      if (take(a).type != done % 1000) break;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "after " << done << " round trips: " << e.what();
  }
  if (done != round_trips) ::shutdown(a.native_handle(), SHUT_RDWR);  // ends the echo's wait
  echo.join();
  EXPECT_EQ(done, round_trips);
  EXPECT_EQ(echo_error, "");
}

TEST(channel_ring, receive_for_zero_takes_a_frame_whose_marker_is_in_the_ring) {
  auto [a, b] = ring_pair();
  const unique_fd sent(::memfd_create("carried", MFD_CLOEXEC));
  a.send(3, bytes_of("with a descriptor"), sent.get());  // a marker in the ring, the frame on the socket
  ASSERT_TRUE(readable_within(b.native_handle(), 1000ms));
  channel::frame f = b.receive_for(0ms);
  EXPECT_EQ(text_of(f.payload), "with a descriptor");
  EXPECT_TRUE(f.fd.valid());
}

TEST(channel_ring, a_spin_longer_than_the_deadline_still_reports_a_peer_that_hung_up) {
  auto [a, b] = ring_pair();
  a.send(1, bytes_of("first"));
  EXPECT_EQ(text_of(b.receive_for(1s).payload), "first");
  { connection gone = std::move(a); }
  b.set_receive_spin(50ms);
  EXPECT_THROW((void)b.receive_for(10ms), connection_closed) << "the spin used up the deadline, and the end went unread";
}

// A send that meets the peer's end says whether part of it went: an entry
// published in the ring before the wake-up after it was refused is one the
// peer may still read (the sharing layer then keeps what it names alive).
TEST(channel_ring, a_send_that_meets_the_end_says_whether_part_of_it_went) {
  auto [a, b] = ring_pair();
  a.send(1, bytes_of("first"));
  EXPECT_EQ(text_of(b.receive_for(1s).payload), "first");
  ASSERT_EQ(::shutdown(b.native_handle(), SHUT_RD), 0);  // it reads the ring, not its socket
  try {
    a.send(2, bytes_of("published"));
    ADD_FAILURE() << "the wake-up to a peer that shut its socket went";
  } catch (const connection_closed& e) {
    EXPECT_TRUE(e.part_sent()) << e.what();
  }
  const std::optional<channel::frame> f = b.try_receive();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(text_of(f->payload), "published");
  try {
    a.send(3, bytes_of("after"));
    ADD_FAILURE() << "a send on a broken connection went";
  } catch (const connection_closed& e) {
    EXPECT_FALSE(e.part_sent()) << "nothing of a send on a connection broken already goes";
  }
}

// Announces `ring_fd` as a ring of `capacity` bytes with `fields_fd` its
// fields file, as the wire layout says.
void announce_by_hand(int socket, int ring_fd, int fields_fd, std::uint64_t capacity) {
  std::vector<std::byte> payload(8);
  std::memcpy(payload.data(), &capacity, 8);
  write_raw(socket, raw_batch("SHOL", 2, {{announce_type, payload, 1}, {fields_type, {}, 1}}), {ring_fd, fields_fd});
}

// A memfd of `bytes`, mapped read-write (unmapped with the struct).
struct mapped_memfd {
  mapped_memfd(const char* name, std::size_t bytes) : bytes(bytes) {
    fd = unique_fd(::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
    base = static_cast<std::byte*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
    EXPECT_NE(base, MAP_FAILED);
  }
  ~mapped_memfd() { ::munmap(base, bytes); }
  void touch_every_page() const {
    for (std::size_t at = 0; at < bytes; at += 4096) base[at] = std::byte{0};
  }
  unique_fd fd;
  std::byte* base = nullptr;
  std::size_t bytes;
};

// What a hand-made ring leaves out of what an honest sender does.
struct hand_made_options {
  std::size_t file_bytes = 0;  // the ring file's size, when not the layout's
  bool seal_size = true;       // against shrinking and growing
  bool seal_writes = true;     // F_SEAL_FUTURE_WRITE, once mapped
  bool allocate = true;        // every page of the ring file
};

// A ring made by hand, as a hostile sender would: the two files the header
// documents, with each field at its place.
struct hand_made_ring {
  explicit hand_made_ring(std::size_t capacity, hand_made_options o = {})
      : capacity(capacity),
        ring("hand-made-ring", o.file_bytes != 0 ? o.file_bytes : header_bytes + capacity),
        fields("hand-made-ring-fields", fields_bytes) {
    if (o.allocate) ring.touch_every_page();
    fields.touch_every_page();
    if (o.seal_size) EXPECT_EQ(::fcntl(ring.fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    if (o.seal_writes) EXPECT_EQ(::fcntl(ring.fd.get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
    EXPECT_EQ(::fcntl(fields.fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  void announce(int socket, std::uint64_t announced = 0) const {
    announce_by_hand(socket, ring.fd.get(), fields.fd.get(), announced != 0 ? announced : capacity);
  }
  std::uint64_t& tail() const { return *reinterpret_cast<std::uint64_t*>(ring.base); }
  std::uint64_t& head() const { return *reinterpret_cast<std::uint64_t*>(fields.base); }
  // Writes an entry at the tail and publishes it (with `claimed` bytes in its header, when given).
  void put(std::uint16_t type, const std::vector<std::byte>& payload, std::uint16_t kind = 0,
           std::uint32_t claimed = UINT32_MAX) {
    const std::uint32_t bytes = claimed != UINT32_MAX ? claimed : static_cast<std::uint32_t>(payload.size());
    std::byte* at = ring.base + header_bytes + tail() % capacity;
    std::memcpy(at, &bytes, 4);
    std::memcpy(at + 4, &type, 2);
    std::memcpy(at + 6, &kind, 2);
    if (!payload.empty()) std::memcpy(at + 8, payload.data(), payload.size());
    tail() += 8 + (payload.size() + 7) / 8 * 8;
  }

  std::size_t capacity;
  mapped_memfd ring, fields;
};

// A receiver that takes rings, and the raw socket of its (hostile) sender.
struct ring_receiver {
  explicit ring_receiver(std::size_t max_payload = connection::default_max_payload)
      : b(connection::adopt(std::move(pair.b), {}, max_payload)) {
    b.allow_peer_ring();
  }
  [[nodiscard]] int sender() const { return pair.a.get(); }

  socket_pair pair;
  connection b;
};

// b's next receive fails with protocol_error saying `expected`, and b is closed.
void expect_refused(connection& b, const std::string& expected) {
  try {
    (void)b.receive_for(1s);
    ADD_FAILURE() << "no protocol_error; expected one saying \"" << expected << "\"";
  } catch (const protocol_error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a protocol_error saying \"" << expected << "\"; got: " << e.what();
  }
  EXPECT_TRUE(b.broken());
}

TEST(channel_ring_hostile_sender, a_hand_made_ring_that_keeps_the_layout_is_read) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  ring.put(7, bytes_of("by hand"));
  write_raw(r.sender(), raw_batch("SHOL", 2, {{wake_type, {}}}));
  EXPECT_EQ(text_of(r.b.receive_for(1s).payload), "by hand");
  EXPECT_EQ(ring.head(), 16u) << "the receiver stores how far it read, in the fields file";
}

TEST(channel_ring_hostile_sender, a_ring_on_a_connection_that_takes_none_is_refused) {
  socket_pair pair;
  connection b = connection::adopt(std::move(pair.b), {});
  hand_made_ring ring(4096);
  ring.announce(pair.a.get());
  expect_refused(b, "another protocol");
}

TEST(channel_ring_hostile_sender, a_ring_file_the_sender_could_still_write_through_a_new_mapping_is_refused) {
  ring_receiver r;
  hand_made_ring ring(4096, {.seal_writes = false});
  ring.announce(r.sender());
  expect_refused(r.b, "the ring's file is not sealed against writes");
}

TEST(channel_ring_hostile_sender, a_fields_file_sealed_against_writes_or_opened_read_only_is_refused) {
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    ASSERT_EQ(::fcntl(ring.fields.fd.get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
    ring.announce(r.sender());
    expect_refused(r.b, "fields file is sealed against writes");
  }
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    const unique_fd read_only(
        ::open(("/proc/self/fd/" + std::to_string(ring.fields.fd.get())).c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(read_only.valid());
    announce_by_hand(r.sender(), ring.ring.fd.get(), read_only.get(), 4096);
    expect_refused(r.b, "fields file is not open for reading and writing");
  }
}

TEST(channel_ring_hostile_sender, a_ring_file_opened_read_only_is_read) {
  ring_receiver r;
  hand_made_ring ring(4096);
  const unique_fd read_only(::open(("/proc/self/fd/" + std::to_string(ring.ring.fd.get())).c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(read_only.valid());
  announce_by_hand(r.sender(), read_only.get(), ring.fields.fd.get(), 4096);
  ring.put(7, bytes_of("read only"));
  write_raw(r.sender(), raw_batch("SHOL", 2, {{wake_type, {}}}));
  EXPECT_EQ(text_of(r.b.receive_for(1s).payload), "read only") << "the receiver never writes the ring file";
}

// A page the sender never allocated would be allocated by the receiver's
// first read of it, charged to the receiver, and kept while the sender keeps
// the file: a sender reconnecting with sparse rings would grow the
// receiver's memory without end.
TEST(channel_ring_hostile_sender, a_ring_file_with_pages_its_sender_never_allocated_is_refused) {
  ring_receiver r;
  hand_made_ring ring(16384, {.allocate = false});
  ring.tail() = 0;  // the header's page only
  ring.announce(r.sender());
  expect_refused(r.b, "4 of its 5 pages out of memory");
}

// fallocate() allocates a page but leaves it not up to date, which mincore()
// reports as out of memory: a sender must write its pages in.
TEST(channel_ring_hostile_sender, a_ring_file_whose_pages_were_only_fallocated_is_refused) {
  ring_receiver r;
  hand_made_ring ring(16384, {.allocate = false});
  ASSERT_EQ(::fallocate(ring.ring.fd.get(), 0, 0, static_cast<off_t>(header_bytes + 16384)), 0);
  ring.tail() = 0;  // the header's page written
  ring.announce(r.sender());
  expect_refused(r.b, "4 of its 5 pages out of memory");
}

// The bytes of locked memory this process has (VmLck), or nullopt.
std::optional<std::size_t> locked_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // "VmLck:   68 kB"
  }
  return std::nullopt;
}

// Whether mlock() locks here: the sanitizers' runtimes replace it with a
// call that does nothing, so VmLck cannot rise under them.
bool mlock_takes_effect() {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  void* probe = ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe == MAP_FAILED) return false;
  const std::size_t before = locked_bytes().value_or(0);
  const bool locked = ::mlock(probe, page) == 0 && locked_bytes().value_or(0) >= before + page;
  ::munmap(probe, page);
  return locked;
}

// Locked, the ring's pages cannot be swapped out: a sender that swapped
// them out after the reader's check would have them swapped in again,
// charged to the reader, once its own cgroup is gone.
TEST(channel_ring, both_sides_lock_the_rings_pages_in_memory) {
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &limit), 0);
  if (::geteuid() != 0 && limit.rlim_cur < (std::size_t{1} << 20)) GTEST_SKIP() << "RLIMIT_MEMLOCK under 1 MiB here";
  const std::optional<std::size_t> before = locked_bytes();
  if (!before) GTEST_SKIP() << "no VmLck in /proc/self/status";
  if (!mlock_takes_effect()) GTEST_SKIP() << "mlock() locks nothing in this build (a sanitizer's runtime)";
  channel::detail::ring_writer writer(65536);
  const std::size_t after_writer = locked_bytes().value_or(0);
  EXPECT_GE(after_writer - *before, header_bytes + 65536) << "the sender locks its ring file";
  channel::detail::ring_reader reader = reader_of(writer);
  EXPECT_GE(locked_bytes().value_or(0) - after_writer, header_bytes + 65536) << "the receiver locks the ring file it checked";
}

TEST(channel_ring_hostile_sender, a_ring_announce_without_its_fields_file_or_a_fields_file_alone_is_refused) {
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    std::vector<std::byte> payload(8);
    const std::uint64_t capacity = 4096;
    std::memcpy(payload.data(), &capacity, 8);
    write_raw(r.sender(), raw_batch("SHOL", 2, {{announce_type, payload, 1}}), {ring.ring.fd.get()});
    expect_refused(r.b, "a ring announce without its fields file");
  }
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    std::vector<std::byte> payload(8);
    const std::uint64_t capacity = 4096;
    std::memcpy(payload.data(), &capacity, 8);
    write_raw(r.sender(), raw_batch("SHOL", 2, {{announce_type, payload, 1}, {7, {}, 1}}),
              {ring.ring.fd.get(), ring.fields.fd.get()});
    expect_refused(r.b, "a ring announce without its fields file");
  }
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    write_raw(r.sender(), raw_batch("SHOL", 2, {{fields_type, {}, 1}}), {ring.fields.fd.get()});
    expect_refused(r.b, "a ring's fields file without its announce");
  }
}

TEST(channel_ring, a_senders_ring_file_can_lose_no_page_nor_be_written_but_through_its_own_mapping) {
  channel::detail::ring_writer writer(4096);
  EXPECT_EQ(::fallocate(writer.ring_fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, writer.ring_fd(), 0), MAP_FAILED);
  EXPECT_EQ(::pwrite(writer.ring_fd(), "x", 1, 0), -1);
  channel::detail::ring_reader reader = reader_of(writer);
  writer.write(1, bytes_of("still"), false);
  (void)writer.publish();
  ASSERT_TRUE(reader.has_entries());
  EXPECT_EQ(text_of(reader.take(1024)->payload), "still");
}

TEST(channel_ring_hostile_sender, a_file_that_is_no_memfd_is_refused) {
  ring_receiver r;
  char name[] = "/var/tmp/shoal-ring-test-XXXXXX";
  const unique_fd file(::mkostemp(name, O_CLOEXEC));
  ASSERT_TRUE(file.valid());
  ::unlink(name);
  ASSERT_EQ(::ftruncate(file.get(), static_cast<off_t>(header_bytes + 4096)), 0);
  hand_made_ring ring(4096);
  announce_by_hand(r.sender(), file.get(), ring.fields.fd.get(), 4096);
  expect_refused(r.b, "not a memfd sealed against shrinking");
}

// A ring whose descriptor's last close waits: refused at once, closed on the
// closer thread.
TEST(channel_ring_hostile_sender, a_ring_descriptor_whose_close_lingers_is_refused_without_waiting) {
  ring_receiver r;
  socket_holding_a_lingering_one held(2);
  hand_made_ring ring(4096);
  announce_by_hand(r.sender(), held.holder.get(), ring.fields.fd.get(), 4096);
  held.holder.reset();
  expect_returns_while_the_close_lingers([&] { expect_refused(r.b, "not a memfd sealed against shrinking"); },
                                         "the receive waited out the inner socket's linger");
}

TEST(channel_ring_hostile_sender, frames_on_the_socket_far_ahead_of_their_markers_are_refused) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  std::vector<raw_frame> frames(64, raw_frame{1, bytes_of("x")});
  for (int i = 0; i < 3; ++i) write_raw(r.sender(), raw_batch("SHOL", 2, frames, 1024));
  expect_refused(r.b, "ahead of their markers");
}

// Frames held for their markers are bounded by what two batches carry in
// bytes and descriptors too, not only in count: one large frame a batch
// (or one descriptor a batch) would otherwise be held 128 times.
TEST(channel_ring_hostile_sender, large_frames_ahead_of_their_markers_are_bounded_by_bytes) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  std::thread sender([&] {
    for (int i = 0; i < 3; ++i) {
      write_raw(r.sender(), raw_batch("SHOL", 2, {{1, std::vector<std::byte>(connection::default_max_payload)}}));
    }
  });
  expect_refused(r.b, "past what two batches carry");
  { connection gone = std::move(r.b); }  // a sender still writing (the test failing) ends
  sender.join();
}

TEST(channel_ring_hostile_sender, descriptors_ahead_of_their_markers_are_bounded) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  const unique_fd file(::memfd_create("carried", MFD_CLOEXEC));
  for (std::size_t i = 0; i <= 2 * channel::max_batch_descriptors; ++i) {
    write_raw(r.sender(), raw_batch("SHOL", 2, {{1, bytes_of("d"), 1}}), {file.get()});
  }
  expect_refused(r.b, "past what two batches carry");
}

TEST(channel_ring_hostile_sender, wake_ups_with_nothing_published_between_them_are_refused) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  ring.put(1, bytes_of("x"));
  // Two for one tail an honest sender can send (the test above); a third it cannot.
  for (int i = 0; i < 3; ++i) write_raw(r.sender(), raw_batch("SHOL", 2, {{wake_type, {}}}));
  EXPECT_EQ(text_of(r.b.receive_for(1s).payload), "x");
  expect_refused(r.b, "three ring wake-ups with nothing published");
}

TEST(channel_ring_hostile_sender, entries_behind_a_marker_whose_frame_never_came_are_not_pending) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  ring.put(0, {}, /*kind=*/1);  // a marker: its frame should be on the socket already
  ring.put(2, bytes_of("behind"));
  EXPECT_FALSE(r.b.try_receive().has_value());
  EXPECT_EQ(r.b.pending(), 0u) << "a poller would spin on entries that cannot be taken before the socket says so";
  write_raw(r.sender(), raw_batch("SHOL", 2, {{1, bytes_of("late")}}));
  EXPECT_EQ(text_of(r.b.receive_for(1s).payload), "late");
  EXPECT_EQ(text_of(r.b.receive_for(1s).payload), "behind");
}

TEST(channel_ring_hostile_sender, a_ring_over_the_receivers_bound_is_refused_and_one_at_it_taken) {
  {
    ring_receiver r;
    r.b.allow_peer_ring(8192);
    hand_made_ring ring(8192);
    ring.announce(r.sender());
    ring.put(7, bytes_of("at the bound"));
    write_raw(r.sender(), raw_batch("SHOL", 2, {{wake_type, {}}}));
    EXPECT_EQ(text_of(r.b.receive_for(1s).payload), "at the bound");
  }
  ring_receiver r;
  r.b.allow_peer_ring(8192);
  hand_made_ring ring(16384);
  ring.announce(r.sender());
  expect_refused(r.b, "a ring of 16384 bytes, over the 8192 this side takes");
}

TEST(channel_ring, a_bound_below_the_smallest_ring_is_refused) {
  socket_pair pair;
  connection b = connection::adopt(std::move(pair.b), {});
  EXPECT_THROW(b.allow_peer_ring(4095), invalid_argument);
  EXPECT_NO_THROW(b.allow_peer_ring(4096));
}

TEST(channel_ring_hostile_sender, a_ring_file_that_could_shrink_is_refused) {
  ring_receiver r;
  hand_made_ring ring(4096, {.seal_size = false, .seal_writes = false});
  ring.announce(r.sender());
  expect_refused(r.b, "not a memfd sealed against shrinking");
}

TEST(channel_ring_hostile_sender, a_ring_smaller_than_announced_is_refused) {
  ring_receiver r;
  hand_made_ring ring(4096, {.file_bytes = header_bytes + 2048});
  ring.announce(r.sender());
  expect_refused(r.b, "holds " + std::to_string(header_bytes + 2048) + " bytes");
}

TEST(channel_ring_hostile_sender, a_capacity_that_is_no_power_of_two_is_refused) {
  ring_receiver r;
  hand_made_ring ring(4096, {.file_bytes = header_bytes + 5000});
  ring.announce(r.sender(), 5000);
  expect_refused(r.b, "a ring of 5000 bytes");
}

TEST(channel_ring_hostile_sender, a_tail_past_the_capacity_is_refused) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  ring.tail() = 4096 + 8;
  expect_refused(r.b, "not a whole number of entries within 4096 bytes");
}

// A peer flipping its tail away from the head and back, in time with the
// receiver's looks, would keep has_entries() saying yes and take() no, and a
// receive looping between them with no deadline looked at.
TEST(channel_ring_hostile_sender, a_tail_back_at_the_head_after_the_receiver_saw_it_away_is_refused) {
  channel::detail::ring_writer writer(4096);
  channel::detail::ring_reader reader = reader_of(writer);
  const auto store_tail = [&](std::uint64_t t) { channel::detail::ring_writer_steps::store_tail(writer, t); };
  const auto expect_refused_take = [&](const std::string& expected) {
    try {
      (void)reader.take(1024);
      ADD_FAILURE() << "a tail back at the head was taken as an empty ring";
    } catch (const protocol_error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  writer.write(1, bytes_of("1"), false);
  (void)writer.publish();
  ASSERT_TRUE(reader.has_entries());
  store_tail(0);  // past the head, then back at it
  expect_refused_take("went from 16 back to the head 0");
  // Below the head, then back at it: past an entry taken, the tail said 8.
  store_tail(16);
  ASSERT_TRUE(reader.take(1024).has_value());
  store_tail(8);
  ASSERT_TRUE(reader.has_entries());
  store_tail(16);
  expect_refused_take("went from 8 back to the head 16");
}

TEST(channel_ring, an_empty_ring_after_its_entries_were_taken_is_no_protocol_error) {
  channel::detail::ring_writer writer(4096);
  channel::detail::ring_reader reader = reader_of(writer);
  writer.write(1, bytes_of("1"), false);
  writer.write(2, bytes_of("2"), false);
  (void)writer.publish();
  ASSERT_TRUE(reader.has_entries());
  ASSERT_TRUE(reader.take(1024).has_value());
  ASSERT_TRUE(reader.take(1024).has_value());
  EXPECT_FALSE(reader.has_entries());
  EXPECT_FALSE(reader.take(1024).has_value()) << "the honest tail was at the head, where the reader took it to";
}

TEST(channel_ring_hostile_sender, an_entry_that_runs_past_the_tail_is_refused) {
  ring_receiver r;
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  ring.put(1, bytes_of("short"), 0, /*claimed=*/1000);
  expect_refused(r.b, "runs past the 16 published");
}

TEST(channel_ring_hostile_sender, an_entry_over_the_payload_limit_is_refused) {
  ring_receiver r(/*max_payload=*/16);
  hand_made_ring ring(4096);
  ring.announce(r.sender());
  ring.put(1, std::vector<std::byte>(64));
  expect_refused(r.b, "over the limit of 16");
}

TEST(channel_ring_hostile_sender, wake_ups_without_a_ring_a_second_ring_and_reserved_entries_are_refused) {
  {
    ring_receiver r;
    write_raw(r.sender(), raw_batch("SHOL", 2, {{wake_type, {}}}));
    expect_refused(r.b, "before any ring");
  }
  {
    ring_receiver r;
    hand_made_ring first(4096), second(4096);
    first.announce(r.sender());
    second.announce(r.sender());
    expect_refused(r.b, "a second ring");
  }
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    ring.announce(r.sender());
    ring.put(announce_type, {});
    expect_refused(r.b, "the channel's own frame type");
  }
  {
    ring_receiver r;
    hand_made_ring ring(4096);
    ring.announce(r.sender());
    ring.put(1, bytes_of("x"), /*kind=*/1);
    expect_refused(r.b, "a ring marker that carries a payload");
  }
}

// Reads the announce a real sender sent and maps its ring, as a hostile
// receiver would: the ring file read-only (all its seal allows), the fields
// file read-write.
struct ring_seen_by_hand {
  explicit ring_seen_by_hand(int socket) {
    std::vector<std::byte> batch(256);
    iovec part{batch.data(), batch.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
    msghdr header{};
    header.msg_iov = &part;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof control;
    EXPECT_EQ(::recvmsg(socket, &header, MSG_CMSG_CLOEXEC), 256);
    std::uint16_t type = 0, second_type = 0;
    std::memcpy(&type, batch.data() + 12, 2);
    EXPECT_EQ(type, announce_type);
    std::memcpy(&capacity, batch.data() + 20, 8);
    std::memcpy(&second_type, batch.data() + 28, 2);
    EXPECT_EQ(second_type, fields_type);
    int fds[2] = {-1, -1};
    std::memcpy(fds, CMSG_DATA(CMSG_FIRSTHDR(&header)), sizeof fds);
    ring_file = unique_fd(fds[0]);
    fields_file = unique_fd(fds[1]);
    EXPECT_EQ(::mmap(nullptr, header_bytes + capacity, PROT_READ | PROT_WRITE, MAP_SHARED, ring_file.get(), 0), MAP_FAILED)
        << "the ring file's seal lets a receiver write it";
    ring = static_cast<std::byte*>(::mmap(nullptr, header_bytes + capacity, PROT_READ, MAP_SHARED, ring_file.get(), 0));
    fields = static_cast<std::byte*>(
        ::mmap(nullptr, fields_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fields_file.get(), 0));
  }
  ~ring_seen_by_hand() {
    ::munmap(ring, header_bytes + capacity);
    ::munmap(fields, fields_bytes);
  }
  std::uint64_t& head() const { return *reinterpret_cast<std::uint64_t*>(fields); }
  std::uint64_t tail() const { return *reinterpret_cast<const std::uint64_t*>(ring); }

  std::uint64_t capacity = 0;
  unique_fd ring_file, fields_file;
  std::byte* ring = nullptr;
  std::byte* fields = nullptr;
};

// A real sender, its ring started and one frame in it, and its ring as a
// hostile receiver maps it.
struct sender_with_a_hostile_reader {
  sender_with_a_hostile_reader() : a(connection::adopt(std::move(pair.a), {})) {
    a.start_ring(4096);
    ring.emplace(pair.b.get());
    a.send(1, bytes_of("x"));
  }

  socket_pair pair;
  connection a;
  std::optional<ring_seen_by_hand> ring;
};

TEST(channel_ring_hostile_receiver, a_head_moved_past_the_tail_is_refused) {
  sender_with_a_hostile_reader p;
  auto& [pair, a, ring] = p;
  ring->head() = ring->tail() + 4096;  // "read" what was never written: the sender would overwrite unread bytes
  try {
    for (int i = 0; i < 1000; ++i) a.send(1, std::vector<std::byte>(500));
    ADD_FAILURE() << "the sender believed a head past its tail";
  } catch (const protocol_error& e) {
    EXPECT_NE(std::string(e.what()).find("outside"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(a.broken());
}

TEST(channel_ring_hostile_receiver, a_head_moved_back_is_refused) {
  sender_with_a_hostile_reader p;
  auto& [pair, a, ring] = p;
  ring->head() = ring->tail();
  a.send(1, bytes_of("y"));  // the sender sees the head move forward
  ring->head() = 0;
  EXPECT_THROW(
      {
        for (int i = 0; i < 1000; ++i) a.send(1, std::vector<std::byte>(500));
      },
      protocol_error);
  EXPECT_TRUE(a.broken());
}

}  // namespace
}  // namespace shoal::testing
