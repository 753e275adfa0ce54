#include "shoal/core/error.h"

namespace shoal {

backend_error::backend_error(std::string call, std::string detail)
    : error(call + " failed: " + detail), call_(std::move(call)), detail_(std::move(detail)) {}

}  // namespace shoal
