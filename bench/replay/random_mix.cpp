#include "bench/replay/random_mix.h"

#include <ostream>
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

void check(const mix_options& options) {
  if (options.events == 0) throw invalid_argument("a random mix needs at least one event");
  if (options.streams == 0 || options.streams > max_trace_streams) {
    throw invalid_argument("a random mix has 1.." + std::to_string(max_trace_streams) + " streams, not " +
                           std::to_string(options.streams));
  }
  if (options.live_target_bytes == 0) throw invalid_argument("a random mix needs a live target above 0 bytes");
}

/// The note that says how the mix was made.
std::string describe(const mix_options& options) {
  return "random-size mix: events " + std::to_string(options.events) + ", seed " + std::to_string(options.seed) +
         ", streams " + std::to_string(options.streams) + ", live target " + std::to_string(options.live_target_bytes) +
         " bytes";
}

/// The mix's events, in order, one per next(); `options` have passed check().
class mix_walk {
 public:
  explicit mix_walk(const mix_options& options) : options_(options), rng_(options.seed) {}

  trace_event next() {
    const std::uint64_t alloc_percent = live_bytes_ < options_.live_target_bytes ? 60 : 40;
    return live_.empty() || rng_.below(100) < alloc_percent ? alloc() : free_random_block();
  }

 private:
  // ids are allocation ordinals, so an event's block is its id.
  trace_event alloc() {
    const live_block b{next_id_++, random_size(rng_), static_cast<std::uint32_t>(rng_.below(options_.streams))};
    live_.push_back(b);
    live_bytes_ += b.bytes;
    return {trace_op::alloc, b.id, b.bytes, b.stream, static_cast<std::size_t>(b.id)};
  }

  trace_event free_random_block() {
    const std::size_t victim = rng_.below(live_.size());
    std::swap(live_[victim], live_.back());
    const live_block b = live_.back();
    live_.pop_back();
    live_bytes_ -= b.bytes;
    return {trace_op::free, b.id, b.bytes, b.stream, static_cast<std::size_t>(b.id)};
  }

  mix_options options_;
  splitmix64 rng_;
  std::vector<live_block> live_;
  std::uint64_t live_bytes_ = 0;
  std::uint64_t next_id_ = 0;
};

}  // namespace

trace generate_mix(const mix_options& options) {
  check(options);
  trace t;
  t.add_note(describe(options));
  mix_walk walk(options);
  for (std::size_t made = 0; made < options.events; ++made) {
    const trace_event e = walk.next();
    if (e.op == trace_op::alloc) {
      t.alloc(e.id, e.bytes, e.stream);
    } else {
      t.free(e.id, e.stream);
    }
  }
  return t;
}

void write_mix(std::ostream& out, const mix_options& options) {
  check(options);
  write_trace_start(out, {describe(options)});
  mix_walk walk(options);
  // A stream that failed (a full disk) takes no more: stop there.
  for (std::size_t made = 0; made < options.events && out; ++made) write_trace_event(out, walk.next());
}

}  // namespace shoal::bench
