// Finding devices.
//
// Device objects returned here live for the whole process; the functions are
// thread-safe. A CUDA device that does not exist (no driver, no GPU, ordinal
// out of range, or a build without CUDA) gives shoal::device_unavailable with
// the reason, and the host device is the default then.
#pragma once

#include <string>

#include "shoal/backend/device.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

/// The process-wide host device (host memory, executor-thread streams).
[[nodiscard]] device& host_device_instance();

/// Number of usable CUDA devices; 0 when there is no driver or no GPU.
[[nodiscard]] int cuda_device_count() noexcept;

/// Why CUDA is unusable here, or an empty string when a device exists.
[[nodiscard]] std::string cuda_unavailable_reason();

/// The process-wide object for CUDA device `ordinal`.
/// Throws shoal::device_unavailable when there is none.
[[nodiscard]] device& cuda_device_instance(int ordinal = 0);

/// CUDA device 0 when one exists, else the host device. Setting the
/// environment variable SHOAL_BACKEND to "host" or "cuda" forces the choice
/// ("cuda" then throws device_unavailable where there is none).
[[nodiscard]] device& default_device();

}  // namespace shoal::backend

#pragma GCC visibility pop
