#include "lending/messages.h"

#include <algorithm>

#include "core/wire.h"

namespace shoal::lending::detail {

namespace {

using shoal::detail::wire_reader;
using shoal::detail::wire_writer;

std::span<const std::byte> as_bytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::string as_text(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

}  // namespace

bool valid_purpose(std::string_view purpose) noexcept {
  return !purpose.empty() && purpose.size() <= max_purpose_bytes &&
         std::all_of(purpose.begin(), purpose.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

std::vector<std::byte> encode(const borrow_message& m) {
  wire_writer w;
  w.put(m.request).put(m.bytes).put(static_cast<std::uint8_t>(m.mode)).put_bytes(as_bytes(m.purpose)).put(m.wait_ms);
  return w.take();
}

std::vector<std::byte> encode(const lent_message& m) {
  wire_writer w;
  w.put(m.request).put(m.region).put(m.memory).put(m.bytes).put(m.chunks);
  return w.take();
}

std::vector<std::byte> encode(const refused_message& m) {
  wire_writer w;
  const std::string_view why = std::string_view(m.why).substr(0, max_refusal_text);
  w.put(m.request).put(static_cast<std::uint8_t>(m.reason)).put_bytes(as_bytes(why));
  return w.take();
}

std::vector<std::byte> encode(const give_back_message& m) {
  wire_writer w;
  w.put(m.region).put(static_cast<std::uint8_t>(m.keep_mapping ? 1 : 0));
  return w.take();
}

std::vector<std::byte> encode(const given_back_message& m) {
  wire_writer w;
  w.put(m.region).put(static_cast<std::uint8_t>(m.kept ? 1 : 0));
  return w.take();
}

std::vector<std::byte> encode_forget(std::uint64_t memory) {
  wire_writer w;
  w.put(memory);
  return w.take();
}

borrow_message decode_borrow(std::span<const std::byte> payload) {
  wire_reader r(payload, "borrow");
  borrow_message m;
  m.request = r.get<std::uint64_t>("request");
  m.bytes = r.get<std::uint64_t>("bytes");
  if (m.bytes == 0) r.fail("bytes", "a region of 0 bytes");
  const auto mode = r.get<std::uint8_t>("mode");
  if (mode != static_cast<std::uint8_t>(region_mode::exclusive)) {
    r.fail("mode", "mode " + std::to_string(mode) +
                       " cannot be borrowed fresh (1: exclusive; a shared region is published, then asked for by "
                       "borrow_shared)");
  }
  m.mode = static_cast<region_mode>(mode);
  m.purpose = as_text(r.get_bytes("purpose", max_purpose_bytes));
  if (!valid_purpose(m.purpose)) r.fail("purpose", "must be 1 to 64 bytes of printable ASCII");
  m.wait_ms = r.get<std::uint32_t>("wait_ms");
  r.finish();
  return m;
}

lent_message decode_lent(std::span<const std::byte> payload) {
  wire_reader r(payload, "lent");
  lent_message m;
  m.request = r.get<std::uint64_t>("request");
  m.region = r.get<std::uint64_t>("region");
  m.memory = r.get<std::uint64_t>("memory");
  if (m.memory == 0) r.fail("memory", "memory ids start at 1");
  m.bytes = r.get<std::uint64_t>("bytes");
  m.chunks = r.get<std::uint32_t>("chunks");
  if (m.chunks > max_chunks_per_region) {
    r.fail("chunks", std::to_string(m.chunks) + " is not in 0.." + std::to_string(max_chunks_per_region) +
                         " (0: a mapping the borrower kept)");
  }
  r.finish();
  return m;
}

refused_message decode_refused(std::span<const std::byte> payload) {
  wire_reader r(payload, "refused");
  refused_message m;
  m.request = r.get<std::uint64_t>("request");
  const auto reason = r.get<std::uint8_t>("reason");
  if (reason < static_cast<std::uint8_t>(refusal::capacity) ||
      reason > static_cast<std::uint8_t>(refusal::stopped_waiting)) {
    r.fail("reason", "unknown reason " + std::to_string(reason));
  }
  m.reason = static_cast<refusal>(reason);
  m.why = as_text(r.get_bytes("why", max_refusal_text));  // the lender's bytes: quoted with escapes where used
  r.finish();
  return m;
}

std::vector<std::byte> encode(const revoke_message& m) {
  wire_writer w;
  w.put(m.region).put(m.deadline_ms);
  return w.take();
}

revoke_message decode_revoke(std::span<const std::byte> payload) {
  wire_reader r(payload, "revoke");
  revoke_message m;
  m.region = r.get<std::uint64_t>("region");
  m.deadline_ms = r.get<std::uint32_t>("deadline_ms");
  r.finish();
  return m;
}

std::vector<std::byte> encode(const revoke_request_message& m) {
  wire_writer w;
  w.put(m.request).put(m.region).put(m.deadline_ms);
  return w.take();
}

revoke_request_message decode_revoke_request(std::span<const std::byte> payload) {
  wire_reader r(payload, "revoke_request");
  revoke_request_message m;
  m.request = r.get<std::uint64_t>("request");
  m.region = r.get<std::uint64_t>("region");
  m.deadline_ms = r.get<std::uint32_t>("deadline_ms");
  if (m.deadline_ms == 0) r.fail("deadline_ms", "0: a revoke needs at least 1 ms");
  r.finish();
  return m;
}

std::vector<std::byte> encode_revoke_accepted(std::uint64_t request) {
  wire_writer w;
  w.put(request);
  return w.take();
}

std::uint64_t decode_revoke_accepted(std::span<const std::byte> payload) {
  wire_reader r(payload, "revoke_accepted");
  const auto request = r.get<std::uint64_t>("request");
  r.finish();
  return request;
}

std::vector<std::byte> encode_cancel_wait(std::uint64_t request) { return encode_revoke_accepted(request); }

std::uint64_t decode_cancel_wait(std::span<const std::byte> payload) {
  wire_reader r(payload, "cancel_wait");
  const auto request = r.get<std::uint64_t>("request");
  r.finish();
  return request;
}

namespace {

void put_layout(wire_writer& w, const region_layout& layout) {
  w.put_fixed(layout.hash).put(static_cast<std::uint32_t>(layout.entries.size()));
  for (const auto& e : layout.entries) {
    w.put_bytes(as_bytes(e.name)).put(e.offset).put(e.bytes).put(static_cast<std::uint8_t>(e.type));
    w.put(static_cast<std::uint8_t>(e.shape.size()));
    for (const std::uint64_t extent : e.shape) w.put(extent);
  }
}

// The entries' fields one by one; whether they fit a region is
// layout_problem's to say.
region_layout get_layout(wire_reader& r) {
  region_layout layout;
  const auto hash = r.get_fixed("hash", layout.hash.size());
  std::copy(hash.begin(), hash.end(), layout.hash.begin());
  const auto count = r.get<std::uint32_t>("entries");
  if (count == 0 || count > max_layout_entries) {
    r.fail("entries", std::to_string(count) + " is not in 1.." + std::to_string(max_layout_entries));
  }
  for (std::uint32_t i = 0; i < count; ++i) {
    layout_entry e;
    e.name = as_text(r.get_bytes("entry name", max_entry_name_bytes));
    if (e.name.empty() || !std::all_of(e.name.begin(), e.name.end(), [](char c) { return c >= 0x20 && c < 0x7f; })) {
      r.fail("entry name", "entry " + std::to_string(i) + "'s name must be 1 to " +
                               std::to_string(max_entry_name_bytes) + " bytes of printable ASCII");
    }
    e.offset = r.get<std::uint64_t>("entry offset");
    e.bytes = r.get<std::uint64_t>("entry bytes");
    e.type = static_cast<dtype>(r.get<std::uint8_t>("entry dtype"));
    if (itemsize(e.type) == 0) {
      r.fail("entry dtype", "entry '" + e.name + "' has dtype code " + std::to_string(static_cast<int>(e.type)) +
                                ", which is no dtype");
    }
    const auto rank = r.get<std::uint8_t>("entry rank");
    if (rank > max_entry_rank) {
      r.fail("entry rank", "entry '" + e.name + "' has " + std::to_string(rank) + " dimensions; at most " +
                               std::to_string(max_entry_rank));
    }
    for (std::uint8_t d = 0; d < rank; ++d) e.shape.push_back(r.get<std::uint64_t>("entry extent"));
    layout.entries.push_back(std::move(e));
  }
  return layout;
}

}  // namespace

std::vector<std::byte> encode(const publish_message& m) {
  wire_writer w;
  w.put(m.request).put(m.region);
  put_layout(w, m.layout);
  return w.take();
}

publish_message decode_publish(std::span<const std::byte> payload) {
  wire_reader r(payload, "publish");
  publish_message m;
  m.request = r.get<std::uint64_t>("request");
  m.region = r.get<std::uint64_t>("region");
  m.layout = get_layout(r);
  r.finish();
  return m;
}

std::vector<std::byte> encode(const borrow_shared_message& m) {
  wire_writer w;
  w.put(m.request).put_bytes(as_bytes(m.name)).put(static_cast<std::uint8_t>(m.expected ? 1 : 0));
  if (m.expected) w.put_fixed(*m.expected);
  w.put(static_cast<std::uint8_t>(m.writer_uid ? 1 : 0));
  if (m.writer_uid) w.put(*m.writer_uid);
  return w.take();
}

borrow_shared_message decode_borrow_shared(std::span<const std::byte> payload) {
  wire_reader r(payload, "borrow_shared");
  borrow_shared_message m;
  m.request = r.get<std::uint64_t>("request");
  m.name = as_text(r.get_bytes("name", max_purpose_bytes));
  if (!valid_purpose(m.name)) r.fail("name", "must be 1 to 64 bytes of printable ASCII");
  const auto has_hash = r.get<std::uint8_t>("has_hash");
  if (has_hash > 1) r.fail("has_hash", std::to_string(has_hash) + " is neither 0 nor 1");
  if (has_hash == 1) {
    const auto hash = r.get_fixed("hash", content_hash{}.size());
    m.expected.emplace();
    std::copy(hash.begin(), hash.end(), m.expected->begin());
  }
  const auto has_writer = r.get<std::uint8_t>("has_writer_uid");
  if (has_writer > 1) r.fail("has_writer_uid", std::to_string(has_writer) + " is neither 0 nor 1");
  if (has_writer == 1) m.writer_uid = r.get<std::uint32_t>("writer_uid");
  r.finish();
  return m;
}

std::vector<std::byte> encode(const layout_message& m) {
  wire_writer w;
  w.put(m.request);
  put_layout(w, m.layout);
  return w.take();
}

layout_message decode_layout(std::span<const std::byte> payload) {
  wire_reader r(payload, "layout");
  layout_message m;
  m.request = r.get<std::uint64_t>("request");
  m.layout = get_layout(r);
  r.finish();
  return m;
}

namespace {

// A flag byte: 0 or 1, anything else refused.
bool get_flag(wire_reader& r, const char* field) {
  const auto flag = r.get<std::uint8_t>(field);
  if (flag > 1) r.fail(field, std::to_string(flag) + " is neither 0 nor 1");
  return flag == 1;
}

}  // namespace

give_back_message decode_give_back(std::span<const std::byte> payload) {
  wire_reader r(payload, "give_back");
  give_back_message m;
  m.region = r.get<std::uint64_t>("region");
  m.keep_mapping = get_flag(r, "keep_mapping");
  r.finish();
  return m;
}

given_back_message decode_given_back(std::span<const std::byte> payload) {
  wire_reader r(payload, "given_back");
  given_back_message m;
  m.region = r.get<std::uint64_t>("region");
  m.kept = get_flag(r, "kept");
  r.finish();
  return m;
}

std::uint64_t decode_forget(std::span<const std::byte> payload) {
  wire_reader r(payload, "forget");
  const auto memory = r.get<std::uint64_t>("memory");
  if (memory == 0) r.fail("memory", "memory ids start at 1");
  r.finish();
  return memory;
}

}  // namespace shoal::lending::detail
