#include "transfer/batch_copier.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "alloc/size_policy.h"
#include "shoal/core/error.h"
#include "transfer/staging_pack.h"

namespace shoal::transfer {

namespace {

alloc::allocator_config staging_config(const transfer_config& config) {
  alloc::allocator_config c;
  c.memory = alloc::allocator_memory::pinned_host;
  c.memory_limit = config.max_pinned_bytes;
  return c;
}

/// transfer_config::staging_helpers with automatic_staging_helpers resolved.
std::size_t staging_helpers_for(std::size_t asked) {
  if (asked != transfer_config::automatic_staging_helpers) return asked;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const std::size_t usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  // Measured on 16 CPUs (transfer_config::staging_helpers); fewer keep half.
  if (usable >= 16) return 15;
  return std::clamp<std::size_t>(usable / 2, 1, 8) - 1;
}

store_kind store_kind_of(transfer_config::stores stores) {
  switch (stores) {
    case transfer_config::stores::streaming:
      return store_kind::streaming;
    case transfer_config::stores::cached:
      return store_kind::cached;
    case transfer_config::stores::automatic:
      break;
  }
  return store_kind::automatic;
}

}  // namespace

std::size_t pinned_bytes_of_chunk(const transfer_config& config) {
  if (config.staging_chunk_bytes > alloc::detail::max_request) return alloc::allocator_config::no_limit;
  const std::size_t block = alloc::detail::block_size_for(config.staging_chunk_bytes, staging_config(config));
  // Under a memory limit a block gets a segment of its own size when the
  // pool's standard one does not fit (alloc/size_policy.h).
  return alloc::detail::fallback_segment_size_for(block);
}

transfer_engine::batch_copier::batch_copier(alloc::caching_allocator& device_allocator, backend::stream_ref stream,
                                            const transfer_config& config)
    : device_allocator_(device_allocator),
      device_(device_allocator.device()),
      stream_(stream),
      chunk_bytes_(config.staging_chunk_bytes),
      pinned_(device_allocator.device(), staging_config(config)),
      staging_frees_(pinned_, stream),
      queue_depth_(config.max_batches_in_flight),
      queue_bytes_(config.max_bytes_in_flight),
      stores_(store_kind_of(config.staging_stores)),
      memcpy_(staging_helpers_for(config.staging_helpers)) {}

transfer_engine::batch_copier::~batch_copier() { release_all(); }

std::vector<transfer_engine::outcome> transfer_engine::batch_copier::copy(std::span<job> jobs) {
  std::vector<outcome> outcomes;
  outcomes.reserve(jobs.size());
  std::size_t group_bytes = 0;
  for (const job& j : jobs) group_bytes += j.bytes();
  std::shared_ptr<backend::event> ready;
  try {
    make_room(jobs.size(), group_bytes);
    ready = std::make_shared<backend::event>(device_);
  } catch (...) {
    // The stream failed, or no event could be made: no batch of the group
    // can be transferred.
    for (const job& j : jobs) outcomes.push_back({j.sequence, j.bytes(), nullptr, std::current_exception(), nullptr});
    return outcomes;
  }
  std::vector<storage::storage> targets = group_targets(jobs);
  std::size_t packed_bytes = 0, kept_sources = 0;
  for (const job& j : jobs) {
    for (const host_buffer& b : j.buffers) {
      if (b.pinned) {
        kept_sources += b.keep_alive != nullptr;
      } else if (staging_pack::takes(b.bytes, chunk_bytes_)) {
        packed_bytes += staging_pack::footprint(b.bytes);
      }
    }
  }
  // Whatever the group's end needs is had before its first copy is
  // enqueued: from then on nothing may throw, or a source that copy reads
  // would be let go of while the copy is queued.
  std::vector<std::shared_ptr<const void>> read_directly;
  read_directly.reserve(kept_sources);
  // Per batch: a copy was enqueued straight from a pinned buffer the caller
  // keeps valid (no keep_alive) "until the batch is ready". A failed batch
  // is never ready, and its caller takes the buffer back at the error, so
  // such a batch is reported failed only once those copies have run.
  std::vector<char> reads_callers_memory(jobs.size(), 0);
  std::list<held_sources> held_entry(1);
  std::list<queued_group> queued_entry(1);
  {
    // Each batch's storages, held here until the pack's last run is enqueued
    // (a transferred batch's move into it, which lives longer): a failed
    // batch's storages must not be freed (and handed out again on this
    // stream) before a run copy bound for them. Declared before the pack, so
    // that should anything below throw, the pack's end enqueues its run
    // before they go.
    std::vector<std::vector<storage::storage>> per_batch(jobs.size());
    staging_pack pack(pinned_, staging_frees_, stream_, chunk_bytes_, packed_bytes, jobs.size(), memcpy_, stores_);
    // The block the storages are parts of: the group's, or each batch's own.
    const void* group_block = targets.empty() ? nullptr : targets.front().data();
    std::size_t first_target = 0;
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      job& j = jobs[i];
      outcome o{j.sequence, j.bytes(), nullptr, nullptr, nullptr};  // the tag: the engine's, set after
      const std::size_t first = first_target;
      first_target += j.buffers.size();
      bool reads = false;  // set by transfer as it goes, a throw midway included
      try {
        if (!targets.empty()) {
          const auto from = targets.begin() + static_cast<std::ptrdiff_t>(first);
          per_batch[i].assign(from, from + static_cast<std::ptrdiff_t>(j.buffers.size()));
        }
        o.batch = transfer(j, i, per_batch[i], group_block, ready, pack, read_directly, reads);
      } catch (...) {
        o.error = std::current_exception();
      }
      reads_callers_memory[i] = reads;
      outcomes.push_back(std::move(o));
    }
    pack.give_back();  // the last run's copy enqueued, the last block given back after it
    per_batch.clear();
    targets.clear();  // a failed batch's storages go here, after the copies bound for them
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      // A run's copy that failed fails every batch with a buffer in it.
      if (std::exception_ptr e = pack.error(i); e && outcomes[i].batch) {
        outcomes[i].batch = nullptr;  // its storages freed on the engine's stream, after the copies
        outcomes[i].error = e;
      }
    }
    copies_.fetch_add(pack.copies(), std::memory_order_relaxed);
  }
  // A failed batch that read its caller's memory directly waits for its
  // copies before it is reported (reads_callers_memory above).
  const auto failed_reading_callers_memory = [&] {
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      if (outcomes[i].error && reads_callers_memory[i]) return true;
    }
    return false;
  };
  try {
    ready->record(stream_);
  } catch (...) {
    // No batch of the group could be waited for: each fails, its storages
    // freed after its copies.
    for (outcome& o : outcomes) {
      if (o.batch) o.error = std::current_exception();
      o.batch = nullptr;
    }
    hold_until_now(std::move(read_directly));
    if (failed_reading_callers_memory()) wait_for_copies(nullptr);
    return outcomes;
  }
  if (!read_directly.empty()) {
    held_entry.front() = {ready, std::move(read_directly)};
    held_.splice(held_.end(), held_entry);
  }
  queued_entry.front() = {ready, jobs.size(), group_bytes};
  queued_.splice(queued_.end(), queued_entry);
  queued_batches_ += jobs.size();
  queued_bytes_ += group_bytes;
  if (failed_reading_callers_memory()) wait_for_copies(ready);
  return outcomes;
}

void transfer_engine::batch_copier::wait_for_copies(const std::shared_ptr<backend::event>& done) noexcept {
  try {
    if (done) {
      done->synchronize();
    } else {
      device_.synchronize(stream_);
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
  }
}

// The engine thread runs ahead of its stream by no more than queue_depth_
// batches and queue_bytes_ bytes (a group larger than that goes once the
// queue is empty): otherwise a consumer that takes and drops batches at once
// (its stream lagging behind) would let copies, and the device memory they
// fill, pile up without bound.
void transfer_engine::batch_copier::make_room(std::size_t batches, std::size_t bytes) {
  while (!queued_.empty() && (queued_batches_ + batches > queue_depth_ || !fits_beside(queued_bytes_, bytes, queue_bytes_))) {
    queued_.front().done->synchronize();
    queued_batches_ -= queued_.front().batches;
    queued_bytes_ -= queued_.front().bytes;
    queued_.pop_front();
  }
}

std::vector<storage::storage> transfer_engine::batch_copier::group_targets(std::span<const job> jobs) {
  if (jobs.size() < 2) return {};
  std::vector<std::size_t> sizes;
  for (const job& j : jobs) {
    for (const host_buffer& b : j.buffers) sizes.push_back(b.bytes);
  }
  try {
    return storage::storage::allocate_parts(device_allocator_, sizes, stream_);
  } catch (...) {
    // Out of memory for the group at once (or the stream failed): each
    // batch tries alone, and fails alone, with its own error.
    return {};
  }
}

std::vector<storage::storage> transfer_engine::batch_copier::batch_targets(const job& j) {
  if (j.buffers.size() == 1) return {storage::storage::allocate(device_allocator_, j.buffers[0].bytes, stream_)};
  std::vector<std::size_t> sizes;
  sizes.reserve(j.buffers.size());
  for (const host_buffer& b : j.buffers) sizes.push_back(b.bytes);
  return storage::storage::allocate_parts(device_allocator_, sizes, stream_);
}

std::shared_ptr<const transferred_batch::state> transfer_engine::batch_copier::transfer(
    job& j, std::size_t index, std::vector<storage::storage>& targets, const void* block,
    const std::shared_ptr<backend::event>& ready, staging_pack& pack,
    std::vector<std::shared_ptr<const void>>& read_directly, bool& reads_callers_memory) {
  auto batch = std::make_shared<transferred_batch::state>();
  batch->sequence = j.sequence;
  batch->device = &device_;
  batch->ready = ready;
  if (targets.empty()) {
    targets = batch_targets(j);
    block = targets.front().data();  // parts of a block start at its first part
  }
  for (std::size_t i = 0; i < j.buffers.size(); ++i) {
    host_buffer& source = j.buffers[i];
    void* dst = targets[i].mutable_data(stream_);
    if (source.pinned) {
      device_.copy(stream_, dst, source.data, source.bytes);
      copies_.fetch_add(1, std::memory_order_relaxed);
      if (source.keep_alive) {
        read_directly.push_back(std::move(source.keep_alive));
      } else {
        reads_callers_memory = true;
      }
    } else {
      if (staging_pack::takes(source.bytes, chunk_bytes_)) {
        pack.stage(dst, block, source, index);
      } else {
        pack.give_back();
        stage_in_chunks(dst, source);
      }
      bytes_staged_.fetch_add(source.bytes, std::memory_order_relaxed);
      source.keep_alive.reset();  // staged (or held by the pack until it is): the engine needs it no longer
    }
    bytes_copied_.fetch_add(source.bytes, std::memory_order_relaxed);
  }
  batch->storages = std::move(targets);  // no copy to fail: this batch's copies may be queued
  return batch;
}

void transfer_engine::batch_copier::stage_in_chunks(void* dst, const host_buffer& source) {
  const auto* from = static_cast<const std::byte*>(source.data);
  auto* to = static_cast<std::byte*>(dst);
  for (std::size_t offset = 0; offset < source.bytes; offset += chunk_bytes_) {
    const std::size_t n = std::min(chunk_bytes_, source.bytes - offset);
    // Handed out only once the copy that last read it has run (the pinned
    // allocator's rule); past max_pinned_bytes it waits for such a copy.
    staging_frees_.retry();  // a block whose free was refused is the ring's again first
    void* staging = pinned_.allocate(n, stream_);
    try {
      memcpy_.copy(staging, from + offset, n, stores_);
      device_.copy(stream_, to + offset, staging, n);
      copies_.fetch_add(1, std::memory_order_relaxed);
    } catch (...) {
      staging_frees_.free(staging);
      throw;
    }
    staging_frees_.free(staging);
  }
}

void transfer_engine::batch_copier::hold_until_now(std::vector<std::shared_ptr<const void>> sources) noexcept {
  if (sources.empty()) return;
  try {
    auto done = std::make_shared<backend::event>(device_);
    done->record(stream_);
    held_.push_back({std::move(done), std::move(sources)});
  } catch (...) {
    // No event to be had: wait on the host instead, then let go.
    try {
      device_.synchronize(stream_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the stream failed; its copies will never read again
    }
  }
}

bool transfer_engine::batch_copier::release_finished() noexcept {
  const bool staging_kept = staging_frees_.retry();
  try {
    while (!held_.empty() && held_.front().done->query()) held_.pop_front();
    return !held_.empty() || staging_kept;
  } catch (...) {
    // The event cannot be queried: the stream failed (CUDA reports an
    // earlier asynchronous failure so). As in release_all: once the stream
    // has stopped (at once when it failed) no copy reads a source any more.
    // The consumer learns of the failure from the batches (their
    // synchronize and is_ready) and from the next group's make_room, which
    // fails each of its batches with it (queued_ is left for that).
    try {
      device_.synchronize(stream_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
    }
    held_.clear();
    return staging_kept;
  }
}

void transfer_engine::batch_copier::release_all() noexcept {
  try {
    device_.synchronize(stream_);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
  }
  held_.clear();
  queued_.clear();
  queued_batches_ = queued_bytes_ = 0;
  staging_frees_.retry();  // the last chance before the staging allocator goes with the copier
}

}  // namespace shoal::transfer
