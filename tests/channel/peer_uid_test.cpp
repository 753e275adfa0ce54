// Peers of another uid (root only; skipped otherwise): refused unless the
// access policy allows them (by uid or by group), on either side, and kept out by the 0700
// directory of a path address.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "support/other_uids.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::access_policy;
using channel::channel_address;
using channel::connection;
using channel::listener;

constexpr const char* needs_root =
    "running a peer as uid 65534 (nobody) needs root and the uid mapped";

TEST(channel_uid, a_client_of_another_uid_is_refused_and_the_listener_keeps_working) {
  if (!may_act_as({65534})) GTEST_SKIP() << needs_root;
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
  if (!may_act_as({65534})) GTEST_SKIP() << needs_root;
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

TEST(channel_uid, a_client_of_an_allowed_group_is_accepted) {
  if (!may_act_as({65534})) GTEST_SKIP() << needs_root;
  const auto address = fresh_abstract_name();
  listener server(address, access_policy{{}, {nobody}});  // its uid is not listed, its gid is
  const raw_address target = raw_address_of(address);
  forked_child guest([&] {
    const int switched = become_nobody();
    return switched != 0 ? switched : connect_and_hold(target);
  });
  {
    const connection accepted = server.accept();
    EXPECT_EQ(accepted.peer().gid, nobody);
  }
  EXPECT_EQ(guest.wait(), 0);
}

TEST(channel_uid, a_server_of_another_uid_is_refused) {
  if (!may_act_as({65534})) GTEST_SKIP() << needs_root;
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
  if (!may_act_as({65534})) GTEST_SKIP() << needs_root;
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
