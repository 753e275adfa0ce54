// The borrower processes of the lending tests. Talks to its parent on its
// socket (fd 3, plain bytes: a line per message).
//
//   shoal_test_borrower hold <host|cuda> <socket path> <bytes> <byte>
//       Borrows a region of <bytes>, fills it with <byte>, reads it back,
//       says "held <region id>" (or what went wrong) and waits until the
//       parent hangs up or kills it.
//   shoal_test_borrower hang-up <host|cuda> <socket path> <bytes>
//       Speaks the protocol by hand: borrows and maps a region, then closes
//       its connection to the lender without giving the region back, says
//       "hung up", and stays alive (the mapping held) until the parent hangs
//       up.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "lending/messages.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/child_process.h"
#include "shoal/lending/borrower.h"

namespace {

using namespace shoal;

void say(const std::string& line) {
  const std::string text = line + "\n";
  (void)!::write(child_process::child_socket_fd, text.data(), text.size());
}

void wait_for_parent() {
  char c;
  while (::read(child_process::child_socket_fd, &c, 1) > 0) {
  }
}

std::string check_bytes(backend::device& dev, const void* data, std::size_t bytes, std::uint8_t expected) {
  std::vector<std::uint8_t> seen(bytes);
  dev.copy({}, seen.data(), data, bytes);
  dev.synchronize({});
  for (std::size_t i = 0; i < bytes; ++i) {
    if (seen[i] != expected) return "byte " + std::to_string(i) + " reads " + std::to_string(seen[i]);
  }
  return "";
}

int hold(backend::device& dev, const std::string& path, std::size_t bytes, std::uint8_t value) {
  lending::borrower b(dev, channel::channel_address::at_path(path));
  auto region = b.borrow(bytes, "held by a test");
  dev.fill({}, region.data(), value, region.size());
  if (const auto wrong = check_bytes(dev, region.data(), region.size(), value); !wrong.empty()) {
    say("wrong " + wrong);
    return 1;
  }
  say("held " + std::to_string(region.id()));
  wait_for_parent();
  return 0;
}

int hang_up(backend::device& dev, const std::string& path, std::size_t bytes) {
  void* data = nullptr;
  {
    auto link = channel::connection::connect(channel::channel_address::at_path(path), {});
    const channel::protocol_id& protocol = lending::detail::lending_protocol;
    channel::send_hello(link, protocol);
    channel::check_hello(link.receive(), protocol);
    link.send(
        static_cast<std::uint16_t>(lending::detail::message_type::borrow),
        lending::detail::encode(lending::detail::borrow_message{1, bytes, lending::region_mode::exclusive, "orphan"}));
    const auto lent = lending::detail::decode_lent(link.receive().payload);
    channel::frame chunk = link.receive();
    auto handle = backend::shareable_handle::deserialize(chunk.payload, std::move(chunk.fd));
    data = dev.import_memory(handle);
    (void)lent;
  }  // the connection closes here; the mapping stays
  say("hung up");
  wait_for_parent();
  dev.close_import(data);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    if (args.size() < 4) {
      std::fprintf(stderr, "usage: shoal_test_borrower hold|hang-up <host|cuda> <socket path> <bytes> [<byte>]\n");
      return 2;
    }
    auto& dev = args[1] == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
    const std::size_t bytes = std::stoull(args[3]);
    if (args[0] == "hold" && args.size() == 5)
      return hold(dev, args[2], bytes, static_cast<std::uint8_t>(std::stoi(args[4])));
    if (args[0] == "hang-up") return hang_up(dev, args[2], bytes);
    std::fprintf(stderr, "shoal_test_borrower: unknown command '%s'\n", args[0].c_str());
    return 2;
  } catch (const std::exception& e) {
    say(std::string("error ") + e.what());
    std::fprintf(stderr, "shoal_test_borrower: %s\n", e.what());
    return 1;
  }
}
