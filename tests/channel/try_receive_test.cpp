// Reading without waiting (connection::try_receive): a batch that comes in
// parts is put together over several calls — nothing returned until it is
// whole, since when it is part-read said by incomplete_since — and a
// blocking receive goes on from where try_receive left off; what is
// malformed or cut short breaks the connection as receive does.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;

std::vector<std::byte> part(const std::vector<std::byte>& batch, std::size_t from, std::size_t to) {
  return {batch.begin() + static_cast<std::ptrdiff_t>(from), batch.begin() + static_cast<std::ptrdiff_t>(to)};
}

TEST(channel_try_receive, with_nothing_sent_returns_nothing_and_the_connection_stays_usable) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  EXPECT_FALSE(c.try_receive().has_value());
  EXPECT_FALSE(c.incomplete_since().has_value());
  EXPECT_FALSE(c.broken());
}

TEST(channel_try_receive, a_batch_in_parts_comes_out_whole_once_its_last_part_is_in) {
  const std::vector<std::byte> batch = raw_batch("SHOL", 2, {{7, bytes_of("first")}, {8, bytes_of("second")}}, 1024);
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  write_raw(pair.b.get(), part(batch, 0, 8));  // within the header
  EXPECT_FALSE(c.try_receive().has_value());
  const auto since = c.incomplete_since();
  ASSERT_TRUE(since.has_value());
  write_raw(pair.b.get(), part(batch, 8, 300));  // within the body
  EXPECT_FALSE(c.try_receive().has_value());
  EXPECT_EQ(c.incomplete_since(), since) << "the time its first part was read";
  write_raw(pair.b.get(), part(batch, 300, batch.size()));
  const auto first = c.try_receive();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(text_of(first->payload), "first");
  EXPECT_FALSE(c.incomplete_since().has_value());
  EXPECT_EQ(c.pending(), 1u);
  const auto second = c.try_receive();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(text_of(second->payload), "second");
  EXPECT_FALSE(c.try_receive().has_value());
  EXPECT_FALSE(c.broken());
}

TEST(channel_try_receive, a_blocking_receive_goes_on_from_the_part_it_read) {
  const std::vector<std::byte> batch = raw_batch("SHOL", 2, {{5, bytes_of("whole")}});
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  write_raw(pair.b.get(), part(batch, 0, 100));
  EXPECT_FALSE(c.try_receive().has_value());
  std::thread rest([&] {
    std::this_thread::sleep_for(20ms);
    write_raw(pair.b.get(), part(batch, 100, batch.size()));
  });
  const channel::frame f = c.receive_for(10s);
  rest.join();
  EXPECT_EQ(f.type, 5);
  EXPECT_EQ(text_of(f.payload), "whole");
  EXPECT_FALSE(c.incomplete_since().has_value());
}

TEST(channel_try_receive, a_malformed_batch_is_a_protocol_error_and_breaks_the_connection) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  write_raw(pair.b.get(), raw_batch("SHOX", 2, {{1, bytes_of("x")}}));
  EXPECT_THROW((void)c.try_receive(), protocol_error);
  EXPECT_TRUE(c.broken());
  EXPECT_FALSE(c.incomplete_since().has_value());
}

TEST(channel_try_receive, a_peer_that_hangs_up_mid_batch_is_connection_closed) {
  const std::vector<std::byte> batch = raw_batch("SHOL", 2, {{1, bytes_of("cut")}});
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  write_raw(pair.b.get(), part(batch, 0, 40));
  EXPECT_FALSE(c.try_receive().has_value());
  ::shutdown(pair.b.get(), SHUT_WR);
  EXPECT_THROW((void)c.try_receive(), connection_closed);
  EXPECT_TRUE(c.broken());
}

}  // namespace
}  // namespace shoal::testing
