// Malformed input from a peer: bad batches, bad descriptor counts and fuzzed
// bytes close only their own connection, and leak no descriptor.
#include <gtest/gtest.h>

#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;
using channel::listener;

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

// A connection that takes no descriptors (refuse_descriptors) refuses the
// first bytes of a batch that bring one, at once: nothing is kept while the
// peer stalls, not even the descriptor (the kernel closed it unread).
TEST(channel_protocol, a_connection_that_refuses_descriptors_keeps_none_of_a_stalled_batch) {
  for (const bool refusing : {true, false}) {
    SCOPED_TRACE(refusing ? "refuse_descriptors" : "default");
    socket_pair pair;
    connection victim = connection::adopt(std::move(pair.b), {});
    if (refusing) {
      victim.refuse_descriptors();
      allow_descriptors_in_kernel(victim.native_handle());  // the reads' refusal, as on kernels before 6.16
    }
    pipe_ends pipe;
    const std::size_t descriptors_before = open_descriptor_count();
    const auto batch = raw_batch("SHOL", 2, {{1, std::vector<std::byte>(64), 1}});
    write_raw(pair.a.get(), {batch[0]}, {pipe.write.get()});  // one byte, then nothing
    if (!refusing) {
      EXPECT_FALSE(victim.try_receive().has_value());
      EXPECT_EQ(open_descriptor_count(), descriptors_before + 1) << "the stalled batch's descriptor is kept";
      continue;
    }
    try {
      (void)victim.try_receive();
      ADD_FAILURE() << "a descriptor was taken";
    } catch (const protocol_error& e) {
      EXPECT_NE(std::string(e.what()).find("takes none"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(victim.broken());
    EXPECT_EQ(open_descriptor_count(), descriptors_before) << "a descriptor that came is open";
    EXPECT_TRUE(reads_end_of_stream(pair.a.get())) << "the peer sees its connection closed";
  }
}

// The refused descriptors are never installed in the receiving process: a
// descriptor installed and closed there would drop the process's POSIX lock
// on its file (a peer could make a server lose its locks that way).
TEST(channel_protocol, descriptors_refused_are_never_installed_so_the_receivers_locks_hold) {
  const std::string path = "/tmp/shoal-refused-lock-" + std::to_string(::getpid());
  const unique_fd locked(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  ASSERT_TRUE(locked);
  ::unlink(path.c_str());
  struct flock whole {};
  whole.l_type = F_WRLCK;
  whole.l_whence = SEEK_SET;
  ASSERT_EQ(::fcntl(locked.get(), F_SETLK, &whole), 0);
  socket_pair pair;
  connection victim = connection::adopt(std::move(pair.b), {});
  victim.refuse_descriptors();
  allow_descriptors_in_kernel(victim.native_handle());  // the reads' refusal, as on kernels before 6.16
  const auto batch = raw_batch("SHOL", 2, {{1, std::vector<std::byte>(64), 1}});
  write_raw(pair.a.get(), {batch[0]}, {locked.get()});  // a descriptor of the locked file
  EXPECT_THROW((void)victim.try_receive(), protocol_error);
  // Another process asks who holds the lock: still this one.
  forked_child probe([&] {
    struct flock asked {};
    asked.l_type = F_WRLCK;
    asked.l_whence = SEEK_SET;
    if (::fcntl(locked.get(), F_GETLK, &asked) != 0) return 2;
    return asked.l_type != F_UNLCK ? 0 : 1;
  });
  EXPECT_EQ(probe.wait_for(10s), std::optional<int>(0))
      << "1: the process lost its lock (a refused descriptor was closed here)";
}

// A socket that had SO_PASSCRED on (a socketpair's greeting turns it on for
// a while) still takes batches without descriptors once it refuses them:
// credentials, with no room left for them, would cut every read short.
TEST(channel_protocol, a_connection_that_refuses_descriptors_still_reads_batches_on_a_credentials_socket) {
  socket_pair pair;
  const int on = 1;
  ASSERT_EQ(::setsockopt(pair.b.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof on), 0);
  connection victim = connection::adopt(std::move(pair.b), {});
  victim.refuse_descriptors();
  connection sender = connection::adopt(std::move(pair.a), {});
  sender.send(7, bytes_of("no descriptor"));
  EXPECT_EQ(text_of(victim.receive_for(2s).payload), "no descriptor");
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

}  // namespace
}  // namespace shoal::testing
