// What one small batch costs through the transfer engine: wall time and the
// process's CPU time per batch, for a producer thread that submits batches
// of one buffer back to back and a consumer that takes each, makes its
// stream wait on it and drops it (the data loader's shape), beside the plain
// copy of the same size from pinned memory. On the host backend, where a copy
// is a memmove on a stream's thread, the difference is the engine's own
// overhead: its calls into the device and the allocators, its locks and its
// handovers between threads.
//
//   shoal_bench_small_batches [--backend host|cuda] [--rounds N] [--batches N] [--kib N]
// (--kib: one batch size instead of 64, 256 and 1024 KiB)
// Prints one table: microseconds per batch, median (min-max) over the rounds,
// how many batches the engine's thread took together on average, and how
// many host-to-device copies it enqueued per batch (below 1 where the small
// pageable buffers of a group went as one copy).
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/transfer/transfer_engine.h"

namespace {

using namespace shoal;
using clock_type = std::chrono::steady_clock;
constexpr std::size_t kib = 1024;

struct options {
  std::string backend = "cuda";
  int rounds = 5;
  std::size_t batches = 20000;
  std::vector<std::size_t> sizes{64 * kib, 256 * kib, 1024 * kib};
};

double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

struct cost {
  double wall_us, cpu_us;  // per batch
  double batches_per_group = 0;
  double copies_per_batch = 0;  // host-to-device copies the engine enqueued
};

// Times `count` repetitions of `body`: wall and process CPU microseconds per repetition.
template <class Body>
cost per_batch(std::size_t count, Body body) {
  const double cpu0 = process_cpu_seconds();
  const auto t0 = clock_type::now();
  body();
  const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
  const double cpu = process_cpu_seconds() - cpu0;
  return {wall / static_cast<double>(count) * 1e6, cpu / static_cast<double>(count) * 1e6};
}

struct row_result {
  std::vector<double> wall, cpu, batches_per_group, copies_per_batch;
  void add(cost c) {
    wall.push_back(c.wall_us);
    cpu.push_back(c.cpu_us);
    batches_per_group.push_back(c.batches_per_group);
    copies_per_batch.push_back(c.copies_per_batch);
  }
};

void print_row(std::size_t size, const char* name, row_result r) {
  auto show = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    char text[64];
    std::snprintf(text, sizeof text, "%.2f (%.2f-%.2f)", v[v.size() / 2], v.front(), v.back());
    return std::string(text);
  };
  const bool grouped = r.batches_per_group.front() > 0;  // the anchor has no groups
  std::printf("| %zu KiB | %s | %s | %s | %s | %s |\n", size / kib, name, show(r.wall).c_str(), show(r.cpu).c_str(),
              grouped ? show(r.batches_per_group).c_str() : "-", grouped ? show(r.copies_per_batch).c_str() : "-");
}

class bench {
 public:
  bench(backend::device& dev, const options& o)
      : dev_(dev), opts_(o), copy_stream_(dev), consumer_(dev), device_alloc_(dev, alloc::allocator_config{}) {}

  struct variant {
    const char* name;
    bool pinned_source;
    transfer::transfer_config config;
  };

  void run() {
    // The defaults: 32 batches (64 MiB) in flight, groups of up to 4 MiB.
    const std::vector<variant> variants{
        {"engine, pinned source, each batch alone", true, {.max_coalesced_bytes = 0}},
        {"engine, pinned source, 16 in flight (the default before 32)", true, {.max_batches_in_flight = 16}},
        {"engine, pinned source", true, {}},
        {"engine, pinned source, 64 in flight", true, {.max_batches_in_flight = 64}},
        {"engine, pageable source, each batch alone", false, {.max_coalesced_bytes = 0}},
        {"engine, pageable source, 16 in flight (the default before 32)", false, {.max_batches_in_flight = 16}},
        {"engine, pageable source", false, {}},
        {"engine, pageable source, 8 threads, streaming stores (the defaults before)", false,
         {.staging_helpers = 7, .staging_stores = transfer::transfer_config::stores::streaming}},
        {"engine, pageable source, 64 in flight", false, {.max_batches_in_flight = 64}},
    };
    std::printf(
        "| size | row | wall us per batch, median (min-max over %d rounds) | process CPU us per batch | batches per "
        "group | copies per batch |\n",
        opts_.rounds);
    std::printf("| --- | --- | --- | --- | --- | --- |\n");
    for (std::size_t size : opts_.sizes) {
      void* pinned_src = dev_.allocate_pinned_host(size);
      std::memset(pinned_src, 0x5A, size);
      std::vector<std::uint8_t> pageable_src(size, 0x5A);
      row_result anchor;
      std::vector<row_result> rows(variants.size());
      for (int r = 0; r < opts_.rounds; ++r) {
        anchor.add(plain_copies(pinned_src, size));
        for (std::size_t v = 0; v < variants.size(); ++v) {
          const auto& var = variants[v];
          rows[v].add(engine_batches(var.config, var.pinned_source ? pinned_src : pageable_src.data(),
                                     var.pinned_source, size));
        }
      }
      print_row(size, "copy from pinned memory (anchor)", anchor);
      for (std::size_t v = 0; v < variants.size(); ++v) print_row(size, variants[v].name, rows[v]);
      dev_.free_pinned_host(pinned_src);
    }
  }

 private:
  cost plain_copies(const void* src, std::size_t size) {
    backend::stream_ref s = consumer_;
    void* dst = device_alloc_.allocate(size, s);
    dev_.copy(s, dst, src, size);
    dev_.synchronize(s);
    const cost c = per_batch(opts_.batches, [&] {
      for (std::size_t i = 0; i < opts_.batches; ++i) dev_.copy(s, dst, src, size);
      dev_.synchronize(s);
    });
    device_alloc_.deallocate(dst, s);
    return c;
  }

  cost engine_batches(const transfer::transfer_config& config, const void* src, bool pinned_source, std::size_t size) {
    backend::stream_ref consumer = consumer_;
    // One engine at a time on the copy stream: each is gone before the next starts.
    transfer::transfer_engine engine(device_alloc_, copy_stream_, config);
    auto submit = [&] { engine.submit({transfer::host_buffer{src, size, pinned_source, nullptr}}); };
    for (int i = 0; i < 8; ++i) {  // warm: staging and device blocks exist
      submit();
      engine.next().wait_on(consumer);
    }
    dev_.synchronize(consumer);
    const auto before = engine.stats();
    cost c = per_batch(opts_.batches, [&] {
      std::thread producer([&] {
        for (std::size_t i = 0; i < opts_.batches; ++i) submit();
      });
      for (std::size_t i = 0; i < opts_.batches; ++i) engine.next().wait_on(consumer);  // dropped at once
      producer.join();
      dev_.synchronize(consumer);
    });
    const auto after = engine.stats();
    const auto batches = static_cast<double>(after.batches_transferred - before.batches_transferred);
    c.batches_per_group = batches / static_cast<double>(after.coalesced_groups - before.coalesced_groups);
    c.copies_per_batch = static_cast<double>(after.copies - before.copies) / batches;
    return c;
  }

  backend::device& dev_;
  const options& opts_;
  backend::stream copy_stream_, consumer_;  // outlive the allocator, like every stream it is used with
  alloc::caching_allocator device_alloc_;
};

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--backend") {
      o.backend = value;
    } else if (key == "--rounds") {
      o.rounds = std::max(1, std::atoi(value.c_str()));
    } else if (key == "--kib") {
      o.sizes = {static_cast<std::size_t>(std::max(1, std::atoi(value.c_str()))) * kib};
    } else if (key == "--batches") {
      o.batches = static_cast<std::size_t>(std::max(1, std::atoi(value.c_str())));
    } else {
      std::fprintf(stderr, "usage: %s [--backend host|cuda] [--rounds N] [--batches N] [--kib N]\n", argv[0]);
      return 2;
    }
  }
  try {
    auto& dev = o.backend == "host" ? backend::host_device_instance() : backend::cuda_device_instance(0);
    std::printf("device: %s, %zu batches per measurement\n\n", dev.name().c_str(), o.batches);
    bench(dev, o).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_small_batches: %s\n", e.what());
    return 1;
  }
  return 0;
}
