#include "alloc/event_pool.h"

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
  }
  return device_.create_event();
}

void event_pool::give_back(backend::event_ref event) noexcept {
  std::lock_guard lock(lock_);
  spare_.push_back(event);
}

}  // namespace shoal::alloc::detail
