// Allocation traces (bench/replay): the reader's validation, round trips,
// the random-size mix, replays through a recording adapter and through
// shoal's caching allocator on the host backend, and shoal_replay's command
// line (replay_main, run in this process).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <stdio_ext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench/common/shoal_adapter.h"
#include "bench/replay/random_mix.h"
#include "bench/replay/replay_cli.h"
#include "bench/replay/replayer.h"
#include "bench/replay/trace.h"
#include "shoal/alloc/config.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "support/processes.h"
#include "support/refused_allocations.h"

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

/// The message of the invalid_argument that `read` throws (a test failure
/// when it throws none).
template <typename Read>
std::string refusal(Read read) {
  try {
    (void)read();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "the input was accepted";
  return {};
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

TEST(trace_format, a_note_with_a_carriage_return_names_its_line) {
  const std::string what = refusal([] { return parse("shoal-trace v1\na 1 512 0\n# note\rwith cr\n"); });
  EXPECT_EQ(what.rfind("test:3: ", 0), 0u) << what;
  EXPECT_NE(what.find("one line"), std::string::npos) << what;
}

TEST(trace_format, a_line_longer_than_the_limit_is_refused_naming_its_line) {
  const std::string longest = "# " + std::string(bench::max_trace_line_bytes - 2, 'x');
  EXPECT_EQ(parse("shoal-trace v1\n" + longest + "\n").notes().size(), 1u) << "a line at the limit is read";
  const std::string what = refusal([&] { return parse("shoal-trace v1\n" + longest + "x\na 1 512 0\n"); });
  EXPECT_EQ(what.rfind("test:2: ", 0), 0u) << what;
  EXPECT_NE(what.find("longer than " + std::to_string(bench::max_trace_line_bytes)), std::string::npos) << what;
}

// What write_trace writes, read_trace reads: a note is at most a line less
// its "# ", so "#" and 4095 bytes (a line at the limit) is refused, not
// written back as a line past it.
TEST(trace_format, a_note_that_would_not_fit_a_written_line_is_refused) {
  trace t;
  t.add_note(std::string(bench::max_trace_note_bytes, 'x'));
  std::ostringstream out;
  bench::write_trace(out, t);
  EXPECT_EQ(parse(out.str()).notes(), t.notes()) << "the longest note round-trips";
  EXPECT_THROW(t.add_note(std::string(bench::max_trace_note_bytes + 1, 'x')), invalid_argument);
  const std::string what = refusal([] {
    return parse("shoal-trace v1\n#" + std::string(bench::max_trace_line_bytes - 1, 'x') + "\n");
  });
  EXPECT_EQ(what.rfind("test:2: ", 0), 0u) << what;
  EXPECT_NE(what.find("at most " + std::to_string(bench::max_trace_note_bytes)), std::string::npos) << what;
}

// A small gzip file of comments would otherwise fill memory: the notes
// together are bounded.
TEST(trace_format, notes_past_their_total_are_refused_naming_the_line) {
  std::string text = "shoal-trace v1\n";
  const std::string note = "# " + std::string(bench::max_trace_note_bytes, 'n') + "\n";
  const std::size_t fitting = bench::max_trace_notes_total_bytes / bench::max_trace_note_bytes;
  for (std::size_t i = 0; i < fitting; ++i) text += note;
  EXPECT_EQ(parse(text).notes().size(), fitting);
  const std::string what = refusal([&] { return parse(text + note); });
  EXPECT_EQ(what.rfind("test:" + std::to_string(fitting + 2) + ": ", 0), 0u) << what;
  EXPECT_NE(what.find("notes come to more than"), std::string::npos) << what;
}

TEST(trace_format, a_trace_holds_at_most_its_events) {
  trace t(3);
  t.alloc(1, 512, 0);
  t.free(1, 0);
  t.alloc(2, 512, 0);
  EXPECT_THROW(t.free(2, 0), invalid_argument);
  EXPECT_THROW(t.alloc(3, 512, 0), invalid_argument);
  EXPECT_EQ(t.events().size(), 3u);
  EXPECT_EQ(t.live_at_end(), 1u) << "a refused event changed the trace";
}

// A refusal quotes the input's bytes escaped: a terminal escape does not
// reach the terminal, and a NUL does not cut the message short.
TEST(trace_format, bytes_quoted_in_a_refusal_are_escaped) {
  const std::string escape = refusal([] { return parse("shoal-trace v1\na 1 1\x1b]0;title\x07 0\n"); });
  EXPECT_EQ(escape.find('\x1b'), std::string::npos) << escape;
  EXPECT_NE(escape.find("\\x1b]0;title\\x07"), std::string::npos) << escape;
  const std::string nul = refusal([] {
    std::string text = "shoal-trace v1\na 1 1";
    text += '\0';
    return parse(text + "0 0\n");
  });
  EXPECT_EQ(nul.find('\0'), std::string::npos);
  EXPECT_NE(nul.find("is not a non-negative decimal integer"), std::string::npos) << nul;
  const std::string header = refusal([] { return parse(std::string("\x1f\x8b\x08\0\0\0", 6)); });
  EXPECT_NE(header.find("\\x1f\\x8b"), std::string::npos) << header;
  EXPECT_NE(header.find("is this a shoal trace?"), std::string::npos) << header;
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

TEST(random_mix, written_as_it_is_made_equals_the_generated_trace) {
  const bench::mix_options options{.events = 3000, .seed = 7, .streams = 3};
  std::ostringstream streamed;
  bench::write_mix(streamed, options);
  EXPECT_EQ(streamed.str(), to_text(bench::generate_mix(options)));
  std::ostringstream unused;
  EXPECT_THROW(bench::write_mix(unused, {.events = 0}), invalid_argument);
  EXPECT_TRUE(unused.str().empty()) << "bad options are refused before anything is written";
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

std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

#if defined(SHOAL_REPLAY_HAVE_ZLIB)
/// `text` gzip-compressed, as one complete gzip member.
std::string gzip(const std::string& text) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16 /* gzip */, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, text.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
#endif

TEST(trace_file, a_truncated_gzip_trace_is_refused_naming_the_file) {
#if !defined(SHOAL_REPLAY_HAVE_ZLIB)
  GTEST_SKIP() << "built without zlib";
#else
  const std::string whole = gzip(file_bytes(SHOAL_REPLAY_SAMPLE_TRACE));
  const temp_dir dir;
  const std::string path = dir / "cut.trace.gz";
  // Cut in the middle of the compressed data, inside the trailer (CRC and
  // length), and right after the two magic bytes.
  for (const std::size_t kept : {whole.size() / 2, whole.size() - 4, std::size_t{2}}) {
    write_file(path, whole.substr(0, kept));
    const std::string what = refusal([&] { return bench::read_trace_file(path); });
    EXPECT_EQ(what.rfind(path + ":", 0), 0u) << what;
    EXPECT_NE(what.find("truncated"), std::string::npos) << kept << " bytes kept: " << what;
  }
  write_file(path, whole);
  EXPECT_EQ(to_text(bench::read_trace_file(path)), file_bytes(SHOAL_REPLAY_SAMPLE_TRACE)) << "whole, it reads";
#endif
}

/// Reads `bytes` as a trace file through a pipe (/dev/fd/<n>): a file that
/// cannot seek, as a shell's <(...) or /dev/stdin gives.
trace read_through_pipe(const std::string& bytes) {
  pipe_ends pipe;
  // The whole input fits in the pipe's buffer, so this thread writes it all first.
  EXPECT_EQ(::write(pipe.write.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  pipe.write.reset();
  return bench::read_trace_file("/dev/fd/" + std::to_string(pipe.read.get()));
}

TEST(trace_file, a_pipe_is_read_like_a_file) {
  const trace plain = bench::read_trace_file(SHOAL_REPLAY_SAMPLE_TRACE);
  EXPECT_EQ(read_through_pipe(file_bytes(SHOAL_REPLAY_SAMPLE_TRACE)).events(), plain.events());
#if defined(SHOAL_REPLAY_HAVE_ZLIB)
  EXPECT_EQ(read_through_pipe(gzip(file_bytes(SHOAL_REPLAY_SAMPLE_TRACE))).events(), plain.events());
#endif
}

TEST(trace_file, a_directory_is_refused_as_a_directory) {
  const temp_dir dir;
  const std::string what = refusal([&] { return bench::read_trace_file(dir.path()); });
  EXPECT_NE(what.find(dir.path()), std::string::npos) << what;
  EXPECT_NE(what.find("is a directory"), std::string::npos) << what;
}

TEST(trace_file, an_input_without_line_breaks_is_refused_at_the_line_limit) {
  // /dev/zero never ends: a reader that kept whole lines (or whole files)
  // would fill memory.
  const std::string what = refusal([] { return bench::read_trace_file("/dev/zero"); });
  EXPECT_EQ(what.rfind("/dev/zero:1: ", 0), 0u) << what;
  EXPECT_NE(what.find("longer than"), std::string::npos) << what;
}

/// Points a standard stream (its descriptor and its stdio buffer) at `path`
/// while it lasts.
class redirected_stream {
 public:
  redirected_stream(std::FILE* stream, const std::string& path) : stream_(stream), fd_(::fileno(stream)) {
    std::fflush(stream_);
    saved_ = ::dup(fd_);
    const int target = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    EXPECT_GE(target, 0) << path;
    ::dup2(target, fd_);
    ::close(target);
  }
  ~redirected_stream() {
    std::fflush(stream_);
    __fpurge(stream_);  // what a write that failed (/dev/full) left in the buffer
    std::clearerr(stream_);
    ::dup2(saved_, fd_);
    ::close(saved_);
  }
  redirected_stream(const redirected_stream&) = delete;
  redirected_stream& operator=(const redirected_stream&) = delete;

 private:
  std::FILE* stream_;
  int fd_;
  int saved_;
};

struct cli_run {
  int status = 0;
  std::string out;  ///< standard output, unless it went elsewhere
  std::string err;  ///< standard error
};

/// shoal_replay with `args`, run in this process. Standard output goes to
/// `stdout_path` when given (then `out` stays empty).
cli_run run_shoal_replay(std::vector<std::string> args, const std::string& stdout_path = {}) {
  const temp_dir dir;
  args.insert(args.begin(), "shoal_replay");
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  cli_run run;
  std::cout.clear();  // a run that wrote to /dev/full left the stream failed
  {
    const redirected_stream out(stdout, stdout_path.empty() ? dir / "out" : stdout_path);
    const redirected_stream err(stderr, dir / "err");
    run.status = bench::replay_main(static_cast<int>(argv.size()), argv.data(), {});
  }
  if (stdout_path.empty()) run.out = file_bytes(dir / "out");
  run.err = file_bytes(dir / "err");
  return run;
}

TEST(replay_cli, out_of_memory_is_an_error_with_exit_status_1) {
  const temp_dir dir;
  std::string text = "shoal-trace v1\n";
  for (int id = 0; id < 1000; ++id) text += "a " + std::to_string(id) + " 512 0\n";
  write_file(dir / "big.trace", text);
  // Reading the trace makes an allocation or more per event: the 200th
  // falls well inside it.
  const refusing_one_allocation refuse(200, [] {});
  const cli_run run = run_shoal_replay({dir / "big.trace"});
  ASSERT_TRUE(refuse.refused());
  EXPECT_EQ(run.status, 1);
  EXPECT_NE(run.err.find("out of memory"), std::string::npos) << run.err;
  EXPECT_EQ(run.out, "") << "it stopped while reading, before the table";
}

TEST(replay_cli, output_that_cannot_be_written_is_an_error) {
  const cli_run replayed = run_shoal_replay({SHOAL_REPLAY_SAMPLE_TRACE}, "/dev/full");
  EXPECT_EQ(replayed.status, 1);
  EXPECT_NE(replayed.err.find("writing to standard output failed"), std::string::npos) << replayed.err;
  const cli_run generated = run_shoal_replay({"--generate-mix", "1000", "1"}, "/dev/full");
  EXPECT_EQ(generated.status, 1);
  EXPECT_NE(generated.err.find("writing to standard output failed"), std::string::npos) << generated.err;
}

// A waste row holds the trace's name and its settings whole, however long.
TEST(replay_cli, waste_rows_stay_whole_with_a_long_name) {
  std::string conf = "max_split_size_mb:256";
  for (int i = 0; i < 30; ++i) conf += ",max_split_size_mb:256";
  const cli_run run = run_shoal_replay({"--waste", "--conf", conf, SHOAL_REPLAY_SAMPLE_TRACE});
  ASSERT_EQ(run.status, 0) << run.err;
  std::istringstream lines(run.out.substr(run.out.find("Where the peak reserved memory went")));
  int rows = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find(conf) == std::string::npos) continue;
    ++rows;
    EXPECT_EQ(std::ranges::count(line, '|'), 14) << line;  // the table's 13 columns
  }
  EXPECT_EQ(rows, 2) << "one row per pool\n" << run.out;
}

TEST(replay_cli, a_trace_that_fails_keeps_the_later_traces_waste_rows) {
  const temp_dir dir;
  write_file(dir / "too_big.trace", "shoal-trace v1\na 1 " + std::to_string(bench::max_trace_bytes) + " 0\n");
  const cli_run run = run_shoal_replay({"--waste", dir / "too_big.trace", SHOAL_REPLAY_SAMPLE_TRACE});
  EXPECT_EQ(run.status, 1);
  const std::size_t waste_table = run.out.find("Where the peak reserved memory went");
  ASSERT_NE(waste_table, std::string::npos) << run.out << run.err;
  const std::string waste = run.out.substr(waste_table);
  EXPECT_NE(waste.find("| too_big | shoal | failed: "), std::string::npos) << waste;
  EXPECT_NE(waste.find("| sample | shoal | small |"), std::string::npos) << waste;
  EXPECT_NE(waste.find("| sample | shoal | large |"), std::string::npos) << waste;
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
