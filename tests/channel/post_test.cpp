// Sending without waiting (connection::post): what the socket does not take
// waits in the connection's queue and goes out in order, each descriptor
// with its own frame, as flush() finds room (a later post waits its turn
// even when the socket has room again), frames larger than the socket holds
// too, written in parts; unsent_since() is when the oldest frames queued
// were posted, however much of them the peer reads; destroying a connection
// closes the descriptors its queue holds; a blocking send goes after what
// was posted.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "support/lingering_socket.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;

constexpr std::uint16_t numbered_type = 21;
constexpr std::size_t payload_bytes = 3000;

// A payload of `bytes` that starts with `index`.
std::vector<std::byte> numbered(std::uint64_t index, std::size_t bytes = payload_bytes) {
  std::vector<std::byte> payload(bytes, std::byte{0x5a});
  std::memcpy(payload.data(), &index, sizeof index);
  return payload;
}

std::uint64_t number_in(const std::vector<std::byte>& payload) {
  std::uint64_t index = 0;
  if (payload.size() >= sizeof index) std::memcpy(&index, payload.data(), sizeof index);
  return index;
}

// A memfd holding `index`: which frame a descriptor came with.
unique_fd numbered_file(std::uint64_t index) {
  unique_fd fd(::memfd_create("shoal-post-test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::pwrite(fd.get(), &index, sizeof index, 0), static_cast<ssize_t>(sizeof index));
  return fd;
}

std::uint64_t number_in(const unique_fd& fd) {
  std::uint64_t index = 0;
  EXPECT_EQ(::pread(fd.get(), &index, sizeof index, 0), static_cast<ssize_t>(sizeof index));
  return index;
}

// Posts frame `index` (every third with a descriptor) on `c`.
void post_numbered(connection& c, std::uint64_t index) {
  const unique_fd file = index % 3 == 0 ? numbered_file(index) : unique_fd();
  c.post(numbered_type, numbered(index), file.valid() ? file.get() : -1);  // post keeps its own copy
}

// Posts frames 0, 1, ... until the socket is full and some wait, then as
// many again; returns how many were posted.
std::uint64_t post_past_a_full_socket(connection& c) {
  std::uint64_t posted = 0;
  while (c.unsent_bytes() == 0) post_numbered(c, posted++);
  for (const std::uint64_t sent_at_once = posted; posted < 2 * sent_at_once;) post_numbered(c, posted++);
  return posted;
}

// Flushes `c` whenever its socket is writable until nothing waits.
void flush_until_empty(connection& c) {
  while (c.unsent_bytes() > 0) {
    pollfd writable{c.native_handle(), POLLOUT, 0};
    ASSERT_GE(::poll(&writable, 1, 5000), 0);
    (void)c.flush();
  }
}

struct received {
  std::uint64_t index = 0;
  std::size_t bytes = 0;
  bool has_fd = false;
  std::uint64_t fd_index = 0;
};

// The next `count` frames on `c`, or those that came before a receive failed
// (a test failure: the reader runs on a thread of its own).
std::vector<received> receive_count(connection& c, std::uint64_t count) {
  std::vector<received> out;
  try {
    for (std::uint64_t i = 0; i < count; ++i) {
      const channel::frame f = c.receive_for(5000ms);
      out.push_back({number_in(f.payload), f.payload.size(), f.fd.valid(), f.fd.valid() ? number_in(f.fd) : 0});
    }
  } catch (const error& e) {
    ADD_FAILURE() << "frame " << out.size() << " of " << count << ": " << e.what();
  }
  return out;
}

void expect_in_order(const std::vector<received>& frames) {
  for (std::uint64_t i = 0; i < frames.size(); ++i) {
    EXPECT_EQ(frames[i].index, i) << "frame " << i << " came out of order";
    EXPECT_EQ(frames[i].has_fd, i % 3 == 0) << "frame " << i;
    if (frames[i].has_fd) EXPECT_EQ(frames[i].fd_index, i) << "frame " << i << " came with another frame's descriptor";
  }
}

TEST(channel_post, frames_a_full_socket_does_not_take_wait_and_arrive_in_order_with_their_descriptors) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {});
  const auto start = std::chrono::steady_clock::now();
  const std::uint64_t posted = post_past_a_full_socket(sender);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "post waited for a peer that does not read";
  EXPECT_GT(sender.unsent_bytes(), posted / 2 * payload_bytes) << "the second half of the frames waits whole";

  std::vector<received> frames;
  std::jthread reader([&] { frames = receive_count(receiver, posted); });
  flush_until_empty(sender);
  reader.join();
  ASSERT_EQ(frames.size(), posted);
  expect_in_order(frames);
  EXPECT_FALSE(sender.unsent_since().has_value());
  EXPECT_FALSE(sender.broken());
}

TEST(channel_post, unsent_since_is_when_the_oldest_queued_frames_were_posted_however_much_of_them_the_peer_reads) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {});
  EXPECT_FALSE(sender.unsent_since().has_value());
  const auto before = std::chrono::steady_clock::now();
  const std::uint64_t posted = post_past_a_full_socket(sender);
  const auto filled = std::chrono::steady_clock::now();
  const auto since = sender.unsent_since();
  ASSERT_TRUE(since.has_value());
  EXPECT_GE(*since, before);
  EXPECT_LE(*since, filled);
  std::this_thread::sleep_for(20ms);
  const std::size_t waiting = sender.unsent_bytes();
  EXPECT_EQ(sender.flush(), waiting) << "the socket took bytes the peer did not read";
  post_numbered(sender, posted);
  EXPECT_EQ(sender.unsent_since(), since) << "a flush that moved nothing, or a post behind the queue, moved it";

  // The peer reads a quarter: a quarter of the queue goes, and frames
  // posted before the pause still wait.
  const auto first = receive_count(receiver, posted / 4);
  (void)sender.flush();
  EXPECT_LT(sender.unsent_bytes(), waiting) << "no queued bytes went";
  const auto after_reading = sender.unsent_since();
  ASSERT_TRUE(after_reading.has_value());
  EXPECT_LE(*after_reading, filled) << "bytes went and unsent_since moved past frames that still wait";
  std::vector<received> rest;
  std::jthread reader([&] { rest = receive_count(receiver, posted + 1 - first.size()); });
  flush_until_empty(sender);
  reader.join();
  EXPECT_FALSE(sender.unsent_since().has_value());
  std::vector<received> all = first;
  all.insert(all.end(), rest.begin(), rest.end());
  expect_in_order(all);
}

TEST(channel_post, frames_larger_than_the_socket_holds_are_written_in_parts_each_with_its_own_descriptor) {
  constexpr std::size_t kib = 1024;
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {}, 512 * kib);
  // 300 KiB first (more than the socket holds), then 100 to 275 KiB, every
  // one with a descriptor.
  constexpr std::uint64_t count = 9;
  const auto bytes_of = [](std::uint64_t i) { return (100 + 25 * ((i * 5 + 8) % 9)) * kib; };
  const auto post_large = [&](std::uint64_t i) {
    const unique_fd file = numbered_file(i);
    sender.post(numbered_type, numbered(i, bytes_of(i)), file.get());
  };
  post_large(0);
  const std::size_t first_batch = channel::batch_header_bytes + channel::frame_header_bytes + bytes_of(0);
  EXPECT_GT(sender.unsent_bytes(), 0u) << "the socket took all of a batch of " << first_batch << " bytes";
  EXPECT_LT(sender.unsent_bytes(), first_batch) << "the socket took none of the first batch: no partial write";
  for (std::uint64_t i = 1; i < count; ++i) post_large(i);

  std::vector<received> frames;
  std::jthread reader([&] { frames = receive_count(receiver, count); });
  flush_until_empty(sender);
  reader.join();
  ASSERT_EQ(frames.size(), count);
  for (std::uint64_t i = 0; i < count; ++i) {
    EXPECT_EQ(frames[i].index, i) << "frame " << i << " came out of order";
    EXPECT_EQ(frames[i].bytes, bytes_of(i)) << "frame " << i;
    ASSERT_TRUE(frames[i].has_fd) << "frame " << i << " came without its descriptor";
    EXPECT_EQ(frames[i].fd_index, i) << "frame " << i << " came with another frame's descriptor";
  }
  EXPECT_FALSE(sender.broken());
}

TEST(channel_post, destroying_a_connection_closes_the_descriptor_copies_its_queue_holds) {
  socket_pair pair;
  const std::size_t before = open_descriptor_count();  // both ends of the pair among them
  {
    connection sender = connection::adopt(std::move(pair.a), {});
    const std::uint64_t posted = post_past_a_full_socket(sender);
    constexpr std::uint64_t with_descriptors = 32;  // queued behind the rest, each with a copy
    for (std::uint64_t i = posted; i < posted + with_descriptors; ++i) {
      const unique_fd file = numbered_file(i);
      sender.post(numbered_type, numbered(i), file.get());
    }
    ASSERT_GE(open_descriptor_count(), before + with_descriptors) << "the queue holds no copies of descriptors";
  }
  EXPECT_EQ(open_descriptor_count(), before - 1) << "copies of queued descriptors outlived their connection";
}

// A descriptor posted behind a full socket whose last reference is the
// queue's copy (one a peer passed, say, holding a socket that lingers):
// dropping the connection leaves its close to the closer thread.
TEST(channel_post, a_queued_copy_whose_close_lingers_is_closed_off_the_dropping_thread) {
  socket_pair pair;
  auto sender = std::make_unique<connection>(connection::adopt(std::move(pair.a), {}));
  (void)post_past_a_full_socket(*sender);
  socket_holding_a_lingering_one held(2);
  sender->post(numbered_type, numbered(0), held.holder.get());
  held.holder.reset();  // the queue's copy holds the last reference now
  expect_returns_while_the_close_lingers([&] { sender.reset(); }, "dropping the connection closed the queued copy in place");
}

TEST(channel_post, a_post_behind_queued_bytes_waits_its_turn_when_the_socket_has_room_again) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {});
  const std::uint64_t posted = post_past_a_full_socket(sender);
  const auto first = receive_count(receiver, posted / 4);  // room in the socket, and nothing flushed
  post_numbered(sender, posted);
  std::vector<received> rest;
  std::jthread reader([&] { rest = receive_count(receiver, posted + 1 - first.size()); });
  flush_until_empty(sender);
  reader.join();
  std::vector<received> all = first;
  all.insert(all.end(), rest.begin(), rest.end());
  ASSERT_EQ(all.size(), posted + 1);
  expect_in_order(all);
}

TEST(channel_post, a_blocking_send_goes_after_what_was_posted_and_times_out_usable_when_it_cannot) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {});
  const std::uint64_t posted = post_past_a_full_socket(sender);
  sender.set_send_timeout(100ms);
  EXPECT_THROW(sender.send(numbered_type, numbered(posted)), timeout_error);
  EXPECT_FALSE(sender.broken()) << "nothing of that send went: the stream is in step";

  std::vector<received> frames;
  std::jthread reader([&] { frames = receive_count(receiver, posted + 1); });
  sender.set_send_timeout(5000ms);
  sender.send(numbered_type, numbered(posted));
  reader.join();
  EXPECT_EQ(sender.unsent_bytes(), 0u);
  ASSERT_EQ(frames.size(), posted + 1);
  for (std::uint64_t i = 0; i <= posted; ++i) EXPECT_EQ(frames[i].index, i) << "frame " << i << " came out of order";
}

TEST(channel_post, posting_to_a_peer_that_hung_up_breaks_the_connection) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  pair.b.reset();
  EXPECT_THROW(sender.post(numbered_type, numbered(0)), connection_closed);
  EXPECT_TRUE(sender.broken());
  EXPECT_THROW((void)sender.flush(), connection_closed);
}

}  // namespace
}  // namespace shoal::testing
