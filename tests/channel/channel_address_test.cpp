// Channel addresses: what can and cannot be a UNIX socket address.
#include <gtest/gtest.h>

#include <string>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using channel::channel_address;

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

}  // namespace
}  // namespace shoal::testing
