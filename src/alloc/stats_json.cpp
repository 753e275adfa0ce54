// JSON export of statistics, snapshots and traces (for tools and humans).
#include <sstream>

#include "shoal/alloc/stats.h"

namespace shoal::alloc {

namespace {

void write(std::ostream& out, const stat& s) {
  out << "{\"current\":" << s.current << ",\"peak\":" << s.peak << ",\"allocated\":" << s.allocated
      << ",\"freed\":" << s.freed << '}';
}

void write(std::ostream& out, const char* name, const stat_by_pool& s, bool last = false) {
  out << '"' << name << "\":{\"all\":";
  write(out, s.aggregate);
  out << ",\"small_pool\":";
  write(out, s.pool[0]);
  out << ",\"large_pool\":";
  write(out, s.pool[1]);
  out << '}' << (last ? "" : ",");
}

const char* name_of(block_state s) {
  switch (s) {
    case block_state::allocated: return "allocated";
    case block_state::pending_free: return "pending_free";
    case block_state::free: return "free";
    case block_state::invalidated: return "invalidated";
  }
  return "?";
}

const char* name_of(trace_action a) {
  switch (a) {
    case trace_action::alloc: return "alloc";
    case trace_action::free_requested: return "free_requested";
    case trace_action::free_completed: return "free_completed";
    case trace_action::segment_alloc: return "segment_alloc";
    case trace_action::segment_free: return "segment_free";
    case trace_action::segment_map: return "segment_map";
    case trace_action::segment_unmap: return "segment_unmap";
    case trace_action::oom: return "oom";
  }
  return "?";
}

// Stream references are printed as their native handle (0: default stream).
std::uintptr_t stream_id(backend::stream_ref s) { return reinterpret_cast<std::uintptr_t>(s.native); }

// JSON strings: escape quotes, backslashes and control characters.
std::string quoted(const std::string& s) {
  std::ostringstream out;
  out << '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out << "\\u00" << "0123456789abcdef"[(c >> 4) & 0xF] << "0123456789abcdef"[c & 0xF];
    } else {
      out << c;
    }
  }
  out << '"';
  return out.str();
}

}  // namespace

std::string allocator_stats::to_json() const {
  std::ostringstream out;
  out << '{';
  write(out, "allocations", allocations);
  write(out, "segments", segments);
  write(out, "active", active);
  write(out, "inactive_split", inactive_split);
  write(out, "allocated_bytes", allocated_bytes);
  write(out, "reserved_bytes", reserved_bytes);
  write(out, "active_bytes", active_bytes);
  write(out, "inactive_split_bytes", inactive_split_bytes);
  write(out, "requested_bytes", requested_bytes);
  write(out, "invalidated", invalidated);
  write(out, "invalidated_bytes", invalidated_bytes);
  out << "\"num_alloc_retries\":" << retries << ",\"num_ooms\":" << ooms << ",\"num_device_alloc\":" << device_allocations
      << ",\"num_device_free\":" << device_frees << ",\"vmm_calls\":{\"creates\":" << vmm_calls.creates
      << ",\"releases\":" << vmm_calls.releases << ",\"maps\":" << vmm_calls.maps << ",\"unmaps\":" << vmm_calls.unmaps
      << ",\"access_grants\":" << vmm_calls.access_grants << '}'
      << ",\"expandable_segments_fallback\":" << (expandable_segments_fallback ? "true" : "false") << '}';
  return out.str();
}

std::string snapshot::to_json() const {
  std::ostringstream out;
  out << "{\"segments\":[";
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    out << (i ? "," : "") << "{\"address\":" << s.address << ",\"total_size\":" << s.size
        << ",\"mapped_size\":" << s.mapped_bytes << ",\"pool\":\"" << (s.pool == pool_kind::small ? "small" : "large")
        << "\",\"stream\":" << stream_id(s.stream) << ",\"vacant\":" << (s.vacant ? "true" : "false")
        << ",\"expandable\":" << (s.expandable ? "true" : "false")
        << ",\"external\":" << (s.external ? "true" : "false") << ",\"private_pool\":" << quoted(s.private_pool)
        << ",\"sequence\":" << s.sequence
        << ",\"blocks\":[";
    for (std::size_t j = 0; j < s.blocks.size(); ++j) {
      const auto& b = s.blocks[j];
      out << (j ? "," : "") << "{\"address\":" << b.address << ",\"size\":" << b.size
          << ",\"requested_size\":" << b.requested << ",\"state\":\"" << name_of(b.state) << "\"}";
    }
    out << "]}";
  }
  out << "]}";
  return out.str();
}

std::string to_json(const std::vector<trace_entry>& trace) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const auto& e = trace[i];
    out << (i ? "," : "") << "{\"action\":\"" << name_of(e.action) << "\",\"addr\":" << e.address
        << ",\"size\":" << e.size << ",\"stream\":" << stream_id(e.stream) << ",\"time_ns\":" << e.time_ns << '}';
  }
  out << ']';
  return out.str();
}

}  // namespace shoal::alloc
