#include "bench/replay/random_mix.h"

#include <string>
#include <utility>
#include <vector>

#include "shoal/core/error.h"

namespace shoal::bench {

namespace {

// splitmix64: tiny, fast, and fixed by its definition (std::mt19937_64 is
// too, but the std distributions are not, across standard libraries).
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n), n > 0 (modulo bias is negligible for small n).
  std::uint64_t below(std::uint64_t n) { return next() % n; }

 private:
  std::uint64_t state_;
};

std::uint64_t random_size(splitmix64& rng) {
  const std::uint64_t roll = rng.below(100);
  // Exponent ranges of the three classes: [2^lo, 2^hi) bytes.
  const auto [lo, hi] = roll < 70 ? std::pair{9, 20} : roll < 95 ? std::pair{20, 25} : std::pair{25, 28};
  const auto exponent = static_cast<unsigned>(lo + static_cast<int>(rng.below(static_cast<std::uint64_t>(hi - lo))));
  const std::uint64_t base = std::uint64_t{1} << exponent;
  return base + rng.below(base);
}

struct live_block {
  std::uint64_t id;
  std::uint64_t bytes;
  std::uint32_t stream;
};

}  // namespace

trace generate_mix(const mix_options& options) {
  if (options.events == 0) throw invalid_argument("a random mix needs at least one event");
  if (options.streams == 0 || options.streams > max_trace_streams) {
    throw invalid_argument("a random mix has 1.." + std::to_string(max_trace_streams) + " streams, not " +
                           std::to_string(options.streams));
  }
  if (options.live_target_bytes == 0) throw invalid_argument("a random mix needs a live target above 0 bytes");

  trace t;
  t.add_note("random-size mix: events " + std::to_string(options.events) + ", seed " + std::to_string(options.seed) +
             ", streams " + std::to_string(options.streams) + ", live target " +
             std::to_string(options.live_target_bytes) + " bytes");
  splitmix64 rng(options.seed);
  std::vector<live_block> live;
  std::uint64_t live_bytes = 0;
  std::uint64_t next_id = 0;
  while (t.events().size() < options.events) {
    const std::uint64_t alloc_percent = live_bytes < options.live_target_bytes ? 60 : 40;
    if (live.empty() || rng.below(100) < alloc_percent) {
      const live_block b{next_id++, random_size(rng), static_cast<std::uint32_t>(rng.below(options.streams))};
      t.alloc(b.id, b.bytes, b.stream);
      live.push_back(b);
      live_bytes += b.bytes;
    } else {
      const std::size_t victim = rng.below(live.size());
      std::swap(live[victim], live.back());
      t.free(live.back().id, live.back().stream);
      live_bytes -= live.back().bytes;
      live.pop_back();
    }
  }
  return t;
}

}  // namespace shoal::bench
