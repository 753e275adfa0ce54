#include "fuzz/seed_programs.h"

#include "fuzz/hostile_program.h"

namespace shoal::fuzz {

namespace {

constexpr std::uint8_t size_2mib = 3;  // memfd_sizes[3]

// Counter file `id` of 8 slots, the first 4 held under generation 1; `kind`
// 0 is real counter memory, else 1 + a descriptor_kind.
void counter_file(program_writer &w, std::uint8_t id, std::uint8_t kind = 0) {
  w.op(opcode::counter_file).u8(id).u8(3).u8(0).u8(4).u8(1).u8(kind).u8(0);
}

// Segment `id`: a memfd of 2 MiB; offset mode 0 (none), 1 (4 KiB) or 2 (half of
// it).
void segment(program_writer &w, std::uint8_t id, std::uint8_t offset_mode = 0, std::uint8_t kind = 0) {
  w.op(opcode::segment).u8(id).u8(kind).u8(size_2mib).u8(0).u8(offset_mode).u8(0).u8(0).u64(0).u64(0);
}

struct storage_fields {
  std::vector<std::uint8_t> ids{1};
  std::uint8_t offset_mode = 0;  // 0: 0
  std::uint8_t size_mode = 0;    // 0: 8 KiB
  std::uint8_t slot = 0;
  std::uint8_t ready_mode = 0;   // 0: none, 1: a point of the page
  std::uint8_t ticket_mode = 0;  // 0: passed, 1: the first, 2: never
};

void storage(program_writer &w, const storage_fields &f) {
  w.op(opcode::storage).u8(static_cast<std::uint8_t>(f.ids.size()));
  for (std::size_t i = 0; i < 3; ++i) w.u8(i < f.ids.size() ? f.ids[i] : 0);
  w.u8(f.offset_mode).u8(f.size_mode).u64(0).u64(0).u8(1).u8(f.slot).u8(1);
  w.u8(f.ready_mode).u16(5).u8(f.ticket_mode).u64(0);
  w.u8(4).text("meta");
}

void event_source(program_writer &w) { w.op(opcode::event_source).u8(0).u8(0).u8(0).u8(0).u8(0).u64(0); }

// A block 4 KiB into its segment, as a producer shares most blocks.
program_writer share() {
  program_writer w;
  counter_file(w, 1);
  segment(w, 1, 1);
  storage(w, {});
  return w;
}

}  // namespace

std::vector<seed_program> seed_programs() {
  std::vector<seed_program> seeds;
  seeds.push_back({"share", share().bytes(), 1, 0, "closed"});
  {
    program_writer w = share();
    w.op(opcode::note).u16(5).text("hello");
    storage(w, {.slot = 1});
    seeds.push_back({"two_shares_and_a_note", w.bytes(), 2, 1, "closed"});
  }
  {
    program_writer w;
    counter_file(w, 1);
    for (std::uint8_t id = 1; id <= 3; ++id) segment(w, id);
    storage(w, {.ids = {1, 2, 3}, .offset_mode = 4, .size_mode = 4});  // the middle chunk
    seeds.push_back({"share_across_three_chunks", w.bytes(), 1, 0, "closed"});
  }
  {
    program_writer w;
    counter_file(w, 1);
    event_source(w);
    segment(w, 1);
    storage(w, {.ready_mode = 1, .ticket_mode = 1});
    storage(w, {.slot = 1, .ready_mode = 1, .ticket_mode = 2});
    seeds.push_back({"shares_that_wait_for_points", w.bytes(), 2, 0, "closed"});
  }
  {
    program_writer w;
    counter_file(w, 1);
    segment(w, 1, 2);
    storage(w, {.offset_mode = 7});  // the last 8 KiB of the 1 MiB mapped from the offset
    seeds.push_back({"offset_handle_inside", w.bytes(), 1, 0, "closed"});
  }
  {
    program_writer w;
    counter_file(w, 1);
    segment(w, 1, 2);
    storage(w, {.offset_mode = 3});  // the segment's last 8 KiB, as if mapped from its base
    seeds.push_back({"offset_handle_past_the_mapping", w.bytes(), 0, 0, "do not fit"});
  }
  {
    program_writer w = share();
    w.op(opcode::retire_segments).u8(1).u8(1).u8(0).u8(0);
    w.op(opcode::retire_files).u8(1).u8(1).u8(0).u8(0);
    storage(w, {.slot = 1});
    seeds.push_back({"storage_after_retirement", w.bytes(), 1, 0, "never announced"});
  }
  {
    program_writer w;
    counter_file(w, 1);
    segment(w, 1, 0, 1 + static_cast<std::uint8_t>(descriptor_kind::read_only_memfd));
    storage(w, {});
    seeds.push_back({"read_only_segment", w.bytes(), 0, 0, "cannot be mapped for writing"});
  }
  {
    program_writer w;
    counter_file(w, 1);
    segment(w, 1, 0, 1 + static_cast<std::uint8_t>(descriptor_kind::pipe_end));
    storage(w, {});
    seeds.push_back({"pipe_as_segment", w.bytes(), 0, 0, "not a sealed shoal memfd"});
  }
  {
    program_writer w;
    counter_file(w, 1, 1 + static_cast<std::uint8_t>(descriptor_kind::unsealed_memfd));
    seeds.push_back({"unsealed_counter_memory", w.bytes(), 0, 0, "counter file"});
  }
  {
    program_writer w(opening::none);
    w.op(opcode::raw).u16(300).text(std::string(300, 'x'));
    seeds.push_back({"raw_garbage", w.bytes(), 0, 0, "magic"});
  }
  {
    program_writer w;
    w.op(opcode::raw_with_descriptor).u8(static_cast<std::uint8_t>(descriptor_kind::socket_end)).u8(0).u16(256);
    w.text(std::string(256, '\0'));
    seeds.push_back({"raw_zeros_with_a_socket", w.bytes(), 0, 0, "magic"});
  }
  {
    // More than a socket's buffer holds (a batch of 256 bytes each, which
    // the kernel counts at over 1 KiB), from a program of 3 KiB: written while
    // the consumer reads.
    program_writer w;
    for (int i = 0; i < 600; ++i) w.op(opcode::note).u16(1).text("n").op(opcode::flush);
    seeds.push_back({"more_than_a_socket_buffer", w.bytes(), 0, 600, "closed"});
  }
  return seeds;
}

}  // namespace shoal::fuzz
