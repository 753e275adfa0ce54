#include "ipc/producer_state.h"

#include <algorithm>
#include <set>
#include <string>

#include "core/fork_epoch.h"
#include "core/process_wide_id.h"
#include "ipc/consumer_state.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"

namespace shoal::ipc::detail {

namespace {

// Owns the memory of a storage that was sent to other processes. Its
// destructor runs when the producer's last handle is gone: the block is
// freed at once if no slot is held, else it waits in the limbo.
class sent_data final : public storage::storage_owner {
 public:
  sent_data(std::shared_ptr<producer_state> state, void* data, std::size_t size)
      : state_(std::move(state)), data_(data), size_(size) {}
  ~sent_data() override {
    // A fork() child's drop of a storage it inherited: the block and the
    // limbo are the parent's, and so may be the state's lock.
    if (epoch_.forked_since()) return;
    backend::stream_ref stream;
    try {
      stream = backend::current_stream(state_->allocator.device());
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the default stream then
    }
    state_->retire(data_, size_, stream);
  }

  const producer_state* state() const noexcept { return state_.get(); }
  std::uintptr_t block() const noexcept { return reinterpret_cast<std::uintptr_t>(data_); }
  std::size_t bytes() const noexcept { return size_; }

 private:
  std::shared_ptr<producer_state> state_;
  void* data_;
  std::size_t size_;
  const shoal::detail::fork_epoch epoch_;
};

}  // namespace

producer_state::producer_state(alloc::caching_allocator& a, const sharing_options& o)
    : allocator(a), options(o), serial(shoal::detail::next_process_wide_id()), slots_(o.slots_per_file) {}

void producer_state::attach() {
  std::weak_ptr<producer_state> weak = weak_from_this();
  miss_hook_ = allocator.add_cache_miss_hook([weak] {
    if (auto self = weak.lock()) self->collect(false);
  });
  forced_clear_hook_ = allocator.add_forced_clear_hook([weak] {
    if (auto self = weak.lock()) self->unmark_released();
  });
  release_observer_ = allocator.add_release_observer([this](std::uintptr_t base, std::size_t bytes) {
    on_release(base, bytes);  // the state outlives the observer: removed in the destructor
  });
}

producer_state::~producer_state() {
  if (epoch.forked_since()) return;  // the hooks' lock may be a parent thread's
  // Blocks still in the limbo stay allocated: another process holds them.
  try {
    if (miss_hook_ != 0) allocator.remove_hook(miss_hook_);
    if (forced_clear_hook_ != 0) allocator.remove_hook(forced_clear_hook_);
    if (release_observer_ != 0) allocator.remove_hook(release_observer_);
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): ids we registered; cannot fail
  }
}

producer_state::share producer_state::share_storage(const storage::storage& st, const process_identity& holder,
                                                  backend::stream_ref stream) {
  if (&st.allocator() != &allocator) {
    throw invalid_argument("peer::send: the storage comes from another allocator than the sharing context's");
  }
  auto owner = st.hand_over(
      [this](void* data, std::size_t size) { return std::make_shared<sent_data>(shared_from_this(), data, size); },
      stream);
  auto* sent = dynamic_cast<sent_data*>(owner.get());
  if (sent != nullptr && sent->state() != this) {
    // Its block is freed through the first context's limbo, once every
    // holder that context counts has let it go: a second context's holders
    // would not be counted.
    throw invalid_argument(
        "peer::send: this storage was sent through another sharing context first (in Python, another Producer or "
        "SharingContext), which its memory belongs to from then on: send it again through that one, or send a copy");
  }
  if (sent == nullptr) {
    throw invalid_argument(
        "peer::send: this storage's memory belongs to another owner (it was received from another process, "
        "adopted, or is a part of a block shared with other storages, as the transfer engine's are); such a storage "
        "cannot be sent: copy it into a storage of its own and send the copy");
  }
  share s;
  const auto data = reinterpret_cast<std::uintptr_t>(st.data());
  s.segments = exports_for(data, st.size());
  s.offset = data - s.segments.front()->base;
  s.size = st.size();
  s.block = sent->block();
  std::vector<closed_file> closed;
  {
    std::lock_guard lock(mutex_);
    if (slots_.revoked(holder)) {
      throw peer_refused("peer::send: process " + std::to_string(holder.pid) +
                         " was revoked (peer::revoke); this context sends it nothing more");
    }
    // Another process may use the block until its slots are released: a
    // forced clear of a private pool must not take it back. Marked before
    // a slot exists (a block a forced clear took since hand_over refuses
    // here, with nothing claimed); unmarked once every slot is released
    // (prune_held) or by the block's free (free_blocks).
    auto it = held_.find(s.block);
    if (it == held_.end()) {
      allocator.mark_held_outside(reinterpret_cast<void*>(s.block));
      try {
        it = held_.try_emplace(s.block).first;
      } catch (...) {
        unmark(s.block);
        throw;
      }
    } else {
      prune(it->second);
    }
    try {
      it->second.reserve(it->second.size() + 1);
      s.slot = slots_.claim(holder, sent->block(), sent->bytes());
    } catch (...) {
      if (it->second.empty()) {  // no slot of it is held: no mark either
        unmark(s.block);
        held_.erase(it);
      }
      throw;
    }
    it->second.push_back(s.slot);
    s.file = slots_.file(s.slot.file_id);
    ++sent_;
    closed = slots_.take_closed_files();
  }
  post_files(closed);
  return s;
}

void producer_state::abandon(const share& s) {
  std::lock_guard lock(mutex_);
  // Released as its holder would; the owner's next prune or the limbo frees it.
  slots_.release(s.slot);
  prune_held(s.block);
}

void producer_state::unmark(std::uintptr_t block) noexcept {
  try {
    allocator.unmark_held_outside(reinterpret_cast<void*>(block));
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): a block of a live owner; cannot fail
  }
}

void producer_state::prune_held(std::uintptr_t block) {
  const auto it = held_.find(block);
  if (it == held_.end() || !prune(it->second)) return;
  unmark(block);
  held_.erase(it);
}

void producer_state::unmark_released() {
  std::vector<ready_block> ready;
  std::vector<closed_file> closed;
  {
    std::lock_guard lock(mutex_);
    for (auto it = held_.begin(); it != held_.end();) {
      if (prune(it->second)) {
        unmark(it->first);
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    ready = take_ready();
    closed = slots_.take_closed_files();
  }
  post_files(closed);
  free_blocks(ready);
}

std::vector<std::shared_ptr<const exported_segment>> producer_state::exports_for(std::uintptr_t data, std::size_t size) {
  std::vector<std::shared_ptr<const exported_segment>> out;
  std::lock_guard lock(exports_mutex_);
  for (std::uintptr_t p = data; p < data + size;) {
    auto it = exports_.upper_bound(p);
    std::shared_ptr<exported_segment> seg;
    if (it != exports_.begin() && p < std::prev(it)->first + std::prev(it)->second->handle.size) {
      seg = std::prev(it)->second;
    } else {
      seg = std::make_shared<exported_segment>();
      seg->handle = allocator.device().export_memory(reinterpret_cast<void*>(p));
      seg->base = p - seg->handle.offset;
      seg->handle.offset = 0;
      seg->id = shoal::detail::next_process_wide_id();
      exports_.emplace(seg->base, seg);
    }
    out.push_back(seg);
    p = seg->base + seg->handle.size;
  }
  return out;
}

void producer_state::on_release(std::uintptr_t base, std::size_t bytes) {
  std::vector<std::uint64_t> gone;
  {
    std::lock_guard lock(exports_mutex_);
    for (auto it = exports_.lower_bound(base); it != exports_.end() && it->first < base + bytes;) {
      gone.push_back(it->second->id);
      it = exports_.erase(it);
    }
  }
  if (!gone.empty()) post_segments(gone);
}

void producer_state::post_segments(const std::vector<std::uint64_t>& segments) {
  std::lock_guard lock(exports_mutex_);
  for (auto& box : outboxes_.live()) {
    std::lock_guard box_lock(box->mutex);
    for (const auto id : segments) {
      if (box->announced.erase(id) != 0) box->segments.push_back(id);
    }
  }
}

void producer_state::post_files(const std::vector<closed_file>& files) noexcept {
  if (files.empty()) return;
  try {
    std::lock_guard lock(exports_mutex_);
    for (auto& box : outboxes_.live()) {
      std::lock_guard box_lock(box->mutex);
      for (const auto& f : files) {
        if (f.holder == box->peer) box->files.push_back(f.id);
      }
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): out of memory: the holder keeps its mapping longer
  }
}

void producer_state::add_receiver(const std::shared_ptr<consumer_state>& receiver) {
  std::lock_guard lock(exports_mutex_);
  receivers_.add_unique(receiver);  // connections to one producer share a table
}

void producer_state::add_outbox(const std::shared_ptr<outbox>& box) {
  std::lock_guard lock(exports_mutex_);
  outboxes_.add(box);
}

bool producer_state::prune(std::vector<slot_ref>& slots) {
  std::erase_if(slots, [&](const slot_ref& s) {
    if (!slots_.released(s)) return false;
    slots_.recycle(s);
    return true;
  });
  return slots.empty();
}

void producer_state::retire(void* data, std::size_t size, backend::stream_ref stream) noexcept {
  std::vector<ready_block> ready;
  std::vector<closed_file> closed;
  {
    std::lock_guard lock(mutex_);
    // Its slots go with it into the limbo (still marked: the free ends it).
    std::vector<slot_ref> slots;
    if (auto node = held_.extract(reinterpret_cast<std::uintptr_t>(data))) slots = std::move(node.mapped());
    if (prune(slots)) {
      ready.push_back({data, stream});
    } else {
      limbo_.push_back({data, size, stream, std::move(slots)});
      limbo_bytes_ += size;
    }
    // A shared block's release is one of the moments the limbo is looked at.
    auto more = take_ready();
    ready.insert(ready.end(), more.begin(), more.end());
    closed = slots_.take_closed_files();
  }
  post_files(closed);
  free_blocks(ready);
}

std::vector<producer_state::ready_block> producer_state::take_ready() {
  std::vector<ready_block> ready;
  std::erase_if(limbo_, [&](limbo_entry& e) {
    if (!prune(e.slots)) return false;
    ready.push_back({e.data, e.stream});
    limbo_bytes_ -= e.size;
    ++limbo_freed_;
    return true;
  });
  return ready;
}

std::size_t producer_state::collect(bool reclaim) {
  std::vector<ready_block> ready;
  std::vector<closed_file> closed;
  {
    std::lock_guard lock(mutex_);
    if (reclaim) reclaimed_ += slots_.reclaim_dead_holders();
    ready = take_ready();
    closed = slots_.take_closed_files();
  }
  post_files(closed);
  free_blocks(ready);
  if (reclaim) {
    std::vector<std::shared_ptr<consumer_state>> receivers;
    {
      std::lock_guard lock(exports_mutex_);
      receivers = receivers_.live();
    }
    for (auto& r : receivers) r->close_finished();
    held_for_producers->left_open.close_released(*held_for_producers);
  }
  return ready.size();
}

void producer_state::free_blocks(const std::vector<ready_block>& blocks) noexcept {
  for (const auto& b : blocks) {
    try {
      allocator.deallocate(b.data, b.stream);
    } catch (const error&) {
      // The stream it was dropped on is gone: every slot is released, so only
      // this process's own work could still touch it, the gone stream's
      // included (on CUDA it runs on after cudaStreamDestroy returns).
      try {
        allocator.device().synchronize_device();
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): failed work reads nothing more
      }
      try {
        allocator.deallocate(b.data, backend::stream_ref{});
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): stays allocated, visible in the stats
      }
    }
  }
}

void producer_state::connect(const process_identity& peer) {
  std::lock_guard lock(mutex_);
  slots_.connect(peer);
}

void producer_state::disconnect(const process_identity& peer) {
  std::vector<closed_file> closed;
  {
    std::lock_guard lock(mutex_);
    slots_.disconnect(peer);
    closed = slots_.take_closed_files();
  }
  post_files(closed);
}

void producer_state::revoke(const process_identity& peer) {
  std::lock_guard lock(mutex_);
  slots_.revoke(peer);
}

bool producer_state::revoked(const process_identity& peer) const {
  std::lock_guard lock(mutex_);
  return slots_.revoked(peer);
}

std::vector<holder_stats> producer_state::holders() const {
  using key = std::pair<pid_t, std::uint64_t>;
  const auto key_of = [](const process_identity& p) { return key{p.pid, p.start_time}; };
  std::map<key, holder_stats> by_holder;
  std::map<key, std::set<std::uintptr_t>> blocks_of;
  std::map<std::uintptr_t, std::set<key>> holders_of;
  std::lock_guard lock(mutex_);
  for (const auto& h : slots_.holders()) {
    by_holder[key_of(h.holder)] = {.process = h.holder, .connections = h.connections, .revoked = h.revoked};
  }
  for (const auto& r : slots_.held()) {
    holder_stats& s = by_holder[key_of(r.holder)];
    ++s.references;
    if (blocks_of[key_of(r.holder)].insert(r.block).second) s.pinned_bytes += r.bytes;
    holders_of[r.block].insert(key_of(r.holder));
  }
  for (const auto& e : limbo_) {
    const auto it = holders_of.find(reinterpret_cast<std::uintptr_t>(e.data));
    if (it == holders_of.end() || it->second.size() != 1) continue;
    holder_stats& s = by_holder[*it->second.begin()];
    ++s.limbo_blocks;
    s.limbo_bytes += e.size;
  }
  std::vector<holder_stats> out;
  for (auto& [k, s] : by_holder) out.push_back(s);
  return out;
}

sharing_stats producer_state::stats() const {
  sharing_stats s;
  {
    std::lock_guard lock(mutex_);
    s.limbo_blocks = limbo_.size();
    s.limbo_bytes = limbo_bytes_;
    s.held_slots = slots_.slots_in_use();
    s.counter_files = slots_.file_count();
    s.storages_sent = sent_;
    s.limbo_freed = limbo_freed_;
    s.slots_reclaimed = reclaimed_;
  }
  std::lock_guard lock(exports_mutex_);
  s.exported_segments = exports_.size();
  s.producers_mapped_bytes = held_for_producers->mapped_bytes.load(std::memory_order_relaxed);
  s.producer_resources = held_for_producers->resources.load(std::memory_order_relaxed);
  return s;
}

}  // namespace shoal::ipc::detail
