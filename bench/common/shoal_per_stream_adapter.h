// shoal with nothing shared between streams: every stream the adapter makes
// gets a caching allocator of its own. Not a way to use shoal, but the
// ceiling of the thread rows for shoal's own work: where the shared
// allocator scales as this one does, what it loses against the private-work
// row is the machine's (cores that share a pipeline, turbo), not sharing.
//
// Thread-safety: allocate and deallocate may be called from any thread at
// once, each stream from one thread at a time as the thread rows do;
// create_stream, destroy_stream and synchronize from one thread at a time,
// while no other call is running.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/common/allocator_adapter.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/device.h"

namespace shoal::bench {

class shoal_per_stream_adapter final : public allocator_adapter {
 public:
  shoal_per_stream_adapter(backend::device& device, alloc::allocator_config config)
      : device_(device), config_(std::move(config)) {}
  ~shoal_per_stream_adapter() override {
    for (auto& l : lanes_) close(*l);
  }
  shoal_per_stream_adapter(const shoal_per_stream_adapter&) = delete;
  shoal_per_stream_adapter& operator=(const shoal_per_stream_adapter&) = delete;

  [[nodiscard]] std::string name() const override { return "shoal per stream"; }

  /// The handle is the lane itself: its stream and its allocator.
  [[nodiscard]] void* create_stream() override {
    auto made = std::make_unique<lane>();
    made->stream = device_.create_stream();
    made->allocator = std::make_unique<alloc::caching_allocator>(device_, config_);
    lanes_.push_back(std::move(made));
    return lanes_.back().get();
  }

  void destroy_stream(void* handle) override {
    std::erase_if(lanes_, [&](const std::unique_ptr<lane>& l) {
      if (l.get() != handle) return false;
      close(*l);
      return true;
    });
  }

  [[nodiscard]] void* allocate(std::size_t bytes, void* handle) override {
    auto* l = static_cast<lane*>(handle);
    return l->allocator->allocate(bytes, l->stream);
  }

  void deallocate(void* ptr, std::size_t, void* handle) override {
    auto* l = static_cast<lane*>(handle);
    l->allocator->deallocate(ptr, l->stream);
  }

  [[nodiscard]] std::size_t reserved_bytes() const override {
    std::size_t total = 0;
    for (const auto& l : lanes_) total += static_cast<std::size_t>(l->allocator->stats().reserved_bytes.aggregate.current);
    return total;
  }

  /// The sum of the lanes' peaks (an upper bound: they need not coincide).
  [[nodiscard]] std::size_t peak_reserved_bytes() const override {
    std::size_t total = 0;
    for (const auto& l : lanes_) total += static_cast<std::size_t>(l->allocator->stats().reserved_bytes.aggregate.peak);
    return total;
  }

  void synchronize() override {
    for (const auto& l : lanes_) device_.synchronize(l->stream);
  }

 private:
  struct lane {
    backend::stream_ref stream;
    std::unique_ptr<alloc::caching_allocator> allocator;
  };
  void close(lane& l) {
    l.allocator.reset();  // before its stream: it may still use the stream while it gives memory back
    device_.destroy_stream(l.stream);
  }

  backend::device& device_;
  const alloc::allocator_config config_;
  std::vector<std::unique_ptr<lane>> lanes_;
};

}  // namespace shoal::bench
