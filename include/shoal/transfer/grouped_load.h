// Grouped loading: a model's parameters copied host→device group by group on
// a copy stream, one event per group, so the compute stream can start the
// first layers while later groups are still on their way.
//
// load_groups enqueues every group's copies on the copy stream in order and
// records an event after each group. A consumer makes its compute stream
// wait for group k (wait_for_group: a GPU-side wait, no host
// synchronization, no message per group) only before the first layer that
// needs group k. The copy stream runs the groups in order, so group k's
// event also covers groups 0..k-1.
//
// Sources should be page-locked (a pinned allocator's blocks, pinned
// tensors): the copies then run asynchronously at the link's speed. A
// pageable source is copied correctly, but the driver stages it and the
// enqueueing thread may stall.
//
// Thread-safety: a grouped_load is immutable once made; its members may be
// called from any threads at once. Lifetimes: the destinations must stay
// valid, and nothing else may write them, until their group is ready;
// `keep_alive` of each group is held until the load is destroyed, and
// destroying the load waits for its copies (so sources are never released
// under a copy still reading them). The copy stream must outlive the load.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/backend/stream.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::transfer {

/// One copy of a group: `bytes` bytes from host memory to device memory.
struct group_copy {
  void* device_destination = nullptr;
  const void* host_source = nullptr;
  std::size_t bytes = 0;  ///< > 0
};

/// The copies that make one group ready, and what keeps their memory valid.
struct load_group {
  std::vector<group_copy> copies;          ///< at least one
  std::shared_ptr<const void> keep_alive;  ///< may be null
};

class grouped_load {
 public:
  struct __attribute__((visibility("hidden"))) state;  // hidden: the library's own
  explicit grouped_load(std::shared_ptr<const state> s) : state_(std::move(s)) {}

  [[nodiscard]] std::size_t groups() const noexcept;
  /// Complete once groups 0..k have been copied. invalid_argument past the last
  /// group.
  [[nodiscard]] backend::event_ref group_ready(std::size_t k) const;
  /// Work enqueued on `stream` from now on sees groups 0..k (a GPU-side wait).
  void wait_for_group(std::size_t k, backend::stream_ref stream) const;
  /// True once groups 0..k have been copied.
  [[nodiscard]] bool is_group_ready(std::size_t k) const;
  /// Blocks the calling thread until every group has been copied.
  void synchronize() const;

 private:
  std::shared_ptr<const state> state_;
};

/// Enqueues the groups' copies on `copy_stream` (a stream of `device`), in
/// order, with an event after each group. invalid_argument (nothing
/// enqueued) for no groups, an empty group, or a copy with a null pointer or
/// zero bytes. Throws the device's error when a copy cannot be enqueued; the
/// copies enqueued before it are waited for before the error leaves.
[[nodiscard]] grouped_load load_groups(backend::device& device, backend::stream_ref copy_stream,
                                       std::vector<load_group> groups);

}  // namespace shoal::transfer

#pragma GCC visibility pop
