// Protocols over a channel name themselves in their first frame
// (shoal/channel/protocol.h): a peer of another protocol, or of another
// version, is refused with a message naming both.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shoal/channel/channel.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using channel::connection;
using channel::protocol_id;

constexpr protocol_id sharing_v1{"shoal.sharing", 1};

std::pair<connection, connection> socket_pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw std::runtime_error("socketpair");
  return {connection::adopt(unique_fd(fds[0]), {}), connection::adopt(unique_fd(fds[1]), {})};
}

channel::frame hello_frame(std::vector<std::byte> payload) {
  channel::frame f;
  f.type = channel::hello_frame_type;
  f.payload = std::move(payload);
  return f;
}

std::string refusal(const channel::frame& f, const protocol_id& expected) {
  try {
    channel::check_hello(f, expected);
  } catch (const protocol_error& e) {
    return e.what();
  }
  return "";
}

TEST(protocol_hello, a_hello_for_the_same_protocol_and_version_passes_over_a_connection) {
  auto [a, b] = socket_pair();
  channel::send_hello(a, sharing_v1);
  const channel::frame first = b.receive();
  EXPECT_EQ(first.type, channel::hello_frame_type);
  EXPECT_NO_THROW(channel::check_hello(first, sharing_v1));
}

TEST(protocol_hello, a_peer_of_another_protocol_is_told_both_names) {
  const std::string why = refusal(hello_frame(channel::encode_hello({"shoal.lending", 1})), sharing_v1);
  EXPECT_NE(why.find("the peer speaks 'shoal.lending' version 1"), std::string::npos) << why;
  EXPECT_NE(why.find("this side speaks 'shoal.sharing' version 1"), std::string::npos) << why;
  EXPECT_NE(why.find("wrong socket"), std::string::npos) << why;
}

TEST(protocol_hello, a_peer_of_another_version_is_told_both_versions) {
  const std::string why = refusal(hello_frame(channel::encode_hello({"shoal.sharing", 2})), sharing_v1);
  EXPECT_NE(why.find("'shoal.sharing' version 2"), std::string::npos) << why;
  EXPECT_NE(why.find("'shoal.sharing' version 1"), std::string::npos) << why;
  EXPECT_NE(why.find("matching shoal versions"), std::string::npos) << why;
}

// A hostile peer's name is bytes: the message writes those outside printable
// ASCII as \xNN, so that a NUL does not cut it short and it stays text.
TEST(protocol_hello, a_name_that_is_no_text_is_written_as_escapes) {
  const std::string name("ev\xff\x00\x1b[31m\\", 10);
  const std::string why = refusal(hello_frame(channel::encode_hello({name, 1})), sharing_v1);
  EXPECT_NE(why.find("the peer speaks 'ev\\xff\\x00\\x1b[31m\\x5c' version 1"), std::string::npos) << why;
  EXPECT_NE(why.find("wrong socket"), std::string::npos) << "the message was cut short: " << why;
}

TEST(protocol_hello, a_first_frame_that_is_not_a_hello_is_refused) {
  channel::frame f;
  f.type = 7;
  const std::string why = refusal(f, sharing_v1);
  EXPECT_NE(why.find("is not a protocol hello"), std::string::npos) << why;
}

TEST(protocol_hello, malformed_hellos_are_refused) {
  auto good = channel::encode_hello(sharing_v1);
  auto truncated = good;
  truncated.pop_back();
  auto trailing = good;
  trailing.push_back(std::byte{0});
  std::vector<std::byte> long_name(4 + 65 + 2, std::byte{'a'});
  long_name[0] = std::byte{65};
  long_name[1] = long_name[2] = long_name[3] = std::byte{0};
  for (auto* payload : {&truncated, &trailing, &long_name}) {
    EXPECT_THROW(channel::check_hello(hello_frame(*payload), sharing_v1), protocol_error);
  }
  auto with_descriptor = hello_frame(good);
  with_descriptor.fd = unique_fd(::dup(0));
  EXPECT_THROW(channel::check_hello(with_descriptor, sharing_v1), protocol_error);
  EXPECT_NO_THROW(channel::check_hello(hello_frame(good), sharing_v1)) << "the unaltered hello passes";
}

TEST(protocol_hello, a_protocol_name_must_have_1_to_64_bytes) {
  EXPECT_THROW((void)channel::encode_hello({"", 1}), invalid_argument);
  const std::string too_long(channel::max_protocol_name_bytes + 1, 'x');
  EXPECT_THROW((void)channel::encode_hello({too_long, 1}), invalid_argument);
  const std::string longest(channel::max_protocol_name_bytes, 'x');
  EXPECT_NO_THROW(channel::check_hello(hello_frame(channel::encode_hello({longest, 3})), {longest, 3}));
}

TEST(protocol_hello, a_side_of_several_protocols_learns_which_one_the_peer_speaks) {
  constexpr protocol_id lending{"shoal.lending", 4};
  constexpr protocol_id observing{"shoal.lending.observer", 4};
  const std::array expected{lending, observing};
  EXPECT_EQ(channel::check_hello_one_of(hello_frame(channel::encode_hello(lending)), expected), 0U);
  EXPECT_EQ(channel::check_hello_one_of(hello_frame(channel::encode_hello(observing)), expected), 1U);
  try {
    (void)channel::check_hello_one_of(hello_frame(channel::encode_hello({"shoal.lending.observer", 3})), expected);
    ADD_FAILURE() << "another version of one of them passed";
  } catch (const protocol_error& e) {
    const std::string why = e.what();
    EXPECT_NE(why.find("'shoal.lending' version 4 or 'shoal.lending.observer' version 4"), std::string::npos) << why;
    EXPECT_NE(why.find("matching shoal versions"), std::string::npos) << why;
  }
  EXPECT_THROW((void)channel::check_hello_one_of(hello_frame(channel::encode_hello(sharing_v1)), expected),
               protocol_error);
  EXPECT_THROW((void)channel::check_hello_one_of(hello_frame(channel::encode_hello(lending)), {}), invalid_argument);
}

}  // namespace
}  // namespace shoal::testing
