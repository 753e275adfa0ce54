// The allocators shoal is compared with, behind the common adapter face, all
// on CUDA device 0:
//   torch_adapter        PyTorch's caching allocator, called from C++
//                        (raw_alloc_with_stream / raw_delete), with its
//                        defaults or with expandable segments; needs
//                        libtorch and SHOAL_BENCH_WITH_TORCH.
//   cuda_async_adapter   cudaMallocAsync / cudaFreeAsync on the device's
//                        current memory pool, made retaining (release
//                        threshold UINT64_MAX), as the anchors measure it.
//   cuda_malloc_adapter  plain cudaMalloc / cudaFree.
//   rmm_pool_adapter, rmm_arena_adapter
//                        RMM's pool_memory_resource and arena_memory_resource
//                        over cuda_memory_resource; need RMM and
//                        SHOAL_BENCH_WITH_RMM.
// Streams are CUDA streams made with cudaStreamCreateWithFlags(non-blocking),
// like the anchors' threads use; the adapter destroys those left at its end.
// Reserved bytes are what the allocator holds from the driver: PyTorch's
// reserved_bytes statistic, the pool's reserved-memory attributes, what
// cudaMalloc handed out and is not freed, and what RMM's resource took from
// its upstream (counted by a statistics_resource_adaptor under it).
//
// Thread-safety: allocate and deallocate may be called from any thread at
// once (each allocator here is thread-safe); everything else from one thread
// at a time, while no other call is running. Errors throw std::runtime_error.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench/common/allocator_adapter.h"

#ifdef SHOAL_BENCH_WITH_TORCH
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#if __has_include(<c10/core/AllocatorConfig.h>)
#include <c10/core/AllocatorConfig.h>
#endif
#endif

#ifdef SHOAL_BENCH_WITH_RMM
#include <optional>
#include <rmm/aligned.hpp>
#include <rmm/mr/arena_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>
#endif

namespace shoal::bench {

namespace detail {

inline void check_cuda(cudaError_t result, const char* what) {
  if (result != cudaSuccess) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(result));
}

/// The stream half of the face, shared by every CUDA-stream adapter.
class cuda_stream_adapter : public allocator_adapter {
 public:
  cuda_stream_adapter() = default;
  cuda_stream_adapter(const cuda_stream_adapter&) = delete;
  cuda_stream_adapter& operator=(const cuda_stream_adapter&) = delete;
  ~cuda_stream_adapter() override {
    for (cudaStream_t stream : streams_) cudaStreamDestroy(stream);
  }

  [[nodiscard]] void* create_stream() override {
    cudaStream_t stream = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    streams_.push_back(stream);
    return stream;
  }

  void destroy_stream(void* stream) override {
    std::erase(streams_, static_cast<cudaStream_t>(stream));
    check_cuda(cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "cudaStreamDestroy");
  }

  void synchronize() override {
    for (cudaStream_t stream : streams_) check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

 private:
  std::vector<cudaStream_t> streams_;
};

/// Current and peak of a byte count changed from many threads.
class byte_gauge {
 public:
  void add(std::size_t bytes) noexcept {
    const std::size_t now = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::size_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void remove(std::size_t bytes) noexcept { current_.fetch_sub(bytes, std::memory_order_relaxed); }
  [[nodiscard]] std::size_t current() const noexcept { return current_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> current_{0};
  std::atomic<std::size_t> peak_{0};
};

}  // namespace detail

#ifdef SHOAL_BENCH_WITH_TORCH
/// PyTorch's allocator is one per process: the adapter sets its
/// expandable_segments setting (PYTORCH_CUDA_ALLOC_CONF's, applied to the
/// segments made from then on), empties its cache and resets its peak when
/// made, and empties the cache again at its end. Make one at a time.
class torch_adapter final : public detail::cuda_stream_adapter {
 public:
  explicit torch_adapter(bool expandable_segments = false) : expandable_(expandable_segments) {
    // What any PyTorch program does first: initializes CUDA and the allocator.
    (void)at::empty({1}, at::TensorOptions().device(at::kCUDA));
    c10::cuda::CUDACachingAllocator::emptyCache();
    set_expandable_segments(expandable_);
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_index);
  }
  ~torch_adapter() override {
    cudaDeviceSynchronize();
    try {
      c10::cuda::CUDACachingAllocator::emptyCache();
      if (expandable_) set_expandable_segments(false);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "torch_adapter: %s\n", e.what());
    }
  }

  // PyTorch's expandable segments keep the stream they grew on and
  // synchronize it when they unmap: the cache is emptied while it lives.
  void destroy_stream(void* stream) override {
    detail::check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
    c10::cuda::CUDACachingAllocator::emptyCache();
    cuda_stream_adapter::destroy_stream(stream);
  }

  [[nodiscard]] std::string name() const override { return expandable_ ? "torch expandable" : "torch"; }
  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
  }
  void deallocate(void* ptr, std::size_t, void*) override { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
  [[nodiscard]] std::size_t reserved_bytes() const override { return static_cast<std::size_t>(reserved().current); }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override { return static_cast<std::size_t>(reserved().peak); }

 private:
  static constexpr c10::DeviceIndex device_index = 0;
  static void set_expandable_segments(bool on) {
    const std::string setting = on ? "expandable_segments:True" : "expandable_segments:False";
#if __has_include(<c10/core/AllocatorConfig.h>)
    c10::CachingAllocator::setAllocatorSettings(setting);
#else
    c10::cuda::CUDACachingAllocator::setAllocatorSettings(setting);
#endif
    // Where the setting does not reach the CUDA allocator (PyTorch has moved
    // it between classes), the column would silently be the defaults again:
    // a probe block's segment says which kind PyTorch made.
    void* probe = c10::cuda::CUDACachingAllocator::raw_alloc(std::size_t{1} << 20);
    bool took = false;
    for (const auto& segment : c10::cuda::CUDACachingAllocator::snapshot().segments) {
      took = took || segment.is_expandable == on;
    }
    c10::cuda::CUDACachingAllocator::raw_delete(probe);
    c10::cuda::CUDACachingAllocator::emptyCache();
    if (!took) throw std::runtime_error("torch_adapter: PyTorch did not take " + setting);
  }
  static c10::CachingAllocator::Stat reserved() {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_index)
        .reserved_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  }
  bool expandable_;
};
#endif

/// The pool is the device's, shared with every other cudaMallocAsync user
/// in the process: the adapter trims it and resets its high-water mark when
/// made, and trims it again at its end. Make one at a time.
class cuda_async_adapter final : public detail::cuda_stream_adapter {
 public:
  cuda_async_adapter() {
    detail::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    detail::check_cuda(cudaDeviceGetMemPool(&pool_, 0), "cudaDeviceGetMemPool");
    std::uint64_t retain_all = UINT64_MAX;
    detail::check_cuda(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &retain_all),
                       "cudaMemPoolSetAttribute(release threshold)");
    detail::check_cuda(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
    std::uint64_t zero = 0;  // the only value the high-water mark can be set to
    detail::check_cuda(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero),
                       "cudaMemPoolSetAttribute(reserved high)");
  }
  ~cuda_async_adapter() override {
    cudaDeviceSynchronize();
    cudaMemPoolTrimTo(pool_, 0);
  }

  [[nodiscard]] std::string name() const override { return "cudaMallocAsync"; }
  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) override {
    void* ptr = nullptr;
    detail::check_cuda(cudaMallocAsync(&ptr, bytes, static_cast<cudaStream_t>(stream)), "cudaMallocAsync");
    return ptr;
  }
  void deallocate(void* ptr, std::size_t, void* stream) override {
    detail::check_cuda(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
  }
  [[nodiscard]] std::size_t reserved_bytes() const override { return attribute(cudaMemPoolAttrReservedMemCurrent); }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override { return attribute(cudaMemPoolAttrReservedMemHigh); }

 private:
  [[nodiscard]] std::size_t attribute(cudaMemPoolAttr which) const {
    std::uint64_t value = 0;
    detail::check_cuda(cudaMemPoolGetAttribute(pool_, which, &value), "cudaMemPoolGetAttribute");
    return static_cast<std::size_t>(value);
  }
  cudaMemPool_t pool_ = nullptr;
};

/// No caching at all: every pair goes to the driver (and synchronizes the device).
class cuda_malloc_adapter final : public detail::cuda_stream_adapter {
 public:
  [[nodiscard]] std::string name() const override { return "cudaMalloc"; }
  [[nodiscard]] void* allocate(std::size_t bytes, void*) override {
    void* ptr = nullptr;
    detail::check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc");
    held_.add(bytes);
    return ptr;
  }
  void deallocate(void* ptr, std::size_t bytes, void*) override {
    detail::check_cuda(cudaFree(ptr), "cudaFree");
    held_.remove(bytes);
  }
  [[nodiscard]] std::size_t reserved_bytes() const override { return held_.current(); }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override { return held_.peak(); }

 private:
  detail::byte_gauge held_;
};

#ifdef SHOAL_BENCH_WITH_RMM
namespace detail {

/// An RMM resource over a counted cuda_memory_resource. `make` builds the
/// resource from the (shared) counting upstream.
template <class Resource>
class rmm_adapter : public cuda_stream_adapter {
 public:
  template <class Make>
  rmm_adapter(std::string name, Make make)
      : name_(std::move(name)), upstream_(rmm::mr::cuda_memory_resource{}), resource_(make(upstream_)) {}
  ~rmm_adapter() override { cudaDeviceSynchronize(); }

  [[nodiscard]] std::string name() const override { return name_; }
  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) override {
    return resource_.allocate(cuda::stream_ref{static_cast<cudaStream_t>(stream)}, bytes,
                              rmm::CUDA_ALLOCATION_ALIGNMENT);
  }
  void deallocate(void* ptr, std::size_t bytes, void* stream) override {
    resource_.deallocate(cuda::stream_ref{static_cast<cudaStream_t>(stream)}, ptr, bytes,
                         rmm::CUDA_ALLOCATION_ALIGNMENT);
  }
  [[nodiscard]] std::size_t reserved_bytes() const override {
    return static_cast<std::size_t>(upstream_.get_bytes_counter().value);
  }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override {
    return static_cast<std::size_t>(upstream_.get_bytes_counter().peak);
  }

 private:
  std::string name_;
  // Copies of an RMM resource share one state, so this one counts what the
  // resource below takes.
  rmm::mr::statistics_resource_adaptor upstream_;
  Resource resource_;
};

}  // namespace detail

/// RMM's coalescing best-fit pool; it starts empty (initial size 0 unless
/// given) and grows from cudaMalloc as needed.
class rmm_pool_adapter final : public detail::rmm_adapter<rmm::mr::pool_memory_resource> {
 public:
  explicit rmm_pool_adapter(std::size_t initial_pool_size = 0)
      : rmm_adapter("rmm pool", [&](const rmm::mr::statistics_resource_adaptor& upstream) {
          return rmm::mr::pool_memory_resource(upstream, initial_pool_size);
        }) {}
};

/// RMM's arena: per-stream arenas over one global arena, which it takes at
/// once (its default size unless given).
class rmm_arena_adapter final : public detail::rmm_adapter<rmm::mr::arena_memory_resource> {
 public:
  explicit rmm_arena_adapter(std::optional<std::size_t> arena_size = std::nullopt)
      : rmm_adapter("rmm arena", [&](const rmm::mr::statistics_resource_adaptor& upstream) {
          return rmm::mr::arena_memory_resource(upstream, arena_size);
        }) {}
};
#endif

}  // namespace shoal::bench
