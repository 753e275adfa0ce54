// [sharing]: a storage shared with a child process over an authenticated
// channel. The child (this program's hidden "demo-child" command) reads it,
// writes an answer into it and drops it; the parent sees the reference
// released and reads the child's write.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/core/child_process.h"
#include "shoal/core/error.h"
#include "shoal/ipc/sharing.h"
#include "tools/shoal/demo.h"
#include "tools/shoal/demo_steps.h"

namespace shoal::tools {

namespace {

using namespace std::chrono_literals;
using demo::expect;

constexpr std::size_t share_bytes = 4 << 20;
constexpr std::uint8_t parent_byte = 0x5A;
constexpr std::uint8_t child_byte = 0xA5;
constexpr auto answer_deadline = 10s;

std::span<const std::byte> text(const std::string& s) { return std::as_bytes(std::span(s)); }
std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

std::string self_path() {
  std::vector<char> path(4096);
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throw backend_error("readlink(/proc/self/exe)", "cannot find this program to start its child");
  return {path.data(), static_cast<std::size_t>(n)};
}

/// The child's next note; every wait on another process has a deadline.
std::string next_note(ipc::peer& child) {
  pollfd p{child.native_handle(), POLLIN, 0};
  const int ready = ::poll(&p, 1, static_cast<int>(std::chrono::milliseconds(answer_deadline).count()));
  expect(ready > 0, "the child process did not answer within " + std::to_string(answer_deadline.count()) + " s");
  ipc::received r = child.receive();
  const std::string said = text_of(r.metadata);
  expect(!r.storage.valid(), "the child sent a storage; it was to answer with a note");
  expect(!said.starts_with("FAILED"), "the child process says: " + said);
  return said;
}

}  // namespace

namespace demo {

void show_sharing(backend::device& dev, alloc::caching_allocator& allocator) {
  ipc::sharing_context context(allocator);
  auto shared = storage::storage::allocate(allocator, share_bytes);
  dev.fill({}, shared.mutable_data(), parent_byte, share_bytes);

  child_process child(self_path(), {"demo-child", std::string(to_string(dev.kind()))});
  ipc::peer to_child(context, channel::connection::adopt_pair_end(unique_fd(::dup(child.socket())), {}));
  const auto start = std::chrono::steady_clock::now();
  to_child.send(shared);  // the child waits for the fill enqueued above
  const std::string read_note = next_note(to_child);
  const double answer_ms = ms_since(start);
  const bool sees_write = all_are(read_back(dev, shared.data(), share_bytes, {}), child_byte);
  const std::size_t held_while_child_holds = context.stats().held_slots;
  std::printf("[sharing] child %d (uid checked by the channel): %s, %.1f ms after the send; the parent reads the "
              "child's 0x%02X: %s; references held: %zu\n",
              static_cast<int>(to_child.credentials().process.pid), read_note.c_str(), answer_ms, child_byte,
              sees_write ? "yes" : "NO", held_while_child_holds);
  expect(sees_write, "the parent did not see the bytes the child wrote");
  expect(held_while_child_holds == 1, "the child's reference was not counted while it held the storage");

  shared = {};  // the parent drops its handle first: the block must wait for the child
  const ipc::sharing_stats in_limbo = context.stats();
  try {
    to_child.send_note(text("drop"));
    (void)next_note(to_child);  // "dropped"
  } catch (const error& e) {
    // The connection ended early: say how the child ended (waited for once
    // both ends of the socket are shut, so a child still reading exits; its
    // own error is on stderr).
    ::shutdown(to_child.native_handle(), SHUT_RDWR);
    throw error("demo: " + std::string(e.what()) + "; the child process ended with status " +
                std::to_string(child.wait()));
  }
  const auto until = std::chrono::steady_clock::now() + answer_deadline;
  ipc::sharing_stats after;
  for (;;) {
    context.collect();
    after = context.stats();
    if ((after.held_slots == 0 && after.limbo_blocks == 0) || std::chrono::steady_clock::now() > until) break;
    std::this_thread::sleep_for(1ms);
  }
  const int status = child.wait();
  std::printf("[sharing] the parent dropped its handle first: %zu block (%s) waited in the limbo; the child dropped "
              "it: after collect(), references held %zu, limbo %zu (freed %llu); child exit status %d\n",
              in_limbo.limbo_blocks, mib(static_cast<std::int64_t>(in_limbo.limbo_bytes)).c_str(), after.held_slots,
              after.limbo_blocks, static_cast<unsigned long long>(after.limbo_freed), status);
  expect(in_limbo.limbo_blocks == 1, "the block shared with the child was not kept while the child held it");
  expect(after.held_slots == 0 && after.limbo_blocks == 0,
         "the child's reference was still counted, or its block still in the limbo, after it dropped the storage");
  expect(status == 0, "the child process ended with status " + std::to_string(status));
}

}  // namespace demo

int run_demo_child(const std::string& backend_name) {
  backend::device& dev = backend_name == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
  alloc::caching_allocator allocator(dev, alloc::allocator_config{});
  ipc::sharing_context context(allocator);
  ipc::peer parent(context, channel::connection::adopt_pair_end(unique_fd(child_process::child_socket_fd), {}));
  try {
    ipc::received r = parent.receive();
    expect(r.storage.valid(), "the parent sent a note; a storage was expected");
    const auto seen = demo::read_back(dev, r.storage.data(), r.storage.size(), {});
    const bool saw_parent = demo::all_are(seen, parent_byte);
    expect(saw_parent, "the received storage does not hold the parent's 0x5A");
    dev.fill({}, r.storage.mutable_data(), child_byte, r.storage.size());
    dev.synchronize({});
    parent.send_note(text("received " + demo::mib(static_cast<std::int64_t>(r.storage.size())) +
                          ", saw the parent's 0x5A in every byte, wrote 0xA5 into it"));
    (void)parent.receive();  // "drop"
    r.storage = {};          // releases the reference once this stream has passed its uses
    dev.synchronize({});
    parent.send_note(text("dropped"));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal demo-child: %s\n", e.what());  // seen even when the parent stopped reading
    try {
      parent.send_note(text(std::string("FAILED: ") + e.what()));
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the parent is gone; the exit status says it
    }
    return 1;
  }
}

}  // namespace shoal::tools
