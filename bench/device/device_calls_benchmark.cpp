// shoal_bench_device: what the device calls an allocator makes cost, one by
// one, through shoal's device interface — a plain segment's allocate and
// free, and a growable segment's physical chunk created, mapped with its
// access granted (map_chunks), unmapped and released — for chunks of
// several sizes, and k chunks mapped side by side in one map_chunks call.
// These are the costs a replay's device-call counts are multiplied by
// (shoal_replay's device allocs / frees and VMM columns). First, the
// cheapest call (an idle stream's query) from a thread with no current
// context and from one with the device's primary context current: what the
// backend's device scope adds to every call of such a thread.
//
//   shoal_bench_device [--backend host|cuda] [--rounds N]
//
// Prints µs per call, median (min–max) over the rounds.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/spread.h"
#include "shoal/backend/devices.h"

namespace {

using shoal::bench::spread;
using shoal::bench::summarize;
using shoal::bench::text;

using clock_type = std::chrono::steady_clock;
using shoal::backend::device;
using shoal::backend::physical_ref;
using shoal::backend::sized_chunk;

constexpr std::size_t mib = std::size_t{1} << 20;

template <class F>
double micros(F&& f) {
  const auto start = clock_type::now();
  f();
  return std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
}

// One row: `k` chunks of `bytes` each, mapped side by side in one
// map_chunks call; every figure per call made, the map's per call too.
struct chunk_times {
  std::vector<double> create, map, unmap, remap, release;
};

void chunk_round(device& dev, void* range, std::size_t bytes, std::size_t k, chunk_times& t) {
  std::vector<sized_chunk> chunks(k);
  double created = 0;
  for (auto& c : chunks) {
    c.bytes = bytes;
    created += micros([&] { c.chunk = dev.create_physical(bytes); });
  }
  t.create.push_back(created / static_cast<double>(k));
  t.map.push_back(micros([&] { dev.map_chunks(range, chunks); }));
  auto* base = static_cast<char*>(range);
  double unmapped = 0;
  for (std::size_t i = 0; i < k; ++i) unmapped += micros([&] { dev.unmap(base + i * bytes); });
  t.unmap.push_back(unmapped / static_cast<double>(k));
  // A chunk given back and mapped again elsewhere (what a growth does with
  // the chunks it just unmapped): the same range here, the same calls.
  t.remap.push_back(micros([&] { dev.map_chunks(range, chunks); }));
  for (std::size_t i = 0; i < k; ++i) dev.unmap(base + i * bytes);
  double released = 0;
  for (auto& c : chunks) released += micros([&] { dev.release_physical(c.chunk); });
  t.release.push_back(released / static_cast<double>(k));
}

// Nanoseconds per query of an idle stream, over `calls` calls on a new
// thread; `primary_current`: the thread first makes device 0's primary
// context current through the driver (as a CUDA runtime call would), and
// lets it go after. Negative when the driver's calls could not be found.
double query_ns(device& dev, shoal::backend::stream_ref stream, int calls, bool primary_current) {
  double ns = -1;
  std::thread caller([&] {
    using retain_fn = int (*)(void**, int);
    using release_fn = int (*)(int);
    using set_fn = int (*)(void*);
    retain_fn retain = nullptr;
    release_fn release = nullptr;
    set_fn set = nullptr;
    if (primary_current) {
      void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (library == nullptr) return;
      retain = reinterpret_cast<retain_fn>(::dlsym(library, "cuDevicePrimaryCtxRetain"));
      release = reinterpret_cast<release_fn>(::dlsym(library, "cuDevicePrimaryCtxRelease_v2"));
      set = reinterpret_cast<set_fn>(::dlsym(library, "cuCtxSetCurrent"));
      void* context = nullptr;
      if (retain == nullptr || release == nullptr || set == nullptr || retain(&context, 0) != 0) return;
      if (set(context) != 0) {
        (void)release(0);
        return;
      }
    }
    (void)dev.query(stream);
    const auto start = clock_type::now();
    for (int i = 0; i < calls; ++i) (void)dev.query(stream);
    ns = std::chrono::duration<double, std::nano>(clock_type::now() - start).count() / calls;
    if (primary_current) {
      (void)set(nullptr);
      (void)release(0);
    }
  });
  caller.join();
  return ns;
}

void quick_call_rows(device& dev, int rounds) {
  const shoal::backend::stream_ref stream = dev.create_stream();
  std::vector<double> none, primary;
  for (int r = 0; r < rounds; ++r) {
    none.push_back(query_ns(dev, stream, 20000, false));
    primary.push_back(query_ns(dev, stream, 20000, true));
  }
  dev.destroy_stream(stream);
  const bool measured = *std::min_element(primary.begin(), primary.end()) >= 0;
  std::printf("| idle stream's query, ns | no current context | device's primary context current |\n| --- | --- | --- |\n");
  std::printf("| per call | %s | %s |\n\n", text(summarize(none)).c_str(),
              measured ? text(summarize(primary)).c_str() : "n/a (the driver's context calls were not found)");
  std::fflush(stdout);
}

void growable_rows(device& dev, int rounds) {
  std::printf("\n| chunks mapped in one call | create, per chunk | map + access, the call | unmap, per chunk "
              "| map again, the call | release, per chunk |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  struct shape {
    std::size_t mib_each, k;
  };
  const shape shapes[] = {{2, 1}, {24, 1}, {96, 1}, {384, 1}, {2, 4}, {2, 12}, {24, 4}, {24, 12}};
  void* range = dev.reserve_range(512 * mib);
  for (const shape s : shapes) {
    chunk_times t;
    for (int r = 0; r < rounds; ++r) chunk_round(dev, range, s.mib_each * mib, s.k, t);
    std::printf("| %zu × %zu MiB | %s | %s | %s | %s | %s |\n", s.k, s.mib_each, text(summarize(t.create)).c_str(),
                text(summarize(t.map)).c_str(), text(summarize(t.unmap)).c_str(), text(summarize(t.remap)).c_str(),
                text(summarize(t.release)).c_str());
    std::fflush(stdout);
  }
  dev.release_range(range);
}

void plain_rows(device& dev, int rounds) {
  std::printf("| plain segment | allocate | free |\n| --- | --- | --- |\n");
  for (const std::size_t m : {2, 20, 96, 384}) {
    std::vector<double> allocate, release;
    for (int r = 0; r < rounds; ++r) {
      void* p = nullptr;
      allocate.push_back(micros([&] { p = dev.allocate_segment(m * mib); }));
      release.push_back(micros([&] { dev.free_segment(p); }));
    }
    std::printf("| %zu MiB | %s | %s |\n", m, text(summarize(allocate)).c_str(), text(summarize(release)).c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "cuda";
  int rounds = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--backend") {
      backend = argv[i + 1];
    } else if (key == "--rounds") {
      rounds = std::max(1, std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr, "usage: %s [--backend host|cuda] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "usage: %s [--backend host|cuda] [--rounds N]\n", argv[0]);
    return 2;
  }
  try {
    device& dev = backend == "host" ? shoal::backend::host_device_instance() : shoal::backend::cuda_device_instance(0);
    std::printf("device calls on %s (%s backend), µs, median (min–max) over %d rounds\n\n", dev.name().c_str(),
                backend.c_str(), rounds);
    if (backend == "cuda") quick_call_rows(dev, rounds);
    plain_rows(dev, rounds);
    if (dev.growable().supported) growable_rows(dev, rounds);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_device: %s\n", e.what());
    return 1;
  }
  return 0;
}
