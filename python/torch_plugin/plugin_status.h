// The plugin's one way of turning a status of the C table (torch_api.h)
// into a PyTorch error: out of memory becomes torch.cuda.OutOfMemoryError,
// anything else a RuntimeError, each with shoal's message.
#pragma once

#include <c10/util/Exception.h>

#include <string>

#include "torch_api.h"

namespace shoal_torch {

[[noreturn]] inline void raise(const shoal_torch_api& api, int status, const char* what) {
  const std::string message = std::string("shoal (") + what + "): " + api.last_error();
  if (status == SHOAL_TORCH_OUT_OF_MEMORY) TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  TORCH_CHECK(false, message);
}

inline void check(const shoal_torch_api& api, int status, const char* what) {
  if (status != SHOAL_TORCH_OK) raise(api, status, what);
}

}  // namespace shoal_torch
