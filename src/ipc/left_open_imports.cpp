#include "ipc/left_open_imports.h"

#include <algorithm>

#include "ipc/consumer_state.h"
#include "ipc/context_holdings.h"
#include "shoal/core/error.h"

namespace shoal::ipc::detail {

void left_open_imports::keep(table_remains&& remains) {
  std::lock_guard lock(mutex_);
  remains_.push_back(std::move(remains));
}

void left_open_imports::close_released(context_holdings& held) noexcept {
  std::lock_guard lock(mutex_);
  std::erase_if(remains_, [&](table_remains& r) {
    // No view can be added any more (the table is gone): one at 0 stays so.
    std::erase_if(r.mappings, [&](const std::shared_ptr<mapping>& m) {
      if (mapping_in_use(*m)) return false;
      close_mapping(*r.device, held, *m);
      return true;
    });
    if (!r.mappings.empty()) return false;
    // Every wait that may read these sources was enqueued before a release
    // it holds back, and every release has run.
    for (const auto source : r.sources) {
      try {
        r.device->close_event_source(source);
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): closed or not, it is no longer counted
      }
    }
    give_back(held.resources, r.sources.size());
    return true;
  });
}

left_open_imports::amount left_open_imports::held_for(const process_identity& producer) const {
  amount a;
  std::lock_guard lock(mutex_);
  for (const auto& r : remains_) {
    if (r.producer != producer) continue;
    for (const auto& m : r.mappings) {
      a.segments += m->segment_ids.size();
      a.bytes += m->mapped_bytes;
    }
  }
  return a;
}

}  // namespace shoal::ipc::detail
