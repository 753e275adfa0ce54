#include "shoal/backend/device.h"

#include <atomic>

#include "shoal/core/error.h"

namespace shoal::backend {

namespace {
std::atomic<std::uint64_t> next_device_serial{1};
}

device::device() : serial_(next_device_serial.fetch_add(1, std::memory_order_relaxed)) {}

void device::synchronize_device() {
  throw backend_error("synchronize_device",
                      "device '" + name() +
                          "' does not implement a device-wide wait (its backend::device implementation does not "
                          "override synchronize_device); what needs one, such as a forced clear of a private pool "
                          "(live_blocks::invalidate), is refused and changes nothing: free the blocks instead, or "
                          "implement synchronize_device");
}

}  // namespace shoal::backend
