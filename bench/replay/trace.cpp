#include "bench/replay/trace.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <istream>
#include <ostream>
#include <set>
#include <streambuf>
#include <system_error>
#include <vector>

#if defined(SHOAL_REPLAY_HAVE_ZLIB)
#include <zlib.h>
#else
#include <fstream>
#endif

#include "shoal/core/error.h"
#include "src/core/printable_text.h"

namespace shoal::bench {

namespace {

constexpr std::string_view header = "shoal-trace v1";

void check_stream(std::uint64_t stream) {
  if (stream >= max_trace_streams) {
    throw invalid_argument("stream " + std::to_string(stream) + " is out of range; stream ids are 0.." +
                           std::to_string(max_trace_streams - 1) + " (renumber the trace's streams densely)");
  }
}

std::string cannot_open(const std::filesystem::path& path) {
  return "cannot open trace file '" + path.string() + "': " + std::strerror(errno);
}

#if defined(SHOAL_REPLAY_HAVE_ZLIB)
/// A file read through zlib, as a std::streambuf: gzip-compressed (several
/// concatenated members included) or plain, which zlib passes through as it
/// is. zlib needs no seek, so pipes work. A read error, or a gzip stream
/// that ends before its trailer, is invalid_argument (read_trace adds the
/// file and line).
class gzip_file_buffer final : public std::streambuf {
 public:
  explicit gzip_file_buffer(const std::filesystem::path& path)
      : path_(path.string()), file_(gzopen(path_.c_str(), "rb")) {
    if (file_ == nullptr) throw invalid_argument(cannot_open(path));
  }
  ~gzip_file_buffer() override { gzclose(file_); }
  gzip_file_buffer(const gzip_file_buffer&) = delete;
  gzip_file_buffer& operator=(const gzip_file_buffer&) = delete;

 protected:
  int_type underflow() override {
    const int n = gzread(file_, buffer_.data(), static_cast<unsigned>(buffer_.size()));
    if (n > 0) {
      setg(buffer_.data(), buffer_.data(), buffer_.data() + n);
      return traits_type::to_int_type(buffer_[0]);
    }
    int code = Z_OK;
    const std::string why = zlib_message(code);
    // At a premature end gzread returns 0, not -1: only gzerror tells it
    // from the real end.
    if (code == Z_OK) return traits_type::eof();
    if (code == Z_BUF_ERROR) {
      throw invalid_argument("the file ends before its gzip trailer: it is truncated (an interrupted write or copy?)");
    }
    throw invalid_argument("reading failed: " + why);
  }

 private:
  /// gzerror's message, without the path zlib puts first.
  std::string zlib_message(int& code) {
    const std::string message = gzerror(file_, &code);
    const std::string prefix = path_ + ": ";
    return message.starts_with(prefix) ? message.substr(prefix.size()) : message;
  }

  std::string path_;
  gzFile file_;
  std::array<char, std::size_t{64} << 10> buffer_{};
};
#else
/// Without zlib a gzip file is refused by its magic bytes, looked at with
/// peek rather than a seek back, so that pipes work; a first byte 0x1f not
/// followed by 0x8b is put back, for the header check to refuse.
bool starts_with_gzip_magic(std::istream& in) {
  if (in.peek() != 0x1f) return false;
  in.get();
  if (in.peek() == 0x8b) return true;
  in.unget();
  return false;
}
#endif

std::string_view trim(std::string_view s) {
  constexpr std::string_view space = " \t\r";
  const auto first = s.find_first_not_of(space);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(space) - first + 1);
}

std::vector<std::string_view> split_fields(std::string_view line) {
  std::vector<std::string_view> fields;
  std::size_t pos = 0;
  while (pos < line.size()) {
    while (pos < line.size() && (line[pos] == ' ' || line[pos] == '\t')) ++pos;
    const std::size_t end = std::min(line.find_first_of(" \t", pos), line.size());
    if (end > pos) fields.push_back(line.substr(pos, end - pos));
    pos = end;
  }
  return fields;
}

std::uint64_t parse_number(std::string_view field, std::string_view what) {
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), value);
  if (ec == std::errc::result_out_of_range) {
    throw invalid_argument(std::string(what) + " '" + detail::printable(field) + "' does not fit in 64 bits");
  }
  if (ec != std::errc{} || end != field.data() + field.size()) {
    throw invalid_argument(std::string(what) + " '" + detail::printable(field) + "' is not a non-negative decimal integer");
  }
  return value;
}

std::uint32_t parse_stream(std::string_view field) {
  const std::uint64_t value = parse_number(field, "stream");
  check_stream(value);
  return static_cast<std::uint32_t>(value);
}

void parse_event(trace& t, std::string_view line) {
  const auto fields = split_fields(line);
  if (fields[0] == "a") {
    if (fields.size() != 4) {
      throw invalid_argument("an alloc line is 'a <id> <bytes> <stream>', found " + std::to_string(fields.size()) +
                             " fields");
    }
    t.alloc(parse_number(fields[1], "id"), parse_number(fields[2], "bytes"), parse_stream(fields[3]));
  } else if (fields[0] == "f") {
    if (fields.size() != 3) {
      throw invalid_argument("a free line is 'f <id> <stream>', found " + std::to_string(fields.size()) + " fields");
    }
    t.free(parse_number(fields[1], "id"), parse_stream(fields[2]));
  } else {
    throw invalid_argument("unknown event '" + detail::printable(fields[0]) + "'; events are 'a' (alloc) and 'f' (free)");
  }
}

void check_header(std::string_view text) {
  if (text != header) {
    throw invalid_argument("expected the header '" + std::string(header) + "', found '" +
                           detail::printable(text.substr(0, 40)) + "'; is this a shoal trace?");
  }
}

/// Adds what a line after the header holds to `t`: an event, a note, or
/// nothing (a blank line).
void parse_line(trace& t, std::string_view text) {
  if (text.empty()) return;
  if (text.front() == '#') {
    const std::string_view note = text.substr(1);
    t.add_note(std::string(note.starts_with(' ') ? note.substr(1) : note));
  } else {
    parse_event(t, text);
  }
}

/// Reads the next line, without its '\n', into `line`; false at the end of
/// the input. A line longer than max_trace_line_bytes is invalid_argument.
bool next_line(std::streambuf& in, std::string& line) {
  line.clear();
  for (auto c = in.sbumpc(); c != std::streambuf::traits_type::eof(); c = in.sbumpc()) {
    if (c == '\n') return true;
    if (line.size() == max_trace_line_bytes) {
      throw invalid_argument("the line is longer than " + std::to_string(max_trace_line_bytes) +
                             " bytes; is this a shoal trace?");
    }
    line.push_back(static_cast<char>(c));
  }
  return !line.empty();
}

}  // namespace

void trace::alloc(std::uint64_t id, std::uint64_t bytes, std::uint32_t stream) {
  check_room_for_an_event();
  if (bytes == 0) throw invalid_argument("alloc of id " + std::to_string(id) + " has size 0; sizes are > 0");
  if (bytes > max_trace_bytes) {
    throw invalid_argument("alloc of id " + std::to_string(id) + " asks for " + std::to_string(bytes) +
                           " bytes, more than the limit of " + std::to_string(max_trace_bytes));
  }
  check_stream(stream);
  const auto [it, inserted] = live_.try_emplace(id, live_block{allocations_, bytes});
  if (!inserted) {
    throw invalid_argument("alloc of id " + std::to_string(id) +
                           ", which is already live; free it first or use another id");
  }
  events_.push_back({trace_op::alloc, id, bytes, stream, allocations_});
  ++allocations_;
}

void trace::check_room_for_an_event() const {
  if (events_.size() >= max_events_) {
    throw invalid_argument("the trace holds more than " + std::to_string(max_events_) +
                           " events, the most one replay holds in memory; split the recording");
  }
}

void trace::free(std::uint64_t id, std::uint32_t stream) {
  check_stream(stream);
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw invalid_argument("free of id " + std::to_string(id) +
                           ", which is not live (never allocated or already freed)");
  }
  check_room_for_an_event();
  events_.push_back({trace_op::free, id, it->second.bytes, stream, it->second.block});
  live_.erase(it);
}

void trace::add_note(std::string note) {
  if (note.find_first_of("\r\n") != std::string::npos) {
    throw invalid_argument("a trace note is one line; split '" + detail::printable(note) + "' into several notes");
  }
  // "# " and the note fit a line, so that read_trace reads back what write_trace wrote.
  if (note.size() > max_trace_note_bytes) {
    throw invalid_argument("a trace note is at most " + std::to_string(max_trace_note_bytes) + " bytes, this one " +
                           std::to_string(note.size()) + "; split it into several notes");
  }
  if (note.size() > max_trace_notes_total_bytes - notes_bytes_) {
    throw invalid_argument("the trace's notes come to more than " + std::to_string(max_trace_notes_total_bytes) +
                           " bytes; is this a shoal trace?");
  }
  notes_bytes_ += note.size();
  notes_.push_back(std::move(note));
}

std::vector<std::uint32_t> trace::streams() const {
  std::set<std::uint32_t> seen;
  for (const auto& e : events_) seen.insert(e.stream);
  return {seen.begin(), seen.end()};
}

trace read_trace(std::istream& in, std::string_view source) {
  trace t;
  std::string line;
  for (std::size_t line_number = 1;; ++line_number) {
    try {
      if (!next_line(*in.rdbuf(), line)) {
        if (line_number > 1) return t;
        throw invalid_argument("the input is empty; expected the header '" + std::string(header) + "'");
      }
      const std::string_view text = trim(line);
      if (line_number == 1) {
        check_header(text);
      } else {
        parse_line(t, text);
      }
    } catch (const invalid_argument& e) {
      throw invalid_argument(std::string(source) + ":" + std::to_string(line_number) + ": " + e.what());
    }
  }
}

trace read_trace_file(const std::filesystem::path& path) {
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) {
    throw invalid_argument("'" + path.string() + "' is a directory; give the trace files in it");
  }
#if defined(SHOAL_REPLAY_HAVE_ZLIB)
  gzip_file_buffer buffer(path);
  std::istream in(&buffer);
#else
  std::ifstream in(path, std::ios::binary);
  if (!in) throw invalid_argument(cannot_open(path));
  if (starts_with_gzip_magic(in)) {
    throw invalid_argument(path.string() +
                           " is gzip-compressed, and this build has no zlib: decompress it (gunzip) or rebuild "
                           "with zlib's headers installed (zlib1g-dev)");
  }
#endif
  return read_trace(in, path.string());
}

void write_trace(std::ostream& out, const trace& t) {
  write_trace_start(out, t.notes());
  for (const auto& e : t.events()) write_trace_event(out, e);
}

void write_trace_start(std::ostream& out, const std::vector<std::string>& notes) {
  out << header << '\n';
  for (const auto& note : notes) out << "# " << note << '\n';
}

void write_trace_event(std::ostream& out, const trace_event& e) {
  if (e.op == trace_op::alloc) {
    out << "a " << e.id << ' ' << e.bytes << ' ' << e.stream << '\n';
  } else {
    out << "f " << e.id << ' ' << e.stream << '\n';
  }
}

}  // namespace shoal::bench
