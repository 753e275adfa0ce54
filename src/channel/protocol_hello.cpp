#include <string>

#include "core/printable_text.h"
#include "core/wire.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"

namespace shoal::channel {

std::string protocol_id::to_string() const {
  return "'" + shoal::detail::printable(name) + "' version " + std::to_string(version);  // a peer's name
}

std::vector<std::byte> encode_hello(const protocol_id& ours) {
  if (ours.name.empty() || ours.name.size() > max_protocol_name_bytes) {
    throw invalid_argument("protocol name '" + std::string(ours.name) + "' must have 1 to " +
                           std::to_string(max_protocol_name_bytes) + " bytes");
  }
  shoal::detail::wire_writer w;
  w.put_bytes(std::as_bytes(std::span(ours.name))).put(ours.version);
  return w.take();
}

void send_hello(connection& link, const protocol_id& ours) { link.send(hello_frame_type, encode_hello(ours)); }

void check_hello(const frame& first, const protocol_id& expected) {
  (void)check_hello_one_of(first, std::span(&expected, 1));
}

std::size_t check_hello_one_of(const frame& first, std::span<const protocol_id> expected) {
  if (expected.empty()) throw invalid_argument("check_hello_one_of: no protocol to expect");
  const auto here = [&] {
    std::string text = "this side speaks " + expected[0].to_string();
    for (std::size_t i = 1; i < expected.size(); ++i) text += " or " + expected[i].to_string();
    return text;
  };
  if (first.type != hello_frame_type) {
    throw protocol_error("the peer's first frame (type " + std::to_string(first.type) +
                         ") is not a protocol hello; " + here() + ": the peer is not a shoal " +
                         std::string(expected[0].name) + " endpoint, or is older than protocol hellos");
  }
  if (first.fd) throw protocol_error("the peer's protocol hello came with a descriptor; it carries none");
  shoal::detail::wire_reader r(first.payload, "protocol hello");
  const auto name_bytes = r.get_bytes("name", max_protocol_name_bytes);
  const protocol_id theirs{std::string_view(reinterpret_cast<const char*>(name_bytes.data()), name_bytes.size()),
                           r.get<std::uint16_t>("version")};
  r.finish();
  bool name_known = false;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (theirs.name == expected[i].name && theirs.version == expected[i].version) return i;
    name_known = name_known || theirs.name == expected[i].name;
  }
  throw protocol_error("the peer speaks " + theirs.to_string() + "; " + here() +
                       (name_known ? ": run matching shoal versions on both ends" : ": it connected to the wrong socket"));
}

}  // namespace shoal::channel
