#include "transfer/streaming_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace shoal::transfer {

void copy_streaming(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  auto* to = static_cast<std::byte*>(dst);
  const auto* from = static_cast<const std::byte*>(src);
  // Non-temporal stores need 16-byte aligned destinations: the head goes
  // through memcpy, then 64-byte lines, then the tail.
  const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(to) % 16;
  const std::size_t head = std::min(bytes, misalignment == 0 ? 0 : 16 - misalignment);
  std::memcpy(to, from, head);
  to += head;
  from += head;
  bytes -= head;
  for (; bytes >= 64; bytes -= 64, to += 64, from += 64) {
    const auto* in = reinterpret_cast<const __m128i*>(from);
    auto* out = reinterpret_cast<__m128i*>(to);
    const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
    const __m128i c = _mm_loadu_si128(in + 2), d = _mm_loadu_si128(in + 3);
    _mm_stream_si128(out, a);
    _mm_stream_si128(out + 1, b);
    _mm_stream_si128(out + 2, c);
    _mm_stream_si128(out + 3, d);
  }
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
  std::memcpy(to, from, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace shoal::transfer
