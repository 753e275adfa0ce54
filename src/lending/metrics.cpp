#include "lending/metrics.h"

#include <chrono>
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

// Sample lines added while the text stays under its limit, less the room
// kept for the trailer; the lines that would pass it are counted instead.
class bounded_samples {
 public:
  bounded_samples(std::ostringstream& out, std::size_t limit) : out_(out), limit_(limit) {}

  // Adds `line` if it fits; otherwise counts it against `series`.
  void add(const std::string& line, std::uint64_t& left_out) {
    const auto used = static_cast<std::size_t>(out_.tellp());
    if (left_out == 0 && used + line.size() + trailer_room <= limit_) {
      out_ << line;
    } else {
      ++left_out;  // once one is left out, the rest of its series is too (no gaps)
    }
  }

  // Room kept for the samples_left_out trailer.
  static constexpr std::size_t trailer_room = 1024;

 private:
  std::ostringstream& out_;
  std::size_t limit_;
};

// Room for the HELP and TYPE lines of the per-item series.
constexpr std::size_t headers_room = 1024;

struct left_out_counts {
  std::uint64_t regions = 0;
  std::uint64_t holds = 0;
  std::uint64_t spares = 0;
  std::uint64_t waiting = 0;
  std::uint64_t waited = 0;
};

// One sample per region, and one per hold of a shared region: who holds what.
void per_region(std::ostringstream& out, bounded_samples& samples, const lender_status& s, left_out_counts& left) {
  out << "# HELP shoal_lending_region_bytes Bytes of each region, by id, purpose (a shared region's name), mode, "
         "state and borrower (a shared region's writer).\n"
      << "# TYPE shoal_lending_region_bytes gauge\n";
  for (const auto& r : s.regions) {
    std::ostringstream line;
    line.exceptions(std::ios::badbit);
    line << "shoal_lending_region_bytes{id=\"" << r.id << "\",purpose=\"" << label(r.purpose) << "\",mode=\""
         << to_string(r.mode) << "\",state=\"" << to_string(r.state) << "\",pid=\"" << r.borrower.pid << "\",uid=\""
         << r.uid << "\"} " << r.bytes << '\n';
    samples.add(line.str(), left.regions);
  }
  out << "# HELP shoal_lending_region_holds Holds of each shared region by process (the writer's and each "
         "reader's), by state.\n"
      << "# TYPE shoal_lending_region_holds gauge\n";
  for (const auto& r : s.regions) {
    std::map<std::pair<pid_t, region_state>, std::uint64_t> holds;
    for (const auto& h : r.holders) ++holds[{h.process.pid, h.state}];
    for (const auto& [who, count] : holds) {
      std::ostringstream line;
      line.exceptions(std::ios::badbit);
      line << "shoal_lending_region_holds{id=\"" << r.id << "\",pid=\"" << who.first << "\",state=\""
           << to_string(who.second) << "\"} " << count << '\n';
      samples.add(line.str(), left.holds);
    }
  }
}

// One sample per spare chunk: what the lender keeps for reuse, and for whom.
void per_spare(std::ostringstream& out, bounded_samples& samples, const lender_status& s, left_out_counts& left) {
  out << "# HELP shoal_lending_spare_chunk_bytes Bytes of each spare chunk, by memory id, the uid it is lent "
         "again to, and how many connections keep it mapped.\n"
      << "# TYPE shoal_lending_spare_chunk_bytes gauge\n";
  for (const auto& spare : s.spares) {
    std::ostringstream line;
    line.exceptions(std::ios::badbit);
    line << "shoal_lending_spare_chunk_bytes{memory=\"" << spare.memory << "\",uid=\"" << spare.uid
         << "\",kept_by=\"" << spare.kept_by << "\"} " << spare.bytes << '\n';
    samples.add(line.str(), left.spares);
  }
}

// One sample per waiting borrow, by its place in line (0 is served next).
void per_waiting(std::ostringstream& out, bounded_samples& samples, const lender_status& s, left_out_counts& left) {
  out << "# HELP shoal_lending_waiting_borrow_bytes Bytes each waiting borrow asks for, by its place in line "
         "(0: served next), borrower and purpose.\n"
      << "# TYPE shoal_lending_waiting_borrow_bytes gauge\n";
  std::size_t place = 0;
  for (const auto& w : s.waiting) {
    std::ostringstream line;
    line.exceptions(std::ios::badbit);
    line << "shoal_lending_waiting_borrow_bytes{place=\"" << place++ << "\",pid=\"" << w.borrower.pid << "\",uid=\""
         << w.uid << "\",purpose=\"" << label(w.purpose) << "\"} " << w.bytes << '\n';
    samples.add(line.str(), left.waiting);
  }
  out << "# HELP shoal_lending_waiting_borrow_waited_seconds How long each waiting borrow has waited, by its place "
         "in line, borrower and purpose.\n"
      << "# TYPE shoal_lending_waiting_borrow_waited_seconds gauge\n";
  place = 0;
  for (const auto& w : s.waiting) {
    std::ostringstream line;
    line.exceptions(std::ios::badbit);
    line << "shoal_lending_waiting_borrow_waited_seconds{place=\"" << place++ << "\",pid=\"" << w.borrower.pid
         << "\",uid=\"" << w.uid << "\",purpose=\"" << label(w.purpose) << "\"} "
         << std::chrono::duration<double>(w.waited).count() << '\n';
    samples.add(line.str(), left.waited);
  }
}

// How many samples were left out, by series, with a comment when any were.
void left_out_trailer(std::ostringstream& out, const left_out_counts& left, std::size_t limit) {
  if (left.regions + left.holds + left.spares + left.waiting + left.waited > 0) {
    out << "# truncated: samples left out to keep this text under " << limit
        << " bytes; the totals above count every region, hold, spare and waiting borrow\n";
  }
  out << "# HELP shoal_lending_samples_left_out Per-region, per-hold and per-spare samples left out of this text "
         "to keep it under its size limit.\n"
      << "# TYPE shoal_lending_samples_left_out gauge\n"
      << "shoal_lending_samples_left_out{series=\"region_bytes\"} " << left.regions << '\n'
      << "shoal_lending_samples_left_out{series=\"region_holds\"} " << left.holds << '\n'
      << "shoal_lending_samples_left_out{series=\"spare_chunk_bytes\"} " << left.spares << '\n'
      << "shoal_lending_samples_left_out{series=\"waiting_borrow_bytes\"} " << left.waiting << '\n'
      << "shoal_lending_samples_left_out{series=\"waiting_borrow_waited_seconds\"} " << left.waited << '\n';
}

}  // namespace

std::string prometheus_text(const lender_status& s, std::size_t max_bytes) {
  std::ostringstream out;
  out.exceptions(std::ios::badbit);  // a failed allocation throws instead of cutting the text short
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
  metric(out, "observers", "gauge", "Observer connections now (metrics and revokes only).", s.observers);
  metric(out, "connections", "gauge", "Connections now: borrowers, observers and those whose hello has not come.",
         s.connections);
  std::uint64_t waiting_bytes = 0;
  for (const auto& w : s.waiting) waiting_bytes += w.bytes;
  metric(out, "waiting_borrows", "gauge", "Borrows waiting for memory to be given back.", s.waiting.size());
  metric(out, "waiting_bytes", "gauge", "Bytes the waiting borrows ask for.", waiting_bytes);
  metric(out, "requests_total", "counter", "Borrow, publish and shared-borrow requests received.", s.requests);
  metric(out, "published_total", "counter", "Regions published.", s.published);
  metric(out, "refusals_total", "counter", "Requests and connections refused.", s.refusals);
  metric(out, "given_back_total", "counter", "Holds given back by their borrowers.", s.given_back);
  metric(out, "reclaimed_total", "counter", "Holds reclaimed from borrowers that died.", s.reclaimed);
  metric(out, "revocations_total", "counter", "Regions asked back.", s.revocations);
  metric(out, "revocations_missed_total", "counter", "Revoked regions not given back by their deadline.",
         s.revocations_missed);
  metric(out, "preemptions_total", "counter", "Regions asked back for a borrow waiting first in line (preemption).",
         s.preemptions);
  metric(out, "chunks_made_total", "counter", "Chunks made (created, mapped, exported), prepared ones included.",
         s.chunks_made);
  metric(out, "reuses_total", "counter", "Regions lent from a spare chunk.", s.reuses);
  metric(out, "prepared_used_total", "counter", "Regions lent from a prepared chunk.", s.prepared_used);
  metric(out, "kept_mappings_used_total", "counter", "Regions lent with no chunk: the borrower's kept mapping used.",
         s.kept_mappings_used);
  metric(out, "forgets_total", "counter", "Forget messages sent for released chunks borrowers kept mapped.",
         s.forgets);
  metric(out, "waits_total", "counter", "Borrows that waited for memory.", s.waits);
  metric(out, "waits_expired_total", "counter", "Waiting borrows refused when their wait ran out.", s.waits_expired);
  metric(out, "closed_for_errors_total", "counter",
         "Connections closed for malformed or stalled input, or for messages they did not read in time.",
         s.connections_closed_for_errors);
  // The totals above are about 3 KiB; the headers of the series below and
  // the trailer are kept room for, so the text never passes max_bytes.
  bounded_samples samples(out, max_bytes > headers_room ? max_bytes - headers_room : 0);
  left_out_counts left;
  per_region(out, samples, s, left);
  per_spare(out, samples, s, left);
  per_waiting(out, samples, s, left);
  left_out_trailer(out, left, max_bytes);
  return out.str();
}

}  // namespace shoal::lending::detail
