// A program of the public API alone, linked with the shared library: each
// layer's entry points resolve against its exports, and shoal's exceptions
// cross the library's boundary as their own types. Exit status 0 when every
// step held; the failing step is named otherwise.
#include <cstdio>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/alloc/config.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"

namespace {

int failed(const char* step) {
  std::printf("public_api_tour: %s failed\n", step);
  return 1;
}

}  // namespace

int main() {
  auto& device = shoal::backend::host_device_instance();
  shoal::backend::stream stream(device);
  shoal::alloc::caching_allocator allocator(device, shoal::alloc::allocator_config::parse("memory_limit_mb:64"));

  void* block = allocator.allocate(1 << 20, stream);
  device.fill(stream, block, 0x5A, 1 << 20);
  std::vector<unsigned char> seen(1 << 20);
  device.copy(stream, seen.data(), block, seen.size());
  stream.synchronize();
  if (seen.front() != 0x5A || seen.back() != 0x5A) return failed("a fill read back");
  if (allocator.stats().allocated_bytes.aggregate.current != 1 << 20) return failed("stats()");
  allocator.deallocate(block, stream);

  try {
    (void)allocator.allocate(std::size_t{128} << 20, stream);
    return failed("the memory limit");
  } catch (const shoal::out_of_memory&) {  // its typeinfo comes from the library
  }
  try {
    (void)shoal::alloc::allocator_config::parse("no_such_setting:1");
    return failed("a bad setting's refusal");
  } catch (const shoal::invalid_argument&) {
  }

  auto original = shoal::storage::storage::allocate(allocator, 4096, stream);
  device.fill(stream, original.mutable_data(stream), 0x11, 4096);
  auto copy = shoal::storage::lazy_clone(original, stream);
  device.fill(stream, copy.mutable_data(stream), 0x22, 4096);  // the write moves the clone to its own bytes
  unsigned char a = 0;
  unsigned char b = 0;
  device.copy(stream, &a, original.data(), 1);
  device.copy(stream, &b, copy.data(), 1);
  stream.synchronize();
  if (a != 0x11 || b != 0x22) return failed("a lazy clone written");

  std::printf("public_api_tour: every step held through the shared library\n");
  return 0;
}
