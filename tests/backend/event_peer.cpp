// The other process of event_sharing_test.cpp. It talks over its socket
// (fd 3) in messages: handles and sources arrive with their descriptors,
// points as bytes; it answers in text: "ready", "ok ...", or what went
// wrong ("peer failed: ...").
//
//   shoal_test_event_peer wait-and-read <host|cuda> <bytes> <expected byte>
//     Receives a memory handle and an event source, imports and opens them,
//     answers "ready <pid the source names as its exporter, or unnamed>"; then
//     receives a point, makes a new stream wait for it,
//     copies `bytes` bytes from the memory on that stream and checks that
//     each is `expected`. Answers "ok <milliseconds from the wait to the end
//     of the copy>".
//   shoal_test_event_peer export-and-hang <host|cuda> <bytes>
//     Exports a segment of `bytes` bytes filled with 1, the source of a new
//     stream, a point A on it, then delays the stream 60 s, fills the
//     segment with 2 and exports a point B after that. Sends handle,
//     source, A and B, then waits for its socket to close (or to be killed).
//   shoal_test_event_peer import-chunks <host|cuda> <first byte> <second byte> <byte to write>
//     Receives two chunk handles, imports them as one range, checks that the
//     first chunk's bytes (from its offset) are `first` and the second's are
//     `second`, overwrites all of them with the third value. Answers "ok".
//   shoal_test_event_peer import-twice <host|cuda> <bytes> <expected byte>
//     Receives one memory handle and imports it twice (as a producer that
//     announces one segment under two ids makes a consumer do), closes the
//     first import, then checks through the second that each of `bytes` bytes
//     is `expected` and closes it. Answers "ok".
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "shoal/core/child_process.h"
#include "support/fd_transport.h"

namespace {

using namespace shoal;

constexpr int socket_fd = child_process::child_socket_fd;
constexpr std::size_t max_message = 4096;

void say(const std::string& text) { testing::send_message(socket_fd, std::as_bytes(std::span(text))); }

backend::shareable_handle receive_handle() {
  testing::message m = testing::receive_message(socket_fd, max_message);
  return backend::shareable_handle::deserialize(m.payload, std::move(m.fd));
}

backend::event_source receive_source() {
  testing::message m = testing::receive_message(socket_fd, max_message);
  return backend::event_source::deserialize(m.payload, std::move(m.fd));
}

backend::event_point receive_point() {
  return backend::event_point::deserialize(testing::receive_message(socket_fd, max_message).payload);
}

void send_handle(const backend::shareable_handle& h) { testing::send_message(socket_fd, h.serialize(), h.fd.get()); }
void send_source(const backend::event_source& s) { testing::send_message(socket_fd, s.serialize(), s.fd.get()); }
void send_point(const backend::event_point& p) { testing::send_message(socket_fd, p.serialize()); }

// The first byte of `seen` that is not `expected`, as text, or "".
std::string mismatch(const std::vector<std::uint8_t>& seen, std::size_t from, std::size_t to, std::uint8_t expected) {
  for (std::size_t i = from; i < to; ++i) {
    if (seen[i] != expected) {
      return "byte " + std::to_string(i) + " is " + std::to_string(seen[i]) + ", expected " + std::to_string(expected);
    }
  }
  return {};
}

std::string wait_and_read(backend::device& dev, std::size_t bytes, std::uint8_t expected) {
  const backend::shareable_handle handle = receive_handle();
  const backend::event_source source = receive_source();
  void* memory = dev.import_memory(handle);
  const backend::imported_event_ref opened = dev.open_event_source(source);
  const backend::stream_ref stream = dev.create_stream();
  const auto exporter = dev.event_source_exporter(opened);  // as the page names it, if the kind does
  say("ready " + (exporter ? std::to_string(exporter->pid) : std::string("unnamed")));
  const backend::event_point point = receive_point();
  const auto start = std::chrono::steady_clock::now();
  dev.wait_imported(stream, opened, point);
  std::vector<std::uint8_t> seen(bytes);
  dev.copy(stream, seen.data(), memory, bytes);
  dev.synchronize(stream);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  dev.destroy_stream(stream);
  dev.close_event_source(opened);
  dev.close_import(memory);
  if (std::string wrong = mismatch(seen, 0, bytes, expected); !wrong.empty()) return wrong;
  return "ok " + std::to_string(waited.count());
}

[[noreturn]] void export_and_hang(backend::device& dev, std::size_t bytes) {
  void* segment = dev.allocate_segment(bytes);
  const backend::stream_ref stream = dev.create_stream();
  dev.fill(stream, segment, 1, bytes);
  const backend::event_point passed_soon = dev.export_event(stream);
  dev.delay(stream, std::chrono::seconds(60));
  dev.fill(stream, segment, 2, bytes);
  const backend::event_point never_passed = dev.export_event(stream);
  send_handle(dev.export_memory(segment));
  send_source(dev.describe_event_source(never_passed.source_id));
  send_point(passed_soon);
  send_point(never_passed);
  try {
    (void)testing::receive_message(socket_fd, max_message);
  } catch (const connection_closed&) {
  }
  std::_Exit(0);  // not waiting for the delayed stream
}

std::string import_chunks(backend::device& dev, std::uint8_t first, std::uint8_t second, std::uint8_t write) {
  std::vector<backend::shareable_handle> chunks;
  chunks.push_back(receive_handle());
  chunks.push_back(receive_handle());
  auto* p = static_cast<std::uint8_t*>(dev.import_memory(chunks));
  const std::size_t first_bytes = chunks[0].size - chunks[0].offset;
  const std::size_t bytes = first_bytes + chunks[1].size;
  std::vector<std::uint8_t> seen(bytes);
  dev.copy({}, seen.data(), p, bytes);
  dev.synchronize({});
  std::string wrong = mismatch(seen, 0, first_bytes, first);
  if (wrong.empty()) wrong = mismatch(seen, first_bytes, bytes, second);
  if (wrong.empty()) {
    dev.fill({}, p, write, bytes);
    dev.synchronize({});
  }
  dev.close_import(p);
  return wrong.empty() ? "ok" : wrong;
}

// CUDA hands out one mapping for a handle opened twice and counts the opens:
// each import must stay usable until its own close.
std::string import_twice(backend::device& dev, std::size_t bytes, std::uint8_t expected) {
  const backend::shareable_handle handle = receive_handle();
  void* first = dev.import_memory(handle);
  void* second = dev.import_memory(handle);
  dev.close_import(first);
  std::vector<std::uint8_t> seen(bytes);
  dev.copy({}, seen.data(), second, bytes);
  dev.synchronize({});
  dev.close_import(second);
  std::string wrong = mismatch(seen, 0, bytes, expected);
  return wrong.empty() ? "ok" : "through the second import after the first was closed: " + wrong;
}

std::uint8_t byte_argument(const std::string& text) { return static_cast<std::uint8_t>(std::stoi(text)); }

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  std::string answer;
  try {
    if (args.size() < 2) throw invalid_argument("expected a mode and a backend");
    backend::device& dev = args[1] == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
    if (args[0] == "wait-and-read" && args.size() == 4) {
      answer = wait_and_read(dev, std::stoull(args[2]), byte_argument(args[3]));
    } else if (args[0] == "export-and-hang" && args.size() == 3) {
      export_and_hang(dev, std::stoull(args[2]));
    } else if (args[0] == "import-chunks" && args.size() == 5) {
      answer = import_chunks(dev, byte_argument(args[2]), byte_argument(args[3]), byte_argument(args[4]));
    } else if (args[0] == "import-twice" && args.size() == 4) {
      answer = import_twice(dev, std::stoull(args[2]), byte_argument(args[3]));
    } else {
      throw invalid_argument("unknown mode or wrong number of arguments; see the top of event_peer.cpp");
    }
  } catch (const std::exception& e) {
    answer = std::string("peer failed: ") + e.what();
  }
  try {
    say(answer);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "peer could not answer: %s\n", e.what());
    return 1;
  }
  return answer.starts_with("ok") ? 0 : 1;
}
