// Memory this process holds — a region borrowed from a lender, or any
// Storage — as the segment source of a torch.cuda.MemPool (shoal.torch.
// RegionPool): PyTorch's own caching allocator asks the pool's allocator for
// segments, and they are carved from the storage by a shoal caching
// allocator's private pool over it. So a process keeps PyTorch's allocator
// and still puts a model's tensors into memory it borrowed.
//
// PyTorch's custom allocators are two C functions with no context argument
// (torch._C._cuda_customAllocator takes their addresses), so each source
// sits in one of a fixed number of slots, and every slot has its own pair of
// functions. A slot is bound while its RegionPool is open, while a segment
// is out, and while PyTorch's MemPool object lives (a MemPool kept after
// close() still calls the slot's functions: they refuse, and the slot is not
// given to another pool meanwhile). The storage (and so the region) is held
// until all three have ended and its streams' work has passed (the private
// pool is drained first); the last of them lets it go outside the slot's lock.
//
// Thread-safety: the slot functions may be called from any thread, with or
// without the GIL (they never touch Python); each slot has its own lock.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "gil.h"
#include "shoal/core/error.h"

namespace shoal::python {

namespace {

constexpr std::size_t slot_count = 16;

/// One storage's memory lent out as segments.
class segment_source {
 public:
  /// `stream` (kept by the storage's handles) is where a lazy storage is
  /// materialized and the write access recorded.
  segment_source(const storage_handle& memory, backend::stream_ref stream)
      : memory_(memory),
        allocator_(std::make_shared<allocator_state>(memory.get().device(), alloc::allocator_config{})) {
    memory_.require_writable("shoal.torch.RegionPool");  // PyTorch writes what it allocates
    // PyTorch writes it in place from now on: never shared lazily again.
    memory_.get().mark_shared_outside_process(stream);
    const auto start = reinterpret_cast<std::uintptr_t>(memory_.get().mutable_data(stream));
    const std::uintptr_t aligned = (start + 511) / 512 * 512;  // private pools take whole 512-byte units
    const std::size_t skipped = aligned - start;
    if (memory_.get().size() < skipped + 512) {
      throw invalid_argument("shoal.torch.RegionPool: the storage holds less than one 512-byte aligned unit");
    }
    base_ = reinterpret_cast<void*>(aligned);
    bytes_ = (memory_.get().size() - skipped) / 512 * 512;
    pool_ = allocator_->allocator().create_private_pool(base_, bytes_);
  }

  ~segment_source() {
    auto& a = allocator_->allocator();
    try {
      a.destroy_private_pool(pool_);  // drains first: the streams PyTorch used pass before the memory goes
    } catch (const device_unavailable&) {
      // A fork() child's copy: the pool and its memory are the parent's.
    } catch (const std::exception& e) {
      // The memory may still be in use: keep it (and its allocator) for the
      // process's life rather than let it go under the work.
      std::fprintf(stderr, "shoal: closing a RegionPool's segment source failed, its memory is kept: %s\n", e.what());
      new storage_handle(memory_);                              // NOLINT(cppcoreguidelines-owning-memory)
      new std::shared_ptr<allocator_state>(allocator_);         // NOLINT(cppcoreguidelines-owning-memory)
    }
  }

  segment_source(const segment_source&) = delete;
  segment_source& operator=(const segment_source&) = delete;

  /// nullptr when the storage has no room left (PyTorch's out of memory)
  /// or PyTorch asks for another device's memory.
  void* allocate(std::size_t bytes, int device, void* stream) {
    auto& a = allocator_->allocator();
    if (a.device().kind() == backend::device_kind::cuda && device != a.device().ordinal()) {
      std::fprintf(stderr, "shoal: a RegionPool on CUDA device %d was asked for a segment of device %d\n",
                   a.device().ordinal(), device);
      return nullptr;
    }
    const backend::stream_ref on = stream == nullptr ? backend::stream_ref{} : a.device().adopt_external_stream(stream);
    alloc::private_pool_scope scope(a, pool_);
    try {
      void* p = a.allocate(bytes, on);
      ++segments_;
      return p;
    } catch (const out_of_memory&) {
      return nullptr;
    }
  }

  void deallocate(void* ptr, void* stream) {
    auto& a = allocator_->allocator();
    const backend::stream_ref on = stream == nullptr ? backend::stream_ref{} : a.device().adopt_external_stream(stream);
    a.deallocate(ptr, on);
    --segments_;
  }

  [[nodiscard]] std::size_t segments() const noexcept { return segments_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t segment_bytes() const {
    return static_cast<std::size_t>(allocator_->allocator().stats().allocated_bytes.aggregate.current);
  }
  [[nodiscard]] std::uintptr_t base() const noexcept { return reinterpret_cast<std::uintptr_t>(base_); }

 private:
  storage_handle memory_;  // first: the memory outlives the allocator carving it
  std::shared_ptr<allocator_state> allocator_;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  alloc::private_pool_id pool_{};
  std::size_t segments_ = 0;  // guarded by the slot's lock
};

struct slot {
  std::mutex mutex;
  std::unique_ptr<segment_source> source;  // guarded by mutex
  bool open = false;                       // guarded by mutex: its RegionPool has not closed it
  bool mem_pool_alive = false;             // guarded by mutex: PyTorch's MemPool object may still call
  std::uint64_t binding = 0;               // guarded by mutex: which opening bound it (unique in the process)
};

// The bindings handed out (_segment_source_new_binding); 0 is none.
std::atomic<std::uint64_t> last_binding{0};

std::array<slot, slot_count>& slots() {
  // Never destroyed: PyTorch may free segments from its static destructors.
  static auto* instance = new std::array<slot, slot_count>();
  return *instance;
}

slot& slot_at(std::size_t index) {
  if (index >= slot_count) throw invalid_argument("segment source " + std::to_string(index) + " does not exist");
  return slots()[index];
}

/// The slot's source once it is closed, has no segment out and no MemPool
/// that may call it: the caller destroys it outside the lock (that drains
/// streams and gives the region back).
std::unique_ptr<segment_source> unbind_if_done(slot& s) {
  if (s.open || s.mem_pool_alive || !s.source || s.source->segments() > 0) return nullptr;
  return std::move(s.source);
}

template <std::size_t K>
void* slot_allocate(std::size_t bytes, int device, void* stream) noexcept {
  const detail::keeping_the_gil kept;  // PyTorch's allocator mutex is held around this call
  slot& s = slots()[K];
  try {
    std::lock_guard lock(s.mutex);
    if (!s.open || !s.source) return nullptr;  // closed: PyTorch sees out of memory
    return s.source->allocate(bytes, device, stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal: a RegionPool could not carve a %zu-byte segment: %s\n", bytes, e.what());
    return nullptr;
  }
}

template <std::size_t K>
void slot_free(void* ptr, std::size_t /*bytes*/, int /*device*/, void* stream) noexcept {
  const detail::keeping_the_gil kept;  // PyTorch's allocator mutex is held: a GIL let go could not come back
  slot& s = slots()[K];
  try {
    std::unique_ptr<segment_source> done;
    {
      std::lock_guard lock(s.mutex);
      if (!s.source) return;
      s.source->deallocate(ptr, stream);
      done = unbind_if_done(s);
    }
    done.reset();  // outside the lock: drains the streams, gives the region back
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal: a RegionPool could not take a segment back: %s\n", e.what());
  }
}

using allocate_fn = void* (*)(std::size_t, int, void*) noexcept;
using free_fn = void (*)(void*, std::size_t, int, void*) noexcept;

template <std::size_t... K>
constexpr std::array<std::pair<allocate_fn, free_fn>, slot_count> make_functions(std::index_sequence<K...>) {
  return {std::pair<allocate_fn, free_fn>{&slot_allocate<K>, &slot_free<K>}...};
}
constexpr auto slot_functions = make_functions(std::make_index_sequence<slot_count>{});

}  // namespace

void register_segment_sources(nb::module_& m) {
  m.def(
      "_segment_source_new_binding", [] { return last_binding.fetch_add(1) + 1; },
      "A number no opening of a slot has had: what shoal.torch.RegionPool opens its slot under, known before "
      "the opening (a Ctrl-C as _segment_source_open returns loses the slot's number, not the binding).");
  m.def(
      "_segment_source_open",
      [](const py_storage& storage, std::optional<std::uint64_t> binding) {
        if (!binding) binding = last_binding.fetch_add(1) + 1;
        if (*binding == 0 || *binding > last_binding.load()) {
          throw invalid_argument("_segment_source_open: binding " + std::to_string(*binding) +
                                 " was not handed out by _segment_source_new_binding");
        }
        const storage_handle memory = storage.handle;  // with the GIL: another thread may assign the handle
        const auto stream = current_stream_state(memory.get().device());
        memory.keep_stream(stream);  // the storage's release waits for it
        // Without the GIL: marking the storage (its lock) may materialize it, which allocates and may
        // wait for pending frees; and a slot's lock is held across PyTorch's allocations from it.
        released_gil release;
        auto source = std::make_unique<segment_source>(memory, stream->ref());
        // One opening at a time from the checks to the binding: no two slots ever share a binding
        // (_segment_source_abandon would end both), nor carve the same bytes (each source has its
        // own allocator: neither would know the other's segments).
        static std::mutex opening;
        std::lock_guard one_at_a_time(opening);
        const std::uintptr_t begin = source->base();
        const std::uintptr_t end = begin + source->capacity();
        for (std::size_t i = 0; i < slot_count; ++i) {
          slot& s = slots()[i];
          std::lock_guard lock(s.mutex);
          if (s.binding == *binding) {
            throw invalid_argument("_segment_source_open: binding " + std::to_string(*binding) +
                                   " opened a slot already; draw a new one");
          }
          if (s.source && s.source->base() < end && begin < s.source->base() + s.source->capacity()) {
            throw invalid_argument(
                "shoal.torch.RegionPool: this memory is carved already by another RegionPool (slot " +
                std::to_string(i) + (s.open ? ", open" : ", closed but its tensors or MemPool still live") +
                "): two pools would hand out the same bytes; close that pool, free its tensors and drop its "
                "MemPool first");
          }
        }
        for (std::size_t i = 0; i < slot_count; ++i) {
          slot& s = slots()[i];
          std::lock_guard lock(s.mutex);
          if (s.source || s.mem_pool_alive) continue;
          s.source = std::move(source);
          s.open = true;
          s.mem_pool_alive = true;
          s.binding = *binding;
          return i;
        }
        throw invalid_argument("shoal.torch.RegionPool: " + std::to_string(slot_count) +
                               " region pools are open, still hold segments or still have their MemPool; close one, "
                               "free its tensors and drop its MemPool first");
      },
      nb::arg("storage"), nb::arg("binding").none() = nb::none(),
      "Binds a free slot to `storage`'s memory as a segment source, under `binding` (from "
      "_segment_source_new_binding; a new one when None); returns the slot.");
  m.def(
      "_segment_source_functions",
      [](std::size_t index) {
        (void)slot_at(index);
        return std::pair{reinterpret_cast<std::uintptr_t>(slot_functions[index].first),
                         reinterpret_cast<std::uintptr_t>(slot_functions[index].second)};
      },
      nb::arg("slot"),
      "The addresses of the slot's allocate(size, device, stream) and free(ptr, size, device, stream) "
      "functions, for torch._C._cuda_customAllocator.");
  m.def(
      "_segment_source_stats",
      [](std::size_t index) -> nb::dict {
        slot& s = slot_at(index);
        bool open = false;
        bool bound = false;
        std::size_t segments = 0;
        std::size_t segment_bytes = 0;
        std::size_t capacity_bytes = 0;
        std::uintptr_t base = 0;
        std::uint64_t binding = 0;
        {
          // Without the GIL: an allocation from the slot (PyTorch's, on any thread) holds its lock
          // while it waits for pending frees.
          released_gil release;
          std::lock_guard lock(s.mutex);
          open = s.open;
          bound = static_cast<bool>(s.source);
          segments = s.source ? s.source->segments() : 0;
          segment_bytes = s.source ? s.source->segment_bytes() : 0;
          capacity_bytes = s.source ? s.source->capacity() : 0;
          base = s.source ? s.source->base() : 0;
          binding = s.binding;
        }
        nb::dict d;
        d["open"] = open;
        d["bound"] = bound;
        d["segments"] = segments;
        d["segment_bytes"] = segment_bytes;
        d["capacity_bytes"] = capacity_bytes;
        d["base"] = base;
        d["binding"] = binding;
        return d;
      },
      nb::arg("slot"),
      "What the slot's source has carved out, and its `binding`: which opening of the slot (a slot serves "
      "another pool once unbound).");
  // `binding`: the opening of the slot the caller ends (a weak reference's
  // callback may come after the slot serves another); None: whichever.
  const auto end = [](std::size_t index, std::optional<std::uint64_t> binding, bool closing) {
    slot& s = slot_at(index);
    // Without the GIL: the slot's lock, as _segment_source_stats; and the drain (outside the
    // lock) waits for streams.
    detail::waiting_without_gil([&] {
      std::unique_ptr<segment_source> done;
      {
        std::lock_guard lock(s.mutex);
        if (binding && *binding != s.binding) return;
        (closing ? s.open : s.mem_pool_alive) = false;
        done = unbind_if_done(s);
      }
      done.reset();
    });
  };
  m.def(
      "_segment_source_abandon",
      [end](std::uint64_t binding) {
        for (std::size_t i = 0; i < slot_count; ++i) {
          end(i, binding, true);
          end(i, binding, false);
        }
      },
      nb::arg("binding"),
      "Ends opening `binding` of whichever slot it bound, as closing it and dropping its MemPool do (a "
      "RegionPool that failed as it was made, perhaps before it learnt its slot); nothing if none.");
  // Each takes a last argument it ignores: the weak reference whose callback it is
  // (shoal.torch.RegionPool's, a C call that runs no Python code a Ctrl-C could interrupt).
  m.def(
      "_segment_source_close",
      [end](std::size_t index, std::optional<std::uint64_t> binding, const nb::object&) { end(index, binding, true); },
      nb::arg("slot"), nb::arg("binding").none() = nb::none(), nb::arg("reference").none() = nb::none(),
      "No more segments from the slot (from its opening `binding`, when given); it is unbound (its storage "
      "dropped) once every segment is back and its MemPool is gone.");
  m.def(
      "_segment_source_mem_pool_gone",
      [end](std::size_t index, std::optional<std::uint64_t> binding, const nb::object&) {
        end(index, binding, false);
      },
      nb::arg("slot"), nb::arg("binding").none() = nb::none(), nb::arg("reference").none() = nb::none(),
      "The slot's MemPool object is gone (a weak reference's callback calls this): nothing calls the slot's "
      "functions any more.");
}

}  // namespace shoal::python
