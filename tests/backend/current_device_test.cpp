// A CUDA device's calls leave the calling thread's current device as they
// found it: PyTorch, for one, reads `device="cuda"` as that device, and a
// thread that had none must not be handed one. Observed through the driver's
// own cuCtxGetCurrent, opened with dlopen (the tests never link libcuda).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <thread>
#include <type_traits>

#include "shoal/backend/devices.h"

namespace shoal::testing {
namespace {

// The few driver calls the tests need, by their C signatures (CUresult is an
// int, CUcontext and CUdevice a pointer and an int).
struct driver_calls {
  int (*init)(unsigned) = nullptr;
  int (*ctx_get_current)(void**) = nullptr;
  int (*ctx_set_current)(void*) = nullptr;
  int (*device_get)(int*, int) = nullptr;
  int (*primary_ctx_retain)(void**, int) = nullptr;
  int (*primary_ctx_release)(int) = nullptr;

  [[nodiscard]] bool loaded() const { return init != nullptr; }
};

const driver_calls& driver() {
  static const driver_calls calls = [] {
    driver_calls d;
    void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return d;
    const auto find = [library](auto& function, const char* name) {
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(::dlsym(library, name));
    };
    find(d.ctx_get_current, "cuCtxGetCurrent");
    find(d.ctx_set_current, "cuCtxSetCurrent");
    find(d.device_get, "cuDeviceGet");
    find(d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");  // no _v2 of this one
    find(d.primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
    find(d.init, "cuInit");
    if (d.init == nullptr || d.init(0) != 0) d.init = nullptr;
    return d;
  }();
  return calls;
}

void* current_context() {
  void* context = nullptr;
  EXPECT_EQ(driver().ctx_get_current(&context), 0);
  return context;
}

// Every kind of call the device makes: memory, streams, events.
void use(backend::device& device) {
  void* segment = device.allocate_segment(std::size_t{1} << 20);
  const backend::stream_ref stream = device.create_stream();
  device.fill(stream, segment, 0x5a, std::size_t{1} << 20);
  const backend::event_ref event = device.create_event();
  device.record(event, stream);
  device.synchronize_event(event);
  (void)device.query(stream);
  device.destroy_event(event);
  device.destroy_stream(stream);
  device.free_segment(segment);
  (void)device.memory();
}

TEST(cuda_current_device, a_thread_with_no_context_is_left_with_none) {
  if (backend::cuda_device_count() == 0 || !driver().loaded()) GTEST_SKIP() << "no CUDA device";
  backend::device& device = backend::cuda_device_instance(0);
  void* before = reinterpret_cast<void*>(1);
  void* after = reinterpret_cast<void*>(1);
  std::thread fresh([&] {
    before = current_context();
    use(device);
    after = current_context();
  });
  fresh.join();
  EXPECT_EQ(before, nullptr) << "a new thread starts with no current context";
  EXPECT_EQ(after, nullptr) << "the device's calls left their context current on the caller's thread";
}

TEST(cuda_current_device, another_device_current_stays_current) {
  if (backend::cuda_device_count() < 2 || !driver().loaded()) GTEST_SKIP() << "needs two CUDA devices";
  backend::device& first = backend::cuda_device_instance(0);
  backend::device& second = backend::cuda_device_instance(1);
  std::thread caller([&] {
    int devices[2] = {};
    void* contexts[2] = {};
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(driver().device_get(&devices[i], i), 0);
      ASSERT_EQ(driver().primary_ctx_retain(&contexts[i], devices[i]), 0);
    }
    ASSERT_EQ(driver().ctx_set_current(contexts[1]), 0);
    use(first);
    EXPECT_EQ(current_context(), contexts[1]) << "device 0's calls changed the caller's current device 1";
    ASSERT_EQ(driver().ctx_set_current(contexts[0]), 0);
    use(second);
    EXPECT_EQ(current_context(), contexts[0]) << "device 1's calls changed the caller's current device 0";
    use(first);  // its own device current: used as it is
    EXPECT_EQ(current_context(), contexts[0]);
    (void)driver().ctx_set_current(nullptr);
    for (int i = 0; i < 2; ++i) (void)driver().primary_ctx_release(devices[i]);
  });
  caller.join();
}

}  // namespace
}  // namespace shoal::testing
