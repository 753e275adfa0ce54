// A CUDA device's calls leave the calling thread's current device as they
// found it: PyTorch, for one, reads `device="cuda"` as that device. A thread
// that had none is handed none, but device 0's primary context (the one its
// first runtime call would make current). Observed through the driver's own
// cuCtxGetCurrent, opened with dlopen (the tests never link libcuda).
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
  int (*ctx_create)(void**, unsigned, int) = nullptr;
  int (*ctx_destroy)(void*) = nullptr;

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
    find(d.ctx_create, "cuCtxCreate_v2");
    find(d.ctx_destroy, "cuCtxDestroy_v2");
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

// The primary context of `ordinal`, retained for the test's life.
void* primary_context(int ordinal) {
  int device = 0;
  void* context = nullptr;
  EXPECT_EQ(driver().device_get(&device, ordinal), 0);
  EXPECT_EQ(driver().primary_ctx_retain(&context, device), 0);
  return context;
}

TEST(cuda_current_device, a_thread_with_no_context_is_left_with_device_0s_primary_context) {
  if (backend::cuda_device_count() == 0 || !driver().loaded()) GTEST_SKIP() << "no CUDA device";
  backend::device& device = backend::cuda_device_instance(0);
  void* before = reinterpret_cast<void*>(1);
  void* after = nullptr;
  std::thread fresh([&] {
    before = current_context();
    use(device);
    after = current_context();
  });
  fresh.join();
  EXPECT_EQ(before, nullptr) << "a new thread starts with no current context";
  EXPECT_EQ(after, primary_context(0)) << "not the context the thread's first runtime call would make current";
}

TEST(cuda_current_device, a_programs_own_context_stays_current) {
  if (backend::cuda_device_count() == 0 || !driver().loaded() || driver().ctx_create == nullptr) {
    GTEST_SKIP() << "no CUDA device";
  }
  backend::device& device = backend::cuda_device_instance(0);
  std::thread caller([&] {
    int ordinal_0 = 0;
    ASSERT_EQ(driver().device_get(&ordinal_0, 0), 0);
    void* own = nullptr;
    ASSERT_EQ(driver().ctx_create(&own, 0, ordinal_0), 0);  // current from here on
    use(device);
    EXPECT_EQ(current_context(), own) << "device 0's calls left their context current over the program's own";
    (void)driver().ctx_destroy(own);
  });
  caller.join();
}

TEST(cuda_current_device, a_thread_with_no_context_is_left_with_none_by_another_device) {
  if (backend::cuda_device_count() < 2 || !driver().loaded()) GTEST_SKIP() << "needs two CUDA devices";
  backend::device& second = backend::cuda_device_instance(1);
  void* after = reinterpret_cast<void*>(1);
  std::thread fresh([&] {
    use(second);
    after = current_context();
  });
  fresh.join();
  EXPECT_EQ(after, nullptr) << "device 1's calls left their context current: the thread's runtime device moved";
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
