// Allocation traces (bench/replay): the reader's validation, round trips,
// the random-size mix, and replays through a recording adapter and through
// shoal's caching allocator on the host backend.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench/common/shoal_adapter.h"
#include "bench/replay/random_mix.h"
#include "bench/replay/replayer.h"
#include "bench/replay/trace.h"
#include "shoal/alloc/config.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"

#if defined(SHOAL_REPLAY_HAVE_ZLIB)
#include <zlib.h>
#endif

namespace shoal::testing {
namespace {

using bench::trace;
using bench::trace_op;

trace parse(const std::string& text) {
  std::istringstream in(text);
  return bench::read_trace(in, "test");
}

std::string to_text(const trace& t) {
  std::ostringstream out;
  bench::write_trace(out, t);
  return out.str();
}

// The most bytes live at once, computed straight from the events.
std::size_t implied_peak(const trace& t) {
  std::map<std::uint64_t, std::uint64_t> live;
  std::size_t bytes = 0;
  std::size_t peak = 0;
  for (const auto& e : t.events()) {
    if (e.op == trace_op::alloc) {
      live[e.id] = e.bytes;
      bytes += e.bytes;
      peak = std::max(peak, bytes);
    } else {
      bytes -= live.at(e.id);
      live.erase(e.id);
    }
  }
  return peak;
}

TEST(trace_format, reads_events_comments_and_blank_lines) {
  const trace t = parse(
      "shoal-trace v1\n"
      "# recorded by hand\n"
      "a 7 1000 0\n"
      "\n"
      "a\t8   512 1\r\n"
      "f 7 1\n"
      "#second note\n"
      "a 7 2048 0\n");
  ASSERT_EQ(t.events().size(), 4u);
  EXPECT_EQ(t.events()[0], (bench::trace_event{trace_op::alloc, 7, 1000, 0, 0}));
  EXPECT_EQ(t.events()[1], (bench::trace_event{trace_op::alloc, 8, 512, 1, 1}));
  EXPECT_EQ(t.events()[2], (bench::trace_event{trace_op::free, 7, 1000, 1, 0})) << "a free knows its block's size";
  EXPECT_EQ(t.events()[3], (bench::trace_event{trace_op::alloc, 7, 2048, 0, 2})) << "a freed id may be reused";
  EXPECT_EQ(t.notes(), (std::vector<std::string>{"recorded by hand", "second note"}));
  EXPECT_EQ(t.allocation_count(), 3u);
  EXPECT_EQ(t.live_at_end(), 2u);
  EXPECT_EQ(t.streams(), (std::vector<std::uint32_t>{0, 1}));
}

TEST(trace_format, round_trips_through_text) {
  const trace original = bench::generate_mix({.events = 2000, .seed = 3, .streams = 3});
  const std::string text = to_text(original);
  const trace again = parse(text);
  EXPECT_EQ(again.events(), original.events());
  EXPECT_EQ(again.notes(), original.notes());
  EXPECT_EQ(to_text(again), text);
}

struct malformed_case {
  const char* text;
  int line;
  const char* says;
};

TEST(trace_format, malformed_input_names_its_line) {
  const std::vector<malformed_case> cases = {
      {"", 1, "empty"},
      {"shoal-trace v2\na 1 1 0\n", 1, "header"},
      {"a 1 512 0\n", 1, "header"},
      {"shoal-trace v1\na 1 512 0\nx 1 0\n", 3, "unknown event"},
      {"shoal-trace v1\na 1 512\n", 2, "'a <id> <bytes> <stream>'"},
      {"shoal-trace v1\na 1 512 0 9\n", 2, "'a <id> <bytes> <stream>'"},
      {"shoal-trace v1\na 1 512 0\nf 1\n", 3, "'f <id> <stream>'"},
      {"shoal-trace v1\n# fine\na 1 0 0\n", 3, "size 0"},
      {"shoal-trace v1\na 1 -5 0\n", 2, "not a non-negative decimal integer"},
      {"shoal-trace v1\na 1 12k 0\n", 2, "not a non-negative decimal integer"},
      {"shoal-trace v1\na one 512 0\n", 2, "id 'one'"},
      {"shoal-trace v1\na 1 99999999999999999999 0\n", 2, "64 bits"},
      {"shoal-trace v1\na 1 281474976710657 0\n", 2, "limit"},
      {"shoal-trace v1\na 1 512 0\na 1 512 0\n", 3, "already live"},
      {"shoal-trace v1\na 1 512 0\nf 2 0\n", 3, "not live"},
      {"shoal-trace v1\na 1 512 0\nf 1 0\nf 1 0\n", 4, "not live"},
      {"shoal-trace v1\na 1 512 1024\n", 2, "stream 1024 is out of range"},
      {"shoal-trace v1\na 1 512 0\nf 1 s\n", 3, "stream 's'"},
  };
  for (const auto& c : cases) {
    try {
      (void)parse(c.text);
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("test:" + std::to_string(c.line) + ": ", 0), 0u) << what;
      EXPECT_NE(what.find(c.says), std::string::npos) << what << " (expected it to mention " << c.says << ")";
    }
  }
}

TEST(trace_format, a_refused_event_changes_nothing) {
  trace t;
  t.alloc(1, 512, 0);
  EXPECT_THROW(t.alloc(1, 512, 0), invalid_argument);
  EXPECT_THROW(t.alloc(2, 0, 0), invalid_argument);
  EXPECT_THROW(t.alloc(2, 512, bench::max_trace_streams), invalid_argument);
  EXPECT_THROW(t.free(2, 0), invalid_argument);
  EXPECT_THROW(t.free(1, bench::max_trace_streams), invalid_argument);
  EXPECT_THROW(t.add_note("two\nlines"), invalid_argument);
  EXPECT_EQ(t.events().size(), 1u);
  EXPECT_TRUE(t.notes().empty());
  t.free(1, 0);
  t.alloc(2, 512, 0);
  EXPECT_EQ(t.events().size(), 3u);
  EXPECT_EQ(t.allocation_count(), 2u);
}

TEST(random_mix, is_deterministic_and_valid) {
  const bench::mix_options options{.events = 5000, .seed = 11, .streams = 4};
  const trace a = bench::generate_mix(options);
  const trace b = bench::generate_mix(options);
  EXPECT_EQ(a.events(), b.events());
  EXPECT_EQ(a.events().size(), 5000u);
  EXPECT_EQ(a.streams(), (std::vector<std::uint32_t>{0, 1, 2, 3}));
  EXPECT_NE(bench::generate_mix({.events = 5000, .seed = 12, .streams = 4}).events(), a.events());
  std::set<std::uint64_t> sizes;
  for (const auto& e : a.events()) sizes.insert(e.bytes);
  EXPECT_GT(sizes.size(), 1000u) << "sizes are spread, not a handful of classes";
  EXPECT_GE(*sizes.begin(), 512u);
  EXPECT_LT(*sizes.rbegin(), std::uint64_t{256} << 20);
  EXPECT_THROW((void)bench::generate_mix({.events = 0}), invalid_argument);
  EXPECT_THROW((void)bench::generate_mix({.streams = 0}), invalid_argument);
}

// Records what the replayer asks of it; fails the allocate numbered fail_at.
class recording_adapter final : public bench::allocator_adapter {
 public:
  explicit recording_adapter(std::size_t fail_at = ~std::size_t{0}) : fail_at_(fail_at) {}
  [[nodiscard]] std::string name() const override { return "recording"; }
  [[nodiscard]] void* create_stream() override {
    streams_.push_back(std::make_unique<int>(0));
    live_streams_.insert(streams_.back().get());
    return streams_.back().get();
  }
  void destroy_stream(void* stream) override { ASSERT_EQ(live_streams_.erase(stream), 1u); }
  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) override {
    EXPECT_TRUE(live_streams_.contains(stream));
    if (allocations_++ == fail_at_) throw out_of_memory("recording adapter: planned failure", bytes);
    auto storage = std::make_unique<char[]>(1);
    void* p = storage.get();
    live_[p] = {std::move(storage), bytes, stream};
    reserved_ += bytes;
    peak_ = std::max(peak_, reserved_);
    return p;
  }
  void deallocate(void* ptr, std::size_t bytes, void* stream) override {
    const auto it = live_.find(ptr);
    ASSERT_NE(it, live_.end());
    EXPECT_EQ(it->second.bytes, bytes);
    EXPECT_TRUE(live_streams_.contains(stream));
    frees_.push_back({it->second.stream, stream});
    reserved_ -= bytes;
    live_.erase(it);
  }
  [[nodiscard]] std::size_t reserved_bytes() const override { return reserved_; }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override { return peak_; }
  void synchronize() override {}

  struct block {
    std::unique_ptr<char[]> storage;
    std::size_t bytes;
    void* stream;
  };
  std::vector<std::unique_ptr<int>> streams_;
  std::set<void*> live_streams_;
  std::map<void*, block> live_;
  std::vector<std::pair<void*, void*>> frees_;  // (alloc stream, free stream)
  std::size_t fail_at_;
  std::size_t allocations_ = 0;
  std::size_t reserved_ = 0;
  std::size_t peak_ = 0;
};

TEST(replayer, drives_the_adapter_event_by_event) {
  const trace t = parse(
      "shoal-trace v1\n"
      "a 1 1000 0\n"
      "a 2 3000 5\n"
      "f 1 5\n"  // a cross-stream free
      "a 3 500 0\n"
      "a 4 200 5\n");  // 2, 3 and 4 stay live
  recording_adapter adapter;
  const auto r = bench::replay(t, adapter);
  EXPECT_EQ(r.events, 5u);
  EXPECT_EQ(r.streams, 2u);
  EXPECT_EQ(r.peak_requested_bytes, 4000u);
  EXPECT_EQ(r.peak_reserved_bytes, 4000u);
  EXPECT_DOUBLE_EQ(r.fragmentation(), 1.0);
  EXPECT_EQ(adapter.streams_.size(), 2u) << "one adapter stream per trace stream";
  EXPECT_TRUE(adapter.live_streams_.empty()) << "streams are destroyed";
  EXPECT_TRUE(adapter.live_.empty()) << "blocks left live by the trace are freed afterwards";
  ASSERT_EQ(adapter.frees_.size(), 4u);
  EXPECT_NE(adapter.frees_[0].first, adapter.frees_[0].second) << "the free happens on the trace's free stream";
  for (std::size_t i = 1; i < 4; ++i) EXPECT_EQ(adapter.frees_[i].first, adapter.frees_[i].second);
}

TEST(replayer, cleans_up_when_an_allocation_fails) {
  const trace t = bench::generate_mix({.events = 300, .seed = 5, .streams = 2});
  recording_adapter adapter(/*fail_at=*/100);
  EXPECT_THROW((void)bench::replay(t, adapter), out_of_memory);
  EXPECT_TRUE(adapter.live_.empty());
  EXPECT_TRUE(adapter.live_streams_.empty());
}

// shoal's adapter, checking the allocator's invariants after every
// allocate and deallocate the replayer makes (a broken one throws
// invariant_violation out of the replay).
class checking_adapter final : public bench::allocator_adapter {
 public:
  checking_adapter(backend::device& device, alloc::allocator_config config) : inner_(device, std::move(config)) {}
  [[nodiscard]] std::string name() const override { return inner_.name(); }
  [[nodiscard]] void* create_stream() override { return inner_.create_stream(); }
  void destroy_stream(void* stream) override { inner_.destroy_stream(stream); }
  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) override {
    void* p = inner_.allocate(bytes, stream);
    checked();
    return p;
  }
  void deallocate(void* ptr, std::size_t bytes, void* stream) override {
    inner_.deallocate(ptr, bytes, stream);
    checked();
  }
  [[nodiscard]] std::size_t reserved_bytes() const override { return inner_.reserved_bytes(); }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override { return inner_.peak_reserved_bytes(); }
  void synchronize() override { inner_.synchronize(); }

  std::size_t checks = 0;  ///< steps after which the invariants were checked

 private:
  void checked() {
    inner_.allocator().check_invariants();
    ++checks;
  }
  bench::shoal_adapter inner_;
};

/// A file in the test's temporary directory, removed at the end.
class temporary_file {
 public:
  explicit temporary_file(const std::string& name) : path_(std::filesystem::temp_directory_path() / name) {}
  ~temporary_file() { std::filesystem::remove(path_); }
  temporary_file(const temporary_file&) = delete;
  temporary_file& operator=(const temporary_file&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(trace_format, a_gzip_compressed_trace_reads_as_the_same_trace) {
  const trace plain = bench::read_trace_file(SHOAL_REPLAY_SAMPLE_TRACE);
  std::ostringstream text;
  bench::write_trace(text, plain);
  temporary_file compressed("shoal_trace_" + std::to_string(::getpid()) + ".trace.gz");
#if defined(SHOAL_REPLAY_HAVE_ZLIB)
  gzFile out = gzopen(compressed.path().c_str(), "wb");
  ASSERT_NE(out, nullptr);
  const std::string bytes = text.str();
  ASSERT_EQ(gzwrite(out, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(out), Z_OK);
  const trace read = bench::read_trace_file(compressed.path());
  std::ostringstream again;
  bench::write_trace(again, read);
  EXPECT_EQ(again.str(), bytes);
  // A file that starts like gzip but is not: refused, naming the file.
  std::ofstream(compressed.path(), std::ios::binary) << "\x1f\x8bnot really gzip";
  try {
    (void)bench::read_trace_file(compressed.path());
    ADD_FAILURE() << "a corrupt gzip file was read";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(compressed.path().string()), std::string::npos) << e.what();
  }
#else
  std::ofstream(compressed.path(), std::ios::binary) << "\x1f\x8b\x08";
  try {
    (void)bench::read_trace_file(compressed.path());
    ADD_FAILURE() << "a compressed trace was read without zlib";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no zlib"), std::string::npos) << e.what();
  }
#endif
}

class replay_through_shoal : public ::testing::TestWithParam<const char*> {};

TEST_P(replay_through_shoal, sample_trace_on_the_host_backend) {
  const trace t = bench::read_trace_file(SHOAL_REPLAY_SAMPLE_TRACE);
  ASSERT_GT(t.events().size(), 100u);
  ASSERT_GT(t.streams().size(), 1u);
  checking_adapter adapter(backend::host_device_instance(), alloc::allocator_config::parse(GetParam()));
  const auto r = bench::replay(t, adapter);
  EXPECT_EQ(r.events, t.events().size());
  EXPECT_EQ(adapter.checks, t.events().size() + t.live_at_end()) << "every step was checked";
  EXPECT_EQ(r.peak_requested_bytes, implied_peak(t));
  EXPECT_GE(r.peak_reserved_bytes, r.peak_requested_bytes);
  EXPECT_GE(r.fragmentation(), 1.0);
  EXPECT_LE(adapter.reserved_bytes(), adapter.peak_reserved_bytes());
}

INSTANTIATE_TEST_SUITE_P(configs, replay_through_shoal, ::testing::Values("", "expandable_segments:true"),
                         [](const auto& info) { return info.index == 0 ? "default" : "expandable"; });

}  // namespace
}  // namespace shoal::testing
