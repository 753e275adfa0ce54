// A fuzz input read as a program: what a hostile producer writes into one
// connection. The first byte says how the connection opens (the sharing
// hello, none, or another protocol's); then each operation takes an opcode
// and fixed fields from the bytes that follow, and an input that runs out
// reads as zeros and ends the program. Operations:
//   raw bytes, with or without a descriptor attached: written as they are,
//     so every check of the channel's batches is reachable;
//   a frame of any type with any payload and any kind of descriptor;
//   the sharing messages, built with the protocol's own encoders from fields
//     the input picks (mostly from small menus, so ids, slots and generations
//     match what was announced often enough to build storages): counter
//     memory made the library's way with slots held, segments of sealed
//     memfds (or any other descriptor) with any size and offset, the event
//     page made the library's way, storages, retirements, notes.
// Frames gather into batches as the channel writes them (magic, version,
// frame count, body bytes, frames, padding to 256), sent whole with their
// descriptors; a flush operation, a raw write, or the batch limits end one.
//
// program_writer writes such programs (for the seed corpus); the opcodes and
// field order below are shared by both sides.
//
// Not thread-safe: value types built and read by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "fuzz/descriptor_kit.h"

namespace shoal::fuzz {

enum class opcode : std::uint8_t {
  raw,                  // u16 length, bytes
  raw_with_descriptor,  // u8 kind, u8 size, u16 length (at least 1), bytes
  frame,                // u16 type, u8 kind (0: none), u8 size, u16 length, bytes
  counter_file,         // u8 id, u8 slots, u8 declared, u8 held, u8 generation, u8 kind
                        // (0: its own), u8 size
  segment,              // u8 id, u8 kind (0: sealed memfd), u8 size, u8 size mode, u8 offset
                        // mode, u8 handle kind, u8 device, u64 size, u64 offset
  event_source,         // u8 id mode, u8 kind (0: the page), u8 size, u8 source kind,
                        // u8 device, u64 id
  storage,              // u8 count, u8 id x3, u8 offset mode (menus, or at the edges of what
                        // the segments as announced map), u8 size mode, u64 offset, u64
                        // size, u8 file, u8 slot, u8 generation, u8 ready mode, u16 stream
                        // slot, u8 ticket mode, u64 raw id, u8 metadata length, bytes
  retire_segments,      // u8 count, u8 id x3
  retire_files,         // u8 count, u8 id x3
  note,                 // u16 length, bytes
  flush,
  hello,
};
inline constexpr std::uint8_t opcodes = 12;

/// How the connection opens (the program's first byte, modulo 4).
enum class opening : std::uint8_t { sharing_hello, none, other_version, other_protocol };

/// One write onto the socket, with descriptors attached (SCM_RIGHTS).
struct socket_write {
  std::vector<std::byte> bytes;
  std::vector<int> fds;  // owned by the program's kit
};

/// A program read from an input: its writes, and the kit that owns every
/// descriptor they carry (keep the program until the receiver is done).
class hostile_program {
 public:
  explicit hostile_program(std::span<const std::uint8_t> input);

  [[nodiscard]] const std::vector<socket_write> &writes() const noexcept { return writes_; }
  [[nodiscard]] descriptor_kit &kit() noexcept { return kit_; }

 private:
  struct pending_frame {
    std::uint16_t type;
    std::vector<std::byte> payload;
    int fd;
  };
  void add_frame(std::uint16_t type, std::vector<std::byte> payload, int fd);
  void flush();

  struct segment_geometry {
    std::uint64_t size, offset;
  };

  descriptor_kit kit_;
  std::map<std::uint64_t, segment_geometry> segments_;  // as announced, for storage offsets at their edges
  std::vector<pending_frame> batch_;
  std::vector<socket_write> writes_;
};

/// Writes programs, field by field as hostile_program reads them.
class program_writer {
 public:
  explicit program_writer(opening how = opening::sharing_hello) { u8(static_cast<std::uint8_t>(how)); }

  program_writer &op(opcode o) { return u8(static_cast<std::uint8_t>(o)); }
  program_writer &u8(std::uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  program_writer &u16(std::uint16_t v) { return u8(v & 0xff).u8(v >> 8); }
  program_writer &u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) u8(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  program_writer &text(const std::string &s) {
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  [[nodiscard]] const std::vector<std::uint8_t> &bytes() const noexcept { return bytes_; }

 private:
  std::vector<std::uint8_t> bytes_;
};

}  // namespace shoal::fuzz
