// Ordering a stream after a point in another process's stream, and
// importing several exported chunks as one range. The other process is
// shoal_test_event_peer (event_peer.cpp).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/shareable_event.h"
#include "shoal/core/error.h"
#include "shoal/core/child_process.h"
#include "support/fd_transport.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::event_point;
using backend::event_source;
using backend::event_source_kind;
using backend::shareable_handle;

constexpr std::size_t max_message = 4096;

// ---- talking to the peer -------------------------------------------------------

void send(const child_process& peer, const shareable_handle& h) {
  testing::send_message(peer.socket(), h.serialize(), h.fd.get());
}
void send(const child_process& peer, const event_source& s) {
  testing::send_message(peer.socket(), s.serialize(), s.fd.get());
}
void send(const child_process& peer, const event_point& p) { testing::send_message(peer.socket(), p.serialize()); }

std::string text_of(const testing::message& m) {
  return {reinterpret_cast<const char*>(m.payload.data()), m.payload.size()};
}

std::string receive_text(const child_process& peer) { return text_of(testing::receive_message(peer.socket(), max_message)); }

// A value the peer sends; when it sent its failure instead, that is the error.
template <class Value, class Decode>
Value receive_value(const child_process& peer, Decode decode) {
  testing::message m = testing::receive_message(peer.socket(), max_message);
  const std::string text = text_of(m);
  try {
    return decode(m);
  } catch (const protocol_error&) {
    throw std::runtime_error("the peer sent '" + text + "' instead of a value");
  }
}

shareable_handle receive_handle(const child_process& peer) {
  return receive_value<shareable_handle>(peer, [](testing::message& m) { return shareable_handle::deserialize(m.payload, std::move(m.fd)); });
}
event_source receive_source(const child_process& peer) {
  return receive_value<event_source>(peer, [](testing::message& m) { return event_source::deserialize(m.payload, std::move(m.fd)); });
}
event_point receive_point(const child_process& peer) {
  return receive_value<event_point>(peer, [](testing::message& m) { return event_point::deserialize(m.payload); });
}

// ---- helpers ------------------------------------------------------------------------

bool descriptor_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

unique_fd any_fd() { return unique_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

std::vector<shareable_handle> both(const shareable_handle& a, const shareable_handle& b) {
  std::vector<shareable_handle> chunks;
  chunks.push_back(a.duplicate());
  chunks.push_back(b.duplicate());
  return chunks;
}

// ---- on both backends -----------------------------------------------------------------

template <class Backend>
class event_sharing : public backend_test<Backend> {};
TYPED_TEST_SUITE(event_sharing, backend_types, backend_names);

TYPED_TEST(event_sharing, a_stream_waiting_on_an_exported_point_runs_after_it) {
  auto& dev = this->device();
  constexpr std::size_t bytes = 1 << 20;
  void* segment = dev.allocate_segment(bytes);
  const auto stream = dev.create_stream();
  dev.fill(stream, segment, 0x11, bytes);
  const event_point first = dev.export_event(stream);  // brings the stream's source into being
  dev.synchronize(stream);

  child_process peer(SHOAL_TEST_EVENT_PEER, {"wait-and-read", TypeParam::name, std::to_string(bytes), "34"});
  send(peer, dev.export_memory(segment));
  send(peer, dev.describe_event_source(first.source_id));
  // A host page names its exporter, this process; a CUDA event names none.
  const std::string exporter = dev.kind() == backend::device_kind::host ? std::to_string(::getpid()) : "unnamed";
  ASSERT_EQ(receive_text(peer), "ready " + exporter);
  // Enqueued only now that the peer is ready, so its wait and copy surely
  // come while this stream is still delayed; without the wait it would copy
  // the old 0x11.
  dev.delay(stream, 200ms);
  dev.fill(stream, segment, 0x22, bytes);
  const event_point after_fill = dev.export_event(stream);
  EXPECT_EQ(after_fill.source_id, first.source_id);
  send(peer, after_fill);
  const std::string answer = receive_text(peer);
  EXPECT_TRUE(answer.starts_with("ok")) << answer;
  EXPECT_EQ(peer.wait(), 0);
  dev.synchronize(stream);
  dev.destroy_stream(stream);
  dev.free_segment(segment);
}

TYPED_TEST(event_sharing, a_passed_point_does_not_wait_for_work_enqueued_after_it) {
  auto& dev = this->device();
  constexpr std::size_t bytes = 1 << 20;
  void* segment = dev.allocate_segment(bytes);
  const auto stream = dev.create_stream();
  dev.fill(stream, segment, 0x33, bytes);
  const event_point point = dev.export_event(stream);
  dev.synchronize(stream);

  child_process peer(SHOAL_TEST_EVENT_PEER, {"wait-and-read", TypeParam::name, std::to_string(bytes), "51"});
  send(peer, dev.export_memory(segment));
  send(peer, dev.describe_event_source(point.source_id));
  ASSERT_TRUE(receive_text(peer).starts_with("ready"));
  dev.delay(stream, 1s);  // the exporting stream is busy, but past the point
  send(peer, point);
  const std::string answer = receive_text(peer);
  ASSERT_TRUE(answer.starts_with("ok ")) << answer;
  EXPECT_LT(std::stoi(answer.substr(3)), 500) << "the peer waited for work after the point";
  EXPECT_EQ(peer.wait(), 0);
  dev.synchronize(stream);
  dev.destroy_stream(stream);
  dev.free_segment(segment);
}

TYPED_TEST(event_sharing, a_source_is_described_for_the_wire_and_outlives_its_stream) {
  auto& dev = this->device();
  const auto stream = dev.create_stream();
  const event_point point = dev.export_event(stream);
  EXPECT_NE(point.source_id, 0u);
  EXPECT_EQ(dev.export_event(stream).source_id, point.source_id) << "one source per stream (or per page)";
  EXPECT_EQ(event_point::deserialize(point.serialize()), point);
  dev.destroy_stream(stream);

  event_source source = dev.describe_event_source(point.source_id);  // still there: other processes may hold it
  const bool host = dev.kind() == backend::device_kind::host;
  EXPECT_EQ(source.kind, host ? event_source_kind::host_page : event_source_kind::cuda_ipc_event);
  EXPECT_EQ(source.device, dev.kind());
  EXPECT_EQ(source.device_ordinal, dev.ordinal());
  EXPECT_EQ(source.source_id, point.source_id);
  EXPECT_EQ(source.fd.valid(), host);
  const auto wire = source.serialize();
  ASSERT_EQ(wire.size(), event_source::wire_bytes);
  const event_source back = event_source::deserialize(wire, std::move(source.fd));
  EXPECT_EQ(back.kind, source.kind);
  EXPECT_EQ(back.source_id, source.source_id);
  EXPECT_EQ(back.opaque, source.opaque);
  EXPECT_EQ(back.fd.valid(), host);
  EXPECT_THROW((void)dev.describe_event_source(point.source_id + 1'000'000), invalid_argument);
}

TYPED_TEST(event_sharing, two_chunks_of_a_growable_range_are_imported_as_one_range) {
  auto& dev = this->device();
  const std::size_t g = dev.granularity();
  auto* range = static_cast<std::uint8_t*>(dev.reserve_range(2 * g));
  const auto first = dev.create_physical(g);
  const auto second = dev.create_physical(g);
  dev.map(range, first);
  dev.map(range + g, second);
  dev.fill({}, range, 0x0A, g);
  dev.fill({}, range + g, 0x0B, g);
  dev.synchronize({});
  const shareable_handle h0 = dev.export_memory(range + 512);
  const shareable_handle h1 = dev.export_memory(range + g);
  EXPECT_EQ(h0.offset, 512u);
  EXPECT_EQ(h1.offset, 0u);

  child_process peer(SHOAL_TEST_EVENT_PEER, {"import-chunks", TypeParam::name, "10", "11", "12"});
  send(peer, h0);
  send(peer, h1);
  EXPECT_EQ(receive_text(peer), "ok");
  EXPECT_EQ(peer.wait(), 0);
  EXPECT_TRUE(all_equal(this->read(range + 512, 2 * g - 512), 12)) << "the peer's writes landed in both chunks";
  EXPECT_TRUE(all_equal(this->read(range, 512), 0x0A)) << "the bytes before the exported pointer are untouched";
  dev.unmap(range);
  dev.unmap(range + g);
  dev.release_physical(first);
  dev.release_physical(second);
  dev.release_range(range);
}

// A hostile producer may announce one segment under two ids: the consumer
// imports the same handle twice, and closing one import must not take the
// other's memory away (CUDA returns the same mapping and counts its opens).
TYPED_TEST(event_sharing, one_handle_imported_twice_stays_mapped_until_both_are_closed) {
  auto& dev = this->device();
  constexpr std::size_t bytes = 1 << 20;
  void* segment = dev.allocate_segment(bytes);
  dev.fill({}, segment, 0x5A, bytes);
  dev.synchronize({});
  child_process peer(SHOAL_TEST_EVENT_PEER, {"import-twice", TypeParam::name, std::to_string(bytes), "90"});
  send(peer, dev.export_memory(segment));
  EXPECT_EQ(receive_text(peer), "ok");
  EXPECT_EQ(peer.wait(), 0);
  dev.free_segment(segment);
}

TYPED_TEST(event_sharing, chunks_that_cannot_be_imported_together_are_refused) {
  auto& dev = this->device();
  const std::size_t g = dev.granularity();
  auto* range = static_cast<std::uint8_t*>(dev.reserve_range(2 * g));
  const auto first = dev.create_physical(g);
  const auto second = dev.create_physical(g);
  dev.map(range, first);
  dev.map(range + g, second);
  void* segment = dev.allocate_segment(4096);
  const shareable_handle h0 = dev.export_memory(range);
  const shareable_handle h1 = dev.export_memory(range + g);
  const shareable_handle h1_inside = dev.export_memory(range + g + 512);
  const shareable_handle seg = dev.export_memory(segment);

  EXPECT_THROW(dev.import_memory(std::span<const shareable_handle>{}), invalid_argument) << "no chunks";
  EXPECT_THROW(dev.import_memory(both(h0, h1_inside)), invalid_argument) << "a later chunk with an offset";
  // host: a 4096-byte segment is no granularity multiple; cuda: a cuda_ipc
  // handle with a cuda_vmm_fd one.
  EXPECT_THROW(dev.import_memory(both(h0, seg)), invalid_argument) << "a segment with a chunk";
  // host: again not granularity multiples; cuda: legacy IPC handles only singly.
  EXPECT_THROW(dev.import_memory(both(seg, seg)), invalid_argument) << "two segments";
  auto closed = both(h0, h1);
  closed[1].fd.reset();
  EXPECT_THROW(dev.import_memory(closed), invalid_argument) << "a chunk without its descriptor";
  auto foreign = both(h0, h1);
  foreign[1].device = dev.kind() == backend::device_kind::host ? backend::device_kind::cuda : backend::device_kind::host;
  EXPECT_THROW(dev.import_memory(foreign), invalid_argument) << "a chunk of another backend";

  dev.free_segment(segment);
  dev.unmap(range);
  dev.unmap(range + g);
  dev.release_physical(first);
  dev.release_physical(second);
  dev.release_range(range);
}

// ---- the host backend only ---------------------------------------------------------------

// CUDA is not tested for this: what a stream waiting on an IPC event does
// when the process that exported the event dies is up to the driver, and a
// GPU-side wait cannot look whether the exporter still lives.
TEST(host_event_sharing, a_wait_on_a_point_of_a_process_that_died_fails_instead_of_hanging) {
  auto& dev = backend::host_device_instance();
  constexpr std::size_t bytes = 4096;
  child_process peer(SHOAL_TEST_EVENT_PEER, {"export-and-hang", "host", std::to_string(bytes)});
  const shareable_handle handle = receive_handle(peer);
  const event_source source = receive_source(peer);
  const event_point passed_soon = receive_point(peer);
  const event_point never_passed = receive_point(peer);
  void* memory = dev.import_memory(handle);
  const auto opened = dev.open_event_source(source);
  ASSERT_TRUE(dev.event_source_exporter(opened).has_value());
  EXPECT_EQ(dev.event_source_exporter(opened)->pid, peer.pid()) << "the page names the process that exported it";
  const auto waiting = dev.create_stream();
  const auto other = dev.create_stream();
  dev.wait_imported(other, opened, passed_soon);
  dev.synchronize(other);  // the point before the peer's delay passes

  std::vector<std::uint8_t> seen(bytes);
  dev.wait_imported(waiting, opened, never_passed);
  dev.copy(waiting, seen.data(), memory, bytes);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(dev.query(waiting)) << "the wait did not hold the stream";
  ASSERT_EQ(::kill(peer.pid(), SIGKILL), 0);  // not reaped yet: the waiter must see through the zombie
  const auto killed = std::chrono::steady_clock::now();
  try {
    dev.synchronize(waiting);
    ADD_FAILURE() << "the wait on a point the dead exporter never reached succeeded";
  } catch (const stream_error& e) {
    EXPECT_NE(std::string(e.what()).find("died"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 5s);

  dev.wait_imported(other, opened, passed_soon);
  EXPECT_NO_THROW(dev.synchronize(other)) << "a point passed before the death stays passed";
  EXPECT_EQ(peer.wait(), 128 + SIGKILL);
  dev.destroy_stream(waiting);
  dev.destroy_stream(other);
  dev.close_event_source(opened);
  dev.close_import(memory);
}

// A peer may live and never pass the point (stopped, or writing its page's
// count as it likes): the wait gives up at the device's peer_wait_limit, so
// neither the stream nor the device's end waits on it forever. The peer
// passes the point only 60 s later: without the limit the wait would end
// then, successfully, and this test fail.
TEST(host_event_sharing, a_wait_on_a_live_exporter_that_does_not_pass_the_point_fails_at_the_limit) {
  backend::host_device dev{{.peer_wait_limit = 300ms}};
  child_process peer(SHOAL_TEST_EVENT_PEER, {"export-and-hang", "host", "4096"});
  const shareable_handle handle = receive_handle(peer);
  const event_source source = receive_source(peer);
  (void)receive_point(peer);
  const event_point never_passed = receive_point(peer);
  const auto opened = dev.open_event_source(source);
  const auto waiting = dev.create_stream();
  const auto start = std::chrono::steady_clock::now();
  dev.wait_imported(waiting, opened, never_passed);
  try {
    dev.synchronize(waiting);
    ADD_FAILURE() << "the wait on a point the exporter has not passed succeeded";
  } catch (const stream_error& e) {
    EXPECT_NE(std::string(e.what()).find("has not passed the point in 300 ms"), std::string::npos) << e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 300ms);
  EXPECT_LT(waited, 10s);
  EXPECT_EQ(::kill(peer.pid(), 0), 0) << "the exporter lives: the limit, not its death, ended the wait";
  dev.destroy_stream(waiting);
  dev.close_event_source(opened);
  ASSERT_EQ(::kill(peer.pid(), SIGKILL), 0);
  EXPECT_EQ(peer.wait(), 128 + SIGKILL);
}

TEST(host_event_sharing, a_peer_wait_limit_must_be_positive) {
  EXPECT_THROW(backend::host_device({.peer_wait_limit = 0ms}), invalid_argument);
}

TEST(host_event_sharing, a_closed_source_still_completes_the_waits_enqueued_on_it) {
  auto& dev = backend::host_device_instance();
  const auto producer = dev.create_stream();
  const auto consumer = dev.create_stream();
  // Flags rather than bytes: ThreadSanitizer cannot see ordering through a
  // second mapping of the page in the same process.
  std::atomic<bool> produced{false};
  std::atomic<bool> seen_produced{false};
  dev.delay(producer, 100ms);
  dev.host_task(producer, [&] { produced = true; });
  const event_point point = dev.export_event(producer);
  // This process may open its own page, as another would.
  const auto opened = dev.open_event_source(dev.describe_event_source(point.source_id));
  dev.wait_imported(consumer, opened, point);
  dev.close_event_source(opened);
  dev.host_task(consumer, [&] { seen_produced = produced.load(); });
  dev.synchronize(consumer);
  EXPECT_TRUE(seen_produced) << "the consumer ran before the point";
  EXPECT_THROW(dev.close_event_source(opened), invalid_argument) << "closed twice";
  EXPECT_THROW(dev.wait_imported(consumer, opened, point), invalid_argument) << "used after closing";
  dev.destroy_stream(producer);
  dev.destroy_stream(consumer);
}

TEST(host_event_sharing, points_of_other_sources_or_slots_are_refused) {
  auto& dev = backend::host_device_instance();
  const auto stream = dev.create_stream();
  const event_point point = dev.export_event(stream);
  const auto opened = dev.open_event_source(dev.describe_event_source(point.source_id));
  event_point other_source = point;
  other_source.source_id += 1;
  EXPECT_THROW(dev.wait_imported(stream, opened, other_source), invalid_argument);
  event_point no_such_slot = point;
  no_such_slot.stream_slot = 1u << 20;
  EXPECT_THROW(dev.wait_imported(stream, opened, no_such_slot), invalid_argument);
  EXPECT_THROW(dev.wait_imported(stream, backend::imported_event_ref{&other_source}, point), invalid_argument);
  dev.close_event_source(opened);
  dev.destroy_stream(stream);
}

TEST(host_event_sharing, a_reused_slot_continues_from_where_its_last_stream_stopped) {
  auto& dev = backend::host_device_instance();
  const auto old_stream = dev.create_stream();
  for (int i = 0; i < 3; ++i) dev.delay(old_stream, 1ms);
  const event_point old_point = dev.export_event(old_stream);
  dev.destroy_stream(old_stream);  // its work runs on, then its slot goes back
  dev.synchronize_device();

  // The slot goes back when the stream's thread lets go of it, which may be
  // a moment after its last work ran: a stream made before then gets another
  // slot. Those are kept (so none of their slots comes back first) until the
  // freed one is the next handed out.
  std::vector<backend::stream_ref> too_early;
  auto new_stream = dev.create_stream();
  event_point new_point = dev.export_event(new_stream);
  for (const auto deadline = std::chrono::steady_clock::now() + 10s;
       new_point.stream_slot != old_point.stream_slot && std::chrono::steady_clock::now() < deadline;) {
    too_early.push_back(new_stream);
    std::this_thread::sleep_for(20ms);  // at most 500 streams kept
    new_stream = dev.create_stream();
    new_point = dev.export_event(new_stream);
  }
  for (auto s : too_early) dev.destroy_stream(s);
  ASSERT_EQ(new_point.stream_slot, old_point.stream_slot) << "the freed slot is the next one handed out";
  EXPECT_GE(new_point.ticket, old_point.ticket) << "a slot's count never goes back";
  const auto opened = dev.open_event_source(dev.describe_event_source(old_point.source_id));
  dev.wait_imported(new_stream, opened, old_point);  // passed long ago: must not hang
  dev.synchronize(new_stream);
  dev.close_event_source(opened);
  dev.destroy_stream(new_stream);
}

TEST(host_event_sharing, importers_get_a_page_they_cannot_write) {
  auto& dev = backend::host_device_instance();
  const event_source source = dev.describe_event_source(dev.export_event({}).source_id);
  struct stat st {};
  ASSERT_EQ(::fstat(source.fd.get(), &st), 0);
  const auto bytes = static_cast<std::size_t>(st.st_size);
  EXPECT_EQ(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, source.fd.get(), 0), MAP_FAILED);
  EXPECT_NE(::ftruncate(source.fd.get(), 0), 0) << "the page could shrink under an importer";
}

TEST(host_event_sharing, descriptors_that_are_not_an_event_page_are_refused) {
  auto& dev = backend::host_device_instance();
  const event_source real = dev.describe_event_source(dev.export_event({}).source_id);
  struct stat st {};
  ASSERT_EQ(::fstat(real.fd.get(), &st), 0);
  auto source_with = [&](unique_fd fd) {
    event_source s;
    s.kind = event_source_kind::host_page;
    s.source_id = real.source_id;
    s.fd = std::move(fd);
    return s;
  };
  EXPECT_THROW(dev.open_event_source(source_with(unique_fd(::open("/dev/zero", O_RDONLY | O_CLOEXEC)))), invalid_argument);
  unique_fd unsealed(::memfd_create("not-a-page", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(unsealed.get(), st.st_size), 0);
  EXPECT_THROW(dev.open_event_source(source_with(std::move(unsealed))), invalid_argument) << "unsealed";
  unique_fd blank(::memfd_create("blank-page", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(blank.get(), st.st_size), 0);
  ASSERT_EQ(::fcntl(blank.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_THROW(dev.open_event_source(source_with(std::move(blank))), invalid_argument) << "no header";
  void* segment = dev.allocate_segment(4096);
  EXPECT_THROW(dev.open_event_source(source_with(std::move(dev.export_memory(segment).fd))), invalid_argument)
      << "a memory segment";
  dev.free_segment(segment);
  event_source wrong_id = source_with(real.fd.duplicate());
  wrong_id.source_id += 1;
  EXPECT_THROW(dev.open_event_source(wrong_id), invalid_argument) << "a page under another source's id";
  event_source cuda;
  cuda.kind = event_source_kind::cuda_ipc_event;
  cuda.device = backend::device_kind::cuda;
  cuda.source_id = 7;
  EXPECT_THROW(dev.open_event_source(cuda), invalid_argument) << "a CUDA source";
}

// ---- the wire forms --------------------------------------------------------------------------

event_source host_sample() {
  event_source s;
  s.kind = event_source_kind::host_page;
  s.device = backend::device_kind::host;
  s.source_id = 42;
  return s;
}

event_source cuda_sample() {
  event_source s;
  s.kind = event_source_kind::cuda_ipc_event;
  s.device = backend::device_kind::cuda;
  s.device_ordinal = 2;
  s.source_id = 43;
  for (std::size_t i = 0; i < s.opaque.size(); ++i) s.opaque[i] = static_cast<std::byte>(i + 1);
  return s;
}

// Deserializes `wire` with `fd`; true when refused with protocol_error, and
// then the descriptor must be closed.
bool refused_and_closed(std::span<const std::byte> wire, unique_fd fd) {
  const int number = fd.get();
  try {
    (void)event_source::deserialize(wire, std::move(fd));
    return false;
  } catch (const protocol_error&) {
    if (number >= 0) EXPECT_FALSE(descriptor_open(number)) << "a refused source leaked its descriptor";
    return true;
  }
}

TEST(event_wire, points_and_sources_round_trip) {
  const event_point point{9, 17, 123456789};
  const auto point_wire = point.serialize();
  ASSERT_EQ(point_wire.size(), event_point::wire_bytes);
  EXPECT_EQ(event_point::deserialize(point_wire), point);

  const event_source cuda = cuda_sample();
  const event_source back = event_source::deserialize(cuda.serialize(), unique_fd{});
  EXPECT_EQ(back.kind, cuda.kind);
  EXPECT_EQ(back.device, cuda.device);
  EXPECT_EQ(back.device_ordinal, 2);
  EXPECT_EQ(back.source_id, 43u);
  EXPECT_EQ(back.opaque, cuda.opaque);
  const event_source host = event_source::deserialize(host_sample().serialize(), any_fd());
  EXPECT_EQ(host.kind, event_source_kind::host_page);
  EXPECT_TRUE(host.fd.valid());
}

TEST(event_wire, malformed_fields_are_refused_and_the_descriptor_closed) {
  const auto host = host_sample().serialize();
  const auto cuda = cuda_sample().serialize();
  auto changed = [](std::vector<std::byte> wire, std::size_t at, std::uint8_t value) {
    wire[at] = static_cast<std::byte>(value);
    return wire;
  };
  // Offsets: magic 0, version 4, kind 6, device 7, ordinal 8, source id 12, opaque 20.
  EXPECT_TRUE(refused_and_closed(std::span(host).first(host.size() - 1), any_fd())) << "short";
  EXPECT_TRUE(refused_and_closed(changed(host, 0, 0), any_fd())) << "magic";
  EXPECT_TRUE(refused_and_closed(changed(host, 4, 9), any_fd())) << "version";
  EXPECT_TRUE(refused_and_closed(changed(host, 6, 7), any_fd())) << "kind";
  EXPECT_TRUE(refused_and_closed(changed(host, 7, 9), any_fd())) << "device";
  EXPECT_TRUE(refused_and_closed(changed(host, 7, 2), any_fd())) << "a host page of a cuda device";
  EXPECT_TRUE(refused_and_closed(changed(host, 8, 1), any_fd())) << "host ordinal other than 0";
  EXPECT_TRUE(refused_and_closed(changed(cuda, 11, 0x80), {})) << "negative ordinal";
  event_source zero_id = host_sample();
  zero_id.source_id = 0;
  EXPECT_TRUE(refused_and_closed(zero_id.serialize(), any_fd())) << "source id 0";
  EXPECT_TRUE(refused_and_closed(changed(host, 20, 1), any_fd())) << "opaque bytes in a host page";
  EXPECT_TRUE(refused_and_closed(host, {})) << "a host page without its descriptor";
  EXPECT_TRUE(refused_and_closed(cuda, any_fd())) << "a descriptor with a CUDA event";

  const auto point = event_point{9, 1, 2}.serialize();
  EXPECT_THROW((void)event_point::deserialize(std::span(point).first(point.size() - 1)), protocol_error) << "short";
  EXPECT_THROW((void)event_point::deserialize(changed(point, 0, 0)), protocol_error) << "magic";
  EXPECT_THROW((void)event_point::deserialize(changed(point, 4, 9)), protocol_error) << "version";
  EXPECT_THROW((void)event_point::deserialize(event_point{0, 1, 2}.serialize()), protocol_error) << "source id 0";
}

TEST(event_wire, random_bytes_are_refused_or_accepted_but_never_crash_or_leak) {
  std::mt19937_64 random(2024);
  const std::vector<std::byte> goods[] = {host_sample().serialize(), cuda_sample().serialize()};
  const auto good_point = event_point{5, 6, 7}.serialize();
  int refused = 0;
  for (int i = 0; i < 20000; ++i) {
    auto wire = goods[i % 2];
    auto point = good_point;
    for (int f = 1 + static_cast<int>(random() % 4); f > 0; --f) {
      wire[random() % wire.size()] = static_cast<std::byte>(random());
      point[random() % point.size()] = static_cast<std::byte>(random());
    }
    if (random() % 8 == 0) wire.resize(random() % (wire.size() + 8));
    if (random() % 8 == 0) point.resize(random() % (point.size() + 8));
    if (refused_and_closed(wire, random() % 2 == 0 ? any_fd() : unique_fd{})) ++refused;
    try {
      (void)event_point::deserialize(point);
    } catch (const protocol_error&) {
    }
  }
  EXPECT_GT(refused, 10000);
}

}  // namespace
}  // namespace shoal::testing
