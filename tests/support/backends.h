// Typed-test plumbing: one fixture type per backend, so every contract test
// runs on both. CUDA instances skip, saying why, where no device exists.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/backend/devices.h"

namespace shoal::testing {

struct host_backend {
  static constexpr const char* name = "host";
  static backend::device& get() { return backend::host_device_instance(); }
  static std::string unavailable_reason() { return {}; }
};

struct cuda_backend {
  static constexpr const char* name = "cuda";
  static backend::device& get() { return backend::cuda_device_instance(0); }
  static std::string unavailable_reason() { return backend::cuda_unavailable_reason(); }
};

using backend_types = ::testing::Types<host_backend, cuda_backend>;

struct backend_names {
  template <class T>
  static std::string GetName(int) {
    return T::name;
  }
};

/// Base fixture: `device()` is the backend's device; CUDA skips when absent.
template <class Backend>
class backend_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string reason = Backend::unavailable_reason(); !reason.empty()) {
      GTEST_SKIP() << "no " << Backend::name << " device: " << reason;
    }
    device_ = &Backend::get();
  }

 public:
  backend::device& device() { return *device_; }

  /// The bytes at device address `src`, copied out on `stream`.
  std::vector<std::uint8_t> read(const void* src, std::size_t bytes, backend::stream_ref stream = {}) {
    std::vector<std::uint8_t> out(bytes);
    device().copy(stream, out.data(), src, bytes);
    device().synchronize(stream);
    return out;
  }

 private:
  backend::device* device_ = nullptr;
};

/// True when every byte of `bytes` equals `value`.
inline bool all_equal(const std::vector<std::uint8_t>& bytes, std::uint8_t value) {
  for (auto b : bytes) {
    if (b != value) return false;
  }
  return !bytes.empty();
}

}  // namespace shoal::testing
