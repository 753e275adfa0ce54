// The borrower processes of the lending tests. Talks to its parent on its
// socket (fd 3, plain bytes: a line per message).
//
//   shoal_test_borrower hold <host|cuda> <socket path> <bytes> <byte>
//       Borrows a region of <bytes>, fills it with <byte>, reads it back,
//       says "held <region id>" (or what went wrong) and waits until the
//       parent hangs up or kills it.
//   shoal_test_borrower yield <host|cuda> <socket path> <bytes> <byte>
//       As hold, then waits (up to 30 s) for the lender to revoke the region,
//       gives it back and says "yielded <region id>" ("not revoked" if no
//       revoke came), and waits until the parent hangs up.
//   shoal_test_borrower wait-borrow <host|cuda> <socket path or @abstract name> <bytes> <wait ms> [<as>]
//       As <as> ("self", the default, or "nobody", as for cycle), borrows a
//       region of <bytes> that may wait <wait ms> at the lender for memory,
//       then says "lent <region id>" (or "refused <why>": its wait ran out,
//       or a quota) and waits until the parent hangs up.
//   shoal_test_borrower hang-up <host|cuda> <socket path> <bytes>
//       Speaks the protocol by hand: borrows and maps a region, then closes
//       its connection to the lender without giving the region back, says
//       "hung up", and stays alive (the mapping held) until the parent hangs
//       up.
//   shoal_test_borrower publish <host|cuda> <socket path> <bytes> <name> <byte>
//       Borrows an exclusive region under <name>, fills it with <byte>,
//       publishes it with test_layout (two entries, "first" and "second"),
//       checks its read-only mapping reads <byte>, says "published <region id>
//       <hash in hex>" and waits.
//   shoal_test_borrower read <host|cuda> <socket path> <name> <hash or -> <byte>
//       Maps the region published as <name> (expecting <hash> unless "-"),
//       checks that both entries read <byte> and that the layout's hash is
//       what the entries hash to, says "read <region id>" and waits.
//   shoal_test_borrower write-shared <host|cuda> <socket path> <name> <mapping>
//       Maps the region published as <name> — through borrow_shared when
//       <mapping> is "read-only"; by hand, with the same handle mapped
//       read-write, when it is "read-write" (the protection turned off) —
//       says "writing", writes a byte and says "wrote" (or what failed).
//   shoal_test_borrower deaf <host|cuda> <socket path> <bytes> <fill>
//       Speaks the protocol by hand: borrows a region, then sends <fill>
//       give-backs of a region it does not hold (their refusals fill the
//       lender's socket to it) and one more borrow of <bytes>, reads none of
//       the answers, says "deaf" and waits to be killed.
//   shoal_test_borrower refusals <host|cuda> <socket path> <count> [then-bad]
//       Speaks the protocol by hand: gives back <count> times a region it
//       does not hold (a window of 64 sent before their answers are read),
//       each refused (one record in a daemon's log each), says "refused
//       <count>" (or what went wrong) and waits until the parent hangs up.
//       With then-bad it sends a frame of no known type after the last
//       answer, before it says so: the lender closes the connection for it
//       (a closed_for_error record, a warning).
//   shoal_test_borrower cycle <host|cuda> <socket path or @abstract name> <bytes> <rounds> <as>
//       As <as> ("self"; "nobody", or a uid's number: it drops to that uid,
//       65534 for nobody, and the gid of that number first and admits a
//       lender of uid 0),
//       borrows a region of <bytes> and gives it back (keeping its mapping
//       when the lender lets it), <rounds> times, writing the round's
//       number into it and checking that a region lent again reads the
//       number written last; says "cycled <memory id>,... imports <count>
//       kept <count>" (imports counted through a forwarding device) and
//       waits, its kept mappings held.
//   shoal_test_borrower revoke <host|cuda> <socket path or @abstract name> <region> <as>
//       As <as> (as for cycle), asks the lender to revoke <region> with a
//       deadline of 5 s (borrower::revoke) and says "revoked", or "refused
//       <why>" when the lender refused it as not permitted (peer_refused).
//   shoal_test_borrower observe <host|cuda> <socket path or @abstract name> <as>
//       As <as> (as for cycle), connects as an observer, reads the metrics and
//       says "observing", or "refused <why>" when the lender turned it away
//       (peer_refused); then waits until the parent hangs up.
//   shoal_test_borrower older-lender <host|cuda> <socket path> <connections>
//       A lender older than observer connections, by hand: listens at
//       <socket path>, says "listening", and for each of <connections>
//       connections greets with the lending protocol's hello and closes the
//       connection when the peer's hello names another protocol, saying
//       "closed <why>" (or "greeted" when it named the lending protocol);
//       then waits until the parent hangs up.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "lending/messages.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/child_process.h"
#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/layout.h"
#include "lending/counting_device.h"

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

// Holds a region as `hold` does until the lender revokes it (preemption),
// then gives it back: a model that answers revokes.
int yield(backend::device& dev, const std::string& path, std::size_t bytes, std::uint8_t value) {
  lending::borrower b(dev, channel::channel_address::at_path(path));
  auto region = b.borrow(bytes, "held until revoked");
  dev.fill({}, region.data(), value, region.size());
  dev.synchronize({});
  const std::uint64_t id = region.id();
  say("held " + std::to_string(id));
  std::vector<lending::borrower::revocation> asked;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (asked.empty() && std::chrono::steady_clock::now() < give_up) asked = b.revocations(std::chrono::seconds(1));
  if (asked.empty() || asked.front().region != id) {
    say("not revoked");
    return 1;
  }
  b.give_back(std::move(region));
  say("yielded " + std::to_string(id));
  wait_for_parent();
  return 0;
}

// Two entries over the first three quarters of a region of `bytes` (a
// multiple of 16): float32 [bytes / 8] from 0, uint8 [bytes / 4] after it.
lending::region_layout test_layout(std::size_t bytes) {
  lending::region_layout layout;
  layout.entries = {{"first", 0, bytes / 2, lending::dtype::float32, {bytes / 8}},
                    {"second", bytes / 2, bytes / 4, lending::dtype::uint8, {bytes / 4}}};
  return layout;
}

int publish(backend::device& dev, const std::string& path, std::size_t bytes, const std::string& name,
            std::uint8_t value) {
  lending::borrower b(dev, channel::channel_address::at_path(path));
  auto region = b.borrow(bytes, name);
  dev.fill({}, region.data(), value, region.size());
  dev.synchronize({});
  auto layout = test_layout(region.size());
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  region = b.publish(std::move(region), layout);
  if (const auto wrong = check_bytes(dev, region.data(), region.size(), value); !wrong.empty()) {
    say("wrong " + wrong);
    return 1;
  }
  say("published " + std::to_string(region.id()) + " " + lending::to_hex(layout.hash));
  wait_for_parent();
  return 0;
}

int read(backend::device& dev, const std::string& path, const std::string& name, const std::string& hash,
         std::uint8_t value) {
  lending::borrower b(dev, channel::channel_address::at_path(path));
  std::optional<lending::content_hash> expected;
  if (hash != "-") expected = lending::hash_from_hex(hash);
  auto region = b.borrow_shared(name, expected);
  const auto& layout = *region.layout();
  for (const char* entry : {"first", "second"}) {
    const auto& e = layout.at(entry);
    if (const auto wrong = check_bytes(dev, region.address_of(entry), e.bytes, value); !wrong.empty()) {
      say(std::string("wrong in ") + entry + ": " + wrong);
      return 1;
    }
  }
  if (lending::hash_entries(dev, region.data(), region.size(), layout) != layout.hash) {
    say("wrong hash: the entries do not hash to the layout's hash");
    return 1;
  }
  say("read " + std::to_string(region.id()));
  wait_for_parent();
  return 0;
}

int write_shared(backend::device& dev, const std::string& path, const std::string& name, const std::string& mapping) {
  void* data = nullptr;
  lending::borrower b(dev, channel::channel_address::at_path(path));
  lending::borrowed_region region;
  std::optional<channel::connection> link;
  if (mapping == "read-only") {
    region = b.borrow_shared(name);
    data = region.data();
  } else {
    link.emplace(channel::connection::connect(channel::channel_address::at_path(path), {},
                                              lending::detail::max_frame_payload));
    const channel::protocol_id& protocol = lending::detail::lending_protocol;
    channel::send_hello(*link, protocol);
    channel::check_hello(link->receive(), protocol);
    link->send(static_cast<std::uint16_t>(lending::detail::message_type::borrow_shared),
               lending::detail::encode(lending::detail::borrow_shared_message{1, name, {}}));
    (void)lending::detail::decode_lent(link->receive().payload);
    channel::frame chunk = link->receive();
    auto handle = backend::shareable_handle::deserialize(chunk.payload, std::move(chunk.fd));
    data = dev.import_memory(handle, backend::memory_access::read_write);
  }
  say("writing");
  if (dev.kind() == backend::device_kind::host) {
    std::signal(SIGSEGV, SIG_DFL);  // the fault kills, even where a sanitizer's handler would exit(1)
    *static_cast<volatile std::uint8_t*>(data) = 0xEE;  // SIGSEGV through a read-only mapping
  } else {
    dev.fill({}, data, 0xEE, 1);
    dev.synchronize({});  // a write through a read-only mapping fails the stream
  }
  say("wrote");
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

int deaf(const std::string& path, std::size_t bytes, std::size_t fill) {
  using lending::detail::message_type;
  auto link = channel::connection::connect(channel::channel_address::at_path(path), {},
                                           lending::detail::max_frame_payload);
  channel::send_hello(link, lending::detail::lending_protocol);
  channel::check_hello(link.receive(), lending::detail::lending_protocol);
  const auto borrow = [&](std::uint64_t request) {
    link.send(static_cast<std::uint16_t>(message_type::borrow),
              lending::detail::encode(lending::detail::borrow_message{request, bytes, lending::region_mode::exclusive, "deaf"}));
  };
  borrow(1);
  const auto lent = lending::detail::decode_lent(link.receive().payload);
  (void)link.receive();  // its chunk
  const auto bogus = lending::detail::encode(lending::detail::give_back_message{lent.region + 1000, false});
  for (std::size_t i = 0; i < fill; ++i) link.send(static_cast<std::uint16_t>(message_type::give_back), bogus);
  borrow(2);
  say("deaf");
  wait_for_parent();
  return 0;
}

int refusals(const std::string& path, std::size_t count, bool then_bad) {
  using lending::detail::message_type;
  auto link = channel::connection::connect(channel::channel_address::at_path(path), {},
                                           lending::detail::max_frame_payload);
  channel::send_hello(link, lending::detail::lending_protocol);
  channel::check_hello(link.receive(), lending::detail::lending_protocol);
  const auto bogus = lending::detail::encode(lending::detail::give_back_message{1'000'000'000, false});
  constexpr std::size_t window = 64;
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = std::min(window, count - done);
    for (std::size_t i = 0; i < n; ++i) link.send(static_cast<std::uint16_t>(message_type::give_back), bogus);
    for (std::size_t i = 0; i < n; ++i) {
      if (const auto answer = link.receive_for(std::chrono::seconds(30));
          answer.type != static_cast<std::uint16_t>(message_type::refused)) {
        say("error answer " + std::to_string(answer.type) + " to give-back " + std::to_string(done + i + 1));
        return 1;
      }
    }
    done += n;
  }
  if (then_bad) link.send(0x7777, {});  // no frame type the lender knows
  say("refused " + std::to_string(count));
  wait_for_parent();
  return 0;
}

// A borrower on `dev` of the lender at `where` (a path or @abstract name),
// as `as`: "self", "nobody" (uid 65534) or a uid's number — it drops to
// that uid and the gid of that number first and admits the lender's uid
// (root's) explicitly. Nothing when it cannot drop.
std::optional<lending::borrower> borrower_as(backend::device& dev, const std::string& where, const std::string& as,
                                             const lending::borrower_options& options = {}) {
  const bool self = as == "self";
  if (!self) {
    const auto uid = static_cast<uid_t>(as == "nobody" ? 65534 : std::stoul(as));
    if (::setresgid(uid, uid, uid) != 0 || ::setresuid(uid, uid, uid) != 0) {
      say("error cannot become uid " + std::to_string(uid));
      return std::nullopt;
    }
  }
  const auto address = where.starts_with('@') ? channel::channel_address::abstract(where.substr(1))
                                              : channel::channel_address::at_path(where);
  return std::optional<lending::borrower>(std::in_place, dev, address,
                                          self ? channel::access_policy{} : channel::access_policy{{0}, {}},
                                          lending::borrower::default_timeout, options);
}

int wait_borrow(backend::device& dev, const std::string& where, std::size_t bytes, std::chrono::milliseconds wait,
                const std::string& as) {
  auto b = borrower_as(dev, where, as);
  if (!b) return 1;
  try {
    auto region = b->borrow(bytes, "waiting test", lending::region_mode::exclusive,
                            lending::borrower::default_timeout, lending::borrow_wait{wait, {}});
    say("lent " + std::to_string(region.id()));
    wait_for_parent();
  } catch (const out_of_memory& e) {
    say(std::string("refused ") + e.what());
  } catch (const peer_refused& e) {
    say(std::string("refused ") + e.what());
  }
  return 0;
}

int cycle(backend::device& target, const std::string& where, std::size_t bytes, int rounds, const std::string& as) {
  testing::counting_device dev(target);  // a kept mapping used means no import
  auto borrower = borrower_as(dev, where, as);
  if (!borrower) return 1;
  lending::borrower& b = *borrower;
  std::string ids;
  for (int round = 1; round <= rounds; ++round) {
    auto region = b.borrow(bytes, "cycled");
    if (round > 1 && ids.ends_with("," + std::to_string(region.memory_id()))) {
      if (const auto wrong = check_bytes(dev, region.data(), region.size(), static_cast<std::uint8_t>(round - 1));
          !wrong.empty()) {
        say("wrong kept content: " + wrong);
        return 1;
      }
    }
    dev.fill({}, region.data(), static_cast<std::uint8_t>(round), region.size());
    dev.synchronize({});
    ids += "," + std::to_string(region.memory_id());
    b.give_back(std::move(region));
  }
  say("cycled " + ids.substr(1) + " imports " + std::to_string(dev.imports.load()) + " kept " +
      std::to_string(b.kept().count));
  wait_for_parent();
  return 0;
}

int revoke(backend::device& dev, const std::string& where, std::uint64_t region, const std::string& as) {
  auto b = borrower_as(dev, where, as);
  if (!b) return 1;
  try {
    b->revoke(region, std::chrono::seconds(5));
  } catch (const peer_refused& e) {
    say(std::string("refused ") + e.what());
    return 0;
  }
  say("revoked");
  return 0;
}

int observe(backend::device& dev, const std::string& where, const std::string& as) {
  lending::borrower_options observer;
  observer.observer = true;
  try {
    auto b = borrower_as(dev, where, as, observer);
    if (!b) return 1;
    (void)b->metrics();
    say("observing");
    wait_for_parent();
  } catch (const peer_refused& e) {
    say(std::string("refused ") + e.what());
  }
  return 0;
}

int older_lender(const std::string& path, int connections) {
  channel::listener server(channel::channel_address::at_path(path), {}, lending::detail::max_frame_payload);
  say("listening");
  for (int i = 0; i < connections; ++i) {
    auto link = server.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    try {
      channel::check_hello(link.receive(), lending::detail::lending_protocol);
      say("greeted");
    } catch (const protocol_error& e) {
      say(std::string("closed ") + e.what());  // the connection closes as `link` goes
    }
  }
  wait_for_parent();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    if (args.size() < 4) {
      std::fprintf(stderr, "usage: shoal_test_borrower hold|yield|wait-borrow|hang-up|publish|read|write-shared|deaf|refusals|cycle|revoke|observe|older-lender <host|cuda> "
                   "<socket path> ...\n");
      return 2;
    }
    auto& dev = args[1] == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
    const bool sized = args[0] == "publish" || args[0] == "hold" || args[0] == "yield" || args[0] == "wait-borrow" ||
                       args[0] == "hang-up" || args[0] == "deaf";
    const std::size_t bytes = sized ? std::stoull(args[3]) : 0;
    if (args[0] == "hold" && args.size() == 5)
      return hold(dev, args[2], bytes, static_cast<std::uint8_t>(std::stoi(args[4])));
    if (args[0] == "yield" && args.size() == 5)
      return yield(dev, args[2], bytes, static_cast<std::uint8_t>(std::stoi(args[4])));
    if (args[0] == "wait-borrow" && (args.size() == 5 || args.size() == 6))
      return wait_borrow(dev, args[2], bytes, std::chrono::milliseconds(std::stoll(args[4])),
                         args.size() == 6 ? args[5] : "self");
    if (args[0] == "hang-up") return hang_up(dev, args[2], bytes);
    if (args[0] == "deaf" && args.size() == 5) return deaf(args[2], bytes, std::stoull(args[4]));
    if (args[0] == "refusals" && (args.size() == 4 || (args.size() == 5 && args[4] == "then-bad")))
      return refusals(args[2], std::stoull(args[3]), args.size() == 5);
    if (args[0] == "publish" && args.size() == 6)
      return publish(dev, args[2], bytes, args[4], static_cast<std::uint8_t>(std::stoi(args[5])));
    if (args[0] == "read" && args.size() == 6)
      return read(dev, args[2], args[3], args[4], static_cast<std::uint8_t>(std::stoi(args[5])));
    if (args[0] == "write-shared" && args.size() == 5) return write_shared(dev, args[2], args[3], args[4]);
    if (args[0] == "cycle" && args.size() == 6)
      return cycle(dev, args[2], std::stoull(args[3]), std::stoi(args[4]), args[5]);
    if (args[0] == "revoke" && args.size() == 5) return revoke(dev, args[2], std::stoull(args[3]), args[4]);
    if (args[0] == "observe" && args.size() == 4) return observe(dev, args[2], args[3]);
    if (args[0] == "older-lender" && args.size() == 4) return older_lender(args[2], std::stoi(args[3]));
    std::fprintf(stderr, "shoal_test_borrower: unknown command '%s'\n", args[0].c_str());
    return 2;
  } catch (const std::exception& e) {
    say(std::string("error ") + e.what());
    std::fprintf(stderr, "shoal_test_borrower: %s\n", e.what());
    return 1;
  }
}
