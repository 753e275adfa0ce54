// A hostile consumer gets nowhere: it can give up its own references and
// nothing else. It cannot truncate counter memory under the producer, touch
// another consumer's references, or stop the producer serving others; and a
// producer's counter memory that could be truncated, or not written, is
// refused with a protocol error that closes that connection.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/core/child_process.h"
#include "shoal/ipc/sharing.h"
#include "ipc/captured_exchange.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
constexpr std::size_t kib = 1024;
channel::frame& counter_frame(std::vector<channel::frame>& frames) { return frame_of_type(frames, counter_file_type); }

/// A memfd with the same bytes as `original`, sealed with `seals` (none: unsealed).
unique_fd copy_of(int original, int seals) {
  struct stat st {};
  if (::fstat(original, &st) != 0) throw std::runtime_error("fstat");
  unique_fd copy(::memfd_create("copy", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  std::vector<char> bytes(static_cast<std::size_t>(st.st_size));
  if (::pread(original, bytes.data(), bytes.size(), 0) != st.st_size) throw std::runtime_error("pread");
  if (::write(copy.get(), bytes.data(), bytes.size()) != st.st_size) throw std::runtime_error("write");
  if (seals != 0 && ::fcntl(copy.get(), F_ADD_SEALS, seals) != 0) throw std::runtime_error("F_ADD_SEALS");
  return copy;
}

TEST(hostile_consumer, counter_memory_cannot_be_truncated_by_a_consumer) {
  captured_exchange p;
  auto frames = p.capture_share(8 * kib);
  const int fd = counter_frame(frames).fd.get();
  EXPECT_EQ(::ftruncate(fd, 0), -1) << "a consumer shrank the producer's counters (the producer would die of SIGBUS)";
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(fd, 1 << 30), -1) << "a consumer grew the producer's counters";
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1) << "a consumer sealed the producer's counters against writes";
  EXPECT_EQ(p.replay(frames).storage.size(), 8 * kib) << "the real counter memory is accepted";
}

TEST(hostile_consumer, counter_memory_is_named_nowhere) {
  captured_exchange p;
  auto frames = p.capture_share(8 * kib);
  char link[64];
  const std::string path = "/proc/self/fd/" + std::to_string(counter_frame(frames).fd.get());
  const ssize_t n = ::readlink(path.c_str(), link, sizeof link - 1);
  ASSERT_GT(n, 0);
  EXPECT_TRUE(std::string(link, static_cast<std::size_t>(n)).starts_with("/memfd:"))
      << "counter memory is an anonymous memfd, not a name in /dev/shm: " << std::string(link, static_cast<std::size_t>(n));
}

TEST(hostile_producer, counter_memory_that_could_be_truncated_is_refused) {
  captured_exchange p;
  auto frames = p.capture_share(8 * kib);
  channel::frame& counters = counter_frame(frames);
  counters.fd = copy_of(counters.fd.get(), 0);  // the same bytes, unsealed
  const std::string why = p.refusal_of(frames);
  EXPECT_NE(why.find("sealed"), std::string::npos) << why;
}

TEST(hostile_producer, counter_memory_sealed_against_writes_is_a_protocol_error) {
  captured_exchange p;
  auto frames = p.capture_share(8 * kib);
  channel::frame& counters = counter_frame(frames);
  counters.fd = copy_of(counters.fd.get(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
  EXPECT_NE(p.refusal_of(frames), "accepted");
}

TEST(hostile_producer, read_only_counter_memory_is_a_protocol_error) {
  captured_exchange p;
  auto frames = p.capture_share(8 * kib);
  channel::frame& counters = counter_frame(frames);
  const std::string path = "/proc/self/fd/" + std::to_string(counters.fd.get());
  counters.fd = unique_fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(counters.fd);
  const std::string why = p.refusal_of(frames);
  EXPECT_NE(why.find("reading and writing"), std::string::npos) << why;
}

// Consumer B, another process (shoal_test_sharing_peer scribble), receives a
// share and then writes into every slot of the counter memory it was given:
// held slots marked released (another consumer's references, were they
// there) and free slots marked held (so a later claim would find them taken).
TEST(hostile_consumer, a_consumer_cannot_release_another_consumers_references_or_stop_the_producer) {
  captured_exchange p;
  child_process child(SHOAL_TEST_SHARING_PEER, {"scribble", "host"});

  // Consumer A, this process, holds storage X.
  auto [to_a, a_end] = connected_pair();
  ipc::peer producer_to_a(p.producer, std::move(to_a));
  ipc::peer consumer_a(p.consumer, std::move(a_end));
  auto x = storage::storage::allocate(p.producer_allocator, 8 * kib, {});
  producer_to_a.send(x, {}, {});
  ipc::received held_by_a = consumer_a.receive({});
  ASSERT_TRUE(held_by_a.storage.valid());

  {
    // Consumer B gets storage Y and scribbles over its counters.
    ipc::peer producer_to_b(p.producer,
                            channel::connection::adopt_pair_end(unique_fd(::dup(child.socket())), {}, 1 << 20));
    producer_to_b.send(storage::storage::allocate(p.producer_allocator, 8 * kib, {}), {}, {});
    const ipc::received said = producer_to_b.receive({});
    ASSERT_EQ(std::string(reinterpret_cast<const char*>(said.metadata.data()), said.metadata.size()), "scribbled");

    x = storage::storage();  // the producer's last handle: X now waits for A alone
    p.producer.collect();
    EXPECT_GE(p.producer.stats().limbo_blocks, 1u) << "X was freed while consumer A still holds it";
    EXPECT_NO_THROW(producer_to_a.send(storage::storage::allocate(p.producer_allocator, 4 * kib, {}), {}, {}))
        << "what B wrote stopped the producer serving A";
    EXPECT_TRUE(consumer_a.receive({}).storage.valid());
    EXPECT_NO_THROW(producer_to_b.send(storage::storage::allocate(p.producer_allocator, 4 * kib, {}), {}, {}))
        << "the producer still serves B over what B wrote into its free slots";
  }  // hangs up on B
  EXPECT_EQ(child.wait(), 0);
  held_by_a = ipc::received();
  p.dev.synchronize({});
  p.producer.collect();
  EXPECT_EQ(p.producer.stats().limbo_blocks, 0u) << "X is freed once A lets go (and B's slots are reclaimed)";
}

TEST(hostile_peer, errors_a_peer_causes_name_its_pid_and_uid) {
  captured_exchange p;
  const std::string named = "peer pid " + std::to_string(::getpid()) + " (uid " + std::to_string(::getuid()) + "): ";
  auto frames = p.capture_share(8 * kib);
  counter_frame(frames).fd = copy_of(counter_frame(frames).fd.get(), 0);  // unsealed: refused
  const std::string refused = p.refusal_of(frames);
  EXPECT_TRUE(refused.starts_with(named)) << refused;

  auto [from, to] = connected_pair();
  ipc::peer receiver(p.consumer, std::move(to));
  { auto gone = std::move(from); }  // the peer hangs up
  try {
    (void)receiver.receive({});
    ADD_FAILURE() << "a closed connection delivered something";
  } catch (const connection_closed& e) {
    EXPECT_TRUE(std::string(e.what()).starts_with(named)) << e.what();
  }
}

// Revoking stops serving the process on every connection and wakes a
// receive blocked on the revoked one; what it holds stays held.
TEST(hostile_peer, a_revoked_process_is_refused_on_every_connection) {
  captured_exchange p;
  auto [to_a, a_end] = connected_pair();
  auto [to_b, b_end] = connected_pair();
  ipc::peer producer_to_a(p.producer, std::move(to_a)), producer_to_b(p.producer, std::move(to_b));
  ipc::peer consumer_a(p.consumer, std::move(a_end)), consumer_b(p.consumer, std::move(b_end));
  producer_to_a.send(storage::storage::allocate(p.producer_allocator, 4 * kib, {}), {}, {});
  ipc::received held = consumer_a.receive({});
  ASSERT_TRUE(held.storage.valid());

  auto blocked = std::async(std::launch::async, [&] { (void)producer_to_a.receive({}); });
  producer_to_a.revoke();
  ASSERT_EQ(blocked.wait_for(5s), std::future_status::ready) << "a receive blocked on the revoked connection still waits";
  EXPECT_THROW(blocked.get(), connection_closed);
  EXPECT_THROW((void)consumer_a.receive({}), connection_closed) << "the consumer's end is closed";
  EXPECT_THROW(producer_to_b.send(storage::storage::allocate(p.producer_allocator, 4 * kib, {}), {}, {}), peer_refused);
  const std::vector<std::byte> note{std::byte{1}};
  EXPECT_THROW(producer_to_b.send_note(note), peer_refused) << "a note is sent to a revoked process too";
  const auto holders = p.producer.holders();
  ASSERT_EQ(holders.size(), 1u);
  EXPECT_TRUE(holders[0].revoked);
  EXPECT_EQ(holders[0].references, 1u) << "what it holds stays held";
  EXPECT_EQ(holders[0].pinned_bytes, 4 * kib);
}

// A consumer that stops reading its socket: the producer's send publishes
// the storage in the ring, then its wake-up is refused. The consumer can
// still take the storage from the ring, so its block stays held — freed, the
// next allocation would get memory the consumer maps.
TEST(hostile_consumer, a_share_that_reached_the_ring_before_the_send_failed_stays_held) {
  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator producer_allocator{dev, {}};
  ipc::sharing_context producer{producer_allocator, {.collect_interval = 0ms}};
  auto [a, b] = connected_pair();
  ipc::peer p(producer, std::move(a));
  p.send(storage::storage::allocate(producer_allocator, 8 * kib, {}), {}, {});
  std::vector<channel::frame> got;
  do {
    got.push_back(b.receive_for(5s));
  } while (got.back().type != storage_type);  // the counter file, the segment, the storage
  ASSERT_EQ(::shutdown(b.native_handle(), SHUT_RD), 0);  // it stops reading its socket
  auto second = storage::storage::allocate(producer_allocator, 8 * kib, {});
  const void* const address = second.data();
  EXPECT_THROW(p.send(second, {}, {}), error);
  const std::optional<channel::frame> f = b.try_receive();
  ASSERT_TRUE(f && f->type == storage_type) << "the storage reached the consumer through the ring";
  second = {};
  const auto reuse = storage::storage::allocate(producer_allocator, 8 * kib, {});
  EXPECT_NE(reuse.data(), address) << "the producer freed and reused a block whose storage message was delivered";
  EXPECT_EQ(producer.stats().held_slots, 2u);
}


}  // namespace
}  // namespace shoal::testing
