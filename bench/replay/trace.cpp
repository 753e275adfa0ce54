#include "bench/replay/trace.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <istream>
#include <ostream>
#include <set>
#include <sstream>
#include <vector>

#if defined(SHOAL_REPLAY_HAVE_ZLIB)
#include <zlib.h>
#endif

#include "shoal/core/error.h"

namespace shoal::bench {

namespace {

constexpr std::string_view header = "shoal-trace v1";

void check_stream(std::uint64_t stream) {
  if (stream >= max_trace_streams) {
    throw invalid_argument("stream " + std::to_string(stream) + " is out of range; stream ids are 0.." +
                           std::to_string(max_trace_streams - 1) + " (renumber the trace's streams densely)");
  }
}

bool starts_with_gzip_magic(std::istream& in) {
  const int first = in.get();
  const int second = in.get();
  in.clear();
  in.seekg(0);
  return first == 0x1f && second == 0x8b;
}

/// The decompressed bytes of a gzip file (several concatenated members included).
std::string gunzip_file(const std::filesystem::path& path) {
#if defined(SHOAL_REPLAY_HAVE_ZLIB)
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw invalid_argument("cannot open trace file '" + path.string() + "'");
  std::string out;
  std::vector<char> chunk(std::size_t{1} << 20);
  for (;;) {
    const int n = gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) {
      int code = 0;
      const std::string why = gzerror(file, &code);
      gzclose(file);
      throw invalid_argument(path.string() + ": not a readable gzip file (" + why + ")");
    }
    if (n == 0) break;
    out.append(chunk.data(), static_cast<std::size_t>(n));
  }
  gzclose(file);
  return out;
#else
  throw invalid_argument(path.string() +
                         " is gzip-compressed, and this build has no zlib: decompress it (gunzip) or rebuild "
                         "with zlib's headers installed (zlib1g-dev)");
#endif
}

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
    throw invalid_argument(std::string(what) + " '" + std::string(field) + "' does not fit in 64 bits");
  }
  if (ec != std::errc{} || end != field.data() + field.size()) {
    throw invalid_argument(std::string(what) + " '" + std::string(field) + "' is not a non-negative decimal integer");
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
    throw invalid_argument("unknown event '" + std::string(fields[0]) + "'; events are 'a' (alloc) and 'f' (free)");
  }
}

}  // namespace

void trace::alloc(std::uint64_t id, std::uint64_t bytes, std::uint32_t stream) {
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

void trace::free(std::uint64_t id, std::uint32_t stream) {
  check_stream(stream);
  const auto it = live_.find(id);
  if (it == live_.end()) {
    throw invalid_argument("free of id " + std::to_string(id) +
                           ", which is not live (never allocated or already freed)");
  }
  events_.push_back({trace_op::free, id, it->second.bytes, stream, it->second.block});
  live_.erase(it);
}

void trace::add_note(std::string note) {
  if (note.find_first_of("\r\n") != std::string::npos) {
    throw invalid_argument("a trace note is one line; split '" + note + "' into several notes");
  }
  notes_.push_back(std::move(note));
}

std::vector<std::uint32_t> trace::streams() const {
  std::set<std::uint32_t> seen;
  for (const auto& e : events_) seen.insert(e.stream);
  return {seen.begin(), seen.end()};
}

trace read_trace(std::istream& in, std::string_view source) {
  const auto located = [&](std::size_t line_number, const std::string& what) {
    return invalid_argument(std::string(source) + ":" + std::to_string(line_number) + ": " + what);
  };
  trace t;
  std::string line;
  std::size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    const std::string_view text = trim(line);
    if (line_number == 1) {
      if (text != header) {
        throw located(1, "expected the header '" + std::string(header) + "', found '" +
                             std::string(text.substr(0, 40)) + "'; is this a shoal trace?");
      }
      continue;
    }
    if (text.empty()) continue;
    if (text.front() == '#') {
      const std::string_view note = text.substr(1);
      t.add_note(std::string(note.starts_with(' ') ? note.substr(1) : note));
      continue;
    }
    try {
      parse_event(t, text);
    } catch (const invalid_argument& e) {
      throw located(line_number, e.what());
    }
  }
  if (in.bad())
    throw invalid_argument(std::string(source) + ": reading failed after line " + std::to_string(line_number));
  if (line_number == 0) throw located(1, "the input is empty; expected the header '" + std::string(header) + "'");
  return t;
}

trace read_trace_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw invalid_argument("cannot open trace file '" + path.string() + "'");
  if (!starts_with_gzip_magic(in)) return read_trace(in, path.string());
  in.close();
  std::istringstream text(gunzip_file(path));
  return read_trace(text, path.string());
}

void write_trace(std::ostream& out, const trace& t) {
  out << header << '\n';
  for (const auto& note : t.notes()) out << "# " << note << '\n';
  for (const auto& e : t.events()) {
    if (e.op == trace_op::alloc) {
      out << "a " << e.id << ' ' << e.bytes << ' ' << e.stream << '\n';
    } else {
      out << "f " << e.id << ' ' << e.stream << '\n';
    }
  }
}

}  // namespace shoal::bench
