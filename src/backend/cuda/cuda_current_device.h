// Which CUDA device the calling thread talks to, and how a device is named in
// error messages. Shared by every part of the CUDA backend.
//
// Thread-safety: every function may be called from any thread; a
// device_scope belongs to the thread that made it.
#pragma once

#include <cuda.h>

#include <string>

namespace shoal::backend::detail {

/// Makes device `ordinal` current on the calling thread for the scope's life
/// (its primary context, as cudaSetDevice does), then puts back the context
/// the thread had. A caller's current device is the caller's: PyTorch, for
/// one, takes `device="cuda"` to mean it. A thread that had no context is
/// left with none, except by device 0, whose primary context stays current:
/// the context the runtime gives such a thread at its first call (its
/// runtime device is 0 either way), and no switch on its later calls.
/// Does nothing, and restores nothing, when the device's primary context is
/// current already (another context of the device, a program's own, is put
/// aside: shoal's streams and memory are the primary context's).
/// Throws shoal::backend_error when the device cannot be made current, and
/// invalid_argument for an ordinal past the 64 devices served (devices.h
/// refuses those first).
class device_scope {
 public:
  explicit device_scope(int ordinal);
  ~device_scope();
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

/// "cuda device <ordinal>", as error messages name a device.
[[nodiscard]] std::string cuda_label(int ordinal);

}  // namespace shoal::backend::detail
