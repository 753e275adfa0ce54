// The machine's own ceiling for the thread rows of the comparison: a "pair"
// that does a fixed amount of arithmetic on thread-private state and shares
// nothing, so its scaling from 1 to N threads is what the machine (cores,
// turbo, vCPUs sharing physical cores) allows any allocator in the same
// harness. Hands out no memory: the address returned is thread-local state.
#pragma once

#include <cstdint>
#include <string>

#include "bench/common/allocator_adapter.h"

namespace shoal::bench {

class private_work_adapter final : public allocator_adapter {
 public:
  /// `steps` rounds of xorshift per pair: 32 take about as long as a cached
  /// shoal pair on the H100 machines (40-70 ns).
  explicit private_work_adapter(int steps = 32) : steps_(steps) {}
  [[nodiscard]] std::string name() const override { return "private work"; }
  [[nodiscard]] void* create_stream() override { return new char; }
  void destroy_stream(void* stream) override { delete static_cast<char*>(stream); }
  [[nodiscard]] void* allocate(std::size_t bytes, void*) override {
    std::uint64_t& x = state();
    x ^= bytes;
    for (int i = 0; i < steps_; ++i) {  // a dependent chain the compiler cannot fold
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
    }
    return &x;
  }
  void deallocate(void* ptr, std::size_t, void*) override { state() += reinterpret_cast<std::uintptr_t>(ptr) & 1; }
  [[nodiscard]] std::size_t reserved_bytes() const override { return 0; }
  [[nodiscard]] std::size_t peak_reserved_bytes() const override { return 0; }
  void synchronize() override {}

 private:
  static std::uint64_t& state() {
    thread_local std::uint64_t x = 0x9e3779b97f4a7c15ULL;
    return x;
  }
  const int steps_;
};

}  // namespace shoal::bench
