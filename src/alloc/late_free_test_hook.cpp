#include "shoal/alloc/late_free_test_hook.h"

#include <utility>

#include "alloc/allocator_core.h"

namespace shoal::alloc {

namespace {

std::function<void(test_hook::late_free_step)>& late_free_hook() {
  static std::function<void(test_hook::late_free_step)> hook;
  return hook;
}

}  // namespace

void test_hook::set_late_free_hook(std::function<void(late_free_step)> hook) { late_free_hook() = std::move(hook); }

void detail::run_late_free_hook(test_hook::late_free_step step) {
  if (const auto& hook = late_free_hook()) hook(step);
}

}  // namespace shoal::alloc
