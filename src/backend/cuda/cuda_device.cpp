#include "cuda_device.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>

#include "cuda_driver.h"
#include "cuda_kernels.h"
#include "core/address_text.h"
#include "core/process_wide_id.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

struct cuda_task_failures {
  std::mutex mutex;
  std::unordered_map<cudaStream_t, std::string> first;  // stream -> first failure since its last synchronize

  void record(cudaStream_t stream, const char* what) noexcept;
  std::optional<std::string> take(cudaStream_t stream);
  void forget(cudaStream_t stream);
};

namespace {

using range_map = std::map<std::uintptr_t, std::size_t>;

using shoal::detail::hex;

std::string label(int ordinal) { return "cuda device " + std::to_string(ordinal); }

// The range of `ranges` (start -> bytes) that contains `address`, if any.
std::optional<std::pair<std::uintptr_t, std::size_t>> containing(const range_map& ranges, std::uintptr_t address) {
  auto it = ranges.upper_bound(address);
  if (it == ranges.begin()) return std::nullopt;
  --it;
  if (address - it->first >= it->second) return std::nullopt;
  return *it;
}

CUmemAllocationProp chunk_properties(int ordinal) {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = ordinal;
  properties.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return properties;
}

CUmemAccessDesc read_write_access(int ordinal) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

// Maps the chunk `handle` exports at `address` (reserved, not mapped) with
// read-write access for device `ordinal`. On failure nothing stays mapped,
// and `failed` names the call that failed.
CUresult map_imported_chunk(const cuda_driver& d, const shareable_handle& handle, CUdeviceptr address, int ordinal,
                            const char*& failed) {
  CUmemGenericAllocationHandle chunk = 0;
  failed = "cuMemImportFromShareableHandle";
  // The fd is not consumed: the handle keeps owning it.
  CUresult result = d.mem_import_from_shareable_handle(
      &chunk, reinterpret_cast<void*>(static_cast<std::uintptr_t>(handle.fd.get())), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (result != CUDA_SUCCESS) return result;
  failed = "cuMemMap";
  result = d.mem_map(address, handle.size, 0, chunk, 0);
  if (result == CUDA_SUCCESS) {
    failed = "cuMemSetAccess";
    const CUmemAccessDesc access = read_write_access(ordinal);
    result = d.mem_set_access(address, handle.size, &access, 1);
    if (result != CUDA_SUCCESS) d.mem_unmap(address, handle.size);
  }
  d.mem_release(chunk);  // the mapping, if made, keeps the memory
  return result;
}

// Unmaps chunks mapped back to back from `base`; returns the first failure.
CUresult unmap_chunks(const cuda_driver& d, CUdeviceptr base, const std::vector<std::size_t>& sizes) {
  CUresult first = CUDA_SUCCESS;
  for (const std::size_t size : sizes) {
    const CUresult result = d.mem_unmap(base, size);
    if (first == CUDA_SUCCESS) first = result;
    base += size;
  }
  return first;
}

// Errors from device work enqueued earlier (a kernel fault) that surface at
// the next call that waits for it. CUDA makes them sticky.
bool is_work_failure(cudaError_t result) {
  switch (result) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorECCUncorrectable:
    case cudaErrorContained:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

// check() for calls that wait for or poll device work: failures of that work
// become stream_error, anything else backend_error.
void check_work(cudaError_t result, const char* call, int ordinal) {
  if (result == cudaSuccess) return;
  if (is_work_failure(result)) {
    cudaGetLastError();
    throw stream_error(std::string(call) + ": work enqueued earlier on " + label(ordinal) + " failed: " +
                       describe(result) + "; CUDA keeps this error, so the process must restart to use the GPU");
  }
  check(result, call);
}

void size_must_fit(std::size_t bytes, std::size_t granularity, const char* op) {
  if (bytes == 0 || bytes % granularity != 0) {
    throw invalid_argument(std::string("cuda_device::") + op + ": bytes (" + std::to_string(bytes) +
                           ") must be a nonzero multiple of granularity() (" + std::to_string(granularity) + ")");
  }
}

struct host_task_call {
  std::function<void()> task;
  std::shared_ptr<cuda_task_failures> failures;
  cudaStream_t stream;
};

// Runs on a CUDA-owned thread: nothing may escape into the runtime.
void CUDART_CB run_host_task(void* data) noexcept {
  const std::unique_ptr<host_task_call> call(static_cast<host_task_call*>(data));
  try {
    call->task();
  } catch (const std::exception& e) {
    call->failures->record(call->stream, e.what());
  } catch (...) {
    call->failures->record(call->stream, "an exception not derived from std::exception");
  }
}

cudaError_t device_count(int& count) noexcept {
  count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  return result;
}

std::string unavailable_reason(cudaError_t result, int count) {
  if (result == cudaErrorInsufficientDriver) {
    return "cudaGetDeviceCount failed: " + describe(result) +
           "; install an NVIDIA driver of the CUDA 13 generation (580 or newer)";
  }
  if (result == cudaErrorNoDevice) {
    return "cudaGetDeviceCount failed: " + describe(result) +
           "; no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)";
  }
  if (result != cudaSuccess) return "cudaGetDeviceCount failed: " + describe(result);
  return count == 0 ? "the CUDA driver reports no devices" : "";
}

}  // namespace

void cuda_task_failures::record(cudaStream_t stream, const char* what) noexcept {
  try {
    std::lock_guard lock(mutex);
    first.try_emplace(stream, "a host task on " + (stream == nullptr ? "the default stream" : "stream " + hex(stream)) +
                                  " threw: " + what);
  } catch (...) {
    // Out of memory while recording: the failure is lost rather than thrown
    // into the CUDA runtime.
  }
}

std::optional<std::string> cuda_task_failures::take(cudaStream_t stream) {
  std::lock_guard lock(mutex);
  const auto it = first.find(stream);
  if (it == first.end()) return std::nullopt;
  std::string message = std::move(it->second);
  first.erase(it);
  return message;
}

void cuda_task_failures::forget(cudaStream_t stream) {
  std::lock_guard lock(mutex);
  first.erase(stream);
}

// ---- lifetime ----------------------------------------------------------------

cuda_device::cuda_device(int ordinal) : ordinal_(ordinal), task_failures_(std::make_shared<cuda_task_failures>()) {
  make_current();
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, ordinal_), "cudaGetDeviceProperties");
  name_ = properties.name;
  const CUmemAllocationProp chunk = chunk_properties(ordinal_);
  check(driver().mem_get_allocation_granularity(&granularity_, &chunk, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
}

cuda_device::~cuda_device() {
  // Errors are ignored: at process exit the runtime may already be gone.
  // The driver table was loaded by the constructor, so driver() cannot throw.
  cudaSetDevice(ordinal_);
  const cuda_driver& d = driver();
  for (const auto& [ptr, import] : imports_) {
    if (import.kind == handle_kind::cuda_ipc) {
      cudaIpcCloseMemHandle(reinterpret_cast<void*>(import.base));
    } else {
      unmap_chunks(d, import.base, import.chunk_sizes);
      d.mem_address_free(import.base, import.size);
    }
  }
  for (cudaStream_t stream : streams_) cudaStreamDestroy(stream);
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
  for (const auto& [id, exported] : exported_events_) cudaEventDestroy(exported.event);
  for (const auto& [event, id] : imported_events_) cudaEventDestroy(event);
  for (const auto& [address, size] : mappings_) d.mem_unmap(address, size);
  for (const auto& [chunk, size] : chunks_) d.mem_release(chunk);
  for (const auto& [base, size] : reservations_) d.mem_address_free(base, size);
  for (const auto& [base, size] : segments_) cudaFree(reinterpret_cast<void*>(base));
  cudaGetLastError();
}

void cuda_device::make_current() const {
  // cudaGetDevice reports 0 on a thread that never chose a device, without
  // making a context current there; the driver calls need one. So each
  // thread sets the device once, and again when it finds it changed.
  thread_local int set_on_this_thread = -1;
  int current = -1;
  if (set_on_this_thread == ordinal_ && cudaGetDevice(&current) == cudaSuccess && current == ordinal_) return;
  check(cudaSetDevice(ordinal_), "cudaSetDevice");
  set_on_this_thread = ordinal_;
}

// ---- plain segments ------------------------------------------------------------

memory_info cuda_device::memory() const {
  make_current();
  memory_info info;
  check(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
  return info;
}

void* cuda_device::allocate_segment(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("cuda_device::allocate_segment: bytes must be > 0");
  make_current();
  void* base = nullptr;
  check(cudaMalloc(&base, bytes), "cudaMalloc", bytes);
  std::lock_guard lock(memory_mutex_);
  segments_.emplace(reinterpret_cast<std::uintptr_t>(base), bytes);
  return base;
}

void cuda_device::free_segment(void* base) {
  make_current();
  {
    std::lock_guard lock(memory_mutex_);
    if (segments_.erase(reinterpret_cast<std::uintptr_t>(base)) == 0) {
      throw invalid_argument("cuda_device::free_segment: pointer " + hex(base) + " was not allocated by " +
                             label(ordinal_) + " or was already freed");
    }
  }
  check(cudaFree(base), "cudaFree");
}

// ---- growable ranges -------------------------------------------------------------

void* cuda_device::reserve_range(std::size_t bytes) {
  size_must_fit(bytes, granularity_, "reserve_range");
  make_current();
  CUdeviceptr base = 0;
  check(driver().mem_address_reserve(&base, bytes, granularity_, 0, 0), "cuMemAddressReserve", bytes);
  std::lock_guard lock(memory_mutex_);
  reservations_.emplace(base, bytes);
  return reinterpret_cast<void*>(base);
}

void cuda_device::release_range(void* base) {
  make_current();
  const auto start = reinterpret_cast<std::uintptr_t>(base);
  std::size_t size = 0;
  {
    std::lock_guard lock(memory_mutex_);
    const auto range = reservations_.find(start);
    if (range == reservations_.end()) {
      throw invalid_argument("cuda_device::release_range: " + hex(base) + " is not the base of a reservation of " +
                             label(ordinal_) + " (never reserved, or already released)");
    }
    size = range->second;
    const auto first = mappings_.lower_bound(start);
    const auto count = std::distance(first, mappings_.lower_bound(start + size));
    if (count != 0) {
      throw invalid_argument("cuda_device::release_range: the reservation at " + hex(base) + " still has " +
                             std::to_string(count) + " mapped chunk(s), the first at " + hex(first->first) +
                             "; unmap them first");
    }
    reservations_.erase(range);
  }
  check(driver().mem_address_free(start, size), "cuMemAddressFree");
}

physical_ref cuda_device::create_physical(std::size_t bytes) {
  size_must_fit(bytes, granularity_, "create_physical");
  make_current();
  const CUmemAllocationProp properties = chunk_properties(ordinal_);
  CUmemGenericAllocationHandle chunk = 0;
  check(driver().mem_create(&chunk, bytes, &properties, 0), "cuMemCreate", bytes);
  std::lock_guard lock(memory_mutex_);
  chunks_.emplace(chunk, bytes);
  return physical_ref{chunk};
}

void cuda_device::release_physical(physical_ref chunk) {
  make_current();
  {
    std::lock_guard lock(memory_mutex_);
    if (chunks_.erase(chunk.native) == 0) {
      throw invalid_argument("cuda_device::release_physical: chunk " + std::to_string(chunk.native) +
                             " is not a live chunk of " + label(ordinal_) + " (never created, or already released)");
    }
  }
  check(driver().mem_release(chunk.native), "cuMemRelease");
}

void cuda_device::map(void* address, physical_ref chunk) {
  make_current();
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  std::size_t size = 0;
  {
    std::lock_guard lock(memory_mutex_);
    const auto live = chunks_.find(chunk.native);
    if (live == chunks_.end()) {
      throw invalid_argument("cuda_device::map: chunk " + std::to_string(chunk.native) + " is not a live chunk of " +
                             label(ordinal_) + " (never created, or already released)");
    }
    size = live->second;
    if (start % granularity_ != 0) {
      throw invalid_argument("cuda_device::map: address " + hex(address) + " is not a multiple of granularity() (" +
                             std::to_string(granularity_) + ")");
    }
    const auto range = containing(reservations_, start);
    if (!range || start - range->first + size > range->second) {
      throw invalid_argument("cuda_device::map: [" + hex(address) + ", +" + std::to_string(size) +
                             ") does not lie inside one reservation of " + label(ordinal_));
    }
    const auto next = mappings_.lower_bound(start);
    if (next != mappings_.end() && next->first < start + size) {
      throw invalid_argument("cuda_device::map: [" + hex(address) + ", +" + std::to_string(size) +
                             ") overlaps the chunk mapped at " + hex(next->first));
    }
    if (next != mappings_.begin()) {
      const auto previous = std::prev(next);
      if (previous->first + previous->second > start) {
        throw invalid_argument("cuda_device::map: " + hex(address) + " lies inside the chunk mapped at " +
                               hex(previous->first));
      }
    }
    // Claimed before mapping, so concurrent maps and release_range see it.
    mappings_.emplace(start, size);
  }
  const cuda_driver& d = driver();
  const CUmemAccessDesc access = read_write_access(ordinal_);
  const char* failed = "cuMemMap";
  CUresult result = d.mem_map(start, size, 0, chunk.native, 0);
  if (result == CUDA_SUCCESS) {
    failed = "cuMemSetAccess";
    result = d.mem_set_access(start, size, &access, 1);
    if (result != CUDA_SUCCESS) d.mem_unmap(start, size);
  }
  if (result != CUDA_SUCCESS) {
    {
      std::lock_guard lock(memory_mutex_);
      mappings_.erase(start);
    }
    check(result, failed, size);
  }
}

void cuda_device::unmap(void* address) {
  make_current();
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  std::size_t size = 0;
  {
    std::lock_guard lock(memory_mutex_);
    const auto mapping = mappings_.find(start);
    if (mapping == mappings_.end()) {
      throw invalid_argument("cuda_device::unmap: no chunk of " + label(ordinal_) + " is mapped at " + hex(address));
    }
    size = mapping->second;
    mappings_.erase(mapping);
  }
  check(driver().mem_unmap(start, size), "cuMemUnmap");
}

// ---- streams ----------------------------------------------------------------------

cuda_device::locked<cudaStream_t> cuda_device::lock_stream(stream_ref stream, const char* op) const {
  std::shared_lock lock(streams_mutex_);
  const auto native = static_cast<cudaStream_t>(stream.native);
  if (!stream.is_default() && !streams_.contains(native)) {
    throw invalid_argument(std::string("cuda_device::") + op + ": stream " + hex(stream.native) +
                           " is not a live stream of " + label(ordinal_) + " (destroyed, or made by another device)");
  }
  return {std::move(lock), native};
}

stream_ref cuda_device::create_stream() {
  make_current();
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  // A host task of a destroyed stream at the same address may have failed
  // after that stream was destroyed; its failure is not this stream's.
  task_failures_->forget(stream);
  std::unique_lock lock(streams_mutex_);
  streams_.insert(stream);
  return stream_ref{stream};
}

void cuda_device::destroy_stream(stream_ref stream) {
  if (stream.is_default()) throw invalid_argument("cuda_device::destroy_stream: the default stream cannot be destroyed");
  make_current();
  const auto native = static_cast<cudaStream_t>(stream.native);
  {
    std::unique_lock lock(streams_mutex_);
    if (streams_.erase(native) == 0) {
      throw invalid_argument("cuda_device::destroy_stream: stream " + hex(stream.native) + " is not a live stream of " +
                             label(ordinal_) + " (already destroyed, or made by another device)");
    }
    // Its exported event stays (other processes may hold it) but is never
    // recorded again: a later stream at this address gets a new one.
    std::lock_guard exported_lock(exported_events_mutex_);
    stream_sources_.erase(native);
  }
  task_failures_->forget(native);
  check(cudaStreamDestroy(native), "cudaStreamDestroy");
}

void cuda_device::synchronize(stream_ref stream) {
  make_current();
  // The registry lock is not held while waiting, so waiting never blocks
  // creating or destroying other streams.
  const cudaStream_t native = lock_stream(stream, "synchronize").native;
  check_work(cudaStreamSynchronize(native), "cudaStreamSynchronize", ordinal_);
  if (auto failure = task_failures_->take(native)) throw stream_error("cuda_device::synchronize: " + *failure);
}

bool cuda_device::query(stream_ref stream) {
  make_current();
  const auto locked = lock_stream(stream, "query");
  const cudaError_t result = cudaStreamQuery(locked.native);
  if (result == cudaErrorNotReady) return false;
  check_work(result, "cudaStreamQuery", ordinal_);
  return true;
}

// ---- events -----------------------------------------------------------------------

cuda_device::locked<cudaEvent_t> cuda_device::lock_event(event_ref event, const char* op) const {
  std::shared_lock lock(events_mutex_);
  const auto native = static_cast<cudaEvent_t>(event.native);
  if (!events_.contains(native)) {
    throw invalid_argument(std::string("cuda_device::") + op + ": event " + hex(event.native) +
                           " is not a live event of " + label(ordinal_) + " (destroyed, or made by another device)");
  }
  return {std::move(lock), native};
}

event_ref cuda_device::create_event() {
  make_current();
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  std::unique_lock lock(events_mutex_);
  events_.insert(event);
  return event_ref{event};
}

void cuda_device::destroy_event(event_ref event) {
  make_current();
  const auto native = static_cast<cudaEvent_t>(event.native);
  {
    std::unique_lock lock(events_mutex_);
    if (events_.erase(native) == 0) {
      throw invalid_argument("cuda_device::destroy_event: event " + hex(event.native) + " is not a live event of " +
                             label(ordinal_) + " (already destroyed, or made by another device)");
    }
  }
  check(cudaEventDestroy(native), "cudaEventDestroy");
}

void cuda_device::record(event_ref event, stream_ref stream) {
  make_current();
  const auto s = lock_stream(stream, "record");
  const auto e = lock_event(event, "record");
  check(cudaEventRecord(e.native, s.native), "cudaEventRecord");
}

bool cuda_device::query_event(event_ref event) {
  make_current();
  const auto locked = lock_event(event, "query_event");
  const cudaError_t result = cudaEventQuery(locked.native);
  if (result == cudaErrorNotReady) return false;
  check_work(result, "cudaEventQuery", ordinal_);
  return true;
}

void cuda_device::synchronize_event(event_ref event) {
  make_current();
  const cudaEvent_t native = lock_event(event, "synchronize_event").native;  // not held while waiting
  check_work(cudaEventSynchronize(native), "cudaEventSynchronize", ordinal_);
}

void cuda_device::wait(stream_ref stream, event_ref event) {
  make_current();
  const auto s = lock_stream(stream, "wait");
  const auto e = lock_event(event, "wait");
  check(cudaStreamWaitEvent(s.native, e.native, 0), "cudaStreamWaitEvent");
}

// ---- work on a stream ---------------------------------------------------------------

void cuda_device::copy(stream_ref stream, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) {
    throw invalid_argument("cuda_device::copy: null " + std::string(dst == nullptr ? "dst" : "src") + " with " +
                           std::to_string(bytes) + " bytes to copy");
  }
  make_current();
  const auto s = lock_stream(stream, "copy");
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.native), "cudaMemcpyAsync");
}

void cuda_device::fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr) {
    throw invalid_argument("cuda_device::fill: null dst with " + std::to_string(bytes) + " bytes to fill");
  }
  make_current();
  const auto s = lock_stream(stream, "fill");
  check(cudaMemsetAsync(dst, value, bytes, s.native), "cudaMemsetAsync");
}

void cuda_device::delay(stream_ref stream, std::chrono::microseconds duration) {
  make_current();
  const auto s = lock_stream(stream, "delay");
  launch_spin(s.native, std::max(duration, std::chrono::microseconds::zero()));  // negative: no wait, as sleep_for
}

void cuda_device::host_task(stream_ref stream, std::function<void()> task) {
  if (!task) throw invalid_argument("cuda_device::host_task: the task is empty");
  make_current();
  const auto s = lock_stream(stream, "host_task");
  auto call = std::make_unique<host_task_call>(host_task_call{std::move(task), task_failures_, s.native});
  check(cudaLaunchHostFunc(s.native, run_host_task, call.get()), "cudaLaunchHostFunc");
  call.release();  // run_host_task owns it now
}

// ---- sharing with other processes ------------------------------------------------------

shareable_handle cuda_device::export_memory(const void* ptr) {
  static_assert(sizeof(cudaIpcMemHandle_t) == shareable_handle::opaque_bytes);
  make_current();
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  shareable_handle handle;
  handle.device = device_kind::cuda;
  handle.device_ordinal = ordinal_;

  std::unique_lock lock(memory_mutex_);
  if (const auto segment = containing(segments_, address)) {
    lock.unlock();
    cudaIpcMemHandle_t ipc{};
    check(cudaIpcGetMemHandle(&ipc, reinterpret_cast<void*>(segment->first)), "cudaIpcGetMemHandle");
    handle.kind = handle_kind::cuda_ipc;
    handle.size = segment->second;
    handle.offset = address - segment->first;
    std::memcpy(handle.opaque.data(), &ipc, sizeof ipc);
    return handle;
  }
  if (const auto mapping = containing(mappings_, address)) {
    lock.unlock();
    // Retained from the mapping rather than taken from chunks_: the chunk's
    // own handle may already be released while its mapping lives on.
    const cuda_driver& d = driver();
    CUmemGenericAllocationHandle chunk = 0;
    check(d.mem_retain_allocation_handle(&chunk, reinterpret_cast<void*>(mapping->first)),
          "cuMemRetainAllocationHandle");
    int fd = -1;
    const CUresult exported =
        d.mem_export_to_shareable_handle(&fd, chunk, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    d.mem_release(chunk);  // drops only the reference the retain took
    check(exported, "cuMemExportToShareableHandle");
    handle.kind = handle_kind::cuda_vmm_fd;
    handle.size = mapping->second;
    handle.offset = address - mapping->first;
    handle.fd = unique_fd(fd);
    return handle;
  }
  throw invalid_argument("cuda_device::export_memory: pointer " + hex(ptr) + " is not in memory of " +
                         label(ordinal_) + " (no live segment or mapped chunk contains it)");
}

void* cuda_device::import_memory(std::span<const shareable_handle> chunks) {
  if (chunks.empty()) throw invalid_argument("cuda_device::import_memory: no handles were given; pass at least one");
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const shareable_handle& handle = chunks[i];
    const std::string which = "cuda_device::import_memory: " +
                              (chunks.size() == 1 ? std::string("the handle") : "chunk " + std::to_string(i));
    if (handle.device != device_kind::cuda) {
      throw invalid_argument(which + " describes memory of a " + std::string(to_string(handle.device)) +
                             " device, not a cuda device");
    }
    if (handle.kind != handle_kind::cuda_ipc && handle.kind != handle_kind::cuda_vmm_fd) {
      throw invalid_argument(which + " has handle kind " + std::to_string(static_cast<int>(handle.kind)) +
                             ", which is not a CUDA kind");
    }
    if (handle.kind != chunks.front().kind || handle.device_ordinal != chunks.front().device_ordinal) {
      throw invalid_argument(which + " is of another kind or device than chunk 0; chunks imported together are "
                             "mapped chunks of one device");
    }
    if (handle.size == 0 || handle.offset >= handle.size) {
      throw invalid_argument(which + "'s offset (" + std::to_string(handle.offset) + ") must be less than its size (" +
                             std::to_string(handle.size) + ")");
    }
    if (i > 0 && handle.offset != 0) {
      throw invalid_argument(which + " has offset " + std::to_string(handle.offset) +
                             "; only the first chunk may point inside itself, the others are mapped whole");
    }
  }
  if (chunks.front().kind == handle_kind::cuda_vmm_fd) return import_vmm(chunks);
  if (chunks.size() > 1) {
    throw invalid_argument("cuda_device::import_memory: " + std::to_string(chunks.size()) +
                           " cuda_ipc handles were given; segments shared by legacy CUDA IPC are imported one at a "
                           "time, only mapped chunks (cuda_vmm_fd) together");
  }
  return import_ipc(chunks.front());
}

void* cuda_device::import_ipc(const shareable_handle& handle) {
  make_current();
  cudaIpcMemHandle_t ipc{};
  std::memcpy(&ipc, handle.opaque.data(), sizeof ipc);
  void* base = nullptr;
  check(cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  // The size came from another process: hold it against what was mapped.
  CUdeviceptr range_base = 0;
  std::size_t range_size = 0;
  const CUresult range =
      driver().mem_get_address_range(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base));
  if (range != CUDA_SUCCESS || handle.size > range_size) {
    cudaIpcCloseMemHandle(base);
    cudaGetLastError();
    check(range, "cuMemGetAddressRange");
    throw invalid_argument("cuda_device::import_memory: the handle says the segment has " +
                           std::to_string(handle.size) + " bytes, but the memory it opens has " +
                           std::to_string(range_size));
  }
  const auto pointer = reinterpret_cast<std::uintptr_t>(base) + handle.offset;
  std::lock_guard lock(memory_mutex_);
  imports_.emplace(pointer, import_record{handle_kind::cuda_ipc, reinterpret_cast<std::uintptr_t>(base), 0, {}});
  return reinterpret_cast<void*>(pointer);
}

void* cuda_device::import_vmm(std::span<const shareable_handle> chunks) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const shareable_handle& handle = chunks[i];
    const std::string which = "cuda_device::import_memory: chunk " + std::to_string(i);
    if (!handle.fd.valid()) throw invalid_argument(which + " (cuda_vmm_fd) carries no fd");
    if (handle.size % granularity_ != 0) {
      throw invalid_argument(which + "'s size (" + std::to_string(handle.size) +
                             ") is not a multiple of granularity() (" + std::to_string(granularity_) + ")");
    }
    if (handle.size > std::numeric_limits<std::size_t>::max() - total) {
      throw invalid_argument("cuda_device::import_memory: the chunks' sizes overflow");
    }
    total += handle.size;
  }
  make_current();
  const cuda_driver& d = driver();
  CUdeviceptr base = 0;
  check(d.mem_address_reserve(&base, total, granularity_, 0, 0), "cuMemAddressReserve", total);
  std::vector<std::size_t> mapped;  // sizes of the chunks mapped so far, back to back from base
  mapped.reserve(chunks.size());
  CUdeviceptr at = base;
  for (const shareable_handle& handle : chunks) {
    const char* failed = nullptr;
    const CUresult result = map_imported_chunk(d, handle, at, ordinal_, failed);
    if (result != CUDA_SUCCESS) {
      unmap_chunks(d, base, mapped);
      d.mem_address_free(base, total);
      check(result, failed, handle.size);
    }
    mapped.push_back(handle.size);
    at += handle.size;
  }
  const auto pointer = base + chunks.front().offset;
  std::lock_guard lock(memory_mutex_);
  imports_.emplace(pointer, import_record{handle_kind::cuda_vmm_fd, base, total, std::move(mapped)});
  return reinterpret_cast<void*>(pointer);
}

void cuda_device::close_import(void* ptr) {
  make_current();
  import_record import{};
  {
    std::lock_guard lock(memory_mutex_);
    const auto it = imports_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == imports_.end()) {
      throw invalid_argument("cuda_device::close_import: " + hex(ptr) + " is not an open import of " +
                             label(ordinal_) + " (not returned by import_memory, or already closed)");
    }
    import = std::move(it->second);
    imports_.erase(it);
  }
  if (import.kind == handle_kind::cuda_ipc) {
    check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(import.base)), "cudaIpcCloseMemHandle");
    return;
  }
  const cuda_driver& d = driver();
  check(unmap_chunks(d, import.base, import.chunk_sizes), "cuMemUnmap");
  check(d.mem_address_free(import.base, import.size), "cuMemAddressFree");
}

// ---- ordering across processes ---------------------------------------------------------

std::uint64_t cuda_device::create_exported_event() {
  static_assert(sizeof(cudaIpcEventHandle_t) == event_source::opaque_bytes);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
        "cudaEventCreateWithFlags(cudaEventInterprocess)");
  cudaIpcEventHandle_t handle{};
  const cudaError_t got = cudaIpcGetEventHandle(&handle, event);
  if (got != cudaSuccess) cudaEventDestroy(event);
  check(got, "cudaIpcGetEventHandle");
  const std::uint64_t id = shoal::detail::next_process_wide_id();
  try {
    exported_events_.emplace(id, exported_event{event, handle});
  } catch (...) {
    cudaEventDestroy(event);
    throw;
  }
  return id;
}

event_point cuda_device::export_event(stream_ref stream) {
  make_current();
  const auto s = lock_stream(stream, "export_event");
  std::lock_guard lock(exported_events_mutex_);
  auto source = stream_sources_.find(s.native);
  if (source == stream_sources_.end()) source = stream_sources_.emplace(s.native, create_exported_event()).first;
  check(cudaEventRecord(exported_events_.at(source->second).event, s.native), "cudaEventRecord(interprocess event)");
  return event_point{source->second, 0, 0};
}

event_source cuda_device::describe_event_source(std::uint64_t source_id) {
  std::lock_guard lock(exported_events_mutex_);
  const auto it = exported_events_.find(source_id);
  if (it == exported_events_.end()) {
    throw invalid_argument("cuda_device::describe_event_source: " + std::to_string(source_id) +
                           " is not an event source " + label(ordinal_) + " exported (ids come from export_event)");
  }
  event_source source;
  source.kind = event_source_kind::cuda_ipc_event;
  source.device = device_kind::cuda;
  source.device_ordinal = ordinal_;
  source.source_id = source_id;
  std::memcpy(source.opaque.data(), &it->second.handle, sizeof it->second.handle);
  return source;
}

imported_event_ref cuda_device::open_event_source(const event_source& source) {
  if (source.kind != event_source_kind::cuda_ipc_event || source.device != device_kind::cuda) {
    throw invalid_argument("cuda_device::open_event_source: the source comes from a " +
                           std::string(to_string(source.device)) + " device; " + label(ordinal_) +
                           " opens CUDA IPC events only");
  }
  make_current();
  cudaIpcEventHandle_t handle{};
  std::memcpy(&handle, source.opaque.data(), sizeof handle);
  cudaEvent_t event = nullptr;
  check(cudaIpcOpenEventHandle(&event, handle), "cudaIpcOpenEventHandle");
  try {
    std::unique_lock lock(imported_events_mutex_);
    imported_events_.emplace(event, source.source_id);
  } catch (...) {
    cudaEventDestroy(event);
    throw;
  }
  return imported_event_ref{event};
}

void cuda_device::wait_imported(stream_ref stream, imported_event_ref source, const event_point& point) {
  make_current();
  const auto s = lock_stream(stream, "wait_imported");
  std::shared_lock lock(imported_events_mutex_);  // held so the event is not closed under the wait
  const auto it = imported_events_.find(static_cast<cudaEvent_t>(source.native));
  if (it == imported_events_.end()) {
    throw invalid_argument("cuda_device::wait_imported: " + hex(source.native) + " is not an event source open on " +
                           label(ordinal_) + " (closed already, or opened by another device)");
  }
  if (point.source_id != it->second) {
    throw invalid_argument("cuda_device::wait_imported: the point belongs to event source " +
                           std::to_string(point.source_id) + ", but the source given is " + std::to_string(it->second) +
                           "; open the point's own source and wait on that");
  }
  if (point.stream_slot != 0 || point.ticket != 0) {
    throw invalid_argument("cuda_device::wait_imported: the point has a stream slot or ticket, which only host "
                           "points have");
  }
  check(cudaStreamWaitEvent(s.native, it->first, 0), "cudaStreamWaitEvent(imported event)");
}

void cuda_device::close_event_source(imported_event_ref source) {
  make_current();
  const auto event = static_cast<cudaEvent_t>(source.native);
  {
    std::unique_lock lock(imported_events_mutex_);
    if (imported_events_.erase(event) == 0) {
      throw invalid_argument("cuda_device::close_event_source: " + hex(source.native) +
                             " is not an event source open on " + label(ordinal_) + " (closed already?)");
    }
  }
  check(cudaEventDestroy(event), "cudaEventDestroy(imported event)");
}

// ---- finding devices ------------------------------------------------------------------

int cuda_device_count_impl() noexcept {
  int count = 0;
  device_count(count);
  return count;
}

std::string cuda_unavailable_reason_impl() {
  int count = 0;
  const cudaError_t result = device_count(count);
  return unavailable_reason(result, count);
}

std::unique_ptr<device> make_cuda_device(int ordinal) {
  int count = 0;
  const cudaError_t result = device_count(count);
  if (const std::string reason = unavailable_reason(result, count); !reason.empty()) {
    throw device_unavailable("no CUDA device: " + reason);
  }
  if (ordinal < 0 || ordinal >= count) {
    throw device_unavailable("no CUDA device: ordinal " + std::to_string(ordinal) + " was asked for, but there " +
                             (count == 1 ? "is 1 CUDA device (ordinal 0)"
                                         : "are " + std::to_string(count) + " CUDA devices (ordinals 0 to " +
                                               std::to_string(count - 1) + ")"));
  }
  return std::make_unique<cuda_device>(ordinal);
}

}  // namespace shoal::backend::detail
