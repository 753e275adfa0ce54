#include "ipc/context_holdings.h"

#include <cstdio>
#include <cstdlib>

#include "core/library_checks.h"

namespace shoal::ipc::detail {

bool holdings_checked() noexcept { return shoal::detail::library_checks_on; }

void gave_back_more_than_reserved(std::size_t reserved, std::size_t given_back) noexcept {
  if (!holdings_checked()) return;
  std::fprintf(stderr,
               "shoal: a sharing context gave back more than it had reserved of a context-wide limit "
               "(%zu reserved, %zu given back)\n",
               reserved, given_back);
  std::abort();
}

}  // namespace shoal::ipc::detail
