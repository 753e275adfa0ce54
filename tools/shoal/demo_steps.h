// The steps of `shoal demo` and what they share. Each step prints one to
// three lines of measured facts and throws shoal::error when what it shows
// did not happen, so the demo's exit status means something.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/device.h"
#include "shoal/backend/stream.h"

namespace shoal::tools::demo {

/// The two streams of the demo's story: a data loader's side stream and the
/// model's stream. They outlive every allocator of the demo (an allocator
/// keeps a pool per stream for its own life).
struct demo_streams {
  backend::stream loader;
  backend::stream model;
};

/// Waits for both streams when it goes, so that no allocator declared
/// before it frees memory a stream still uses, even when a step throws.
struct settle_streams {
  demo_streams& streams;
  ~settle_streams();
};

// ---- the steps, in the order run_demo runs them ---------------------------
void show_streams(backend::device& dev, alloc::caching_allocator& allocator, demo_streams& streams);
void show_lazy_clone(backend::device& dev, alloc::caching_allocator& allocator);
void show_sharing(backend::device& dev, alloc::caching_allocator& allocator);
void show_stats(const alloc::caching_allocator& allocator);

// ---- helpers ---------------------------------------------------------------
/// Throws shoal::error("demo: " + what) unless `ok`.
void expect(bool ok, const std::string& what);
/// Copies `bytes` of device memory at `src` to the host in order on `s` and waits.
std::vector<std::uint8_t> read_back(backend::device& dev, const void* src, std::size_t bytes, backend::stream_ref s);
/// How many of `bytes` equal `value`.
std::size_t count_of(std::span<const std::uint8_t> bytes, std::uint8_t value);
bool all_are(std::span<const std::uint8_t> bytes, std::uint8_t value);
double ms_since(std::chrono::steady_clock::time_point start);
double us_since(std::chrono::steady_clock::time_point start);
std::string hex(const void* p);
std::string mib(std::int64_t bytes);

}  // namespace shoal::tools::demo
