#include "shoal/backend/device.h"

#include <atomic>

namespace shoal::backend {

namespace {
std::atomic<std::uint64_t> next_device_serial{1};
}

device::device() : serial_(next_device_serial.fetch_add(1, std::memory_order_relaxed)) {}

}  // namespace shoal::backend
