// The other processes of the sharing tests. Talks on its socket (fd 3).
//
//   shoal_test_sharing_peer consume <host|cuda>
//       Receives storages; metadata = {expected byte, keep (0/1)}. Checks every
//       byte, keeps or drops the storage, answers a note: "ok" or what was
//       wrong. A note "release" drops every kept storage and answers
//       "released"; a note "slow" answers "slow" and makes every later
//       answer to a storage come 300 ms late; a note "bye" ends it.
//   shoal_test_sharing_peer produce <host|cuda> <bytes> <byte>
//       Sends one storage of <bytes> filled with <byte>, waits for a note,
//       then exits at once, dropping its handle as it goes.
//   shoal_test_sharing_peer produce-twice <host|cuda> <socket path> <bytes> <byte>
//       Connects twice to the listener at <socket path> and sends the same
//       storage of <bytes> filled with <byte> on both connections; waits for a
//       note on each, then ends.
//   shoal_test_sharing_peer scribble <host|cuda>
//       A hostile consumer: reads frames raw until a storage message, then
//       writes into every slot of the counter memory it was given (held
//       slots marked released, free ones marked held), says so in a note
//       "scribbled" (after the protocol's hello), and stays connected until
//       the parent hangs up.
//   shoal_test_sharing_peer hold-until-closed <host|cuda>
//       Like consume, keeping every storage, until the connection closes:
//       then checks that every kept storage still reads its byte and exits
//       at once, still holding them, with 3 (1 when a byte changed).
//   shoal_test_sharing_peer fork-holder host
//       Receives one storage, then forks a child that drops its copy of it
//       and exits, and says "child dropped". On a note, forks a second child
//       that keeps the memory mapped until the socket closes, says
//       "keeper <pid>", and exits at once, still holding the reference.
//   shoal_test_sharing_peer relay <host|cuda> <program>
//       Starts <program> consume as the next process; copies each storage it
//       receives into one of its own and sends the copy on; passes the next
//       process's answers back. Ends with "bye".
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/channel/channel.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/child_process.h"
#include "shoal/ipc/sharing.h"

namespace {

using namespace shoal;

std::span<const std::byte> text(const std::string& s) { return std::as_bytes(std::span(s)); }
std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

channel::connection parent_link() {
  channel::connection link =
      channel::connection::adopt_pair_end(unique_fd(child_process::child_socket_fd), {}, 1 << 20);
  link.allow_peer_ring();  // the parent's peer sends through a ring; a raw reader takes it too
  return link;
}

std::string check(backend::device& dev, const storage::storage& st, std::uint8_t expected) {
  std::vector<std::uint8_t> seen(st.size());
  dev.copy({}, seen.data(), st.data(), st.size());
  dev.synchronize({});
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != expected) {
      return "byte " + std::to_string(i) + " is " + std::to_string(seen[i]) + ", expected " + std::to_string(expected);
    }
  }
  return "ok";
}

// Message types of the sharing protocol (src/ipc/messages.h).
constexpr std::uint16_t counter_file_type = 1, storage_type = 4, note_type = 7;

int scribble() {
  auto link = parent_link();
  unique_fd counters;
  std::uint32_t slots = 0;
  for (;;) {
    channel::frame f = link.receive();
    if (f.type == counter_file_type) {
      std::memcpy(&slots, f.payload.data() + 8, sizeof slots);  // file id u64, slots u32
      counters = std::move(f.fd);
    }
    if (f.type == storage_type) break;
  }
  const std::size_t bytes = 64 + std::size_t{slots} * 32;  // counter_file.cpp: header, then 32-byte slots
  void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, counters.get(), 0);
  if (m == MAP_FAILED) throw backend_error("mmap(counters)", "the counter memory cannot be mapped");
  for (std::uint32_t i = 0; i < slots; ++i) {
    auto* word = reinterpret_cast<std::atomic<std::uint64_t>*>(static_cast<char*>(m) + 64 + std::size_t{i} * 32);
    const std::uint64_t w = word->load();
    word->store((w & 3) == 1 ? (w & ~std::uint64_t{3}) | 2 : (std::uint64_t{7} << 2) | 1);
  }
  channel::send_hello(link, ipc::sharing_protocol);
  const std::string said = "scribbled";
  std::vector<std::byte> note(4 + said.size());
  const auto length = static_cast<std::uint32_t>(said.size());
  std::memcpy(note.data(), &length, 4);
  std::memcpy(note.data() + 4, said.data(), said.size());
  link.send(note_type, note);
  for (;;) (void)link.receive();  // until the parent hangs up (connection_closed)
}

int consume(backend::device& dev) {
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator);
  ipc::peer parent(context, parent_link());
  std::vector<storage::storage> kept;
  std::chrono::milliseconds answer_delay{0};  // "slow": each storage is answered this late
  for (;;) {
    ipc::received r = parent.receive(backend::stream_ref{});
    if (!r.storage.valid()) {
      const std::string command = text_of(r.metadata);
      if (command == "bye") return 0;
      if (command == "slow") {
        answer_delay = std::chrono::milliseconds(300);
        parent.send_note(text("slow"));
      }
      if (command == "release") {
        kept.clear();
        dev.synchronize({});
        parent.send_note(text("released"));
      }
      continue;
    }
    if (r.metadata.size() != 2) {
      parent.send_note(text("metadata of " + std::to_string(r.metadata.size()) + " bytes, expected 2"));
      continue;
    }
    const std::string answer = check(dev, r.storage, static_cast<std::uint8_t>(r.metadata[0]));
    if (r.metadata[1] != std::byte{0}) kept.push_back(std::move(r.storage));
    r.storage = {};
    std::this_thread::sleep_for(answer_delay);
    parent.send_note(text(answer));
  }
}

int hold_until_closed(backend::device& dev) {
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator);
  ipc::peer parent(context, parent_link());
  std::vector<std::pair<storage::storage, std::uint8_t>> kept;
  try {
    for (;;) {
      ipc::received r = parent.receive(backend::stream_ref{});
      if (!r.storage.valid() || r.metadata.size() != 2) continue;
      const auto expected = static_cast<std::uint8_t>(r.metadata[0]);
      const std::string answer = check(dev, r.storage, expected);
      kept.emplace_back(std::move(r.storage), expected);
      parent.send_note(text(answer));
    }
  } catch (const connection_closed&) {
    int verdict = 3;
    for (const auto& [st, expected] : kept) {
      if (check(dev, st, expected) != "ok") verdict = 1;
    }
    std::fflush(nullptr);
    std::_Exit(verdict);
  }
}

int fork_holder(backend::device& dev) {
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator, {.collect_interval = std::chrono::milliseconds(0)});
  ipc::peer parent(context, parent_link());
  ipc::received r = parent.receive(backend::stream_ref{});
  dev.synchronize({});
  const pid_t dropper = ::fork();
  if (dropper == 0) {
    r.storage = {};  // in the child: must leave the parent's reference alone
    std::_Exit(0);
  }
  int status = 0;
  if (dropper < 0 || ::waitpid(dropper, &status, 0) != dropper || !WIFEXITED(status)) return 1;
  parent.send_note(text("child dropped"));
  (void)parent.receive(backend::stream_ref{});
  // The keeper watches a descriptor of its own for the test's hang-up: the
  // connection's socket is let go of in a fork() child.
  const int watched = ::dup(child_process::child_socket_fd);
  if (watched < 0) return 1;
  const pid_t keeper = ::fork();
  if (keeper == 0) {
    char byte = 0;
    while (::read(watched, &byte, 1) > 0) {
    }
    std::_Exit(0);  // the test hung up
  }
  if (keeper < 0) return 1;
  parent.send_note(text("keeper " + std::to_string(keeper)));
  std::fflush(nullptr);
  std::_Exit(0);  // still holding the reference
}

// Sends one storage and ends, without clean-up (the memory's owner is
// simply gone): once the parent answers, or, `until_taken`, as soon as the
// parent has taken it (peer::wait_taken), without waiting for an answer.
int produce(backend::device& dev, std::size_t bytes, std::uint8_t value, bool until_taken) {
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator);
  ipc::peer parent(context, parent_link());
  auto st = storage::storage::allocate(allocator, bytes, {});
  dev.fill({}, st.mutable_data({}), value, bytes);
  parent.send(st, {}, {});
  if (!until_taken) (void)parent.receive({});  // the parent has it
  dev.synchronize({});  // the fill has run (else the parent's wait reports this process died first)
  if (until_taken && parent.wait_taken(std::chrono::seconds(10)) != ipc::taken_state::all_taken) return 3;
  std::fflush(nullptr);
  std::_Exit(0);
}

int produce_twice(backend::device& dev, const std::string& path, std::size_t bytes, std::uint8_t value) {
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator);
  const auto address = channel::channel_address::at_path(path);
  ipc::peer first(context, channel::connection::connect(address, {}));
  ipc::peer second(context, channel::connection::connect(address, {}));
  auto st = storage::storage::allocate(allocator, bytes, {});
  dev.fill({}, st.mutable_data({}), value, bytes);
  dev.synchronize({});
  first.send(st, {}, {});
  second.send(st, {}, {});
  (void)first.receive({});
  (void)second.receive({});
  return 0;
}

int relay(backend::device& dev, const std::string& program, const std::string& backend_name) {
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator);
  ipc::peer parent(context, parent_link());
  child_process next_process(program, {"consume", backend_name});
  ipc::peer next(context, channel::connection::adopt_pair_end(unique_fd(::dup(next_process.socket())), {}, 1 << 20));
  backend::stream s(dev);
  backend::stream_guard on_s(dev, s);  // drops happen on s too
  for (;;) {
    ipc::received r = parent.receive(s);
    if (!r.storage.valid()) {
      next.send_note(r.metadata);
      if (text_of(r.metadata) == "bye") break;
      parent.send_note(next.receive(s).metadata);
      continue;
    }
    auto copy = storage::storage::allocate(allocator, r.storage.size(), s);
    dev.copy(s, copy.mutable_data(s), r.storage.data(), r.storage.size());
    r.storage = {};  // released once s has passed the copy
    next.send(copy, r.metadata, s);
    copy = {};       // in the limbo until the next process drops it
    parent.send_note(next.receive(s).metadata);
  }
  return next_process.wait();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s consume|produce|relay <host|cuda> ...\n", argv[0]);
    return 2;
  }
  try {
    const std::string mode = argv[1], backend_name = argv[2];
    backend::device& dev = backend_name == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
    if (mode == "consume") return consume(dev);
    if (mode == "hold-until-closed") return hold_until_closed(dev);
    if (mode == "fork-holder") return fork_holder(dev);
    if ((mode == "produce" || mode == "produce-until-taken") && argc == 5) {
      return produce(dev, std::strtoull(argv[3], nullptr, 10), static_cast<std::uint8_t>(std::atoi(argv[4])),
                     mode == "produce-until-taken");
    }
    if (mode == "relay" && argc == 4) return relay(dev, argv[3], backend_name);
    if (mode == "scribble") return scribble();
    if (mode == "produce-twice" && argc == 6) {
      return produce_twice(dev, argv[3], std::strtoull(argv[4], nullptr, 10), static_cast<std::uint8_t>(std::atoi(argv[5])));
    }
    std::fprintf(stderr, "bad arguments for mode %s\n", mode.c_str());
    return 2;
  } catch (const connection_closed&) {
    return 0;  // the parent went away: nothing left to do
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sharing peer failed: %s\n", e.what());
    return 1;
  }
}
