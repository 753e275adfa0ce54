#include "shoal/core/error.h"

#include <cstring>

namespace shoal {

backend_error::backend_error(std::string call, std::string detail)
    : error(call + " failed: " + detail), call_(std::move(call)), detail_(std::move(detail)) {}

os_error::os_error(int code, std::string call) : os_error(code, std::move(call), std::strerror(code)) {}

os_error::os_error(int code, std::string call, std::string detail)
    : backend_error(std::move(call), std::move(detail)), code_(code) {}

}  // namespace shoal
