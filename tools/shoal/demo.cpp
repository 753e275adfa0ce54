#include "tools/shoal/demo.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/core/child_process.h"

namespace shoal::tools {

namespace {

using namespace std::chrono_literals;
using backend::device;

constexpr std::size_t demo_bytes = 4 << 20;
constexpr std::uint8_t parent_byte = 0x5A;
constexpr std::uint8_t child_byte = 0xA5;

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

bool all_are(const std::vector<std::uint8_t>& bytes, std::uint8_t value) {
  for (auto b : bytes) {
    if (b != value) return false;
  }
  return true;
}

std::vector<std::uint8_t> read_back(device& dev, const void* src, std::size_t bytes, backend::stream_ref s) {
  std::vector<std::uint8_t> out(bytes);
  dev.copy(s, out.data(), src, bytes);
  dev.synchronize(s);
  return out;
}

std::string self_path() {
  std::vector<char> path(4096);
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throw backend_error("readlink(/proc/self/exe)", "cannot find this program to start its child");
  return {path.data(), static_cast<std::size_t>(n)};
}

void streams_and_events(device& dev, void* buffer) {
  backend::stream producer(dev);
  backend::stream consumer(dev);
  backend::event written(dev);
  dev.fill(producer, buffer, 0, demo_bytes);
  dev.delay(producer, 50ms);
  dev.fill(producer, buffer, parent_byte, demo_bytes);
  written.record(producer);
  std::printf("[streams] producer: 50 ms of work then a fill of 0x%02X, enqueued; still running: %s\n", parent_byte,
              dev.query(producer) ? "no" : "yes");
  dev.wait(consumer, written);
  const auto start = std::chrono::steady_clock::now();
  const bool ok = all_are(read_back(dev, buffer, demo_bytes, consumer), parent_byte);
  std::printf("[events]  consumer waited on the producer's event and read the fill after %.1f ms: %s\n", ms_since(start),
              ok ? "all bytes right" : "WRONG BYTES");
  if (!ok) throw error("demo: the consumer stream did not see the producer's write");
}

void growable_range(device& dev) {
  const std::size_t g = dev.granularity();
  auto* range = static_cast<std::uint8_t*>(dev.reserve_range(8 * g));
  std::vector<backend::physical_ref> chunks;
  for (int i = 0; i < 3; ++i) {
    chunks.push_back(dev.create_physical(g));
    dev.map(range + i * g, chunks.back());
    dev.fill({}, range + i * g, static_cast<std::uint8_t>(i + 1), g);
  }
  const bool ok = all_are(read_back(dev, range + 2 * g, g, {}), 3);
  std::printf("[growable] reserved %zu MiB of addresses, grew it by mapping 3 chunks of %zu MiB: %s\n", 8 * g >> 20,
              g >> 20, ok ? "contents right" : "WRONG BYTES");
  for (int i = 0; i < 3; ++i) {
    dev.unmap(range + i * g);
    dev.release_physical(chunks[static_cast<std::size_t>(i)]);
  }
  dev.release_range(range);
  if (!ok) throw error("demo: a mapped chunk did not hold its bytes");
}

void share_with_child(device& dev, void* buffer) {
  const auto handle = dev.export_memory(buffer);
  child_process child(self_path(), {"demo-child", std::string(to_string(dev.kind()))});
  auto link = channel::connection::adopt_pair_end(unique_fd(::dup(child.socket())), {});
  link.send(1, handle.serialize(), handle.fd.get());
  const channel::frame answer = link.receive();
  const std::string said(reinterpret_cast<const char*>(answer.payload.data()), answer.payload.size());
  const pid_t pid = child.pid();
  const int status = child.wait();
  std::printf("[sharing] child process %d: %s\n", static_cast<int>(pid), said.c_str());
  const bool ok = all_are(read_back(dev, buffer, demo_bytes, {}), child_byte);
  std::printf("[sharing] parent reads the child's 0x%02X back: %s\n", child_byte, ok ? "all bytes right" : "WRONG BYTES");
  if (status != 0 || !ok) throw error("demo: sharing with the child process failed (child exit status " + std::to_string(status) + ")");
}

}  // namespace

int run_demo() {
  device& dev = backend::default_device();
  const auto mem = dev.memory();
  std::printf("[device]  %s:%d  %s  (%.1f of %.1f GiB free)\n", std::string(to_string(dev.kind())).c_str(), dev.ordinal(),
              dev.name().c_str(), mem.free_bytes / 1073741824.0, mem.total_bytes / 1073741824.0);
  void* buffer = dev.allocate_segment(demo_bytes);
  try {
    streams_and_events(dev, buffer);
    growable_range(dev);
    share_with_child(dev, buffer);
  } catch (...) {
    dev.free_segment(buffer);
    throw;
  }
  dev.free_segment(buffer);
  std::printf("demo: every step checked out\n");
  return 0;
}

int run_demo_child(const std::string& backend_name) {
  device& dev = backend_name == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
  auto link = channel::connection::adopt_pair_end(unique_fd(child_process::child_socket_fd), {});
  std::string answer;
  try {
    channel::frame m = link.receive();
    const auto handle = backend::shareable_handle::deserialize(m.payload, std::move(m.fd));
    void* p = dev.import_memory(handle);
    const bool saw_parent = all_are(read_back(dev, p, demo_bytes, {}), parent_byte);
    dev.fill({}, p, child_byte, demo_bytes);
    dev.synchronize({});
    dev.close_import(p);
    answer = std::string("imported ") + std::to_string(handle.size >> 20) + " MiB, saw the parent's 0x5A: " +
             (saw_parent ? "yes" : "NO") + ", wrote 0xA5";
    if (!saw_parent) answer = "FAILED: " + answer;
  } catch (const std::exception& e) {
    answer = std::string("FAILED: ") + e.what();
  }
  link.send(1, std::as_bytes(std::span(answer)));
  return answer.starts_with("FAILED") ? 1 : 0;
}

}  // namespace shoal::tools
