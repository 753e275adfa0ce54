#include <cstdio>

#include "shoal/core/error.h"
#include "tools/shoal/demo_steps.h"

namespace shoal::tools::demo {

settle_streams::~settle_streams() {
  try {
    streams.loader.synchronize();
    streams.model.synchronize();
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): an error of the work itself was reported already
  }
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw error("demo: " + what);
}

std::vector<std::uint8_t> read_back(backend::device& dev, const void* src, std::size_t bytes, backend::stream_ref s) {
  std::vector<std::uint8_t> out(bytes);
  dev.copy(s, out.data(), src, bytes);
  dev.synchronize(s);
  return out;
}

std::size_t count_of(std::span<const std::uint8_t> bytes, std::uint8_t value) {
  std::size_t n = 0;
  for (auto b : bytes) n += b == value ? 1 : 0;
  return n;
}

bool all_are(std::span<const std::uint8_t> bytes, std::uint8_t value) { return count_of(bytes, value) == bytes.size(); }

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double us_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

std::string hex(const void* p) {
  char text[32];
  std::snprintf(text, sizeof text, "%#llx", static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p)));
  return text;
}

std::string mib(std::int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

}  // namespace shoal::tools::demo
