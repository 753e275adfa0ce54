// shoal_bench_vmm_driver: where a growable chunk's device time goes, call by
// call, straight through the CUDA driver (shoal_bench_device times the same
// work through shoal's device interface, which maps and grants access in
// one call). For k physical chunks of one size mapped side by side:
//   map         cuMemMap of each chunk (per chunk),
//   access      one cuMemSetAccess over the k mappings (per chunk),
//   access again  the same grant on mappings that have it already,
//   access each   one cuMemSetAccess per mapping (per chunk),
//   alias       the same chunks mapped at a second range and granted there
//               while still mapped at the first (per chunk),
//   unmap each  cuMemUnmap of each mapping (per chunk),
//   unmap one   one cuMemUnmap over all k neighbouring mappings (per chunk).
// What it answers for the allocator: whether a growth's time is the count of
// chunks it maps or the count of calls it makes, and whether unmapping
// neighbouring chunks together or mapping a chunk at two places saves time.
//
//   shoal_bench_vmm_driver [--rounds N]
//
// Prints µs, median (min–max) over the rounds.
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/common/spread.h"

namespace {

using clock_type = std::chrono::steady_clock;
using shoal::bench::summarize;
using shoal::bench::text;

constexpr std::size_t mib = std::size_t{1} << 20;

// A failed driver call ends the benchmark with the call's name and error.
void check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  const char* name = "unknown error";
  (void)cuGetErrorString(result, &name);
  std::fprintf(stderr, "shoal_bench_vmm_driver: %s failed: %s\n", call, name);
  std::exit(1);
}

double micros_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
}

struct row_times {
  std::vector<double> map, access, access_again, access_each, alias, unmap_each, unmap_one;
};

struct driver_setup {
  CUmemAllocationProp prop{};
  CUmemAccessDesc access{};
};

void one_round(const driver_setup& d, CUdeviceptr first, CUdeviceptr second, std::size_t bytes, int k, row_times& t) {
  const auto per_chunk = [k](double total) { return total / k; };
  std::vector<CUmemGenericAllocationHandle> chunks(static_cast<std::size_t>(k));
  for (auto& c : chunks) check(cuMemCreate(&c, bytes, &d.prop, 0), "cuMemCreate");
  const auto at = [&](CUdeviceptr base, int i) { return base + static_cast<CUdeviceptr>(i) * bytes; };
  const std::size_t span = bytes * static_cast<std::size_t>(k);

  auto start = clock_type::now();
  for (int i = 0; i < k; ++i) check(cuMemMap(at(first, i), bytes, 0, chunks[i], 0), "cuMemMap");
  t.map.push_back(per_chunk(micros_since(start)));
  start = clock_type::now();
  check(cuMemSetAccess(first, span, &d.access, 1), "cuMemSetAccess");
  t.access.push_back(per_chunk(micros_since(start)));
  start = clock_type::now();
  check(cuMemSetAccess(first, span, &d.access, 1), "cuMemSetAccess");
  t.access_again.push_back(per_chunk(micros_since(start)));

  start = clock_type::now();
  for (int i = 0; i < k; ++i) check(cuMemMap(at(second, i), bytes, 0, chunks[i], 0), "cuMemMap");
  check(cuMemSetAccess(second, span, &d.access, 1), "cuMemSetAccess");
  t.alias.push_back(per_chunk(micros_since(start)));
  // The alias is the same memory: a byte written through it reads back at the
  // first range.
  check(cuMemsetD8(second, 0x5a, 1), "cuMemsetD8");
  unsigned char seen = 0;
  check(cuMemcpyDtoH(&seen, first, 1), "cuMemcpyDtoH");
  if (seen != 0x5a) {
    std::fprintf(stderr, "shoal_bench_vmm_driver: a chunk mapped twice read back %d, not 0x5a\n", seen);
    std::exit(1);
  }
  start = clock_type::now();
  for (int i = 0; i < k; ++i) check(cuMemUnmap(at(second, i), bytes), "cuMemUnmap");
  t.unmap_each.push_back(per_chunk(micros_since(start)));
  start = clock_type::now();
  check(cuMemUnmap(first, span), "cuMemUnmap over neighbouring mappings");
  t.unmap_one.push_back(per_chunk(micros_since(start)));

  for (int i = 0; i < k; ++i) check(cuMemMap(at(first, i), bytes, 0, chunks[i], 0), "cuMemMap");
  start = clock_type::now();
  for (int i = 0; i < k; ++i) check(cuMemSetAccess(at(first, i), bytes, &d.access, 1), "cuMemSetAccess");
  t.access_each.push_back(per_chunk(micros_since(start)));
  check(cuMemUnmap(first, span), "cuMemUnmap");
  for (auto c : chunks) check(cuMemRelease(c), "cuMemRelease");
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 15;
  if (argc == 3 && std::strcmp(argv[1], "--rounds") == 0) {
    rounds = std::max(1, std::atoi(argv[2]));
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: %s [--rounds N]\n", argv[0]);
    return 2;
  }
  check(cuInit(0), "cuInit");
  CUdevice device = 0;
  check(cuDeviceGet(&device, 0), "cuDeviceGet");
  CUcontext context = nullptr;
  check(cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(context), "cuCtxSetCurrent");
  char name[256] = {};
  check(cuDeviceGetName(name, sizeof name, device), "cuDeviceGetName");
  int driver = 0;
  check(cuDriverGetVersion(&driver), "cuDriverGetVersion");

  driver_setup d;
  d.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  d.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.prop.location.id = device;
  d.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;  // as shoal's chunks are made
  d.access.location = d.prop.location;
  d.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  constexpr std::size_t range_bytes = 512 * mib;
  CUdeviceptr first = 0, second = 0;
  check(cuMemAddressReserve(&first, range_bytes, 0, 0, 0), "cuMemAddressReserve");
  check(cuMemAddressReserve(&second, range_bytes, 0, 0, 0), "cuMemAddressReserve");

  std::printf(
      "growable chunks through the driver on %s (driver %d), µs per "
      "chunk, median (min–max) over %d rounds\n\n",
      name, driver, rounds);
  std::printf(
      "| chunks | map | access | access again | access each | alias "
      "map + access | unmap each | unmap one call |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const std::size_t each : {std::size_t{2}, std::size_t{24}}) {
    for (const int k : {1, 4, 12}) {
      row_times t;
      for (int r = 0; r < rounds; ++r) one_round(d, first, second, each * mib, k, t);
      std::printf("| %d × %zu MiB | %s | %s | %s | %s | %s | %s | %s |\n", k, each, text(summarize(t.map)).c_str(),
                  text(summarize(t.access)).c_str(), text(summarize(t.access_again)).c_str(),
                  text(summarize(t.access_each)).c_str(), text(summarize(t.alias)).c_str(),
                  text(summarize(t.unmap_each)).c_str(), text(summarize(t.unmap_one)).c_str());
      std::fflush(stdout);
    }
  }
  check(cuMemAddressFree(second, range_bytes), "cuMemAddressFree");
  check(cuMemAddressFree(first, range_bytes), "cuMemAddressFree");
  check(cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease");
  return 0;
}
