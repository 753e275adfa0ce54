#include "backend/cuda/cuda_memory.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "backend/cuda/cuda_current_device.h"
#include "backend/cuda/cuda_driver.h"
#include "core/address_text.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

using range_map = std::map<std::uintptr_t, std::size_t>;

using shoal::detail::hex;

// The range of `ranges` (start -> bytes) that contains `address`, if any.
std::optional<std::pair<std::uintptr_t, std::size_t>> containing(const range_map& ranges, std::uintptr_t address) {
  auto it = ranges.upper_bound(address);
  if (it == ranges.begin()) return std::nullopt;
  --it;
  if (address - it->first >= it->second) return std::nullopt;
  return *it;
}

// Chunks ask for POSIX-fd handles only where the device can export them:
// elsewhere cuMemCreate would refuse the request.
CUmemAllocationProp chunk_properties(int ordinal, bool shareable) {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = ordinal;
  properties.requestedHandleTypes = shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return properties;
}

// What device `ordinal` offers for growable ranges, as its driver says.
growable_support query_growable(int ordinal) {
  const cuda_driver& d = driver();
  CUdevice device = 0;
  check(d.device_get(&device, ordinal), "cuDeviceGet");
  int vmm = 0;
  int posix_fd = 0;
  check(d.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device),
        "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
  check(d.device_get_attribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device),
        "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)");
  return {.supported = vmm != 0, .shareable = vmm != 0 && posix_fd != 0};
}

CUmemAccessDesc access_for(int ordinal, memory_access allowed = memory_access::read_write) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags =
      allowed == memory_access::read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

// Maps the chunk `handle` exports at `address` (reserved, not mapped) with
// `allowed` access for device `ordinal`. On failure nothing stays mapped,
// and `failed` names the call that failed.
CUresult map_imported_chunk(const cuda_driver& d, const shareable_handle& handle, CUdeviceptr address, int ordinal,
                            memory_access allowed, const char*& failed) {
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
    const CUmemAccessDesc access = access_for(ordinal, allowed);
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

void size_must_fit(std::size_t bytes, std::size_t granularity, const char* op) {
  if (bytes == 0 || bytes % granularity != 0) {
    throw invalid_argument(std::string("cuda_device::") + op + ": bytes (" + std::to_string(bytes) +
                           ") must be a nonzero multiple of granularity() (" + std::to_string(granularity) + ")");
  }
}

}  // namespace

cuda_memory::cuda_memory(int ordinal) : ordinal_(ordinal), growable_(query_growable(ordinal)) {
  if (!growable_.supported) {
    granularity_ = granularity_without_vmm;
    return;
  }
  const CUmemAllocationProp chunk = chunk_properties(ordinal_, growable_.shareable);
  check(driver().mem_get_allocation_granularity(&granularity_, &chunk, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
}

void cuda_memory::teardown_imports(const cuda_driver& d) noexcept {
  for (const auto& [ptr, import] : imports_) {
    if (import.kind == handle_kind::cuda_ipc) {
      cudaIpcCloseMemHandle(reinterpret_cast<void*>(import.base));
    } else {
      unmap_chunks(d, import.base, import.chunk_sizes);
      d.mem_address_free(import.base, import.size);
    }
  }
}

void cuda_memory::teardown_rest(const cuda_driver& d) noexcept {
  for (const auto& [address, size] : mappings_) d.mem_unmap(address, size);
  for (const auto& [chunk, size] : chunks_) d.mem_release(chunk);
  for (const auto& [base, size] : reservations_) d.mem_address_free(base, size);
  for (const auto& [base, size] : segments_) cudaFree(reinterpret_cast<void*>(base));
  for (const auto& [base, size] : pinned_) cudaFreeHost(reinterpret_cast<void*>(base));
}

// ---- plain segments ------------------------------------------------------------

memory_info cuda_memory::info() const {
  const device_scope on_device(ordinal_);
  memory_info info;
  check(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
  return info;
}

void* cuda_memory::allocate_segment(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("cuda_device::allocate_segment: bytes must be > 0");
  const device_scope on_device(ordinal_);
  void* base = nullptr;
  check(cudaMalloc(&base, bytes), "cudaMalloc", bytes);
  std::lock_guard lock(mutex_);
  segments_.emplace(reinterpret_cast<std::uintptr_t>(base), bytes);
  return base;
}

void cuda_memory::free_segment(void* base) {
  const device_scope on_device(ordinal_);
  {
    std::lock_guard lock(mutex_);
    if (segments_.erase(reinterpret_cast<std::uintptr_t>(base)) == 0) {
      throw invalid_argument("cuda_device::free_segment: pointer " + hex(base) + " was not allocated by " +
                             cuda_label(ordinal_) + " or was already freed");
    }
  }
  check(cudaFree(base), "cudaFree");
}

// ---- pinned host memory ----------------------------------------------------------

void* cuda_memory::allocate_pinned_host(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("cuda_device::allocate_pinned_host: bytes must be > 0");
  const device_scope on_device(ordinal_);
  void* base = nullptr;
  // Portable: pinned for every CUDA context of the process, not only this
  // device's, so a copy to another device runs at full speed too.
  check(cudaHostAlloc(&base, bytes, cudaHostAllocPortable), "cudaHostAlloc", bytes);
  std::lock_guard lock(mutex_);
  pinned_.emplace(reinterpret_cast<std::uintptr_t>(base), bytes);
  return base;
}

void cuda_memory::free_pinned_host(void* base) {
  const device_scope on_device(ordinal_);
  {
    std::lock_guard lock(mutex_);
    if (pinned_.erase(reinterpret_cast<std::uintptr_t>(base)) == 0) {
      throw invalid_argument("cuda_device::free_pinned_host: pointer " + hex(base) + " was not allocated by " +
                             cuda_label(ordinal_) + "'s allocate_pinned_host or was already freed");
    }
  }
  check(cudaFreeHost(base), "cudaFreeHost");
}

// ---- growable ranges -------------------------------------------------------------

void cuda_memory::require_growable(const char* op) const {
  if (growable_.supported) return;
  throw backend_error(std::string("cuda_device::") + op,
                      cuda_label(ordinal_) + " has no virtual memory management "
                      "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0): no growable ranges; use plain "
                      "segments (the caching allocator does so itself for expandable_segments)");
}

void* cuda_memory::reserve_range(std::size_t bytes) {
  size_must_fit(bytes, granularity_, "reserve_range");
  require_growable("reserve_range");
  const device_scope on_device(ordinal_);
  CUdeviceptr base = 0;
  check(driver().mem_address_reserve(&base, bytes, granularity_, 0, 0), "cuMemAddressReserve", bytes);
  std::lock_guard lock(mutex_);
  reservations_.emplace(base, bytes);
  return reinterpret_cast<void*>(base);
}

void cuda_memory::release_range(void* base) {
  const device_scope on_device(ordinal_);
  const auto start = reinterpret_cast<std::uintptr_t>(base);
  std::size_t size = 0;
  {
    std::lock_guard lock(mutex_);
    const auto range = reservations_.find(start);
    if (range == reservations_.end()) {
      throw invalid_argument("cuda_device::release_range: " + hex(base) + " is not the base of a reservation of " +
                             cuda_label(ordinal_) + " (never reserved, or already released)");
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

physical_ref cuda_memory::create_physical(std::size_t bytes) {
  size_must_fit(bytes, granularity_, "create_physical");
  require_growable("create_physical");
  const device_scope on_device(ordinal_);
  const CUmemAllocationProp properties = chunk_properties(ordinal_, growable_.shareable);
  CUmemGenericAllocationHandle chunk = 0;
  check(driver().mem_create(&chunk, bytes, &properties, 0), "cuMemCreate", bytes);
  std::lock_guard lock(mutex_);
  chunks_.emplace(chunk, bytes);
  return physical_ref{chunk};
}

void cuda_memory::release_physical(physical_ref chunk) {
  const device_scope on_device(ordinal_);
  {
    std::lock_guard lock(mutex_);
    if (chunks_.erase(chunk.native) == 0) {
      throw invalid_argument("cuda_device::release_physical: chunk " + std::to_string(chunk.native) +
                             " is not a live chunk of " + cuda_label(ordinal_) +
                             " (never created, or already released)");
    }
  }
  check(driver().mem_release(chunk.native), "cuMemRelease");
}

void cuda_memory::map(void* address, physical_ref chunk) {
  std::size_t size = 0;
  {
    std::lock_guard lock(mutex_);
    const auto live = chunks_.find(chunk.native);
    if (live != chunks_.end()) size = live->second;
  }
  // An unknown chunk is refused by map_chunks with the same message.
  const sized_chunk one{chunk, size};
  map_chunks(address, std::span(&one, 1));
}

std::size_t cuda_memory::claim_mapping(std::uintptr_t start, const sized_chunk& c) {
  const auto live = chunks_.find(c.chunk.native);
  if (live == chunks_.end()) {
    throw invalid_argument("cuda_device::map: chunk " + std::to_string(c.chunk.native) + " is not a live chunk of " +
                           cuda_label(ordinal_) + " (never created, or already released)");
  }
  const std::size_t size = live->second;
  if (c.bytes != size) {
    throw invalid_argument("cuda_device::map_chunks: chunk " + std::to_string(c.chunk.native) + " is given as " +
                           std::to_string(c.bytes) + " bytes but was created with " + std::to_string(size));
  }
  const void* address = reinterpret_cast<const void*>(start);
  if (start % granularity_ != 0) {
    throw invalid_argument("cuda_device::map: address " + hex(address) + " is not a multiple of granularity() (" +
                           std::to_string(granularity_) + ")");
  }
  const auto range = containing(reservations_, start);
  if (!range || start - range->first + size > range->second) {
    throw invalid_argument("cuda_device::map: [" + hex(address) + ", +" + std::to_string(size) +
                           ") does not lie inside one reservation of " + cuda_label(ordinal_));
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
  return size;
}

void cuda_memory::map_chunks(void* address, std::span<const sized_chunk> chunks) {
  if (chunks.empty()) return;
  const device_scope on_device(ordinal_);
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  std::uintptr_t end = start;
  const std::shared_lock no_grant_meanwhile(access_change_);
  std::vector<CUmemAccessDesc> access;  // this device's, then each peer's
  {
    std::lock_guard lock(mutex_);
    access.reserve(1 + peers_.size());
    access.push_back(access_for(ordinal_));
    for (const int peer : peers_) access.push_back(access_for(peer));
    try {
      for (const sized_chunk& c : chunks) end += claim_mapping(end, c);
    } catch (...) {
      mappings_.erase(mappings_.lower_bound(start), mappings_.lower_bound(end));
      throw;
    }
  }
  // Each chunk is mapped on its own, and access is set once over the whole
  // range: cuMemSetAccess costs ~25 us on an H100 whatever the range's size.
  const cuda_driver& d = driver();
  const char* failed = "cuMemMap";
  std::uintptr_t at = start;
  CUresult result = CUDA_SUCCESS;
  for (const sized_chunk& c : chunks) {
    result = d.mem_map(at, c.bytes, 0, c.chunk.native, 0);
    if (result != CUDA_SUCCESS) break;
    at += c.bytes;
  }
  if (result == CUDA_SUCCESS) {
    failed = "cuMemSetAccess";
    result = d.mem_set_access(start, end - start, access.data(), access.size());
  }
  if (result != CUDA_SUCCESS) {
    std::uintptr_t m = start;
    for (std::size_t i = 0; m < at; m += chunks[i++].bytes) d.mem_unmap(m, chunks[i].bytes);  // those mapped so far
    {
      std::lock_guard lock(mutex_);
      mappings_.erase(mappings_.lower_bound(start), mappings_.lower_bound(end));
    }
    check(result, failed, end - start);
  }
}

void cuda_memory::unmap(void* address) {
  const device_scope on_device(ordinal_);
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  std::size_t size = 0;
  const std::shared_lock no_grant_meanwhile(access_change_);
  {
    std::lock_guard lock(mutex_);
    const auto mapping = mappings_.find(start);
    if (mapping == mappings_.end()) {
      throw invalid_argument("cuda_device::unmap: no chunk of " + cuda_label(ordinal_) + " is mapped at " +
                             hex(address));
    }
    size = mapping->second;
    mappings_.erase(mapping);
  }
  check(driver().mem_unmap(start, size), "cuMemUnmap");
}

void cuda_memory::grant_peer_access(int peer) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (peer < 0 || peer >= count || peer == ordinal_) {
    throw invalid_argument("cuda_device::grant_peer_access: " + std::to_string(peer) + " names no other CUDA device of " +
                           std::to_string(count) + " (" + cuda_label(ordinal_) + " is this one)");
  }
  int reachable = 0;
  check(cudaDeviceCanAccessPeer(&reachable, peer, ordinal_), "cudaDeviceCanAccessPeer");
  if (reachable == 0) {
    throw backend_error("cuda_device::grant_peer_access",
                        cuda_label(peer) + " cannot reach the memory of " + cuda_label(ordinal_) +
                            " (cudaDeviceCanAccessPeer says no): copy between them with cudaMemcpyPeerAsync");
  }
  const device_scope on_device(ordinal_);
  const std::unique_lock changing(access_change_);  // every mapping whole, none being made or unmade
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped;
  {
    std::lock_guard lock(mutex_);
    if (std::ranges::find(peers_, peer) != peers_.end()) return;
    mapped.assign(mappings_.begin(), mappings_.end());
    peers_.reserve(peers_.size() + 1);
  }
  // One grant per mapping (~30 us each on an H100), once per peer. A failure
  // leaves the peer unrecorded, to be granted again over every mapping.
  const CUmemAccessDesc access = access_for(peer);
  const cuda_driver& d = driver();
  for (const auto& [address, size] : mapped) check(d.mem_set_access(address, size, &access, 1), "cuMemSetAccess", size);
  std::lock_guard lock(mutex_);
  peers_.push_back(peer);
}

// ---- sharing with other processes ------------------------------------------------------

shareable_handle cuda_memory::export_memory(const void* ptr) const {
  static_assert(sizeof(cudaIpcMemHandle_t) == shareable_handle::opaque_bytes);
  const device_scope on_device(ordinal_);
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  shareable_handle handle;
  handle.device = device_kind::cuda;
  handle.device_ordinal = ordinal_;

  std::unique_lock lock(mutex_);
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
    if (!growable_.shareable) {
      throw backend_error("cuda_device::export_memory",
                          hex(ptr) + " is in a growable chunk, and " + cuda_label(ordinal_) +
                              " cannot export chunks (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED "
                              "is 0); share memory from plain segments (expandable_segments:false)");
    }
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
                         cuda_label(ordinal_) + " (no live segment or mapped chunk contains it)");
}

void* cuda_memory::import_memory(std::span<const shareable_handle> chunks, memory_access access) {
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
  if (chunks.front().kind == handle_kind::cuda_vmm_fd) return import_vmm(chunks, access);
  if (access == memory_access::read_only) {
    throw invalid_argument("cuda_device::import_memory: a cuda_ipc handle (a cudaMalloc segment) cannot be mapped "
                           "read-only; share memory of a growable range (cuda_vmm_fd) to map it read-only");
  }
  if (chunks.size() > 1) {
    throw invalid_argument("cuda_device::import_memory: " + std::to_string(chunks.size()) +
                           " cuda_ipc handles were given; segments shared by legacy CUDA IPC are imported one at a "
                           "time, only mapped chunks (cuda_vmm_fd) together");
  }
  return import_ipc(chunks.front());
}

void* cuda_memory::import_ipc(const shareable_handle& handle) {
  const device_scope on_device(ordinal_);
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
  std::lock_guard lock(mutex_);
  imports_.emplace(pointer, import_record{handle_kind::cuda_ipc, reinterpret_cast<std::uintptr_t>(base), 0, {}});
  return reinterpret_cast<void*>(pointer);
}

void* cuda_memory::import_vmm(std::span<const shareable_handle> chunks, memory_access access) {
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
  const device_scope on_device(ordinal_);
  const cuda_driver& d = driver();
  CUdeviceptr base = 0;
  check(d.mem_address_reserve(&base, total, granularity_, 0, 0), "cuMemAddressReserve", total);
  std::vector<std::size_t> mapped;  // sizes of the chunks mapped so far, back to back from base
  mapped.reserve(chunks.size());
  CUdeviceptr at = base;
  for (const shareable_handle& handle : chunks) {
    const char* failed = nullptr;
    const CUresult result = map_imported_chunk(d, handle, at, ordinal_, access, failed);
    if (result != CUDA_SUCCESS) {
      unmap_chunks(d, base, mapped);
      d.mem_address_free(base, total);
      check(result, failed, handle.size);
    }
    mapped.push_back(handle.size);
    at += handle.size;
  }
  const auto pointer = base + chunks.front().offset;
  std::lock_guard lock(mutex_);
  imports_.emplace(pointer, import_record{handle_kind::cuda_vmm_fd, base, total, std::move(mapped)});
  return reinterpret_cast<void*>(pointer);
}

void cuda_memory::close_import(void* ptr) {
  const device_scope on_device(ordinal_);
  import_record import{};
  {
    std::lock_guard lock(mutex_);
    const auto it = imports_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == imports_.end()) {
      throw invalid_argument("cuda_device::close_import: " + hex(ptr) + " is not an open import of " +
                             cuda_label(ordinal_) + " (not returned by import_memory, or already closed)");
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

}  // namespace shoal::backend::detail
