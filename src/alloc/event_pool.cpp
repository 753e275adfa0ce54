#include "alloc/event_pool.h"

#include <algorithm>
#include <mutex>

#include "shoal/core/error.h"

namespace shoal::alloc::detail {

event_pool::~event_pool() {
  for (auto e : spare_) {
    try {
      device_.destroy_event(e);
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
    }
  }
}

backend::event_ref event_pool::take() {
  {
    std::lock_guard lock(lock_);
    if (!spare_.empty()) {
      const auto e = spare_.back();
      spare_.pop_back();
      return e;
    }
    // Room to take back every event made, this one included, before it is
    // made: std::bad_alloc here changes nothing.
    if (spare_.capacity() < made_ + 1) spare_.reserve(std::max(made_ + 1, 2 * spare_.capacity()));
    ++made_;
  }
  try {
    return device_.create_event();
  } catch (...) {
    std::lock_guard lock(lock_);
    --made_;
    throw;
  }
}

void event_pool::give_back(backend::event_ref event) noexcept {
  std::lock_guard lock(lock_);
  spare_.push_back(event);  // within the room take made: no allocation
}

}  // namespace shoal::alloc::detail
