// The allocators PyTorch allocates from when shoal.torch.enable() has run:
// one caching allocator per CUDA device, made on first use with the
// settings enable() gave, and the C table (torch_api.h) the plugin calls.
//
// They live for the rest of the process and are never destroyed: PyTorch
// frees tensors during interpreter shutdown and after it, from its own
// static destructors, so the allocators must outlive every module.
// Python reaches them through shoal.torch (stats, snapshot, trace), as
// Allocator objects sharing the same state.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"
#include "torch_api.h"

namespace shoal::python {

namespace {

constexpr int max_devices = 64;

// The plugin's segment observer (observe_segments); every allocator made
// here tells it of its segment events.
std::atomic<shoal_torch_segment_observer> segment_observer{nullptr};

shoal_torch_segment_action torch_action(alloc::trace_action action) {
  switch (action) {
    case alloc::trace_action::segment_free: return SHOAL_TORCH_SEGMENT_FREE;
    case alloc::trace_action::segment_map: return SHOAL_TORCH_SEGMENT_MAP;
    case alloc::trace_action::segment_unmap: return SHOAL_TORCH_SEGMENT_UNMAP;
    default: return SHOAL_TORCH_SEGMENT_ALLOC;
  }
}

void tell_segment_observer(int device, const alloc::segment_event& e) noexcept {
  const shoal_torch_segment_observer observe = segment_observer.load(std::memory_order_acquire);
  if (observe == nullptr) return;
  const shoal_torch_segment_event event{device, torch_action(e.action), e.address, e.size, e.stream.native,
                                        e.pool.value};
  observe(&event);
}

// The plugin's free-wait observer (observe_free_waits), told as the segment
// observer is.
std::atomic<shoal_torch_free_wait_observer> free_wait_observer{nullptr};

void tell_free_wait_observer(int device, const alloc::free_wait_event& e) noexcept {
  const shoal_torch_free_wait_observer observe = free_wait_observer.load(std::memory_order_acquire);
  if (observe == nullptr) return;
  const int action = e.what == alloc::free_wait_event::action::held ? SHOAL_TORCH_FREE_HELD : SHOAL_TORCH_FREE_COMPLETED;
  const shoal_torch_free_wait_event event{device, action, e.address, e.size, e.stream.native};
  observe(&event);
}

class torch_allocators {
 public:
  /// Settings for the allocators made from now on; refused once one exists
  /// with other settings.
  void configure(const alloc::allocator_config& config) {
    std::lock_guard lock(mutex_);
    if (made_ && config_ && config_->to_string() != config.to_string()) {
      throw invalid_argument("shoal.torch: PyTorch's allocators already run with '" + config_->to_string() +
                             "'; they cannot change to '" + config.to_string() + "'");
    }
    config_ = config;
  }

  /// Tests only: the allocators made from now on are the host backend's, so
  /// that the table's entries run where no GPU is (_torch_table_on_host).
  void serve_host_for_tests() {
    std::lock_guard lock(mutex_);
    if (made_) throw invalid_argument("shoal.torch: PyTorch's allocators exist already, on CUDA");
    host_for_tests_ = true;
  }

  [[nodiscard]] std::optional<std::string> settings() const {
    std::lock_guard lock(mutex_);
    if (!config_) return std::nullopt;
    return config_->to_string();
  }

  /// The allocator of CUDA device `ordinal`, made on first use.
  allocator_state& of(int ordinal) {
    if (ordinal < 0 || ordinal >= max_devices) {
      throw invalid_argument("shoal.torch: CUDA device " + std::to_string(ordinal) + " is out of range");
    }
    if (allocator_state* s = slots_[ordinal].load(std::memory_order_acquire)) return *s;
    std::lock_guard lock(mutex_);
    if (allocator_state* s = slots_[ordinal].load(std::memory_order_acquire)) return *s;
    if (!config_) throw invalid_argument("shoal.torch: enable() has not configured PyTorch's allocators");
    // Never destroyed (see the file comment): held by a shared_ptr that is
    // itself never released, so Python Allocator objects can share it.
    auto* held = new std::shared_ptr<allocator_state>(
        std::make_shared<allocator_state>(
            host_for_tests_ ? backend::host_device_instance() : backend::cuda_device_instance(ordinal), *config_));
    (*held)->allocator().add_segment_observer(
        [ordinal](const alloc::segment_event& e) { tell_segment_observer(ordinal, e); });
    if (free_wait_observer.load(std::memory_order_acquire) != nullptr) set_free_wait_hook(**held, ordinal, true);
    made_ = true;
    slots_[ordinal].store(held->get(), std::memory_order_release);
    shared_[ordinal] = held;
    return **held;
  }

  std::shared_ptr<allocator_state> shared(int ordinal) {
    (void)of(ordinal);
    std::lock_guard lock(mutex_);
    return *shared_[ordinal];
  }

  /// The allocator of CUDA device `ordinal` when one was made; null otherwise.
  [[nodiscard]] allocator_state* made(int ordinal) const {
    if (ordinal < 0 || ordinal >= max_devices) {
      throw invalid_argument("shoal.torch: CUDA device " + std::to_string(ordinal) + " is out of range");
    }
    return slots_[ordinal].load(std::memory_order_acquire);
  }

  [[nodiscard]] bool configured_growable_segments() const {
    std::lock_guard lock(mutex_);
    return config_ && config_->expandable_segments;
  }

  [[nodiscard]] double configured_memory_fraction() const {
    std::lock_guard lock(mutex_);
    return config_ ? config_->memory_fraction : 0.0;
  }

  /// While `observe` is set, every allocator (and each made later) tells it
  /// of its frees that wait for streams; unset, none has a free-wait
  /// observer, so such a free pays one relaxed load for it.
  void forward_free_waits(shoal_torch_free_wait_observer observe) {
    std::lock_guard lock(mutex_);
    free_wait_observer.store(observe, std::memory_order_release);
    for (int ordinal = 0; ordinal < max_devices; ++ordinal) {
      if (allocator_state* s = slots_[ordinal].load(std::memory_order_acquire)) {
        set_free_wait_hook(*s, ordinal, observe != nullptr);
      }
    }
  }

  template <class Fn>
  void for_each_made(Fn&& fn) {
    for (auto& slot : slots_) {
      if (allocator_state* s = slot.load(std::memory_order_acquire)) fn(*s);
    }
  }

 private:
  /// Adds or removes the forwarder of device `ordinal`'s frees that wait. mutex_ held.
  void set_free_wait_hook(allocator_state& s, int ordinal, bool on) {
    std::uint64_t& id = free_wait_hooks_[static_cast<std::size_t>(ordinal)];
    if (on && id == 0) {
      id = s.allocator().add_free_wait_observer(
          [ordinal](const alloc::free_wait_event& e) { tell_free_wait_observer(ordinal, e); });
    } else if (!on && id != 0) {
      s.allocator().remove_hook(std::exchange(id, 0));
    }
  }

  mutable std::mutex mutex_;
  std::optional<alloc::allocator_config> config_;  // guarded by mutex_
  bool made_ = false;                              // guarded by mutex_
  bool host_for_tests_ = false;                    // guarded by mutex_
  std::array<std::uint64_t, max_devices> free_wait_hooks_{};  // hook ids (0: none); guarded by mutex_
  std::array<std::atomic<allocator_state*>, max_devices> slots_{};
  std::array<std::shared_ptr<allocator_state>*, max_devices> shared_{};  // guarded by mutex_
};

torch_allocators& allocators() {
  static auto* instance = new torch_allocators();  // never destroyed: see the file comment
  return *instance;
}

thread_local std::string last_error_text;

/// Runs `fn`, turning what it throws into a status and last_error's text.
template <class Fn>
int guarded(Fn&& fn) noexcept {
  try {
    fn();
    return SHOAL_TORCH_OK;
  } catch (const out_of_memory& e) {
    last_error_text = e.what();
    return SHOAL_TORCH_OUT_OF_MEMORY;
  } catch (const invalid_argument& e) {
    last_error_text = e.what();
    return SHOAL_TORCH_INVALID_ARGUMENT;
  } catch (const std::exception& e) {
    last_error_text = e.what();
    return SHOAL_TORCH_ERROR;
  } catch (...) {
    last_error_text = "shoal.torch: unknown error";
    return SHOAL_TORCH_ERROR;
  }
}

/// PyTorch's stream `stream` as a stream of `state`'s device: adopted once
/// (device::adopt_external_stream), remembered per thread after that.
backend::stream_ref stream_of(allocator_state& state, void* stream) {
  if (stream == nullptr) return {};
  thread_local void* last_stream = nullptr;
  thread_local backend::device* last_device = nullptr;
  backend::device& device = state.allocator().device();
  if (stream == last_stream && &device == last_device) return backend::stream_ref{stream};
  const backend::stream_ref adopted = device.adopt_external_stream(stream);
  last_stream = stream;
  last_device = &device;
  return adopted;
}

/// Blocks of PyTorch tensors that a shoal storage took over (_torch_share,
/// so the memory can be shared with other processes): the tensor's free
/// drops this table's handle instead of freeing the block, which the
/// storage frees once its last handle — in Python, or a consumer's through
/// the sharing context — is gone, after every stream it was used on.
class shared_blocks {
 public:
  /// A handle of the storage over the block at `ptr` of `state`'s allocator,
  /// made (the block taken over, for use on `stream`) on the first call.
  storage_handle share(const std::shared_ptr<allocator_state>& state, void* ptr, std::size_t bytes,
                       backend::stream_ref stream) {
    std::lock_guard lock(mutex_);
    if (const auto it = blocks_.find(ptr); it != blocks_.end()) {
      if (bytes > it->second.get().size()) {
        throw invalid_argument("shoal.torch.share: the tensor's storage grew past the " +
                               std::to_string(it->second.get().size()) + " bytes shared before");
      }
      return it->second;
    }
    storage_handle handle(storage::storage::take_over(state->allocator(), ptr, bytes, stream), state);
    blocks_.emplace(ptr, handle);
    count_.fetch_add(1, std::memory_order_release);
    return handle;
  }

  /// True when the block at `ptr` was taken over (its free drops a handle).
  bool holds(void* ptr) {
    if (count_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard lock(mutex_);
    return blocks_.find(ptr) != blocks_.end();
  }

  /// True when the block at `ptr` was taken over: PyTorch's free then
  /// records `stream` on the storage and drops the table's handle.
  bool release(void* ptr, backend::stream_ref stream) {
    if (count_.load(std::memory_order_acquire) == 0) return false;  // the common case: one load
    std::optional<storage_handle> dropped;
    {
      std::lock_guard lock(mutex_);
      const auto it = blocks_.find(ptr);
      if (it == blocks_.end()) return false;
      dropped.emplace(std::move(it->second));
      blocks_.erase(it);
      count_.fetch_sub(1, std::memory_order_release);
    }
    dropped->get().record_stream(stream);  // the last handle's release waits for it
    return true;                           // `dropped` goes here, outside the lock
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, storage_handle> blocks_;  // guarded by mutex_
  std::atomic<std::size_t> count_{0};                 // blocks_.size(), read without the lock
};

shared_blocks& shared() {
  static auto* instance = new shared_blocks();  // never destroyed: see the file comment
  return *instance;
}

int api_allocate(size_t bytes, int device, void* stream, void** out) {
  return guarded([&] {
    auto& state = allocators().of(device);
    *out = state.allocator().allocate(bytes, stream_of(state, stream));
  });
}

int api_deallocate(void* ptr, int device, void* stream) {
  return guarded([&] {
    auto& state = allocators().of(device);
    const backend::stream_ref on = stream_of(state, stream);
    if (shared().release(ptr, on)) return;
    state.allocator().deallocate(ptr, on);
  });
}

int api_record_stream(void* ptr, int device, void* stream) {
  return guarded([&] {
    auto& state = allocators().of(device);
    state.allocator().record_stream(ptr, stream_of(state, stream));
  });
}

int api_empty_cache() {
  return guarded([] { allocators().for_each_made([](allocator_state& s) { s.allocator().empty_cache(); }); });
}

int api_set_memory_fraction(double fraction, int device) {
  return guarded([&] { allocators().of(device).allocator().set_memory_fraction(fraction); });
}

void copy_stats(const alloc::stat_by_pool& from, shoal_torch_stat (&to)[3]) {
  const alloc::stat* sources[3] = {&from.aggregate, &from.pool[0], &from.pool[1]};
  for (int i = 0; i < 3; ++i) to[i] = {sources[i]->current, sources[i]->peak, sources[i]->allocated, sources[i]->freed};
}

int api_get_stats(int device, shoal_torch_stats* out) {
  return guarded([&] {
    *out = {};
    allocator_state* made = allocators().made(device);
    if (made == nullptr) return;
    const alloc::allocator_stats s = made->allocator().stats();
    copy_stats(s.allocations, out->allocation);
    copy_stats(s.segments, out->segment);
    copy_stats(s.active, out->active);
    copy_stats(s.inactive_split, out->inactive_split);
    copy_stats(s.allocated_bytes, out->allocated_bytes);
    copy_stats(s.reserved_bytes, out->reserved_bytes);
    copy_stats(s.active_bytes, out->active_bytes);
    copy_stats(s.inactive_split_bytes, out->inactive_split_bytes);
    copy_stats(s.requested_bytes, out->requested_bytes);
    out->num_alloc_retries = s.retries;
    out->num_ooms = s.ooms;
    out->num_device_alloc = s.device_allocations;
    out->num_device_free = s.device_frees;
  });
}

int api_reset_peak_stats(int device) {
  return guarded([&] {
    if (allocator_state* made = allocators().made(device)) made->allocator().reset_peak_stats();
  });
}

int api_reset_accumulated_stats(int device) {
  return guarded([&] {
    if (allocator_state* made = allocators().made(device)) made->allocator().reset_accumulated_stats();
  });
}

const char* api_last_error() { return last_error_text.c_str(); }

alloc::private_pool_id pool_id(std::uint64_t pool) { return alloc::private_pool_id{pool}; }

int api_create_graph_pool(int device, uint64_t* out) {
  return guarded([&] { *out = allocators().of(device).allocator().create_growing_private_pool().value; });
}

int api_allocate_in_pool(uint64_t pool, size_t bytes, int device, void* stream, void** out) {
  return guarded([&] {
    auto& state = allocators().of(device);
    const backend::stream_ref on = stream_of(state, stream);
    const alloc::no_host_waits_scope no_waits;  // a wait on a capturing stream would invalidate its capture
    if (pool == 0) {
      *out = state.allocator().allocate(bytes, on);
      return;
    }
    alloc::private_pool_scope scope(state.allocator(), pool_id(pool));
    *out = state.allocator().allocate(bytes, on);
  });
}

int api_deallocate_without_events(void* ptr, int device, void* stream, int* freed) {
  return guarded([&] {
    auto& state = allocators().of(device);
    // A taken-over block's free records its stream on the storage: later.
    *freed = shared().holds(ptr) ? 0 : state.allocator().deallocate_without_events(ptr, stream_of(state, stream));
  });
}

int api_settle_graph_pool(uint64_t pool, int device) {
  return guarded([&] { allocators().of(device).allocator().forget_last_streams(pool_id(pool)); });
}

int api_checkpoint_graph_pool(uint64_t pool, int device, void** out, size_t* allocated_blocks) {
  return guarded([&] {
    auto checkpoint = std::make_unique<alloc::pool_checkpoint>(
        allocators().of(device).allocator().checkpoint_private_pool(pool_id(pool)));
    size_t allocated = 0;
    for (const auto& s : checkpoint->segments) {
      for (const auto& b : s.blocks) allocated += b.allocated ? 1 : 0;
    }
    *allocated_blocks = allocated;
    *out = checkpoint.release();
  });
}

int api_free_graph_pool_checkpoint(void* checkpoint) {
  delete static_cast<alloc::pool_checkpoint*>(checkpoint);
  return SHOAL_TORCH_OK;
}

int api_restore_graph_pool(uint64_t pool, int device, const void* checkpoint, void* context,
                           shoal_torch_restored_visitor visit) {
  alloc::pool_restore_result result;
  const int status = guarded([&] {
    if (checkpoint == nullptr) throw invalid_argument("shoal.torch: no checkpoint was given");
    if (visit == nullptr) throw invalid_argument("shoal.torch: a restore needs a visitor to tell what it changed");
    result = allocators().of(device).allocator().restore_private_pool(
        pool_id(pool), *static_cast<const alloc::pool_checkpoint*>(checkpoint));
  });
  if (status != SHOAL_TORCH_OK) return status;
  for (const std::uintptr_t address : result.freed) visit(context, SHOAL_TORCH_RESTORE_FREED, address, 0, nullptr);
  for (const auto& b : result.allocated) {
    visit(context, SHOAL_TORCH_RESTORE_ALLOCATED, b.address, b.size, b.stream.native);
  }
  return SHOAL_TORCH_OK;
}

int api_destroy_graph_pool(uint64_t pool, int device, int* destroyed) {
  return guarded([&] {
    auto& allocator = allocators().of(device).allocator();
    *destroyed = 0;
    if (!allocator.private_pool_allocated_blocks(pool_id(pool)).empty()) return;
    (void)allocator.destroy_private_pool(pool_id(pool));
    *destroyed = 1;
  });
}

int api_graph_pool_allocated_blocks(uint64_t pool, int device, void** out, size_t capacity, size_t* count) {
  return guarded([&] {
    const std::vector<void*> blocks = allocators().of(device).allocator().private_pool_allocated_blocks(pool_id(pool));
    *count = blocks.size();
    std::copy_n(blocks.begin(), std::min(capacity, blocks.size()), out);
  });
}

int api_largest_free_block(int device, size_t* out) {
  return guarded([&] {
    allocator_state* made = allocators().made(device);
    *out = made == nullptr ? 0 : made->allocator().largest_free_block();
  });
}

// What torch.multiprocessing needs to share a tensor's block the way
// PyTorch's allocator does: its cudaMalloc allocation, exported whole.
int api_block_segment(void* ptr, int device, void** base, size_t* size) {
  return guarded([&] {
    allocator_state* made = allocators().made(device);
    const std::optional<alloc::block_segment> segment =
        made == nullptr ? std::nullopt : made->allocator().segment_of_allocated_block(ptr);
    const auto where = [&] {
      char hex_address[24];
      const auto address = static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(ptr));
      std::snprintf(hex_address, sizeof hex_address, "%#zx", address);
      return std::string("shoal.torch: the CUDA block at ") + hex_address;
    };
    if (!segment) {
      throw invalid_argument(where() + " is not the start of a block shoal allocated on CUDA device " +
                             std::to_string(device));
    }
    switch (segment->kind) {
      case alloc::segment_kind::growable:
        throw invalid_argument(where() + " lies in a growable segment (expandable_segments, shoal.torch.enable()'s "
                               "default), which CUDA IPC cannot export: share it with shoal.torch.share() or "
                               "shoal.sharing (no ref-count files, faster), or enable shoal with "
                               "expandable_segments=False for torch.multiprocessing");
      case alloc::segment_kind::handed_in:
        throw invalid_argument(where() + " lies in memory handed to a private pool, which shoal did not allocate "
                               "and CUDA IPC cannot export as a whole");
      case alloc::segment_kind::plain:
        break;
    }
    *base = reinterpret_cast<void*>(segment->base);
    *size = segment->size;
  });
}

int api_configured_memory_fraction(double* out) {
  return guarded([&] { *out = allocators().configured_memory_fraction(); });
}

int api_grant_peer_access(int device, int peer) {
  return guarded([&] { allocators().of(device).allocator().device().grant_peer_access(peer); });
}

int api_configured_growable_segments(int* out) {
  return guarded([&] { *out = allocators().configured_growable_segments() ? 1 : 0; });
}

shoal_torch_block_state torch_state(alloc::block_state state) {
  switch (state) {
    case alloc::block_state::allocated: return SHOAL_TORCH_BLOCK_ALLOCATED;
    case alloc::block_state::pending_free: return SHOAL_TORCH_BLOCK_PENDING_FREE;
    case alloc::block_state::free: return SHOAL_TORCH_BLOCK_FREE;
    case alloc::block_state::invalidated: return SHOAL_TORCH_BLOCK_INVALIDATED;
  }
  return SHOAL_TORCH_BLOCK_INVALIDATED;  // unreachable: every state is named above
}

/// The blocks of each stretch of `segment` that memory backs, as [first,
/// last) indices of its runs of contiguous blocks: a plain segment's blocks
/// cover it, one run; a growable segment's snapshot lists only its mapped
/// blocks, one run per stretch (none when nothing is mapped).
std::vector<std::pair<std::size_t, std::size_t>> mapped_runs(const alloc::segment_snapshot& segment) {
  const auto& blocks = segment.blocks;
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const bool continues = i > 0 && blocks[i - 1].address + blocks[i - 1].size == blocks[i].address;
    if (!continues) runs.emplace_back(i, i);
    runs.back().second = i + 1;
  }
  return runs;
}

/// Gives `visit` each stretch of `segment`; false when a visit stopped the walk.
bool visit_segment(int device, const alloc::segment_snapshot& segment, void* context,
                   shoal_torch_segment_visitor visit) {
  std::vector<shoal_torch_block> blocks;
  blocks.reserve(segment.blocks.size());
  for (const alloc::block_snapshot& b : segment.blocks) blocks.push_back({b.size, b.requested, torch_state(b.state)});
  for (const auto& [first, last] : mapped_runs(segment)) {
    shoal_torch_segment out{};
    out.device = device;
    out.address = segment.blocks[first].address;
    for (std::size_t i = first; i < last; ++i) out.total_size += blocks[i].size;
    out.stream = segment.stream.native;
    out.is_large = segment.pool == alloc::pool_kind::large;
    out.is_expandable = segment.expandable;
    out.private_pool = segment.owner.value;
    out.sequence = segment.sequence;
    if (visit(context, &out, blocks.data() + first, last - first) != 0) return false;
  }
  return true;
}

int api_observe_segments(shoal_torch_segment_observer observe) {
  segment_observer.store(observe, std::memory_order_release);
  return SHOAL_TORCH_OK;
}

int api_observe_free_waits(shoal_torch_free_wait_observer observe) {
  return guarded([&] { allocators().forward_free_waits(observe); });
}

int api_snapshot(void* context, shoal_torch_segment_visitor visit) {
  return guarded([&] {
    std::vector<std::pair<int, alloc::snapshot>> taken;  // all of them before the first visit
    for (int device = 0; device < max_devices; ++device) {
      allocator_state* made = allocators().made(device);
      if (made != nullptr) taken.emplace_back(device, made->allocator().take_snapshot());
    }
    for (const auto& [device, snap] : taken) {
      for (const alloc::segment_snapshot& segment : snap.segments) {
        if (!visit_segment(device, segment, context, visit)) throw error("shoal.torch: the snapshot's reader stopped");
      }
    }
  });
}

const shoal_torch_api api_table = {
    SHOAL_TORCH_API_VERSION,
    sizeof(shoal_torch_api),
    api_allocate,
    api_deallocate,
    api_record_stream,
    api_empty_cache,
    api_set_memory_fraction,
    api_get_stats,
    api_reset_peak_stats,
    api_reset_accumulated_stats,
    api_last_error,
    api_create_graph_pool,
    api_allocate_in_pool,
    api_deallocate_without_events,
    api_settle_graph_pool,
    api_destroy_graph_pool,
    api_graph_pool_allocated_blocks,
    api_largest_free_block,
    api_block_segment,
    api_configured_memory_fraction,
    api_snapshot,
    api_observe_segments,
    api_observe_free_waits,
    api_configured_growable_segments,
    api_checkpoint_graph_pool,
    api_free_graph_pool_checkpoint,
    api_restore_graph_pool,
    api_grant_peer_access,
};

}  // namespace

// What PyTorch's allocations get unless the user says otherwise: growable
// segments, which pack a model's 1-10 MiB weights without the 20 MiB plain
// segments' tails (GPT-2 small: 530 MiB reserved against PyTorch's and the
// plain defaults' 584) at the same step time, measured on ResNet-50, BERT
// and GPT-2 (docs/architecture.md, "PyTorch's allocations use growable
// segments"). Where the device has no growable ranges, plain segments serve
// them (stats()["expandable_segments_fallback"]).
constexpr const char* torch_defaults = "expandable_segments:true";

// The settings of PyTorch's allocators: torch_defaults under the user's,
// except for pinned host memory, which has no growable segments.
alloc::allocator_config torch_config(const std::optional<std::string>& conf, bool use_environment,
                                     const nb::kwargs& settings) {
  const alloc::allocator_config asked = config_from_python(conf, use_environment, settings);
  if (asked.memory == alloc::allocator_memory::pinned_host) return asked;
  return config_from_python(conf, use_environment, settings, torch_defaults);
}

void register_torch_api(nb::module_& m) {
  m.def(
      "_torch_configure",
      [](const std::optional<std::string>& conf, bool use_environment, const nb::kwargs& settings) {
        allocators().configure(torch_config(conf, use_environment, settings));
      },
      nb::arg("conf").none() = nb::none(), nb::arg("use_environment") = true, nb::arg("settings"),
      "Settings of the allocators PyTorch will allocate from (shoal.torch.enable): expandable_segments:true "
      "(not with memory:pinned_host), then SHOAL_ALLOC_CONF, conf and keyword settings.");
  m.def(
      "_torch_config_text",
      [](const std::optional<std::string>& conf, bool use_environment, const nb::kwargs& settings) {
        return torch_config(conf, use_environment, settings).to_string();
      },
      nb::arg("conf").none() = nb::none(), nb::arg("use_environment") = true, nb::arg("settings"),
      "The SHOAL_ALLOC_CONF text of these settings (what _torch_settings reports once configured).");
  m.def(
      "_torch_settings", [] { return allocators().settings(); },
      "The settings given to _torch_configure, as SHOAL_ALLOC_CONF text, or None.");
  m.def(
      "_torch_table_on_host", [] { allocators().serve_host_for_tests(); },
      "Tests only: the table's allocators (made from now on) are the host backend's, so that its entries "
      "run where no GPU is. Refused once one exists.");
  m.def(
      "_torch_api", [] { return reinterpret_cast<std::uintptr_t>(&api_table); },
      "The address of the C table (python/src/torch_api.h) the PyTorch plugin calls.");
  m.def(
      "_torch_share",
      [](std::uintptr_t ptr, std::int64_t nbytes, int device, std::uintptr_t stream) {
        if (nbytes <= 0) throw invalid_argument("shoal.torch.share: the tensor's storage is empty");
        auto state = allocators().shared(device);
        const backend::stream_ref on = stream_of(*state, reinterpret_cast<void*>(stream));
        return py_storage{shared().share(state, reinterpret_cast<void*>(ptr), static_cast<std::size_t>(nbytes), on)};
      },
      nb::arg("ptr"), nb::arg("nbytes"), nb::arg("device"), nb::arg("stream"),
      "A Storage over the block at `ptr` (a tensor's storage, `nbytes` long) of PyTorch's shoal "
      "allocator on CUDA device `device`, for use on `stream` (a cudaStream_t): the block is taken "
      "over on the first call, and PyTorch's free of it then drops a handle instead (shoal.torch.share).");
  m.def(
      "_torch_allocator", [](int device) { return py_allocator{allocators().shared(device)}; }, nb::arg("device"),
      "The Allocator PyTorch allocates from on CUDA device `device` (made on first use).");
}

}  // namespace shoal::python
