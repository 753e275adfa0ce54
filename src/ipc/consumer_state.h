// The consumer side of sharing with one producer process: the producer's counter
// files, segments and event sources as announced, the mappings made of them
// (cached until the producer retires a segment), and the received storages'
// owner.
//
// A mapping is closed once it is retired and no received storage uses it;
// a storage's use ends when each stream it was used on (the receive stream
// and those its storage recorded) has passed the work enqueued before it was
// dropped (host tasks count down; the last releases the slot). Host tasks may not
// call the device, so they only count down; closing happens on a user
// thread: the sharing context's collector, collect(), or the destructor — and
// a receive that would pass max_peer_segments or max_peer_mapped_bytes mapped
// closes, under the lock, the mappings no storage uses to make room.
//
// Thread-safety: every member may be called from any thread (one mutex).
// Storages made here keep this object alive.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "ipc/context_holdings.h"
#include "ipc/counters/counter_file.h"
#include "ipc/messages.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/ipc/sharing_types.h"
#include "shoal/storage/storage.h"
#include "shoal/core/process_identity.h"

namespace shoal::ipc::detail {

/// One import of one or more producer segments, mapped back to back.
struct mapping {
  void* base = nullptr;    // what import_memory returned: the first chunk's base + its offset
  std::size_t bytes = 0;   // mapped from base on: the chunks' sizes less the first one's offset
  std::size_t mapped_bytes = 0;  // the chunks' sizes: the address space it takes (max_peer_mapped_bytes, max_mapped_bytes)
  std::vector<std::uint64_t> segment_ids;
  // views << 1 | retired: the storages using it (counted down after their
  // streams pass) and whether the producer retired a segment of it. The one
  // transition to "0 views, retired" closes it.
  std::atomic<std::uint64_t> state{0};
};

/// Whether a received storage still uses `m` (its release not yet run).
[[nodiscard]] bool mapping_in_use(const mapping& m) noexcept;
/// Closes `m` (once: a closed mapping is skipped), which no one else refers
/// to, and gives its counts back to `held`.
void close_mapping(backend::device& device, context_holdings& held, mapping& m) noexcept;

/// Where received storages' host tasks report: holds nothing that needs the
/// device to go, so it may be released on any thread.
struct release_sink {
  std::mutex mutex;
  std::vector<std::shared_ptr<mapping>> finished;  // retired and unused: to close; guarded
  std::atomic<std::size_t> held{0};                // received storages not yet released
};

class consumer_state : public std::enable_shared_from_this<consumer_state> {
 public:
  consumer_state(const process_identity& producer, alloc::caching_allocator& allocator, const sharing_options& options,
                 std::shared_ptr<context_holdings> held_for_producers);
  /// The table of `producer`'s resources for the sharing context numbered
  /// `context` in this process (producer_state::serial), shared by every
  /// connection to that producer: each of its segments is mapped once here.
  /// `held_for_producers`: what all the context's tables hold
  /// (producer_state::held_for_producers), within its limits.
  static std::shared_ptr<consumer_state> for_producer(const process_identity& producer, std::uint64_t context,
                                                      alloc::caching_allocator& allocator,
                                                      const sharing_options& options,
                                                      std::shared_ptr<context_holdings> held_for_producers);
  /// Waits for received storages' pending releases, then closes every
  /// mapping and event source.
  ~consumer_state();
  consumer_state(const consumer_state&) = delete;
  consumer_state& operator=(const consumer_state&) = delete;

  // Each connection announces what it refers to; the first announcement of
  // an id is kept (later ones describe the same resource of the same producer).
  void add_counter_file(const counter_file_message& m, unique_fd fd);
  void add_segment(segment_message m);
  void add_event_source(backend::event_source source);
  void retire_segments(const std::vector<std::uint64_t>& ids);
  void retire_files(const std::vector<std::uint64_t>& ids);
  /// Releases the slot a storage message names, when this process holds it
  /// (a message that will never become a storage).
  void release_unclaimed(const storage_message& m);
  /// The storage a storage message describes, ready on `stream`.
  storage::storage make_storage(const storage_message& m, backend::stream_ref stream);
  /// Closes mappings whose last use has passed since.
  void close_finished();
  [[nodiscard]] peer_stats stats() const;

  const process_identity producer;  // the peer process whose resources these are
  alloc::caching_allocator& allocator;
  const sharing_options options;

 private:
  std::shared_ptr<mapping> map_segments(const std::vector<std::uint64_t>& ids);  // mutex_ held
  /// Room for a mapping of `chunks` more segment chunks of `bytes` within
  /// options.max_peer_segments and max_peer_mapped_bytes mapped at once
  /// (closing mappings no storage uses), and `bytes` and `chunks` reserved
  /// within the context's max_mapped_bytes and max_producer_resources (given
  /// back by close, or by the caller when the mapping fails), or
  /// protocol_error. mutex_ held.
  void make_room_to_map(std::size_t chunks, std::size_t bytes);
  /// Reserves `bytes` and `chunks` in the context's counts, both or neither;
  /// nullptr, or the option whose limit refused.
  [[nodiscard]] const char* reserve_in_context(std::size_t chunks, std::size_t bytes) noexcept;
  /// One descriptor or mapping more in the context's count (closing the
  /// mappings no storage uses in every table of the context when it is
  /// full), or protocol_error naming `what` (an announcement's message).
  /// mutex_ held.
  [[nodiscard]] reservation reserve_resource(const char* what);
  /// Closes the mappings no storage uses, this table's (mutex_ held) and
  /// every other table's of the context whose lock is free (two tables'
  /// locks are never waited for at once).
  void close_unused_in_every_table();
  /// Closes this table's mappings no storage uses, retired or cached. mutex_ held.
  void close_unused_here();
  /// close_unused_here() when mutex_ is free at once (another table's call).
  void try_close_unused();
  void retire(const std::shared_ptr<mapping>& m);                                  // mutex_ held
  void close(mapping& m) noexcept;  // a mapping no one else refers to; mutex_ not needed
  /// The destructor past its deadline: closes the mappings no storage uses
  /// and leaves the others, with the event sources, to held_->left_open.
  void leave_open_what_is_in_use() noexcept;

  mutable std::mutex mutex_;
  std::map<std::uint64_t, std::shared_ptr<counter_file>> files_;
  std::map<std::uint64_t, backend::shareable_handle> segments_;
  std::map<std::vector<std::uint64_t>, std::shared_ptr<mapping>> mappings_;  // cached, not yet retired
  std::vector<std::shared_ptr<mapping>> retired_;                             // retired, still in use
  std::map<std::uint64_t, backend::imported_event_ref> sources_;
  const std::shared_ptr<release_sink> sink_ = std::make_shared<release_sink>();
  const std::shared_ptr<context_holdings> held_;
};

}  // namespace shoal::ipc::detail
