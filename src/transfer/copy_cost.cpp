// measure_copy_cost: the two figures the group planner needs, measured on the
// device the load will run on.
#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/transfer/group_planner.h"

namespace shoal::transfer {

namespace {

using clock_type = std::chrono::steady_clock;

constexpr std::size_t small_copy_bytes = 4096;
constexpr std::size_t small_groups = 256;
constexpr std::size_t large_copy_bytes = std::size_t{64} << 20;
constexpr int measuring_rounds = 3;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

/// Page-locked host memory and device memory for the measuring copies.
class copy_buffers {
 public:
  copy_buffers(backend::device& device, backend::stream_ref stream, std::size_t bytes)
      : device_(device), stream_(stream), host_(device.allocate_pinned_host(bytes)) {
    try {
      target_ = device.allocate_segment(bytes);
    } catch (...) {
      device.free_pinned_host(host_);
      throw;
    }
  }
  ~copy_buffers() {
    // A measurement that threw may leave copies queued on the memory.
    try {
      device_.synchronize(stream_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
    }
    device_.free_segment(target_);
    device_.free_pinned_host(host_);
  }
  copy_buffers(const copy_buffers&) = delete;
  copy_buffers& operator=(const copy_buffers&) = delete;
  [[nodiscard]] void* target() const { return target_; }
  [[nodiscard]] const void* source() const { return host_; }

 private:
  backend::device& device_;
  backend::stream_ref stream_;
  void* host_;
  void* target_ = nullptr;
};

}  // namespace

copy_cost measure_copy_cost(backend::device& device, backend::stream_ref stream) {
  copy_buffers buffers(device, stream, large_copy_bytes);
  device.copy(stream, buffers.target(), buffers.source(), large_copy_bytes);  // warm: first-touch costs out
  device.synchronize(stream);

  // Per group: a small copy and its event, back to back as a load enqueues
  // them; the best of a few rounds (a busy host only adds to the figure).
  std::vector<std::unique_ptr<backend::event>> events;
  events.reserve(small_groups);
  for (std::size_t i = 0; i < small_groups; ++i) events.push_back(std::make_unique<backend::event>(device));
  double per_group = 0;
  for (int round = 0; round < measuring_rounds; ++round) {
    const auto start = clock_type::now();
    for (auto& e : events) {
      device.copy(stream, buffers.target(), buffers.source(), small_copy_bytes);
      e->record(stream);
    }
    device.synchronize(stream);
    const double t = seconds_since(start) / static_cast<double>(small_groups);
    per_group = round == 0 ? t : std::min(per_group, t);
  }

  double best = 0;
  for (int round = 0; round < measuring_rounds; ++round) {
    const auto start = clock_type::now();
    device.copy(stream, buffers.target(), buffers.source(), large_copy_bytes);
    device.synchronize(stream);
    const double t = seconds_since(start);
    best = round == 0 ? t : std::min(best, t);
  }
  return copy_cost{per_group, static_cast<double>(large_copy_bytes) / std::max(best, 1e-9)};
}

}  // namespace shoal::transfer
