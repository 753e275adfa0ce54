// Layouts on their own: what makes one malformed, the content hash (SHA-256
// against the standard's test vectors, and over a region's entries in offset
// order), and the layout messages' decoders against mutated frames.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "lending/messages.h"
#include "lending/sha256.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"

namespace shoal::testing {
namespace {

using lending::dtype;
using lending::layout_entry;
using lending::region_layout;

std::string sha256_hex(std::string_view text) {
  lending::detail::sha256 h;
  h.update(std::as_bytes(std::span(text.data(), text.size())));
  return lending::to_hex(h.finish());
}

TEST(content_hash, sha256_matches_the_standard_test_vectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // A million 'a's, given in uneven pieces: the buffering across update() calls.
  lending::detail::sha256 h;
  const std::string piece(997, 'a');
  std::size_t left = 1000000;
  while (left > 0) {
    const std::size_t n = std::min(left, piece.size() - left % 7);
    h.update(std::as_bytes(std::span(piece.data(), n)));
    left -= n;
  }
  EXPECT_EQ(lending::to_hex(h.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(content_hash, hex_round_trips_and_refuses_what_is_not_64_hex_digits) {
  const auto hash = lending::hash_from_hex("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(lending::to_hex(hash), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_THROW((void)lending::hash_from_hex("ba78"), invalid_argument);
  EXPECT_THROW((void)lending::hash_from_hex(std::string(63, '0') + "g"), invalid_argument);
}

region_layout two_entries() {
  region_layout layout;
  layout.entries = {{"embed", 0, 64, dtype::float32, {4, 4}}, {"head", 64, 32, dtype::float16, {16}}};
  return layout;
}

TEST(region_layout, a_well_formed_layout_passes_and_entries_are_found_by_name) {
  const auto layout = two_entries();
  EXPECT_EQ(lending::layout_problem(layout, 96), "");
  EXPECT_EQ(layout.at("head").offset, 64u);
  try {
    (void)layout.at("tail");
    ADD_FAILURE() << "an entry that is not there was found";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'embed', 'head'"), std::string::npos) << e.what();
  }
}

TEST(region_layout, malformed_layouts_are_named_for_what_is_wrong) {
  const auto problem = [](auto change, std::size_t region = 96) {
    auto layout = two_entries();
    change(layout);
    return lending::layout_problem(layout, region);
  };
  const auto says = [](const std::string& problem, const char* what) {
    return problem.find(what) != std::string::npos;
  };
  EXPECT_TRUE(says(problem([](auto&) {}, 95), "past the region's 95")) << "out of the region";
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].offset = 60; }), "overlap"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries.push_back({"inside", 8, 4, dtype::int32, {1}}); }, 200),
                   "overlap"))
      << "an entry inside another";
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].name = "embed"; }), "two entries are named 'embed'"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].name = "new\nline"; }), "printable ASCII"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].name = ""; }), "printable ASCII"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].name = std::string(65, 'n'); }), "printable ASCII"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].type = static_cast<dtype>(99); }), "no dtype"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].shape = {17}; }), "its shape holds 17 elements"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].offset = 65; }), "not a multiple of its item size"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].shape = std::vector<std::uint64_t>(9, 1); }),
                   "at most 8"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].shape = {1ull << 40, 1ull << 40}; }), "64 bits"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries[1].offset = ~0ull - 1; }), "past the region"));
  EXPECT_TRUE(says(problem([](auto& l) { l.entries.clear(); }), "1 to 4096 entries"));
  EXPECT_TRUE(says(problem(
                       [](auto& l) {
                         l.entries.clear();
                         for (int i = 0; i <= 4096; ++i) l.entries.push_back({std::to_string(i), 0, 0, dtype::uint8, {0}});
                       }),
                   "1 to 4096 entries"));
  EXPECT_EQ(problem([](auto& l) { l.entries.push_back({"empty", 96, 0, dtype::uint8, {0}}); }), "")
      << "an entry of 0 bytes overlaps nothing, even at the region's end";
}

// A layout's entries are bounded by its region's size (what the lender keeps
// for it stays in proportion to the memory lent): one per 16 KiB, at least
// 128, at most 4096.
TEST(region_layout, a_layout_has_at_most_one_entry_per_16_kib_of_its_region_and_at_least_128_allowed) {
  const auto of_entries = [](std::size_t n) {
    region_layout layout;
    for (std::size_t i = 0; i < n; ++i) layout.entries.push_back({std::to_string(i), 0, 0, dtype::uint8, {0}});
    return layout;
  };
  constexpr std::size_t mib = std::size_t{1} << 20;
  EXPECT_EQ(lending::max_entries_for(96), 128u);
  EXPECT_EQ(lending::max_entries_for(2 * mib), 128u);
  EXPECT_EQ(lending::max_entries_for(8 * mib), 512u);
  EXPECT_EQ(lending::max_entries_for(64 * mib), 4096u);
  EXPECT_EQ(lending::max_entries_for(std::size_t{1} << 40), 4096u);
  EXPECT_EQ(lending::layout_problem(of_entries(128), 2 * mib), "");
  EXPECT_NE(lending::layout_problem(of_entries(129), 2 * mib).find("at most 128 entries"), std::string::npos);
  EXPECT_EQ(lending::layout_problem(of_entries(512), 8 * mib), "");
  EXPECT_NE(lending::layout_problem(of_entries(513), 8 * mib).find("at most 512 entries"), std::string::npos);
  EXPECT_EQ(lending::layout_problem(of_entries(4096), 64 * mib), "");
}

TEST(region_layout, the_hash_covers_the_entries_bytes_in_offset_order_and_nothing_else) {
  auto& dev = backend::host_device_instance();
  std::vector<std::uint8_t> region(128);
  for (std::size_t i = 0; i < region.size(); ++i) region[i] = static_cast<std::uint8_t>(i);
  auto layout = two_entries();
  lending::detail::sha256 expected;
  expected.update(std::as_bytes(std::span(region.data(), 96)));
  const auto hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  EXPECT_EQ(hash, expected.finish());
  std::swap(layout.entries[0], layout.entries[1]);
  EXPECT_EQ(lending::hash_entries(dev, region.data(), region.size(), layout), hash) << "the order entries are listed in does not matter";
  region[100] ^= 0xff;  // not in any entry
  EXPECT_EQ(lending::hash_entries(dev, region.data(), region.size(), layout), hash);
  region[70] ^= 0xff;
  EXPECT_NE(lending::hash_entries(dev, region.data(), region.size(), layout), hash);
  layout.entries[0].offset = 120;
  EXPECT_THROW((void)lending::hash_entries(dev, region.data(), region.size(), layout), invalid_argument);
}

TEST(layout_messages, mutated_frames_decode_or_are_refused_and_never_read_past_the_payload) {
  auto layout = two_entries();
  layout.entries[0].shape = {2, 2, 2, 2};
  layout.entries[0].bytes = 64;
  const std::vector<std::vector<std::byte>> valid{
      lending::detail::encode(lending::detail::publish_message{1, 2, layout}),
      lending::detail::encode(lending::detail::layout_message{3, layout}),
      lending::detail::encode(lending::detail::borrow_shared_message{4, "model", layout.hash}),
      lending::detail::encode(lending::detail::borrow_shared_message{5, "model", {}}),
  };
  EXPECT_EQ(lending::detail::decode_publish(valid[0]).layout.entries[0].shape, layout.entries[0].shape);
  EXPECT_EQ(lending::detail::decode_layout(valid[1]).layout.entries[1].name, "head");
  EXPECT_EQ(lending::detail::decode_borrow_shared(valid[2]).expected, layout.hash);
  EXPECT_FALSE(lending::detail::decode_borrow_shared(valid[3]).expected.has_value());
  std::mt19937 rng(16);
  std::size_t decoded = 0;
  for (int round = 0; round < 20000; ++round) {
    auto payload = valid[round % valid.size()];
    const int flips = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int i = 0; i < flips; ++i) {
      payload[std::uniform_int_distribution<std::size_t>(0, payload.size() - 1)(rng)] = static_cast<std::byte>(rng());
    }
    if (round % 5 == 0) payload.resize(std::uniform_int_distribution<std::size_t>(0, payload.size())(rng));
    try {
      switch (round % valid.size()) {
        case 0:
          (void)lending::layout_problem(lending::detail::decode_publish(payload).layout, 96);
          break;
        case 1:
          (void)lending::layout_problem(lending::detail::decode_layout(payload).layout, 96);
          break;
        default:
          (void)lending::detail::decode_borrow_shared(payload);
      }
      ++decoded;
    } catch (const protocol_error&) {  // NOLINT(bugprone-empty-catch): refused is what a mangled frame gets
    }
  }
  EXPECT_GT(decoded, 0u) << "no mutation decoded: the test reaches no further than the first fields";
}

}  // namespace
}  // namespace shoal::testing
