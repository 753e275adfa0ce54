// Copy-on-write costs on the default device, beside the device's own copy
// in the same run:
//   - lazy_clone: ns per clone (batches of 1,000 clones of one storage,
//     median over batches);
//   - materialization of large storages: bytes moved (read + written) per
//     second, against device::copy of the same size into ready buffers;
//   - a 4 KiB clone written (then dropped) on the stream it was made on and
//     on a second stream, beside a storage used on one stream and on two:
//     ns per storage, median over batches of 1,000. A copy made on a second
//     stream keeps the first, so its free records an event there, as any
//     storage used on two streams does.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/storage/storage.h"

namespace {

using clock_type = std::chrono::steady_clock;
using shoal::storage::storage;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

double clone_ns(shoal::alloc::caching_allocator& a) {
  auto source = storage::allocate(a, 1 << 20);
  std::vector<storage> clones;
  clones.reserve(1000);
  std::vector<double> batches;
  for (int b = 0; b < 101; ++b) {
    const auto start = clock_type::now();
    for (int i = 0; i < 1000; ++i) clones.push_back(shoal::storage::lazy_clone(source));
    batches.push_back(seconds_since(start) * 1e9 / 1000);
    clones.clear();
  }
  return median(batches);
}

// Bytes read + written per second: `count` storages of `bytes` each,
// materialized (or copied) back to back on one stream.
struct bandwidth {
  double materialize;
  double copy;
};

bandwidth copy_bandwidth(shoal::alloc::caching_allocator& a, std::size_t bytes, int count) {
  auto& dev = a.device();
  shoal::backend::stream s(dev);
  shoal::backend::stream_guard on_s(dev, s);
  auto source = storage::allocate(a, bytes);
  dev.fill(s, source.mutable_data(), 0x5A, bytes);
  std::vector<void*> targets;
  for (int i = 0; i < count; ++i) targets.push_back(a.allocate(bytes));
  std::vector<double> materialize, copy;
  for (int round = 0; round < 6; ++round) {
    std::vector<storage> clones;
    for (int i = 0; i < count; ++i) clones.push_back(shoal::storage::lazy_clone(source));
    dev.synchronize(s);
    auto start = clock_type::now();
    for (auto& c : clones) (void)c.mutable_data();
    dev.synchronize(s);
    materialize.push_back(2.0 * static_cast<double>(bytes) * count / seconds_since(start));
    start = clock_type::now();
    for (void* t : targets) dev.copy(s, t, source.data(), bytes);
    dev.synchronize(s);
    copy.push_back(2.0 * static_cast<double>(bytes) * count / seconds_since(start));
    clones.clear();
    dev.synchronize(s);
  }
  for (void* t : targets) a.deallocate(t);
  source = storage();
  // The blocks cached on `s` go back before it is destroyed: a stream must
  // outlive what the allocator keeps of it (a later miss would wait on it).
  a.empty_cache();
  // The first round warms the allocator's cache; the median skips it anyway.
  return {median(materialize), median(copy)};
}

struct stream_costs {
  double clone_written_on_its_stream;
  double clone_written_on_another;
  double used_on_one;
  double used_on_two;
};

stream_costs second_stream_ns(shoal::alloc::caching_allocator& a) {
  auto& dev = a.device();
  shoal::backend::stream first(dev);
  shoal::backend::stream second(dev);
  shoal::backend::stream_guard on_first(dev, first);
  constexpr std::size_t bytes = 4096;
  auto source = storage::allocate(a, bytes, first);
  dev.fill(first, source.mutable_data(first), 0x5A, bytes);
  auto time = [&](auto&& one) {
    std::vector<double> batches;
    for (int b = 0; b < 101; ++b) {
      const auto start = clock_type::now();
      for (int i = 0; i < 1000; ++i) one();
      batches.push_back(seconds_since(start) * 1e9 / 1000);
      dev.synchronize(first);
      dev.synchronize(second);
    }
    return median(batches);
  };
  stream_costs costs{};
  costs.clone_written_on_its_stream = time([&] { (void)shoal::storage::lazy_clone(source).mutable_data(first); });
  costs.clone_written_on_another = time([&] { (void)shoal::storage::lazy_clone(source).mutable_data(second); });
  costs.used_on_one = time([&] { (void)storage::allocate(a, bytes, first).mutable_data(first); });
  costs.used_on_two = time([&] { (void)storage::allocate(a, bytes, first).mutable_data(second); });
  source = storage();
  dev.synchronize(first);
  dev.synchronize(second);
  a.empty_cache();  // before the streams go (see copy_bandwidth)
  return costs;
}

}  // namespace

int main() {
  auto& dev = shoal::backend::default_device();
  shoal::alloc::caching_allocator a(dev);
  std::printf("device: %s:%d %s\n", std::string(shoal::backend::to_string(dev.kind())).c_str(), dev.ordinal(),
              dev.name().c_str());
  const double ns = clone_ns(a);
  std::printf("\n| measurement | shoal | anchor: device copy | ratio |\n| --- | ---: | ---: | ---: |\n");
  std::printf("| lazy_clone, ns (median of 101 batches of 1,000) | %.1f | — | — |\n", ns);
  for (std::size_t mib : {64, 256, 1024}) {
    const int count = mib >= 1024 ? 4 : 8;
    const auto bw = copy_bandwidth(a, mib << 20, count);
    std::printf("| materialize %zu MiB (x%d), GB/s read+written | %.0f | %.0f | %.1f%% |\n", mib, count,
                bw.materialize / 1e9, bw.copy / 1e9, 100.0 * bw.materialize / bw.copy);
  }
  const auto costs = second_stream_ns(a);
  std::printf("\n| 4 KiB storage made, written once, dropped: ns (median of 101 batches of 1,000) | ns |\n| --- | ---: |\n");
  std::printf("| lazy clone written on the stream it was made on | %.1f |\n", costs.clone_written_on_its_stream);
  std::printf("| lazy clone written on a second stream (its copy keeps both) | %.1f |\n", costs.clone_written_on_another);
  std::printf("| anchor: storage allocated and written on one stream | %.1f |\n", costs.used_on_one);
  std::printf("| anchor: storage allocated on one stream, written on a second | %.1f |\n", costs.used_on_two);
}
