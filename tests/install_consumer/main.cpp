// Uses an installed shoal: a segment, a stream, a fill and a copy back.
#include <cstdio>
#include <vector>

#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"

int main() {
  auto& dev = shoal::backend::host_device_instance();
  shoal::backend::stream s(dev);
  void* p = dev.allocate_segment(4096);
  dev.fill(s, p, 0x7E, 4096);
  std::vector<unsigned char> out(4096);
  dev.copy(s, out.data(), p, out.size());
  s.synchronize();
  dev.free_segment(p);
  for (unsigned char b : out) {
    if (b != 0x7E) return 1;
  }
  std::printf("consumer: installed shoal works (CUDA devices: %d)\n", shoal::backend::cuda_device_count());
  return 0;
}
