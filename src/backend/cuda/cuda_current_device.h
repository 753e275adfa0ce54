// Which CUDA device the calling thread talks to, and how a device is named in
// error messages. Shared by every part of the CUDA backend.
//
// Thread-safety: both functions may be called from any thread; make_current
// keeps one record per thread.
#pragma once

#include <string>

namespace shoal::backend::detail {

/// Makes device `ordinal` current on the calling thread (cudaSetDevice), once
/// per thread and again whenever the thread's current device changed.
/// Throws shoal::backend_error when cudaSetDevice fails.
void make_current(int ordinal);

/// "cuda device <ordinal>", as error messages name a device.
[[nodiscard]] std::string cuda_label(int ordinal);

}  // namespace shoal::backend::detail
