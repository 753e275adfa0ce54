// Host -> device transfer, timed: the anchors (one copy call from pinned
// memory, and from pageable memory, into device memory, back to back), the
// pinned host allocator feeding the same copies, and the transfer engine
// moving batches from pageable and from pinned sources to a consumer that
// drops each batch once its stream waits on it. Also the pinned allocator's
// allocate + free pair, and host copying bandwidth with memcpy and with the
// engine's streaming copy (the staging ceiling).
//
//   shoal_bench_transfer [--backend host|cuda] [--rounds N] [--mib-per-row N]
// Prints one table: GB/s medians with (min-max) over the rounds, and each
// row's ratio to the pinned anchor of its size.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
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
#include "transfer/streaming_copy.h"

namespace {

using namespace shoal;
using clock_type = std::chrono::steady_clock;
constexpr std::size_t kib = 1024, mib = kib * kib;

struct options {
  std::string backend = "cuda";
  int rounds = 3;
  std::size_t bytes_per_row = 2048 * mib;  // moved per measurement, whatever the size
};

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

struct spread {
  double median, low, high;
};
spread spread_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

class bench {
 public:
  bench(backend::device& dev, const options& o)
      : dev_(dev),
        opts_(o),
        variant_streams_(make_streams(dev, variants().size())),
        device_alloc_(dev, alloc::allocator_config{}),
        stream_(dev) {
    for (std::size_t i = 0; i < variants().size(); ++i) {
      engines_.push_back(
          std::make_unique<transfer::transfer_engine>(device_alloc_, *variant_streams_[i], variants()[i].config));
    }
  }

  // The engine settings compared, each on its own copy stream. The defaults
  // otherwise: a 32 MiB staging ring of 4 MiB chunks, 32 batches and 64 MiB
  // in flight (4 batches from 16 MiB, 1 at 256 MiB).
  struct variant {
    const char* name;
    bool pinned_source;
    transfer::transfer_config config;
  };
  static const std::vector<variant>& variants() {
    using stores = transfer::transfer_config::stores;
    static const std::vector<variant> v{
        {"engine, pageable, the defaults (16 CPUs and more: 16 threads, automatic stores)", false, {}},
        {"engine, pageable, 4 threads, streaming stores", false,
         {.staging_helpers = 3, .staging_stores = stores::streaming}},
        {"engine, pageable, 8 threads, streaming stores (the defaults before)", false,
         {.staging_helpers = 7, .staging_stores = stores::streaming}},
        {"engine, pageable, 16 threads, streaming stores", false,
         {.staging_helpers = 15, .staging_stores = stores::streaming}},
        {"engine, pageable, 8 threads, cached stores", false, {.staging_helpers = 7, .staging_stores = stores::cached}},
        {"engine, pageable, 16 threads, cached stores", false,
         {.staging_helpers = 15, .staging_stores = stores::cached}},
        {"engine, pageable, 8 threads, 4 in flight at any size (the default before 64 MiB)", false,
         {.max_batches_in_flight = 4, .max_bytes_in_flight = SIZE_MAX, .staging_helpers = 7,
          .staging_stores = stores::streaming}},
        {"engine, pinned source", true, {}},
        {"engine, pinned source, 4 in flight at any size (the default before 64 MiB)", true,
         {.max_batches_in_flight = 4, .max_bytes_in_flight = SIZE_MAX}},
    };
    return v;
  }
  static std::vector<std::unique_ptr<backend::stream>> make_streams(backend::device& dev, std::size_t n) {
    std::vector<std::unique_ptr<backend::stream>> streams;
    for (std::size_t i = 0; i < n; ++i) streams.push_back(std::make_unique<backend::stream>(dev));
    return streams;
  }

  // GB/s of `count` copies of `size` bytes from `src` into one device buffer.
  double plain_copies(const void* src, std::size_t size, std::size_t count) {
    void* dst = device_alloc_.allocate(size, stream_);
    dev_.copy(stream_, dst, src, size);  // warm
    dev_.synchronize(stream_);
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < count; ++i) dev_.copy(stream_, dst, src, size);
    dev_.synchronize(stream_);
    const double s = seconds_since(t0);
    device_alloc_.deallocate(dst, stream_);
    return static_cast<double>(size * count) / s / 1e9;
  }

  // The same copies, each from a block the pinned allocator hands out and
  // takes back (it reuses a block once the copy reading it has run). Warm:
  // the blocks in flight exist before the clock starts, as in a loader's
  // steady state.
  double pinned_allocator_copies(alloc::caching_allocator& pinned, std::size_t size, std::size_t count) {
    void* dst = device_alloc_.allocate(size, stream_);
    for (int i = 0; i < 8; ++i) {
      void* block = pinned.allocate(size, stream_);
      dev_.copy(stream_, dst, block, size);
      pinned.deallocate(block, stream_);
    }
    dev_.synchronize(stream_);
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < count; ++i) {
      void* block = pinned.allocate(size, stream_);
      dev_.copy(stream_, dst, block, size);
      pinned.deallocate(block, stream_);
    }
    dev_.synchronize(stream_);
    const double s = seconds_since(t0);
    device_alloc_.deallocate(dst, stream_);
    return static_cast<double>(size * count) / s / 1e9;
  }

  // Batches of one buffer through the engine to a consumer stream; GB/s from
  // the first submit to the last batch ready on the consumer's stream.
  double engine_batches(transfer::transfer_engine& engine, const void* src, bool pinned_source, std::size_t size,
                        std::size_t count) {
    backend::stream& consumer = consumer_;
    auto submit = [&] { engine.submit({transfer::host_buffer{src, size, pinned_source, nullptr}}); };
    submit();  // warm: staging blocks and device blocks exist
    engine.next().wait_on(consumer);
    dev_.synchronize(consumer);
    const auto t0 = clock_type::now();
    std::thread producer([&] {
      for (std::size_t i = 0; i < count; ++i) submit();
    });
    for (std::size_t i = 0; i < count; ++i) engine.next().wait_on(consumer);  // dropped at once
    producer.join();
    dev_.synchronize(consumer);
    return static_cast<double>(size * count) / seconds_since(t0) / 1e9;
  }

  void run() {
    std::printf("| size | row | GB/s median (min-max over %d rounds) | / pinned anchor |\n", opts_.rounds);
    std::printf("| --- | --- | --- | --- |\n");
    alloc::caching_allocator pinned(dev_, alloc::allocator_config::parse("memory:pinned_host"));
    for (std::size_t size : {64 * kib, 1 * mib, 16 * mib, 256 * mib}) {
      // Four blocks in flight at most: past that, allocation waits for a copy.
      auto limited = alloc::allocator_config::parse("memory:pinned_host");
      limited.memory_limit = std::max(8 * mib, 4 * size);
      alloc::caching_allocator staging(dev_, limited);
      const std::size_t count = std::max<std::size_t>(4, opts_.bytes_per_row / size);
      void* pinned_src = dev_.allocate_pinned_host(size);
      std::vector<std::uint8_t> pageable_src(size, 0x5A);
      std::memset(pinned_src, 0x5A, size);
      std::vector<double> anchor, pageable, via_allocator;
      std::vector<std::vector<double>> engine_rows(engines_.size());
      for (int r = 0; r < opts_.rounds; ++r) {
        anchor.push_back(plain_copies(pinned_src, size, count));
        pageable.push_back(plain_copies(pageable_src.data(), size, count));
        via_allocator.push_back(pinned_allocator_copies(staging, size, count));
        for (std::size_t e = 0; e < engines_.size(); ++e) {
          const bool pinned_source = variants()[e].pinned_source;
          engine_rows[e].push_back(
              engine_batches(*engines_[e], pinned_source ? pinned_src : pageable_src.data(), pinned_source, size, count));
        }
      }
      const double base = spread_of(anchor).median;
      auto row = [&](const char* name, const std::vector<double>& v) {
        const spread s = spread_of(v);
        std::printf("| %zu KiB | %s | %.1f (%.1f-%.1f) | %.2f |\n", size / kib, name, s.median, s.low, s.high,
                    s.median / base);
      };
      row("anchor: copy from pinned memory", anchor);
      row("anchor: copy from pageable memory", pageable);
      row("pinned allocator block per copy (<= 4 in flight)", via_allocator);
      for (std::size_t e = 0; e < engines_.size(); ++e) row(variants()[e].name, engine_rows[e]);
      dev_.free_pinned_host(pinned_src);
    }
    pair_and_memcpy(pinned);
    const auto d = device_alloc_.stats();
    const auto p = pinned.stats();
    std::printf("device allocator over the run: %lld segments taken, %lld given back; pinned allocator: %lld, %lld\n",
                static_cast<long long>(d.device_allocations), static_cast<long long>(d.device_frees),
                static_cast<long long>(p.device_allocations), static_cast<long long>(p.device_frees));
  }

  void pair_and_memcpy(alloc::caching_allocator& pinned) {
    std::vector<double> pair_us;
    for (int r = 0; r < opts_.rounds; ++r) {
      constexpr int n = 20000;
      const auto t0 = clock_type::now();
      for (int i = 0; i < n; ++i) pinned.deallocate(pinned.allocate(64 * kib, stream_), stream_);
      pair_us.push_back(seconds_since(t0) / n * 1e6);
      dev_.synchronize(stream_);
    }
    const spread p = spread_of(pair_us);
    std::printf("\npinned allocator allocate + free, 64 KiB: %.3f us (%.3f-%.3f)\n", p.median, p.low, p.high);
    std::vector<std::uint8_t> a(256 * mib, 1), b(256 * mib, 2);
    std::vector<double> gbs;
    for (int r = 0; r < opts_.rounds; ++r) {
      const auto t0 = clock_type::now();
      std::memcpy(b.data(), a.data(), a.size());
      gbs.push_back(static_cast<double>(a.size()) / seconds_since(t0) / 1e9);
    }
    const spread m = spread_of(gbs);
    std::printf("one thread's memcpy, 256 MiB: %.1f GB/s (%.1f-%.1f)\n", m.median, m.low, m.high);
    // What staging can reach at most: host memory copying with every thread,
    // in 2 MiB pieces (a staging chunk's slice), with memcpy and with the
    // engine's streaming copy.
    for (std::size_t threads : {4, 8, 16}) {
      host_copy_row(threads, "memcpy", [](void* to, const void* from, std::size_t n) { std::memcpy(to, from, n); }, a, b);
      host_copy_row(threads, "streaming copy", transfer::copy_streaming, a, b);
    }
  }

  template <class Copy>
  void host_copy_row(std::size_t threads, const char* name, Copy copy, const std::vector<std::uint8_t>& a,
                     std::vector<std::uint8_t>& b) {
    constexpr std::size_t piece = 2 * mib;
    std::vector<double> wide;
    for (int r = 0; r < opts_.rounds; ++r) {
      const std::size_t slice = a.size() / threads;
      const auto t0 = clock_type::now();
      std::vector<std::thread> workers;
      for (std::size_t t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
          for (std::size_t at = t * slice; at < (t + 1) * slice; at += piece) {
            copy(b.data() + at, a.data() + at, std::min(piece, (t + 1) * slice - at));
          }
        });
      }
      for (auto& w : workers) w.join();
      wide.push_back(static_cast<double>(slice * threads) / seconds_since(t0) / 1e9);
    }
    const spread w = spread_of(wide);
    std::printf("%zu threads' %s, 256 MiB in 2 MiB pieces: %.1f GB/s (%.1f-%.1f)\n", threads, name, w.median, w.low,
                w.high);
  }

 private:
  backend::device& dev_;
  const options& opts_;
  std::vector<std::unique_ptr<backend::stream>> variant_streams_;  // outlive the allocator
  alloc::caching_allocator device_alloc_;
  backend::stream stream_;
  backend::stream consumer_{dev_};
  // Last: stopped before the streams and the allocator go.
  std::vector<std::unique_ptr<transfer::transfer_engine>> engines_;
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
    } else if (key == "--mib-per-row") {
      o.bytes_per_row = static_cast<std::size_t>(std::max(1, std::atoi(value.c_str()))) * mib;
    } else {
      std::fprintf(stderr, "usage: %s [--backend host|cuda] [--rounds N] [--mib-per-row N]\n", argv[0]);
      return 2;
    }
  }
  try {
    auto& dev = o.backend == "host" ? backend::host_device_instance() : backend::cuda_device_instance(0);
    std::printf("device: %s\n\n", dev.name().c_str());
    bench(dev, o).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_transfer: %s\n", e.what());
    return 1;
  }
  return 0;
}
