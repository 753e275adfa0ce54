// The ready event that batches coalesced into one group share, and the
// streams that have waited for it already.
//
// The engine's thread records `ready` once, after the group's last copy, and
// never again; only then does any batch of the group reach a consumer. So a
// stream that has waited for `ready` (through any batch of the group) is
// ordered after every copy of the group, and a second wait on it would
// order nothing more: wait_on skips it.
//
// Why the stream in `waited_` is the stream asked about, not another one
// created since at the same address: a stream given to wait_on is used with
// the device allocator (the batch's storages record a use on it), so it
// outlives that allocator (transfer_engine.h, Lifetimes), and the allocator
// outlives every storage it handed out — among them those of the batch
// asking, which holds this group.
//
// Thread-safety: wait may be called from any threads at once.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "shoal/backend/stream.h"

namespace shoal::transfer {

class ready_group {
 public:
  /// Makes the event, not yet recorded.
  explicit ready_group(backend::device& dev) : ready_(std::make_shared<backend::event>(dev)), device_(dev) {}

  /// Recorded once on the engine's stream after the group's last copy;
  /// shared with the sources held until the copies have run.
  [[nodiscard]] const std::shared_ptr<backend::event>& ready() const noexcept { return ready_; }

  /// Work enqueued on `stream` from now on waits for the group's copies: a
  /// GPU-side wait the first time `stream` asks, nothing after that.
  void wait(backend::stream_ref stream) {
    std::lock_guard lock(mutex_);
    for (const backend::stream_ref waited : waited_) {
      if (waited == stream) return;
    }
    device_.wait(stream, ready_->ref());
    waited_.push_back(stream);  // after the wait: a later caller's work is enqueued after it
  }

 private:
  const std::shared_ptr<backend::event> ready_;
  backend::device& device_;
  std::mutex mutex_;
  std::vector<backend::stream_ref> waited_;  // guarded by mutex_; each has waited for ready_
};

}  // namespace shoal::transfer
