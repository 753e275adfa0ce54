#include "shoal/backend/devices.h"

#include <array>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string_view>

#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"

#ifdef SHOAL_HAS_CUDA
#include "backend/cuda/cuda_device.h"
#endif

namespace shoal::backend {

device& host_device_instance() {
  // Never destroyed: streams may still be referenced from other statics'
  // destructors at exit.
  static auto* instance = new host_device();
  return *instance;
}

#ifdef SHOAL_HAS_CUDA

int cuda_device_count() noexcept { return detail::cuda_device_count_impl(); }

std::string cuda_unavailable_reason() { return detail::cuda_unavailable_reason_impl(); }

device& cuda_device_instance(int ordinal) {
  constexpr int max_devices = 64;
  static std::array<std::unique_ptr<device>, max_devices>* devices = new std::array<std::unique_ptr<device>, max_devices>();
  static std::mutex mutex;
  if (ordinal < 0 || ordinal >= max_devices) {
    throw device_unavailable("no CUDA device " + std::to_string(ordinal) + ": ordinals run from 0 to " +
                             std::to_string(max_devices - 1));
  }
  std::lock_guard lock(mutex);
  auto& slot = (*devices)[static_cast<std::size_t>(ordinal)];
  if (!slot) slot = detail::make_cuda_device(ordinal);
  return *slot;
}

#else

int cuda_device_count() noexcept { return 0; }

std::string cuda_unavailable_reason() { return "this build of shoal has no CUDA backend (no CUDA toolkit at build time)"; }

device& cuda_device_instance(int ordinal) {
  throw device_unavailable("no CUDA device " + std::to_string(ordinal) + ": " + cuda_unavailable_reason());
}

#endif

device& default_device() {
  const char* forced = std::getenv("SHOAL_BACKEND");
  const std::string_view choice = forced != nullptr ? forced : "";
  if (choice == "host") return host_device_instance();
  if (choice == "cuda") return cuda_device_instance(0);
  if (!choice.empty()) {
    throw invalid_argument("SHOAL_BACKEND is '" + std::string(choice) + "': set it to 'host', 'cuda', or leave it unset");
  }
  return cuda_device_count() > 0 ? cuda_device_instance(0) : host_device_instance();
}

}  // namespace shoal::backend
