#include "fuzz/lending_seeds.h"

#include "fuzz/lending_program.h"
#include "lending/messages.h"
#include "support/passrights.h"

namespace shoal::fuzz {

namespace {

namespace d = lending::detail;

// Choices of lending_sizes, memfd_sizes and the purposes (lending_program.cpp).
constexpr std::uint8_t size_2mib = 2, size_past_capacity = 5, size_2_to_63 = 6;
constexpr std::uint8_t memfd_4kib = 0, memfd_2mib = 3;
constexpr std::uint8_t purpose_bad_character = 4;
constexpr std::uint8_t sealed_memfd = 1 + static_cast<std::uint8_t>(descriptor_kind::sealed_memfd);
constexpr std::uint8_t pipe = 1 + static_cast<std::uint8_t>(descriptor_kind::pipe_end);

enum side : std::uint8_t { decoders = 0, lender_side = 1, borrower_side = 2 };

// The borrower's script: four calls, two bits each, the first lowest.
enum call : std::uint8_t { borrow_call = 0, revocations_call = 1, metrics_call = 2, give_back_call = 3 };
constexpr std::uint8_t script(call a, call b, call c, call e) {
  return static_cast<std::uint8_t>(a | (b << 2) | (c << 4) | (e << 6));
}

lending_writer against_lender() { return std::move(lending_writer().u8(lender_side).op(lending_op::hello).u8(0)); }
lending_writer against_borrower(std::uint8_t calls) {
  return std::move(lending_writer().u8(borrower_side).u8(calls).op(lending_op::hello).u8(0));
}

void borrow(lending_writer& w, std::uint8_t request, std::uint8_t size, std::uint8_t purpose = 0) {
  w.op(lending_op::borrow).u8(request).u8(size).u64(0).u8(1).u8(purpose);
}
// give_back (keep_mapping) or given_back (kept) of `region`, the flag 0 or 1.
void region_frame(lending_writer& w, lending_op op, std::uint8_t region, std::uint8_t flag = 0) {
  w.op(op).u8(region).u64(0).u8(flag);
}
// A lent region of 2 MiB (memory id 1) in one chunk, whose memfd is `memfd_size`.
void lend(lending_writer& w, std::uint8_t request, std::uint8_t region, std::uint8_t memfd_size = memfd_2mib) {
  w.op(lending_op::lent).u8(request).u8(region).u64(0).u8(1).u8(size_2mib).u64(0).u8(1);
  w.op(lending_op::chunk).u8(1).u8(size_2mib).u64(0).u8(0).u8(sealed_memfd).u8(memfd_size);
}
void revoke(lending_writer& w, std::uint8_t region) { w.op(lending_op::revoke).u8(region).u64(0).u32(1000); }

std::vector<std::uint8_t> decoder_input(const std::vector<std::byte>& payload) {
  std::vector<std::uint8_t> input{decoders};
  for (const std::byte b : payload) input.push_back(static_cast<std::uint8_t>(b));
  return input;
}

}  // namespace

std::vector<lending_seed> lending_seeds() {
  std::vector<lending_seed> seeds;
  // The decoders, each fed its own message (and no other decoder takes it).
  seeds.push_back({"decode_borrow",
                   decoder_input(d::encode(d::borrow_message{7, 4096, lending::region_mode::exclusive, "parameters", 250})),
                   1, "decoded"});
  seeds.push_back({"decode_lent", decoder_input(d::encode(d::lent_message{7, 3, 5, 2u << 20, 1})), 1, "decoded"});
  seeds.push_back(
      {"decode_refused", decoder_input(d::encode(d::refused_message{7, d::refusal::quota, "full"})), 1, "decoded"});
  seeds.push_back({"decode_revoke", decoder_input(d::encode(d::revoke_message{3, 500})), 1, "decoded"});
  // give_back and given_back have one wire form (a region and a flag): both take it.
  seeds.push_back({"decode_give_back", decoder_input(d::encode(d::give_back_message{3, true})), 2, "decoded"});
  // forget, revoke_accepted and cancel_wait have one wire form (a number): all three take it.
  seeds.push_back({"decode_forget", decoder_input(d::encode_forget(3)), 3, "decoded"});
  seeds.push_back({"decode_revoke_request", decoder_input(d::encode(d::revoke_request_message{7, 3, 500})), 1,
                   "decoded"});
  {
    lending::region_layout layout;
    layout.entries.push_back({"weights", 0, 4096, lending::dtype::float32, {32, 32}});
    layout.entries.push_back({"bias", 4096, 128, lending::dtype::float32, {32}});
    layout.hash[0] = std::byte{0x5a};
    seeds.push_back({"decode_publish", decoder_input(d::encode(d::publish_message{7, 3, layout})), 1, "decoded"});
    seeds.push_back({"decode_layout", decoder_input(d::encode(d::layout_message{7, layout})), 1, "decoded"});
    seeds.push_back({"decode_borrow_shared",
                     decoder_input(d::encode(d::borrow_shared_message{7, "model", layout.hash})), 1, "decoded"});
    seeds.push_back({"decode_borrow_shared_with_writer",
                     decoder_input(d::encode(d::borrow_shared_message{7, "model", {}, 1000})), 1, "decoded"});
  }

  // A hostile borrower against a fresh lender.
  {
    lending_writer w = against_lender();
    borrow(w, 1, size_2mib);
    region_frame(w, lending_op::give_back, 1);
    borrow(w, 2, size_2mib);
    w.op(lending_op::query_metrics).u8(0);
    seeds.push_back({"lender_borrow_give_back_metrics", w.bytes(), 2, "closed"});
  }
  {
    lending_writer w = against_lender();
    borrow(w, 1, size_past_capacity);
    borrow(w, 2, size_2_to_63);
    region_frame(w, lending_op::give_back, 4);
    seeds.push_back({"lender_refusals", w.bytes(), 0, "closed"});
  }
  {
    lending_writer w = against_lender();
    for (std::uint8_t request = 1; request <= 8; ++request) borrow(w, request, size_2mib);
    seeds.push_back({"lender_quota_per_uid", w.bytes(), 6, "closed"});
  }
  {
    lending_writer w = against_lender();
    w.op(lending_op::lent).u8(1).u8(1).u64(0).u8(1).u8(size_2mib).u64(0).u8(1);
    seeds.push_back({"lender_sent_a_lenders_frame", w.bytes(), 0, "may send borrow, give_back, query_metrics, publish, borrow_shared, revoke_request and cancel_wait only"});
  }
  {
    lending_writer w = against_lender();
    borrow(w, 1, size_2mib, purpose_bad_character);
    seeds.push_back({"lender_bad_purpose", w.bytes(), 0, "purpose"});
  }
  {
    lending_writer w = against_lender();
    const auto payload = d::encode(d::borrow_message{1, 4096, lending::region_mode::exclusive, "x"});
    w.op(lending_op::frame).u16(static_cast<std::uint16_t>(d::message_type::borrow)).u8(payload.size());
    for (const std::byte b : payload) w.u8(static_cast<std::uint8_t>(b));
    w.u8(pipe).u8(0);
    // The lender's connections take no descriptor: closed before the borrow is
    // read; from Linux 6.16 on the kernel refuses it at the send, and the
    // lender sees nothing before the borrower hangs up.
    seeds.push_back({"lender_borrow_with_a_descriptor", w.bytes(), 0,
                     testing::kernel_refuses_descriptors() ? "closed" : "this connection takes none"});
  }
  {
    lending_writer w = lending_writer().u8(lender_side).op(lending_op::hello).u8(3);
    borrow(w, 1, size_2mib);
    seeds.push_back({"lender_an_observer_borrows", w.bytes(), 0, "an observer connection may send query_metrics and revoke_request only"});
  }
  {
    lending_writer w = lending_writer().u8(lender_side).op(lending_op::hello).u8(2);
    seeds.push_back({"lender_another_protocols_hello", w.bytes(), 0, "shoal.sharing"});
  }
  {
    lending_writer w = against_lender();
    w.op(lending_op::raw).u16(300);
    for (int i = 0; i < 300; ++i) w.u8(0xAB);
    seeds.push_back({"lender_raw_garbage", w.bytes(), 0, "not the magic"});
  }

  // A hostile lender against a borrower.
  {
    lending_writer w = against_borrower(script(borrow_call, give_back_call, metrics_call, revocations_call));
    lend(w, 1, 1);
    region_frame(w, lending_op::given_back, 1);
    const std::string text = "shoal_lending_regions 0\n";
    w.op(lending_op::metrics).u16(static_cast<std::uint16_t>(text.size())).text(text);
    seeds.push_back({"borrower_region_lent_given_back_metrics", w.bytes(), 1, "closed"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, revocations_call, revocations_call, revocations_call));
    lend(w, 1, 1);
    revoke(w, 1);
    revoke(w, 1);
    seeds.push_back({"borrower_region_revoked_twice", w.bytes(), 1, "revoked region 1 a second time"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, borrow_call, borrow_call, borrow_call));
    for (int i = 0; i < 200; ++i) revoke(w, 3);
    seeds.push_back({"borrower_revokes_it_does_not_hold", w.bytes(), 0, "region 3, which this borrower does not hold"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, borrow_call, borrow_call, borrow_call));
    lend(w, 1, 1, memfd_4kib);
    seeds.push_back({"borrower_region_larger_than_its_memory", w.bytes(), 0, "the file holds 4096"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, borrow_call, borrow_call, borrow_call));
    w.op(lending_op::refused).u8(1).u8(static_cast<std::uint8_t>(d::refusal::quota)).u8(4).text("full");
    seeds.push_back({"borrower_refused", w.bytes(), 0, "the lender refused: full"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, borrow_call, borrow_call, borrow_call));
    region_frame(w, lending_op::given_back, 3);
    seeds.push_back({"borrower_unasked_answer", w.bytes(), 0, "answered with frame type 6"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, give_back_call, borrow_call, revocations_call));
    lend(w, 1, 1);
    region_frame(w, lending_op::given_back, 1, 1);  // kept: the borrower keeps memory 1 mapped
    w.op(lending_op::lent).u8(2).u8(2).u64(0).u8(1).u8(size_2mib).u64(0).u8(0);  // memory 1 again, no chunk
    w.op(lending_op::forget).u8(1);
    seeds.push_back({"borrower_kept_mapping_lent_again_then_forgotten", w.bytes(), 2,
                     "which this borrower does not keep mapped"});
  }
  {
    lending_writer w = against_borrower(script(borrow_call, borrow_call, borrow_call, borrow_call));
    w.op(lending_op::lent).u8(1).u8(1).u64(0).u8(7).u8(size_2mib).u64(0).u8(0);
    seeds.push_back({"borrower_lent_no_chunks_for_memory_not_kept", w.bytes(), 0, "it keeps no mapping of it"});
  }
  {
    lending_writer w = against_borrower(script(revocations_call, borrow_call, borrow_call, borrow_call));
    w.op(lending_op::forget).u8(9);
    seeds.push_back({"borrower_forget_for_memory_not_kept", w.bytes(), 0, "which this borrower does not keep mapped"});
  }
  {
    lending_writer w = lending_writer().u8(borrower_side).u8(0).op(lending_op::hello).u8(1);
    seeds.push_back({"borrower_another_version", w.bytes(), 0, "version"});
  }
  return seeds;
}

}  // namespace shoal::fuzz
