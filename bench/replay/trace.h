// Allocation traces: a sequence of allocs and frees with sizes and streams,
// recorded from a real program (scripts/record-traces.py) or generated
// (random_mix.h), replayed through any allocator (replayer.h).
//
// The text format ("shoal-trace v1") is specified in docs/traces.md:
//   shoal-trace v1
//   # a comment
//   a <id> <bytes> <stream>
//   f <id> <stream>
//
// Invariants a trace keeps (checked as events are added, so every trace
// object is replayable):
//   - an alloc's id is not live; a free's id is live (then it no longer is);
//   - 0 < bytes <= max_trace_bytes; stream < max_trace_streams.
// Blocks still live at the end are allowed (memory a program kept).
//
// Thread-safety: a value type; not synchronized.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shoal::bench {

/// Stream ids are small integers: 0 <= stream < max_trace_streams.
inline constexpr std::uint32_t max_trace_streams = 1024;
/// No single request is larger than this (256 TiB): a guard against junk
/// that would overflow byte sums.
inline constexpr std::uint64_t max_trace_bytes = std::uint64_t{1} << 48;
/// No line of a trace is longer than this (without its line break): a reader
/// holds one line at a time, so an input with no line breaks (/dev/zero, a
/// gzip bomb) is refused instead of filling memory.
inline constexpr std::size_t max_trace_line_bytes = 4096;
/// A note is at most this long, so that "# " and it fit a line.
inline constexpr std::size_t max_trace_note_bytes = max_trace_line_bytes - 2;
/// A trace's notes together are at most this long (1 MiB), and it holds at
/// most max_trace_events events (64 Mi, 2.5 GiB in memory): a small gzip
/// file of comments or events (a bomb) is refused before it fills memory.
/// A recording of more events is replayed in parts.
inline constexpr std::size_t max_trace_notes_total_bytes = std::size_t{1} << 20;
inline constexpr std::size_t max_trace_events = std::size_t{1} << 26;

enum class trace_op : std::uint8_t { alloc, free };

struct trace_event {
  trace_op op = trace_op::alloc;
  std::uint64_t id = 0;      ///< as written in the trace
  std::uint64_t bytes = 0;   ///< requested bytes (of the block, for a free)
  std::uint32_t stream = 0;  ///< alloc: the block's stream; free: the stream it is freed on
  /// Which allocation this event is about: the alloc's ordinal among all
  /// allocs of the trace (dense, so a replayer indexes arrays with it).
  std::size_t block = 0;

  friend bool operator==(const trace_event&, const trace_event&) = default;
};

class trace {
 public:
  /// A trace of at most `max_events` events (a test's smaller bound).
  explicit trace(std::size_t max_events = max_trace_events) : max_events_(max_events) {}

  /// Appends an alloc. Throws shoal::invalid_argument (changing nothing)
  /// when `id` is live, `bytes` is 0 or too large, `stream` is too large, or
  /// the trace holds its most events.
  void alloc(std::uint64_t id, std::uint64_t bytes, std::uint32_t stream);
  /// Appends a free of live block `id` on `stream`. Throws
  /// shoal::invalid_argument (changing nothing) when `id` is not live or
  /// `stream` is too large, or the trace holds its most events.
  void free(std::uint64_t id, std::uint32_t stream);
  /// Adds a comment line (without the leading "# "). A note holding a line
  /// break, longer than max_trace_note_bytes, or past
  /// max_trace_notes_total_bytes with the others is invalid_argument.
  void add_note(std::string note);

  [[nodiscard]] const std::vector<trace_event>& events() const noexcept { return events_; }
  [[nodiscard]] const std::vector<std::string>& notes() const noexcept { return notes_; }
  [[nodiscard]] std::size_t allocation_count() const noexcept { return allocations_; }
  /// Distinct stream ids used by any event, ascending.
  [[nodiscard]] std::vector<std::uint32_t> streams() const;
  /// Blocks allocated and not freed by the end of the trace.
  [[nodiscard]] std::size_t live_at_end() const noexcept { return live_.size(); }

 private:
  struct live_block {
    std::size_t block;
    std::uint64_t bytes;
  };
  /// invalid_argument when the trace holds max_events_ already.
  void check_room_for_an_event() const;

  std::size_t max_events_;
  std::vector<trace_event> events_;
  std::vector<std::string> notes_;
  std::size_t notes_bytes_ = 0;
  std::unordered_map<std::uint64_t, live_block> live_;
  std::size_t allocations_ = 0;
};

/// Parses the text format, one line at a time. `source` names the input in
/// error messages. Throws shoal::invalid_argument naming "<source>:<line>"
/// for a missing or unknown header, a malformed line, a line longer than
/// max_trace_line_bytes, an event that breaks the invariants, or an input
/// the stream cannot read (read_trace_file: a truncated gzip file).
[[nodiscard]] trace read_trace(std::istream& in, std::string_view source);
/// read_trace on a file, plain or gzip-compressed, read as a stream: a pipe
/// (/dev/stdin, a shell's <(...)) works. A file that cannot be opened, or a
/// directory, is invalid_argument.
[[nodiscard]] trace read_trace_file(const std::filesystem::path& path);
/// Writes the header, the notes as comments, then one line per event.
/// read_trace gives back an equal trace.
void write_trace(std::ostream& out, const trace& t);
/// write_trace in pieces, for a writer that makes events as it goes and
/// keeps no trace (random_mix.h's write_mix): the header and the notes,
/// then each event's line.
void write_trace_start(std::ostream& out, const std::vector<std::string>& notes);
void write_trace_event(std::ostream& out, const trace_event& e);

}  // namespace shoal::bench
