// The streaming staging copy: every byte lands, for every alignment of source
// and destination and for sizes around the 16-byte head and 64-byte lines,
// and nothing beside the destination range is written.
#include "transfer/streaming_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace shoal::transfer {
namespace {

TEST(streaming_copy, every_byte_arrives_and_none_beside_it_for_every_alignment) {
  constexpr std::size_t guard = 64;
  for (std::size_t bytes : {0u, 1u, 15u, 16u, 17u, 63u, 64u, 65u, 127u, 200u, 4099u, (1u << 20) + 13u}) {
    for (std::size_t dst_offset = 0; dst_offset < 16; dst_offset += 3) {
      for (std::size_t src_offset = 0; src_offset < 16; src_offset += 5) {
        std::vector<std::uint8_t> src(bytes + 2 * guard), dst(bytes + 2 * guard, 0xee);
        for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + bytes);
        copy_streaming(dst.data() + guard + dst_offset, src.data() + src_offset, bytes);
        for (std::size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= guard + dst_offset && i < guard + dst_offset + bytes;
          const std::uint8_t expected = inside ? src[i - guard - dst_offset + src_offset] : 0xee;
          ASSERT_EQ(dst[i], expected) << "byte " << i << " of a copy of " << bytes << " bytes, destination offset "
                                      << dst_offset << ", source offset " << src_offset;
        }
      }
    }
  }
}

}  // namespace
}  // namespace shoal::transfer
