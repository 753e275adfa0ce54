#include "transfer/staging_pack.h"

#include <algorithm>

namespace shoal::transfer {

staging_pack::staging_pack(alloc::caching_allocator& pinned, staging_frees& frees, backend::stream_ref stream,
                           std::size_t block_bytes, std::size_t total_bytes, std::size_t batches,
                           parallel_memcpy& memcpy, store_kind stores)
    : pinned_(pinned),
      frees_(frees),
      device_(pinned.device()),
      stream_(stream),
      block_bytes_(block_bytes),
      still_to_stage_(total_bytes),
      memcpy_(memcpy),
      stores_(stores),
      errors_(batches) {}

staging_pack::~staging_pack() { give_back(); }

void staging_pack::stage(void* dst, const void* dst_block, host_buffer& source, std::size_t batch) {
  const std::size_t needed = footprint(source.bytes);
  // The steps that may throw, before anything changes (doubling: reserving
  // one more each time would copy the lists on every buffer).
  if (unstaged_.size() == unstaged_.capacity()) unstaged_.reserve(std::max<std::size_t>(16, 2 * unstaged_.capacity()));
  if (sources_kept_.size() == sources_kept_.capacity()) {
    sources_kept_.reserve(std::max<std::size_t>(16, 2 * sources_kept_.capacity()));
  }
  if (used_ + needed > capacity_) {
    give_back();
    // Handed out only once the copies that last read it have run (the
    // pinned allocator's rule); past max_pinned_bytes it waits for them.
    const std::size_t capacity = std::clamp(still_to_stage_, needed, block_bytes_);
    frees_.retry();  // a block whose free was refused is the ring's again first
    block_ = static_cast<std::byte*>(pinned_.allocate(capacity, stream_));
    capacity_ = capacity;
  }
  std::byte* staging = block_ + used_;
  auto* to = static_cast<std::byte*>(dst);
  used_ += needed;  // the bytes are this buffer's from here: not reused in this block, whatever its copy does
  still_to_stage_ -= std::min(still_to_stage_, needed);
  if (continues_run(staging, to, dst_block)) {
    run_.bytes = static_cast<std::size_t>(staging - run_.from) + source.bytes;
    run_.last_batch = batch;
  } else {
    flush();
    run_ = {staging, to, dst_block, source.bytes, batch, batch};
  }
  unstaged_.push_back({staging, static_cast<const std::byte*>(source.data), source.bytes});
  if (source.keep_alive) sources_kept_.push_back(std::move(source.keep_alive));
}

// The run's copy may cover the gap before this buffer only when that gap is
// padding on both sides. In one device block, at the same distance from the
// run's start on both sides, with a device gap shorter than `alignment`:
// every buffer of the block starts `alignment`-aligned from it, so no other
// buffer's first byte fits between the run's end and `to` (and in the
// staging block, bytes between buffers are padding).
bool staging_pack::continues_run(const std::byte* from, const std::byte* to, const void* to_block) const noexcept {
  if (run_.bytes == 0 || to_block != run_.to_block) return false;
  const std::byte* run_end = run_.to + run_.bytes;
  return to >= run_end && static_cast<std::size_t>(to - run_end) < alignment && from - run_.from == to - run_.to;
}

void staging_pack::flush() noexcept {
  if (run_.bytes == 0) {
    unstaged_.clear();  // nothing to stage: no buffer is held past its run
    sources_kept_.clear();
    return;
  }
  try {
    // The run's buffers, staged at once: the pieces of a run of small
    // buffers are worth several threads together, though none is alone. At
    // most narrow_threads of them: on the H200 host groups of 64 and 256 KiB
    // batches went at half the speed on 16 threads as on 8.
    memcpy_.copy_all(unstaged_, stores_, parallel_memcpy::narrow_threads);
    device_.copy(stream_, run_.to, run_.from, run_.bytes);
    ++copies_;
  } catch (...) {
    for (std::size_t b = run_.first_batch; b <= run_.last_batch; ++b) {
      if (!errors_[b]) errors_[b] = std::current_exception();
    }
  }
  run_ = {};
  unstaged_.clear();
  sources_kept_.clear();
}

void staging_pack::give_back() noexcept {
  flush();
  if (block_ == nullptr) return;
  frees_.free(block_);  // after the run's copy, in stream order; kept to free again if refused
  block_ = nullptr;
  capacity_ = used_ = 0;
}

}  // namespace shoal::transfer
