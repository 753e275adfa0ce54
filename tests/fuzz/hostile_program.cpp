#include "fuzz/hostile_program.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "fuzz/program_reader.h"
#include "ipc/messages.h"
#include "shoal/backend/shareable_event.h"
#include "shoal/backend/shareable_handle.h"
#include "shoal/channel/channel.h"
#include "shoal/channel/protocol.h"
#include "shoal/ipc/sharing_types.h"

namespace shoal::fuzz {

namespace {

constexpr std::size_t max_raw_bytes = 4096, max_frame_bytes = 8192, max_note_bytes = 1024;
constexpr std::uint64_t kib = 1024, mib = 1024 * kib;

template <class T>
void put(std::vector<std::byte> &out, T value) {
  const auto at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// The segments' geometry as the program announced them (the first
// announcement of an id counts, as for the consumer), for offsets at the
// edges of what a storage message's segments map.
struct announced_geometry {
  std::uint64_t mapped = 0;     // the chunks' sizes less the first one's offset
  std::uint64_t from_base = 0;  // the chunks' sizes
};

std::uint64_t storage_offset(std::uint8_t mode, std::uint64_t raw, std::uint64_t size, announced_geometry g) {
  constexpr std::uint64_t menu[] = {0,       4 * kib,           1 * mib, 2 * mib - 8 * kib,
                                    2 * mib, 4 * mib - 8 * kib, 0,       1 * mib - 8 * kib};
  switch (mode % 11) {
    case 6:
      return raw;
    case 8:
      return g.mapped - size;  // ends where the mapping ends
    case 9:
      return g.mapped - size + 1;  // one byte past it
    case 10:
      return g.from_base - size;  // as if the mapping began at the first segment's base
    default:
      return menu[mode % 11];
  }
}

std::uint64_t storage_size(std::uint8_t mode, std::uint64_t raw) {
  constexpr std::uint64_t menu[] = {8 * kib, 1, 4 * kib, 1 * mib, 2 * mib, 0, 0, 64 * kib};
  return mode % 8 == 5 ? raw : menu[mode % 8];
}

std::vector<std::uint64_t> small_ids(program_reader &r, std::size_t count) {
  std::vector<std::uint64_t> ids;
  for (std::size_t i = 0; i < 3; ++i) {
    const std::uint64_t id = r.u8() % 5;
    if (i < count) ids.push_back(id);
  }
  return ids;
}

}  // namespace

hostile_program::hostile_program(std::span<const std::uint8_t> input) {
  program_reader r(input);
  // A descriptor chosen by a kind byte: 0 gives `otherwise`.
  auto descriptor = [&](std::uint8_t kind, std::uint8_t size, auto otherwise) {
    return kind == 0 ? otherwise() : kit_.make(static_cast<descriptor_kind>((kind - 1) % descriptor_kinds), size);
  };
  auto hello_of = [&](channel::protocol_id id) { add_frame(channel::hello_frame_type, channel::encode_hello(id), -1); };

  switch (static_cast<opening>(r.u8() % 4)) {
    case opening::sharing_hello:
      hello_of(ipc::sharing_protocol);
      break;
    case opening::none:
      break;
    case opening::other_version:
      hello_of({ipc::sharing_protocol.name, ipc::sharing_protocol.version + 1});
      break;
    case opening::other_protocol:
      hello_of({"shoal.lending", ipc::sharing_protocol.version});
      break;
  }
  while (!r.done()) {
    const auto op = static_cast<opcode>(r.u8() % opcodes);
    switch (op) {
      case opcode::raw: {
        flush();
        writes_.push_back({r.bytes(r.u16() % (max_raw_bytes + 1)), {}});
        break;
      }
      case opcode::raw_with_descriptor: {
        const std::uint8_t kind = r.u8(), size = r.u8();
        flush();
        auto bytes = r.bytes(std::max<std::size_t>(1, r.u16() % (max_raw_bytes + 1)));
        if (bytes.empty()) bytes.resize(1);  // a descriptor travels with at least one byte
        const int fd = kit_.make(static_cast<descriptor_kind>(kind % descriptor_kinds), size);
        writes_.push_back({std::move(bytes), fd >= 0 ? std::vector<int>{fd} : std::vector<int>{}});
        break;
      }
      case opcode::frame: {
        const std::uint16_t raw_type = r.u16();
        // Mostly the sharing protocol's types (and 0 and 8 beside them).
        const std::uint16_t type = raw_type < 0x100 ? raw_type % 9 : raw_type;
        const std::uint8_t kind = r.u8(), size = r.u8();
        const int fd = descriptor(kind, size, [] { return -1; });
        add_frame(type, r.bytes(r.u16() % (max_frame_bytes + 1)), fd);
        break;
      }
      case opcode::counter_file: {
        ipc::detail::counter_file_message m;
        m.file_id = r.u8() % 5;
        const std::uint32_t slots = 1u << (r.u8() % 17);
        const std::uint8_t declared = r.u8() % 4;
        m.slots = declared == 0 ? slots : declared == 1 ? slots + 1 : declared == 2 ? 0 : 1u << 20;
        const std::uint32_t held = r.u8() % 9, generation = r.u8() % 4;
        const std::uint8_t kind = r.u8(), size = r.u8();
        const int fd = descriptor(kind, size, [&] { return kit_.counter_memory(slots, held, generation, false); });
        add_frame(static_cast<std::uint16_t>(ipc::detail::message_type::counter_file), ipc::detail::encode(m), fd);
        break;
      }
      case opcode::segment: {
        const std::uint64_t id = r.u8() % 5;
        const std::uint8_t kind = r.u8(), size = r.u8(), size_mode = r.u8() % 4, offset_mode = r.u8() % 6;
        const std::uint8_t handle_kind = r.u8(), device = r.u8();
        const std::uint64_t raw_size = r.u64(), raw_offset = r.u64();
        const int fd = descriptor(kind, size, [&] { return kit_.make(descriptor_kind::sealed_memfd, size); });
        const std::uint64_t actual = memfd_sizes[size % std::size(memfd_sizes)];
        backend::shareable_handle h;
        h.kind = handle_kind == 0 ? backend::handle_kind::host_memfd : static_cast<backend::handle_kind>(handle_kind);
        h.device = device == 0 ? backend::device_kind::host : static_cast<backend::device_kind>(device);
        h.size = size_mode == 0 ? actual : size_mode == 1 ? actual * 2 : size_mode == 2 ? actual / 2 : raw_size;
        const std::uint64_t offsets[] = {
            0, 4 * kib, h.size / 2, h.size - 1, h.size == 0 ? raw_offset : raw_offset % h.size, raw_offset};
        h.offset = offsets[offset_mode];
        segments_.try_emplace(id, segment_geometry{h.size, h.offset});
        add_frame(static_cast<std::uint16_t>(ipc::detail::message_type::segment), ipc::detail::encode_segment(id, h),
                  fd);
        break;
      }
      case opcode::event_source: {
        const std::uint8_t id_mode = r.u8() % 4, kind = r.u8(), size = r.u8(), source_kind = r.u8(), device = r.u8();
        const std::uint64_t raw_id = r.u64();
        backend::event_source s;
        s.kind = source_kind == 0 ? backend::event_source_kind::host_page
                                  : static_cast<backend::event_source_kind>(source_kind);
        s.device = device == 0 ? backend::device_kind::host : static_cast<backend::device_kind>(device);
        const std::uint64_t page_id = kit_.page().source_id();
        s.source_id = id_mode == 0 ? page_id : id_mode == 1 ? page_id + 1 : id_mode == 2 ? raw_id : 0;
        const int fd = descriptor(kind, size, [&] { return kit_.make(descriptor_kind::event_page, 0); });
        add_frame(static_cast<std::uint16_t>(ipc::detail::message_type::event_source), s.serialize(), fd);
        break;
      }
      case opcode::storage: {
        ipc::detail::storage_message m;
        const std::size_t count = r.u8() % 4;
        m.segment_ids = small_ids(r, count);
        const std::uint8_t offset_mode = r.u8(), size_mode = r.u8();
        const std::uint64_t raw_offset = r.u64(), raw_size = r.u64();
        m.size = storage_size(size_mode, raw_size);
        announced_geometry g;
        for (auto id : m.segment_ids) {
          if (const auto it = segments_.find(id); it != segments_.end()) g.from_base += it->second.size;
        }
        if (!m.segment_ids.empty()) {
          if (const auto it = segments_.find(m.segment_ids.front()); it != segments_.end())
            g.mapped = g.from_base - it->second.offset;
        }
        m.offset = storage_offset(offset_mode, raw_offset, m.size, g);
        m.file_id = r.u8() % 5;
        m.slot.index = r.u8() % 10;
        m.slot.generation = r.u8() % 4;
        const std::uint8_t ready_mode = r.u8() % 4;
        const std::uint16_t stream_slot = r.u16() % (backend::detail::host_event_page::slot_count + 1);
        const std::uint8_t ticket_mode = r.u8() % 3;
        const std::uint64_t raw_id = r.u64();
        if (ready_mode != 0) {
          m.ready = backend::event_point{ready_mode == 2 ? raw_id : kit_.page().source_id(), stream_slot,
                                         ticket_mode == 0   ? 0
                                         : ticket_mode == 1 ? 1
                                                            : std::numeric_limits<std::uint64_t>::max()};
        }
        const auto metadata = r.bytes(r.u8());
        m.metadata = metadata;
        add_frame(static_cast<std::uint16_t>(ipc::detail::message_type::storage), ipc::detail::encode(m), -1);
        break;
      }
      case opcode::retire_segments:
      case opcode::retire_files: {
        const auto type = op == opcode::retire_segments ? ipc::detail::message_type::retire_segments
                                                        : ipc::detail::message_type::retire_files;
        const auto ids = small_ids(r, r.u8() % 4);
        if (op == opcode::retire_segments) {
          for (auto id : ids) segments_.erase(id);
        }
        add_frame(static_cast<std::uint16_t>(type), ipc::detail::encode_ids(ids), -1);
        break;
      }
      case opcode::note:
        add_frame(static_cast<std::uint16_t>(ipc::detail::message_type::note),
                  ipc::detail::encode_note(r.bytes(r.u16() % (max_note_bytes + 1))), -1);
        break;
      case opcode::flush:
        flush();
        break;
      case opcode::hello:
        hello_of(ipc::sharing_protocol);
        break;
    }
  }
  flush();
}

void hostile_program::add_frame(std::uint16_t type, std::vector<std::byte> payload, int fd) {
  std::size_t payload_bytes = payload.size(), fds = fd >= 0 ? 1 : 0;
  for (const auto &f : batch_) {
    payload_bytes += f.payload.size();
    fds += f.fd >= 0 ? 1 : 0;
  }
  if (!batch_.empty() && (batch_.size() == channel::max_batch_frames || fds > channel::max_batch_descriptors ||
                          payload_bytes > channel::batch_packing_bytes)) {
    flush();
  }
  batch_.push_back({type, std::move(payload), fd});
}

// The batch as the channel writes it (channel.h's wire form).
void hostile_program::flush() {
  if (batch_.empty()) return;
  socket_write w;
  w.bytes = {std::byte{'S'}, std::byte{'H'}, std::byte{'O'}, std::byte{'L'}};
  put(w.bytes, channel::frame_version);
  put(w.bytes, static_cast<std::uint16_t>(batch_.size()));
  put(w.bytes, std::uint32_t{0});  // the body's size, known below
  for (const auto &f : batch_) {
    put(w.bytes, f.type);
    put(w.bytes, static_cast<std::uint16_t>(f.fd >= 0 ? 1 : 0));
    put(w.bytes, static_cast<std::uint32_t>(f.payload.size()));
    w.bytes.insert(w.bytes.end(), f.payload.begin(), f.payload.end());
    if (f.fd >= 0) w.fds.push_back(f.fd);
  }
  if (w.bytes.size() < channel::min_batch_bytes) w.bytes.resize(channel::min_batch_bytes);
  const auto body = static_cast<std::uint32_t>(w.bytes.size() - channel::batch_header_bytes);
  std::memcpy(w.bytes.data() + 8, &body, sizeof body);
  writes_.push_back(std::move(w));
  batch_.clear();
}

}  // namespace shoal::fuzz
