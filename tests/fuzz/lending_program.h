// A fuzz input read as what a hostile peer of the lending protocol sends into
// one connection: a borrower's frames to a lender, or a lender's to a
// borrower (lending_target.h says which side gets them). Each operation takes
// an opcode and fixed fields from the bytes that follow; an input that runs
// out reads as zeros and ends the program. Messages are built with the
// protocol's own encoders from fields the input picks, mostly from small
// menus (the region ids a fresh lender hands out, sizes at the edges of the
// granularity and the capacity), so that real regions are lent, mapped and
// revoked often; any frame, any descriptor of the kit and raw bytes make
// everything else reachable. Operations, each with its fields in order:
//   hello          u8 variant (0: the lending hello, 1: another version, 2: another protocol,
//                  3: an observer's hello)
//   borrow         u8 request, u8 size choice, u64 raw size, u8 mode, u8 purpose choice
//   give_back      u8 region choice, u64 raw region
//   query_metrics  u8 length (below 200: no payload, else 200 + its length), bytes
//   lent           u8 request, u8 region choice, u64 raw region, u8 size choice, u64 raw size, u8 chunks
//   chunk          u8 handle kind, u8 size choice, u64 raw size, u8 offset choice, u8 descriptor, u8 memfd size
//   refused        u8 request, u8 reason, u8 length, bytes
//   given_back     u8 region choice, u64 raw region
//   metrics        u16 length, bytes
//   revoke         u8 region choice, u64 raw region, u32 deadline in ms
//   frame          u16 type, u8 length, bytes, u8 descriptor
//   raw            u16 length, bytes: written into the socket as they are
// A descriptor byte is 0 for none, else 1 + a descriptor_kind (with the memfd
// size byte that follows it where there is one, memfd_sizes).
//
// Not thread-safe: value types built and read by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fuzz/descriptor_kit.h"
#include "shoal/channel/protocol.h"

namespace shoal::fuzz {

enum class lending_op : std::uint8_t {
  hello,
  borrow,
  give_back,
  query_metrics,
  lent,
  chunk,
  refused,
  given_back,
  metrics,
  revoke,
  frame,
  raw,
  forget,
};
inline constexpr std::uint8_t lending_ops = 13;

/// Sizes a size choice picks (choice % 9; 8: the raw size that follows):
/// around the host backend's 2 MiB granularity and the target lender's
/// capacity of 64 MiB, and the ends of 64 bits.
inline constexpr std::uint64_t lending_sizes[] = {1,        4096,           2u << 20,      (2u << 20) + 1,
                                                  64u << 20, (64u << 20) + 1, std::uint64_t{1} << 63, ~std::uint64_t{0}};

/// One thing the hostile peer does: a frame (a hello is one) with an optional
/// descriptor, or raw bytes.
struct peer_action {
  bool raw = false;
  std::uint16_t type = 0;
  std::vector<std::byte> bytes;  // the payload, or the raw bytes
  int fd = -1;                   // owned by the program's kit
};

class lending_program {
 public:
  explicit lending_program(std::span<const std::uint8_t> input);

  [[nodiscard]] const std::vector<peer_action>& actions() const noexcept { return actions_; }
  [[nodiscard]] descriptor_kit& kit() noexcept { return kit_; }

 private:
  descriptor_kit kit_;
  std::vector<peer_action> actions_;
};

/// Writes programs, field by field as lending_program reads them.
class lending_writer {
 public:
  lending_writer& op(lending_op o) { return u8(static_cast<std::uint8_t>(o)); }
  lending_writer& u8(std::uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  lending_writer& u16(std::uint16_t v) { return u8(v & 0xff).u8(v >> 8); }
  lending_writer& u32(std::uint32_t v) { return u16(v & 0xffff).u16(v >> 16); }
  lending_writer& u64(std::uint64_t v) { return u32(v & 0xffffffff).u32(v >> 32); }
  lending_writer& text(const std::string& s) {
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  [[nodiscard]] const std::vector<std::uint8_t>& bytes() const noexcept { return bytes_; }

 private:
  std::vector<std::uint8_t> bytes_;
};

}  // namespace shoal::fuzz
