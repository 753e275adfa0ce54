// The wire form of shareable handles: round trip and malformed input.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <random>

#include "shoal/backend/shareable_handle.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using backend::handle_kind;
using backend::shareable_handle;

unique_fd any_fd() { return unique_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

shareable_handle sample() {
  shareable_handle h;
  h.kind = handle_kind::cuda_ipc;
  h.device = backend::device_kind::cuda;
  h.device_ordinal = 3;
  h.size = 20 << 20;
  h.offset = 4096;
  for (std::size_t i = 0; i < h.opaque.size(); ++i) h.opaque[i] = static_cast<std::byte>(i + 1);
  return h;
}

TEST(shareable_handle, round_trips) {
  const shareable_handle h = sample();
  const auto wire = h.serialize();
  ASSERT_EQ(wire.size(), shareable_handle::wire_bytes);
  const auto back = shareable_handle::deserialize(wire, unique_fd{});
  EXPECT_EQ(back.kind, h.kind);
  EXPECT_EQ(back.device, h.device);
  EXPECT_EQ(back.device_ordinal, 3);
  EXPECT_EQ(back.size, h.size);
  EXPECT_EQ(back.offset, h.offset);
  EXPECT_EQ(back.opaque, h.opaque);
}

TEST(shareable_handle, malformed_fields_are_refused) {
  const auto good = sample().serialize();
  auto expect_refused = [&](std::vector<std::byte> wire, unique_fd fd, const char* why) {
    EXPECT_THROW((void)shareable_handle::deserialize(wire, std::move(fd)), invalid_argument) << why;
  };
  expect_refused({good.begin(), good.end() - 1}, {}, "short");
  auto bad = good;
  bad[0] = std::byte{0};
  expect_refused(bad, {}, "magic");
  bad = good;
  bad[4] = std::byte{9};
  expect_refused(bad, {}, "version");
  bad = good;
  bad[6] = std::byte{7};
  expect_refused(bad, {}, "kind");
  bad = good;
  bad[7] = std::byte{1};
  expect_refused(bad, {}, "cuda handle claiming the host device");
  shareable_handle h = sample();
  h.offset = h.size;
  expect_refused(h.serialize(), {}, "offset past the end");
  expect_refused(good, any_fd(), "a descriptor with a kind that takes none");
  h = sample();
  h.kind = handle_kind::host_memfd;
  h.device = backend::device_kind::host;
  expect_refused(h.serialize(), {}, "memfd handle without a descriptor");
}

TEST(shareable_handle, a_refused_handle_closes_the_descriptor_it_came_with) {
  unique_fd fd = any_fd();
  const int number = fd.get();
  auto wire = sample().serialize();
  wire[0] = std::byte{0};  // bad magic
  EXPECT_THROW((void)shareable_handle::deserialize(wire, std::move(fd)), invalid_argument);
  EXPECT_EQ(::fcntl(number, F_GETFD), -1) << "the descriptor leaked";
}

TEST(shareable_handle, random_bytes_never_crash) {
  std::mt19937_64 random(1234);
  const auto good = sample().serialize();
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    auto wire = good;
    const int flips = 1 + static_cast<int>(random() % 4);
    for (int f = 0; f < flips; ++f) wire[random() % wire.size()] = static_cast<std::byte>(random());
    if (random() % 8 == 0) wire.resize(random() % (wire.size() + 8));
    try {
      (void)shareable_handle::deserialize(wire, unique_fd{});
      ++accepted;  // a mutation of the opaque bytes or a valid field value
    } catch (const invalid_argument&) {
    }
  }
  EXPECT_LT(accepted, 20000);
}

}  // namespace
}  // namespace shoal::testing
