#include "fuzz/lending_program.h"

#include "fuzz/program_reader.h"
#include "lending/messages.h"
#include "shoal/backend/shareable_handle.h"

namespace shoal::fuzz {

namespace {

using lending::detail::message_type;

constexpr std::size_t max_raw_bytes = 4096;

std::uint16_t type_of(message_type t) { return static_cast<std::uint16_t>(t); }

std::uint64_t size_choice(std::uint8_t choice, std::uint64_t raw) {
  const auto at = choice % (std::size(lending_sizes) + 1);
  return at == std::size(lending_sizes) ? raw : lending_sizes[at];
}

// Regions 1..6, as a fresh lender numbers them; 0: the raw id; 7: the last id.
std::uint64_t region_choice(std::uint8_t choice, std::uint64_t raw) {
  const auto at = choice % 8;
  return at == 0 ? raw : at == 7 ? ~std::uint64_t{0} : at;
}

std::string purpose_choice(std::uint8_t choice) {
  switch (choice % 6) {
    case 0:
      return "parameters";
    case 1:
      return "computation";
    case 2:
      return "";
    case 3:
      return std::string(lending::max_purpose_bytes + 1, 'p');
    case 4:
      return "bad\npurpose";
    default:
      return std::string(lending::max_purpose_bytes, 'q');
  }
}

// A descriptor of the kit: 0 none, else 1 + a descriptor_kind, with a memfd size.
int descriptor(program_reader& in, descriptor_kit& kit) {
  const std::uint8_t choice = in.u8();
  const std::uint8_t memfd_size = in.u8();
  if (choice == 0) return -1;
  return kit.make(static_cast<descriptor_kind>((choice - 1) % descriptor_kinds), memfd_size);
}

std::vector<std::byte> chunk_payload(program_reader& in) {
  backend::shareable_handle h;
  const std::uint8_t kind = in.u8();
  h.kind = static_cast<backend::handle_kind>(kind % 4 == 0 ? kind : kind % 4);  // mostly 1..3
  const std::uint8_t size = in.u8();
  h.size = size_choice(size, in.u64());
  switch (in.u8() % 4) {
    case 0:
      h.offset = 0;
      break;
    case 1:
      h.offset = 4096;
      break;
    case 2:
      h.offset = h.size;
      break;
    default:
      h.offset = h.size - 1;
  }
  return h.serialize();
}

}  // namespace

lending_program::lending_program(std::span<const std::uint8_t> input) {
  program_reader in(input);
  while (!in.done()) {
    peer_action a;
    const auto op = static_cast<lending_op>(in.u8() % lending_ops);
    switch (op) {
      case lending_op::hello: {
        const std::uint8_t variant = in.u8() % 4;
        const channel::protocol_id id = variant == 0   ? lending::detail::lending_protocol
                                        : variant == 1 ? channel::protocol_id{lending::protocol_name,
                                                                              lending::protocol_version + 1}
                                        : variant == 2 ? channel::protocol_id{"shoal.sharing", 1}
                                                       : lending::detail::observer_protocol;
        a.type = channel::hello_frame_type;
        a.bytes = channel::encode_hello(id);
        break;
      }
      case lending_op::borrow: {
        lending::detail::borrow_message m;
        m.request = in.u8();
        const std::uint8_t size = in.u8();
        m.bytes = size_choice(size, in.u64());
        m.mode = static_cast<lending::region_mode>(in.u8() % 3);
        m.purpose = purpose_choice(in.u8());
        a.type = type_of(message_type::borrow);
        a.bytes = lending::detail::encode(m);
        break;
      }
      case lending_op::give_back:
      case lending_op::given_back: {
        const std::uint8_t region = in.u8();
        const std::uint64_t raw = in.u64();
        // The flag: keep_mapping or kept; 2 and up are not flags (refused).
        const std::uint8_t flag = in.u8();
        a.type = type_of(op == lending_op::give_back ? message_type::give_back : message_type::given_back);
        a.bytes = op == lending_op::give_back
                      ? lending::detail::encode(lending::detail::give_back_message{region_choice(region, raw), flag == 1})
                      : lending::detail::encode(lending::detail::given_back_message{region_choice(region, raw), flag == 1});
        if (flag > 1) a.bytes.back() = static_cast<std::byte>(flag);
        break;
      }
      case lending_op::query_metrics: {
        a.type = type_of(message_type::query_metrics);
        const std::uint8_t length = in.u8();
        a.bytes = in.bytes(length < 200 ? 0 : length - 200);
        break;
      }
      case lending_op::lent: {
        lending::detail::lent_message m;
        m.request = in.u8();
        const std::uint8_t region = in.u8();
        m.region = region_choice(region, in.u64());
        m.memory = in.u8();  // 0 is no memory id (refused)
        const std::uint8_t size = in.u8();
        m.bytes = size_choice(size, in.u64());
        const std::uint8_t chunks = in.u8();
        m.chunks = chunks < 250 ? chunks % 4 : lending::detail::max_chunks_per_region + chunks - 250;
        a.type = type_of(message_type::lent);
        a.bytes = lending::detail::encode(m);
        break;
      }
      case lending_op::chunk:
        a.type = type_of(message_type::chunk);
        a.bytes = chunk_payload(in);
        a.fd = descriptor(in, kit_);
        break;
      case lending_op::refused: {
        lending::detail::refused_message m;
        m.request = in.u8();
        m.reason = static_cast<lending::detail::refusal>(in.u8() % 13);  // 0 and 12 are no reason (refused)
        const auto why = in.bytes(in.u8());
        m.why.assign(reinterpret_cast<const char*>(why.data()), why.size());
        a.type = type_of(message_type::refused);
        a.bytes = lending::detail::encode(m);
        break;
      }
      case lending_op::metrics:
        a.type = type_of(message_type::metrics);
        a.bytes = in.bytes(in.u16());
        break;
      case lending_op::revoke: {
        const std::uint8_t region = in.u8();
        const std::uint64_t raw = in.u64();
        a.type = type_of(message_type::revoke);
        a.bytes = lending::detail::encode(lending::detail::revoke_message{region_choice(region, raw), in.u32()});
        break;
      }
      case lending_op::frame:
        a.type = in.u16();
        a.bytes = in.bytes(in.u8());
        a.fd = descriptor(in, kit_);
        break;
      case lending_op::forget:
        a.type = type_of(message_type::forget);
        a.bytes = lending::detail::encode_forget(in.u8());
        if (a.bytes.front() == std::byte{0}) a.bytes = std::vector<std::byte>(8);  // memory 0: refused
        break;
      case lending_op::raw:
        a.raw = true;
        a.bytes = in.bytes(in.u16() % (max_raw_bytes + 1));
        break;
    }
    actions_.push_back(std::move(a));
  }
}

}  // namespace shoal::fuzz
