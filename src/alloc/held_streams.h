// Streams the allocator remembers past the call that named them beyond those
// its pools hold (pool_directory): the stream of a tombstone's late free and
// record_stream's streams kept in a private pool's free blocks as their last
// streams (a later hand-out on another stream waits for them). Each is held
// on the device once (device::hold_stream), until release_all at teardown,
// so its owner may destroy it meanwhile.
//
// Thread-safety: every member may be called from any thread at once. Its
// lock is a leaf (taken under a pool lock); only the device's own hold
// bookkeeping runs under it.
#pragma once

#include <mutex>
#include <vector>

#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

class held_streams {
 public:
  explicit held_streams(backend::device& device) : device_(device) {}
  held_streams(const held_streams&) = delete;
  held_streams& operator=(const held_streams&) = delete;

  /// Holds `stream` unless this already does (the default stream is never
  /// destroyed: not held). std::bad_alloc leaves it as it was.
  void hold(backend::stream_ref stream);
  /// Waits for the work queued on every held stream (errors dropped): at
  /// teardown, before the memory goes. A stream its owner destroyed is
  /// still there, with its work, until release_all.
  void synchronize_all() noexcept;
  /// Ends every hold (the streams destroyed meanwhile go now). Teardown
  /// only, after the allocator's last device calls; errors are dropped.
  void release_all() noexcept;

 private:
  backend::device& device_;
  std::mutex mutex_;
  std::vector<backend::stream_ref> streams_;  // guarded by mutex_; few
};

}  // namespace shoal::alloc::detail
