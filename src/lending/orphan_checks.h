// Which processes a pass of the lender's reclaim looks up in /proc: a process
// that hung up while it runs keeps its orphaned holds until it exits, and
// each pass asks whether it has. Many live processes with orphaned holds
// (an admitted uid's sleeping children, each having borrowed and hung up)
// must not make each pass, on the serving thread, as long as their count:
// a pass looks up at most `per_pass` of them, the next ones in (pid, start
// time) order after the last pass's last, wrapping around. So every process
// is looked up within ceil(n / per_pass) passes (one more when new ones come
// ahead of it meanwhile), once a pass at most.
//
// Thread-safety: none; the lender's serving thread alone uses it.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "shoal/core/process_identity.h"

namespace shoal::lending::detail {

class orphan_checks {
 public:
  /// per_pass > 0.
  explicit orphan_checks(std::size_t per_pass) noexcept : per_pass_(per_pass) {}

  /// The processes to look up this pass, out of `holders` (the processes of
  /// every orphaned hold now, in any order, repeats allowed; sorted and
  /// made unique in place). May throw std::bad_alloc.
  [[nodiscard]] std::vector<process_identity> next(std::vector<process_identity>& holders);

 private:
  std::size_t per_pass_;
  std::optional<process_identity> last_;  // the last one the previous pass looked up
};

/// For tests of the lender only (never use it elsewhere): runs `hook` in
/// every later reclaim pass of every lender that has processes to look up,
/// on its serving thread, outside its locks, with the processes the pass
/// chose, before it looks them up — so that a test sees how many a pass
/// looks up, and can make each lookup as slow as /proc on a loaded machine.
/// An empty function clears it. Thread-safety: set it while no lender serves.
void set_before_orphan_lookups(std::function<void(std::span<const process_identity>)> hook);

/// What set_before_orphan_lookups set (the lender calls it, when not empty).
[[nodiscard]] const std::function<void(std::span<const process_identity>)>& before_orphan_lookups() noexcept;

}  // namespace shoal::lending::detail
