#include "lending/metrics.h"

#include <sstream>

namespace shoal::lending::detail {

namespace {

void metric(std::ostringstream& out, const char* name, const char* type, const char* help, std::uint64_t value) {
  out << "# HELP shoal_lending_" << name << ' ' << help << '\n'
      << "# TYPE shoal_lending_" << name << ' ' << type << '\n'
      << "shoal_lending_" << name << ' ' << value << '\n';
}

}  // namespace

std::string prometheus_text(const lender_status& s) {
  std::ostringstream out;
  std::uint64_t orphaned = 0;
  for (const auto& r : s.regions) orphaned += r.state == region_state::orphaned ? 1 : 0;
  metric(out, "capacity_bytes", "gauge", "Bytes the lender may lend at once.", s.capacity_bytes);
  metric(out, "lent_bytes", "gauge", "Bytes lent now (regions lent or orphaned).", s.lent_bytes);
  metric(out, "free_bytes", "gauge", "Bytes of the capacity not lent.", s.capacity_bytes - s.lent_bytes);
  metric(out, "regions", "gauge", "Regions lent or orphaned now.", s.regions.size());
  metric(out, "orphaned_regions", "gauge", "Regions whose borrower hung up but still runs.", orphaned);
  metric(out, "borrowers", "gauge", "Borrowers connected now.", s.borrowers);
  metric(out, "requests_total", "counter", "Borrow requests received.", s.requests);
  metric(out, "refusals_total", "counter", "Requests and connections refused.", s.refusals);
  metric(out, "given_back_total", "counter", "Regions given back by their borrowers.", s.given_back);
  metric(out, "reclaimed_total", "counter", "Regions reclaimed from borrowers that died or hung up.", s.reclaimed);
  metric(out, "revocations_total", "counter", "Regions asked back.", s.revocations);
  metric(out, "revocations_missed_total", "counter", "Revoked regions not given back by their deadline.",
         s.revocations_missed);
  metric(out, "closed_for_errors_total", "counter", "Connections closed for malformed or stalled input.",
         s.connections_closed_for_errors);
  return out.str();
}

}  // namespace shoal::lending::detail
