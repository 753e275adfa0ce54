#include "lending/metrics.h"

#include <map>
#include <sstream>
#include <string_view>
#include <utility>

namespace shoal::lending::detail {

namespace {

void metric(std::ostringstream& out, const char* name, const char* type, const char* help, std::uint64_t value) {
  out << "# HELP shoal_lending_" << name << ' ' << help << '\n'
      << "# TYPE shoal_lending_" << name << ' ' << type << '\n'
      << "shoal_lending_" << name << ' ' << value << '\n';
}

// A label value with backslash, quote and newline escaped (the format's rules).
std::string label(std::string_view value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

// One sample per region, and one per hold of a shared region: who holds what.
void per_region(std::ostringstream& out, const lender_status& s) {
  out << "# HELP shoal_lending_region_bytes Bytes of each region, by id, purpose (a shared region's name), mode, "
         "state and borrower (a shared region's writer).\n"
      << "# TYPE shoal_lending_region_bytes gauge\n";
  for (const auto& r : s.regions) {
    out << "shoal_lending_region_bytes{id=\"" << r.id << "\",purpose=\"" << label(r.purpose) << "\",mode=\""
        << to_string(r.mode) << "\",state=\"" << to_string(r.state) << "\",pid=\"" << r.borrower.pid << "\",uid=\""
        << r.uid << "\"} " << r.bytes << '\n';
  }
  out << "# HELP shoal_lending_region_holds Holds of each shared region by process (the writer's and each "
         "reader's), by state.\n"
      << "# TYPE shoal_lending_region_holds gauge\n";
  for (const auto& r : s.regions) {
    std::map<std::pair<pid_t, region_state>, std::uint64_t> holds;
    for (const auto& h : r.holders) ++holds[{h.process.pid, h.state}];
    for (const auto& [who, count] : holds) {
      out << "shoal_lending_region_holds{id=\"" << r.id << "\",pid=\"" << who.first << "\",state=\""
          << to_string(who.second) << "\"} " << count << '\n';
    }
  }
}

// One sample per spare chunk: what the lender keeps for reuse, and for whom.
void per_spare(std::ostringstream& out, const lender_status& s) {
  out << "# HELP shoal_lending_spare_chunk_bytes Bytes of each spare chunk, by memory id, the uid it is lent "
         "again to, and how many connections keep it mapped.\n"
      << "# TYPE shoal_lending_spare_chunk_bytes gauge\n";
  for (const auto& spare : s.spares) {
    out << "shoal_lending_spare_chunk_bytes{memory=\"" << spare.memory << "\",uid=\"" << spare.uid
        << "\",kept_by=\"" << spare.kept_by << "\"} " << spare.bytes << '\n';
  }
}

}  // namespace

std::string prometheus_text(const lender_status& s) {
  std::ostringstream out;
  std::uint64_t orphaned = 0;
  std::uint64_t shared = 0;
  std::uint64_t holds = 0;
  for (const auto& r : s.regions) {
    orphaned += r.state == region_state::orphaned ? 1 : 0;
    shared += r.mode == region_mode::shared ? 1 : 0;
    holds += r.holders.size();
  }
  metric(out, "capacity_bytes", "gauge", "Bytes the lender may lend at once.", s.capacity_bytes);
  metric(out, "lent_bytes", "gauge", "Bytes lent now (regions lent or orphaned).", s.lent_bytes);
  metric(out, "spare_bytes", "gauge", "Bytes of spare chunks kept for reuse (counted against the capacity).",
         s.spare_bytes);
  metric(out, "spare_chunks", "gauge", "Spare chunks kept for reuse.", s.spares.size());
  metric(out, "prepared_bytes", "gauge",
         "Bytes of prepared chunks not lent yet, made when the lender started (counted against the capacity).",
         s.prepared_bytes);
  metric(out, "prepared_chunks", "gauge", "Prepared chunks not lent yet.", s.prepared_chunks);
  metric(out, "free_bytes", "gauge", "Bytes of the capacity neither lent, spare nor prepared.",
         s.capacity_bytes - s.lent_bytes - s.spare_bytes - s.prepared_bytes);
  metric(out, "regions", "gauge", "Regions lent or orphaned now.", s.regions.size());
  metric(out, "orphaned_regions", "gauge", "Regions whose borrower hung up but still runs.", orphaned);
  metric(out, "shared_regions", "gauge", "Regions published read-only now.", shared);
  metric(out, "shared_holds", "gauge", "Holds of shared regions now (the writer's and each reader's).", holds);
  metric(out, "borrowers", "gauge", "Borrowers connected now.", s.borrowers);
  metric(out, "requests_total", "counter", "Borrow, publish and shared-borrow requests received.", s.requests);
  metric(out, "published_total", "counter", "Regions published.", s.published);
  metric(out, "refusals_total", "counter", "Requests and connections refused.", s.refusals);
  metric(out, "given_back_total", "counter", "Holds given back by their borrowers.", s.given_back);
  metric(out, "reclaimed_total", "counter", "Holds reclaimed from borrowers that died.", s.reclaimed);
  metric(out, "revocations_total", "counter", "Regions asked back.", s.revocations);
  metric(out, "revocations_missed_total", "counter", "Revoked regions not given back by their deadline.",
         s.revocations_missed);
  metric(out, "chunks_made_total", "counter", "Chunks made (created, mapped, exported), prepared ones included.",
         s.chunks_made);
  metric(out, "reuses_total", "counter", "Regions lent from a spare chunk.", s.reuses);
  metric(out, "prepared_used_total", "counter", "Regions lent from a prepared chunk.", s.prepared_used);
  metric(out, "kept_mappings_used_total", "counter", "Regions lent with no chunk: the borrower's kept mapping used.",
         s.kept_mappings_used);
  metric(out, "forgets_total", "counter", "Forget messages sent for released chunks borrowers kept mapped.",
         s.forgets);
  metric(out, "closed_for_errors_total", "counter", "Connections closed for malformed or stalled input.",
         s.connections_closed_for_errors);
  per_region(out, s);
  per_spare(out, s);
  return out.str();
}

}  // namespace shoal::lending::detail
