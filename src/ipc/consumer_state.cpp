#include "ipc/consumer_state.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>

#include "core/deadline.h"
#include "core/fork_epoch.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"

namespace shoal::ipc::detail {

namespace {

constexpr std::uint64_t one_view = 2, retired_bit = 1;

// Owns a received storage's view: when the storage goes, it releases the
// producer's slot once the receive stream and every stream the storage was
// used on have passed their uses (a host task on each stream still busy; the
// last to run releases), then counts the mapping's view down. Out of host
// memory, a stream that cannot be remembered or given a host task is waited
// for on the host instead: a release path never throws.
class received_data final : public storage::storage_owner {
 public:
  received_data(std::shared_ptr<consumer_state> receiver, std::shared_ptr<release_sink> sink,
                std::shared_ptr<mapping> m, std::shared_ptr<counter_file> file, slot_ticket slot,
                backend::stream_ref received_on)
      : receiver_(std::move(receiver)),
        sink_(std::move(sink)),
        mapping_(std::move(m)),
        file_(std::move(file)),
        slot_(slot),
        received_on_(received_on) {}

  void storage_released(std::span<const backend::stream_ref> used_on) noexcept override {
    if (epoch_.forked_since()) return;  // see the destructor
    std::lock_guard lock(used_on_mutex_);
    for (auto s : used_on) {
      if (s == received_on_ || std::ranges::find(also_used_on_, s) != also_used_on_.end()) continue;
      try {
        also_used_on_.push_back(s);
      } catch (const std::bad_alloc&) {
        wait_on_host(s);
      }
    }
  }

  ~received_data() override {
    // A fork() child's drop of a storage it inherited: the slot, the
    // mapping's count and the streams are the parent's, and so may be the
    // locks on the way (the sink's, the device's stream registry).
    if (epoch_.forked_since()) return;
    auto release = [sink = sink_, m = mapping_, file = file_, slot = slot_] {
      file->release(slot);
      sink->held.fetch_sub(1, std::memory_order_relaxed);
      if (m->state.fetch_sub(one_view, std::memory_order_acq_rel) == one_view + retired_bit) {
        std::lock_guard lock(sink->mutex);
        sink->finished.push_back(m);
      }
    };
    backend::device& dev = receiver_->allocator.device();
    // One count per host task and one for this destructor: the last to count
    // down releases. A stream that is gone (its user broke the rule that it
    // outlives its uses) is waited for with the whole device: on CUDA its
    // work goes on after cudaStreamDestroy returns.
    std::shared_ptr<std::atomic<std::size_t>> pending;
    auto wait_for = [&](backend::stream_ref stream) {
      try {
        if (dev.query(stream)) return;  // every use there has run: no host task needed
      } catch (const error&) {
        wait_for_the_device();
        return;
      }
      try {
        if (!pending) pending = std::make_shared<std::atomic<std::size_t>>(1);
      } catch (const std::bad_alloc&) {
        wait_on_host(stream);
        return;
      }
      pending->fetch_add(1, std::memory_order_relaxed);
      try {
        dev.host_task(stream, [pending, release] {
          if (pending->fetch_sub(1, std::memory_order_acq_rel) == 1) release();
        });
      } catch (const error&) {
        pending->fetch_sub(1, std::memory_order_relaxed);  // gone meanwhile
        wait_for_the_device();
      } catch (const std::bad_alloc&) {
        pending->fetch_sub(1, std::memory_order_relaxed);
        wait_on_host(stream);
      }
    };
    wait_for(received_on_);
    for (auto s : also_used_on_) wait_for(s);
    if (!pending || pending->fetch_sub(1, std::memory_order_acq_rel) == 1) release();
  }

 private:
  void wait_on_host(backend::stream_ref stream) noexcept {
    try {
      receiver_->allocator.device().synchronize(stream);
    } catch (...) {
      wait_for_the_device();  // a stream that is gone: as in the destructor
    }
  }
  // Everything enqueued on the device so far, destroyed streams' work
  // included; a device that fails it has no work left that reads the view.
  void wait_for_the_device() noexcept {
    try {
      receiver_->allocator.device().synchronize_device();
    } catch (...) {  // NOLINT(bugprone-empty-catch)
    }
  }

  std::shared_ptr<consumer_state> receiver_;  // keeps the mappings open while the view lives
  std::shared_ptr<release_sink> sink_;
  std::shared_ptr<mapping> mapping_;
  std::shared_ptr<counter_file> file_;
  slot_ticket slot_;
  const backend::stream_ref received_on_;
  std::mutex used_on_mutex_;
  std::vector<backend::stream_ref> also_used_on_;  // guarded by used_on_mutex_ until the destructor
  const shoal::detail::fork_epoch epoch_;
};

}  // namespace

consumer_state::consumer_state(const process_identity& p, alloc::caching_allocator& a, const sharing_options& o,
                               std::shared_ptr<context_holdings> held_for_producers)
    : producer(p), allocator(a), options(o), held_(std::move(held_for_producers)) {}

std::shared_ptr<consumer_state> consumer_state::for_producer(const process_identity& producer, std::uint64_t context,
                                                             alloc::caching_allocator& allocator,
                                                             const sharing_options& options,
                                                             std::shared_ptr<context_holdings> held_for_producers) {
  using key = std::tuple<pid_t, std::uint64_t, std::uint64_t>;
  static std::mutex mutex;
  static std::map<key, std::weak_ptr<consumer_state>> tables;
  std::lock_guard lock(mutex);
  std::erase_if(tables, [](const auto& entry) { return entry.second.expired(); });
  auto& slot = tables[key{producer.pid, producer.start_time, context}];
  auto table = slot.lock();
  if (!table) {
    table = std::make_shared<consumer_state>(producer, allocator, options, held_for_producers);
    slot = table;
    std::lock_guard tables_lock(held_for_producers->tables_mutex);
    std::erase_if(held_for_producers->tables, [](const auto& t) { return t.expired(); });
    held_for_producers->tables.push_back(table);
  }
  return table;
}

consumer_state::~consumer_state() {
  // Every received storage is gone; their releases may still wait on streams,
  // and a stream may wait for a ready point of the producer. The producer is
  // not trusted to pass it: past the deadline, the mappings still in use stay
  // open, and so do the event sources those waits may use (host tasks cannot
  // close them; the slots are still released when the streams move on), left
  // to the context (left_open_imports.h), which closes them and gives their
  // counts back once the releases have run.
  // The segments' descriptors go with this table (counter files give theirs
  // back as they go: storages may keep them).
  give_back(held_->resources, segments_.size());
  const auto until = shoal::detail::deadline_after(options.teardown_timeout);
  const auto in_use = [](const std::shared_ptr<mapping>& m) { return mapping_in_use(*m); };
  for (;;) {
    bool busy = false;
    for (auto& [ids, m] : mappings_) busy = busy || in_use(m);
    for (auto& m : retired_) busy = busy || in_use(m);
    if (!busy) break;
    if (std::chrono::steady_clock::now() >= until) {
      leave_open_what_is_in_use();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  for (auto& [ids, m] : mappings_) close(*m);
  for (auto& m : retired_) close(*m);
  for (auto& [id, source] : sources_) {
    try {
      allocator.device().close_event_source(source);
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): teardown goes on
    }
  }
  give_back(held_->resources, sources_.size());
}

void consumer_state::leave_open_what_is_in_use() noexcept {
  left_open_imports::table_remains remains{&allocator.device(), producer, {}, {}};
  const auto sort = [&](const std::shared_ptr<mapping>& m) {
    if (mapping_in_use(*m)) {
      remains.mappings.push_back(m);  // within the room reserved below
    } else {
      close(*m);
    }
  };
  try {
    remains.mappings.reserve(mappings_.size() + retired_.size());
    remains.sources.reserve(sources_.size());
    for (auto& [ids, m] : mappings_) sort(m);
    for (auto& m : retired_) sort(m);
    for (auto& [id, source] : sources_) remains.sources.push_back(source);
    held_->left_open.keep(std::move(remains));
  } catch (const std::bad_alloc&) {
    // No host memory to remember them: they stay open and counted for the
    // process's life, which is safe (nothing is unmapped under a read).
  }
}

namespace {

// A peer past one of sharing_options' announcement limits.
void check_room(std::size_t announced, std::size_t limit, const char* what, const char* option) {
  if (announced >= limit) {
    throw protocol_error(std::string("the producer announced more than ") + std::to_string(limit) + " " + what +
                         " at once (sharing_options::" + option + ")");
  }
}

}  // namespace

void consumer_state::add_counter_file(const counter_file_message& m, unique_fd fd) {
  // Checked and added under one lock: connections announcing at once cannot
  // pass the limit between the check and the add.
  std::lock_guard lock(mutex_);
  if (files_.contains(m.file_id)) return;  // another connection announced it first
  check_room(files_.size(), options.max_peer_counter_files, "counter files", "max_peer_counter_files");
  reservation reserved = reserve_resource("counter_file message");
  // Counted until the last storage of its slots goes: they keep it mapped
  // after the producer retires it (a producer retiring a file per storage
  // would otherwise keep uncounted descriptors and mappings here, found in review).
  auto file = std::make_unique<counter_file>(counter_file::open(std::move(fd), m.slots));
  // From here the deleter owns the count, however the file goes: a shared_ptr
  // that cannot allocate its control block calls it too, as does a map node
  // refused (kept after them, the count was given back twice: found in review).
  reserved.keep();
  files_.emplace(m.file_id, std::shared_ptr<counter_file>(file.release(), [held = held_](counter_file* f) {
                   delete f;
                   give_back(held->resources, 1);
                 }));
}

void consumer_state::add_segment(segment_message m) {
  if (m.handle.device != allocator.device().kind()) {
    throw protocol_error("segment message: the producer shares " + std::string(backend::to_string(m.handle.device)) +
                         " memory; this process's allocator is on a " +
                         std::string(backend::to_string(allocator.device().kind())) + " device");
  }
  std::lock_guard lock(mutex_);
  if (segments_.contains(m.segment_id)) return;  // as for files
  check_room(segments_.size(), options.max_peer_segments, "segments", "max_peer_segments");
  if (m.handle.size > options.max_peer_mapped_bytes) {
    throw protocol_error("segment message: a segment of " + std::to_string(m.handle.size) +
                         " bytes, over the " + std::to_string(options.max_peer_mapped_bytes) +
                         " of a producer's this process maps at once (sharing_options::max_peer_mapped_bytes)");
  }
  reservation reserved = reserve_resource("segment message");
  segments_.emplace(m.segment_id, std::move(m.handle));
  reserved.keep();
}

void consumer_state::add_event_source(backend::event_source source) {
  std::lock_guard lock(mutex_);
  if (sources_.contains(source.source_id)) return;  // as for files
  check_room(sources_.size(), options.max_peer_event_sources, "event sources", "max_peer_event_sources");
  reservation reserved = reserve_resource("event_source message");
  backend::imported_event_ref opened;
  try {
    opened = allocator.device().open_event_source(source);
  } catch (const protocol_error&) {
    throw;
  } catch (const invalid_argument& e) {
    throw protocol_error(std::string("event_source message: ") + e.what());
  }
  source.fd.mark_safe_to_close();  // opened: the device's own kind (a sealed memfd page)
  // A page naming another process could tie this process's waits to that
  // process's life (device::event_source_exporter).
  if (const auto exporter = allocator.device().event_source_exporter(opened); exporter && *exporter != producer) {
    allocator.device().close_event_source(opened);
    throw protocol_error("event_source message: the source names process " + std::to_string(exporter->pid) +
                         " as its exporter, but it came from process " + std::to_string(producer.pid));
  }
  sources_.emplace(source.source_id, opened);
  reserved.keep();
}

void consumer_state::retire_segments(const std::vector<std::uint64_t>& ids) {
  std::lock_guard lock(mutex_);
  for (auto id : ids) {
    // An id not announced (or retired already) is in no mapping: nothing to
    // look for (a peer listing thousands of them must not cost a scan each).
    if (segments_.erase(id) == 0) continue;
    give_back(held_->resources, 1);
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      if (std::ranges::find(it->first, id) == it->first.end()) {
        ++it;
        continue;
      }
      retire(it->second);
      it = mappings_.erase(it);
    }
  }
}

void consumer_state::retire(const std::shared_ptr<mapping>& m) {
  retired_.push_back(m);
  if (m->state.fetch_or(retired_bit, std::memory_order_acq_rel) == 0) {
    // Nothing uses it. Closed by the collector, not here: a close costs
    // tens of microseconds on CUDA, which receive() should not pay.
    std::lock_guard lock(sink_->mutex);
    sink_->finished.push_back(m);
  }
}

void consumer_state::retire_files(const std::vector<std::uint64_t>& ids) {
  std::lock_guard lock(mutex_);
  for (auto id : ids) files_.erase(id);  // storages still holding slots keep their mapping of it
}

reservation consumer_state::reserve_resource(const char* what) {
  const auto taken = [&] { return reserve(held_->resources, 1, options.max_producer_resources); };
  if (!taken()) {
    close_unused_in_every_table();
    if (taken()) return reservation(held_->resources, 1);
    throw protocol_error(std::string(what) + ": this process holds " + std::to_string(options.max_producer_resources) +
                         " descriptors and mappings for its producers already (sharing_options::max_producer_resources)");
  }
  return reservation(held_->resources, 1);
}

void consumer_state::make_room_to_map(std::size_t chunks, std::size_t bytes) {
  const std::size_t limit = options.max_peer_segments;
  const std::size_t byte_limit = options.max_peer_mapped_bytes;
  // Every retired mapping counts, those whose last view went too: the
  // collector closes them only every collect_interval, and a producer that
  // retires each segment once its storage is dropped would otherwise have any
  // number of them mapped in between (found in review). One the collector
  // took is counted until it erases it, a moment later.
  // What this producer's earlier tables left open counts too (closed first
  // where their releases have run): a producer that stalls its teardown and
  // reconnects would otherwise map anew each time.
  held_->left_open.close_released(*held_);
  const auto left = held_->left_open.held_for(producer);
  std::size_t mapped = left.segments;
  std::size_t mapped_bytes = left.bytes;  // within byte_limit: every mapping counted here was made within it
  for (const auto& [ids, m] : mappings_) {
    mapped += ids.size();
    mapped_bytes += m->mapped_bytes;
  }
  for (const auto& m : retired_) {
    mapped += m->segment_ids.size();
    mapped_bytes += m->mapped_bytes;
  }
  const auto past_bytes = [&] { return !fits(mapped_bytes, bytes, byte_limit); };
  // All producers together: closes below give their share back to the counts.
  const auto past_context = [&] {
    return !fits(held_->mapped_bytes.load(std::memory_order_relaxed), bytes, options.max_mapped_bytes) ||
           !fits(held_->resources.load(std::memory_order_relaxed), chunks, options.max_producer_resources);
  };
  const auto past = [&] { return mapped + chunks > limit || past_bytes() || past_context(); };
  if (!past() && reserve_in_context(chunks, bytes) == nullptr) return;
  // Past a bound: close what nothing uses, now. Retired mappings whose last
  // view went first (the collector would close them), then cached ones.
  std::vector<std::shared_ptr<mapping>> finished;
  {
    std::lock_guard lock(sink_->mutex);
    finished.swap(sink_->finished);
  }
  for (auto& m : finished) {
    std::erase(retired_, m);
    mapped -= m->segment_ids.size();
    mapped_bytes -= m->mapped_bytes;
    close(*m);
  }
  // Views are added under mutex_ (held): a cached mapping with none stays so.
  for (auto it = mappings_.begin(); it != mappings_.end() && past();) {
    if (it->second->state.load(std::memory_order_acquire) != 0) {
      ++it;
      continue;
    }
    mapped -= it->first.size();
    mapped_bytes -= it->second->mapped_bytes;
    close(*it->second);
    it = mappings_.erase(it);
  }
  // Still past the context's counts: other producers' tables' unused mappings too.
  if (past_context()) close_unused_in_every_table();
  if (mapped + chunks > limit) {
    throw protocol_error("storage message: mapping its " + std::to_string(chunks) + " segment chunks would keep more than " +
                         std::to_string(limit) + " of this producer's mapped at once, those mapped all in use "
                         "(sharing_options::max_peer_segments)");
  }
  if (past_bytes()) {
    throw protocol_error("storage message: mapping its segment chunks of " + std::to_string(bytes) +
                         " bytes would keep more than " + std::to_string(byte_limit) +
                         " bytes of this producer's mapped at once, those mapped all in use "
                         "(sharing_options::max_peer_mapped_bytes)");
  }
  if (const char* refused = reserve_in_context(chunks, bytes); refused != nullptr) {
    const bool of_bytes = std::string_view(refused) == "max_mapped_bytes";
    throw protocol_error("storage message: mapping its " + std::to_string(chunks) + " segment chunks of " +
                         std::to_string(bytes) + " bytes would keep more than " +
                         (of_bytes ? std::to_string(options.max_mapped_bytes) + " bytes of all producers' mapped"
                                   : std::to_string(options.max_producer_resources) +
                                         " descriptors and mappings of all producers held") +
                         " in this process at once, those of this producer's mapped all in use (sharing_options::" +
                         refused + ")");
  }
}

void consumer_state::close_unused_here() {
  std::vector<std::shared_ptr<mapping>> finished;
  {
    std::lock_guard lock(sink_->mutex);
    finished.swap(sink_->finished);
  }
  for (auto& m : finished) {
    std::erase(retired_, m);
    close(*m);
  }
  // Views are added under mutex_ (held): a cached mapping with none stays so.
  std::erase_if(mappings_, [this](auto& entry) {
    if (entry.second->state.load(std::memory_order_acquire) != 0) return false;
    close(*entry.second);
    return true;
  });
}

void consumer_state::try_close_unused() {
  std::unique_lock lock(mutex_, std::try_to_lock);
  if (lock.owns_lock()) close_unused_here();
}

void consumer_state::close_unused_in_every_table() {
  close_unused_here();
  held_->left_open.close_released(*held_);
  std::vector<std::shared_ptr<consumer_state>> others;
  {
    std::lock_guard lock(held_->tables_mutex);
    for (const auto& t : held_->tables) {
      if (auto table = t.lock(); table && table.get() != this) others.push_back(std::move(table));
    }
  }
  // Only a free lock is taken: two tables doing this at once wait for neither.
  for (const auto& table : others) table->try_close_unused();
}

const char* consumer_state::reserve_in_context(std::size_t chunks, std::size_t bytes) noexcept {
  if (!reserve(held_->resources, chunks, options.max_producer_resources)) return "max_producer_resources";
  if (!reserve(held_->mapped_bytes, bytes, options.max_mapped_bytes)) {
    give_back(held_->resources, chunks);
    return "max_mapped_bytes";
  }
  return nullptr;
}

std::shared_ptr<mapping> consumer_state::map_segments(const std::vector<std::uint64_t>& ids) {
  if (auto it = mappings_.find(ids); it != mappings_.end()) return it->second;
  // An honest producer names each chunk of a storage once: a list that
  // repeats one would map it again for each (a mapping, a descriptor each).
  std::vector<std::uint64_t> sorted = ids;
  std::ranges::sort(sorted);
  if (const auto twice = std::ranges::adjacent_find(sorted); twice != sorted.end()) {
    throw protocol_error("storage message: it names segment " + std::to_string(*twice) + " more than once");
  }
  std::size_t bytes = 0;  // saturating: a bound set near SIZE_MAX leaves room for sums past it
  for (auto id : ids) {
    auto it = segments_.find(id);
    if (it == segments_.end()) throw protocol_error("storage message: segment " + std::to_string(id) + " was never announced");
    bytes = it->second.size > SIZE_MAX - bytes ? SIZE_MAX : bytes + it->second.size;
  }
  make_room_to_map(ids.size(), bytes);
  // Reserved in the context's counts: given back here unless the mapping is
  // made, and by close() once it is.
  reservation reserved_bytes(held_->mapped_bytes, bytes);
  reservation reserved_chunks(held_->resources, ids.size());
  std::vector<backend::shareable_handle> chunks;
  for (auto id : ids) {
    auto it = segments_.find(id);
    try {
      chunks.push_back(it->second.duplicate());  // import_memory takes them side by side
    } catch (const backend_error& e) {  // out of descriptors: this connection is closed, not the process
      throw protocol_error(std::string("storage message: its segments cannot be mapped: ") + e.what());
    }
  }
  auto m = std::make_shared<mapping>();
  m->segment_ids = ids;  // before it can be closed: close() gives back a chunk for each
  try {
    m->base = allocator.device().import_memory(chunks);
  } catch (const protocol_error&) {
    throw;
  } catch (const invalid_argument& e) {
    throw protocol_error(std::string("storage message: its segments cannot be mapped: ") + e.what());
  } catch (const backend_error& e) {  // the driver refused the peer's handle
    throw protocol_error(std::string("storage message: its segments cannot be mapped: ") + e.what());
  }
  reserved_bytes.keep();
  reserved_chunks.keep();
  m->mapped_bytes = bytes;
  // Imported, so each is the device's own kind of descriptor (a sealed
  // memfd, a driver's export), whose close cannot block: closed in place.
  for (auto& c : chunks) c.fd.mark_safe_to_close();
  for (auto id : ids) segments_.find(id)->second.fd.mark_safe_to_close();
  // What was mapped from the returned pointer on: the chunks side by side,
  // less the first one's offset (a hostile producer may announce one).
  for (const auto& c : chunks) m->bytes += c.size;
  m->bytes -= chunks.front().offset;
  mappings_.emplace(ids, m);
  return m;
}

void consumer_state::release_unclaimed(const storage_message& m) {
  std::lock_guard lock(mutex_);
  if (auto f = files_.find(m.file_id); f != files_.end()) f->second->release(m.slot);
}

storage::storage consumer_state::make_storage(const storage_message& msg, backend::stream_ref stream) {
  std::shared_ptr<counter_file> file;
  std::shared_ptr<mapping> m;
  backend::imported_event_ref source;
  {
    std::lock_guard lock(mutex_);
    auto f = files_.find(msg.file_id);
    if (f == files_.end()) throw protocol_error("storage message: counter file " + std::to_string(msg.file_id) + " was never announced");
    if (!f->second->holds(msg.slot)) {
      throw protocol_error("storage message: slot " + std::to_string(msg.slot.index) + " of counter file " +
                           std::to_string(msg.file_id) + " is not held under generation " +
                           std::to_string(msg.slot.generation));
    }
    file = f->second;
    try {
      if (msg.ready) {
        auto s = sources_.find(msg.ready->source_id);
        if (s == sources_.end()) {
          throw protocol_error("storage message: event source " + std::to_string(msg.ready->source_id) +
                               " was never announced");
        }
        source = s->second;
      }
      m = map_segments(msg.segment_ids);
      if (msg.offset > m->bytes || msg.size > m->bytes - msg.offset) {
        throw protocol_error("storage message: " + std::to_string(msg.size) + " bytes at offset " +
                             std::to_string(msg.offset) + " do not fit the " + std::to_string(m->bytes) +
                             " bytes mapped from its segments");
      }
      m->state.fetch_add(one_view, std::memory_order_acq_rel);  // under the lock: no retire in between
    } catch (...) {
      file->release(msg.slot);  // the producer must not wait for a reference never taken
      throw;
    }
    // Mapped: the producer may end now without taking this memory along
    // (peer::wait_taken). Under the lock, so a message naming this slot
    // again finds it no longer merely held.
    file->mark_received(msg.slot);
  }
  sink_->held.fetch_add(1, std::memory_order_relaxed);
  auto owner = std::make_shared<received_data>(shared_from_this(), sink_, m, file, msg.slot, stream);
  try {
    if (msg.ready) allocator.device().wait_imported(stream, source, *msg.ready);
  } catch (const invalid_argument& e) {
    throw protocol_error(std::string("storage message: bad ready point: ") + e.what());  // owner releases the slot
  }
  return storage::storage::adopt(allocator, static_cast<std::byte*>(m->base) + msg.offset, msg.size, std::move(owner),
                                 stream);
}

void consumer_state::close_finished() {
  std::vector<std::shared_ptr<mapping>> finished;
  {
    std::lock_guard lock(sink_->mutex);
    finished.swap(sink_->finished);
  }
  if (finished.empty()) return;
  {
    std::lock_guard lock(mutex_);
    for (auto& m : finished) std::erase(retired_, m);
  }
  // Closed without the lock: a close costs tens of microseconds on CUDA, and
  // receive() needs the lock meanwhile. Nothing else refers to these now.
  for (auto& m : finished) close(*m);
}

void consumer_state::close(mapping& m) noexcept { close_mapping(allocator.device(), *held_, m); }

bool mapping_in_use(const mapping& m) noexcept { return m.state.load(std::memory_order_acquire) >= one_view; }

void close_mapping(backend::device& device, context_holdings& held, mapping& m) noexcept {
  if (m.base == nullptr) return;
  try {
    device.close_import(m.base);
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): the mapping is gone either way
  }
  m.base = nullptr;
  give_back(held.mapped_bytes, m.mapped_bytes);
  give_back(held.resources, m.segment_ids.size());
}

peer_stats consumer_state::stats() const {
  std::lock_guard lock(mutex_);
  peer_stats s;
  s.open_mappings = mappings_.size() + retired_.size();
  s.counter_files = files_.size();
  s.event_sources = sources_.size();
  s.held_storages = sink_->held.load(std::memory_order_relaxed);
  return s;
}

}  // namespace shoal::ipc::detail
