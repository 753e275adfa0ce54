// The producer side of sharing: counter slots, exported segments, the limbo.
//
// Lock order: a storage's own lock (hand_over) -> mutex_ -> the allocator's
// pool locks (mark_held_outside, unmark_held_outside); a pool lock ->
// exports_mutex_ -> an outbox's mutex (the release
// observer runs under a pool lock). Nothing takes mutex_ under exports_mutex_
// or the other way round, and no allocator call is made under either, so
// the allocator may call back (cache-miss hook, release observer) at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "core/fork_epoch.h"
#include "ipc/context_holdings.h"
#include "ipc/counters/counter_slots.h"
#include "ipc/weak_list.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/ipc/sharing_types.h"
#include "shoal/storage/storage.h"

namespace shoal::ipc::detail {

class consumer_state;

/// One exported segment (or growable segment's chunk); handle.offset is 0.
struct exported_segment {
  std::uint64_t id = 0;
  std::uintptr_t base = 0;
  backend::shareable_handle handle;
};

/// Retire notices for one peer, filled by the state, sent by the peer.
struct outbox {
  explicit outbox(const process_identity& p) : peer(p) {}
  const process_identity peer;  // counter files are retired to their holder's connections
  std::mutex mutex;
  std::vector<std::uint64_t> segments;  // guarded by mutex
  std::vector<std::uint64_t> files;     // guarded by mutex
  // Segments this connection's sends named and not yet posted for
  // retirement: only these are posted to it, so a connection that sends
  // nothing collects nothing (guarded by mutex).
  std::unordered_set<std::uint64_t> announced;
};

class producer_state : public std::enable_shared_from_this<producer_state> {
 public:
  producer_state(alloc::caching_allocator& allocator, const sharing_options& options);
  ~producer_state();
  producer_state(const producer_state&) = delete;
  producer_state& operator=(const producer_state&) = delete;

  /// Registers the allocator hooks; called once, right after construction
  /// (they need shared_from_this).
  void attach();

  struct share {
    std::vector<std::shared_ptr<const exported_segment>> segments;  // address order
    std::uint64_t offset = 0;  // of the data in segments[0]
    std::uint64_t size = 0;
    slot_ref slot;
    std::shared_ptr<const counter_file> file;  // the slot's, for a peer that lacks it (open while held)
    std::uintptr_t block = 0;  // the storage's block
  };
  /// Hands `st` over to a sent-data owner (once) and claims a slot held by
  /// `holder`; the block is marked held outside while a slot of it may be
  /// held (until a prune finds them all released: unmark_released).
  /// invalid_argument for a storage received from another process or from
  /// another allocator, or whose block a forced clear took back;
  /// peer_refused when `holder` was revoked. When it throws, no slot was
  /// claimed and no mark was added.
  share share_storage(const storage::storage& st, const process_identity& holder, backend::stream_ref stream);
  /// A share that never reached its holder: its slot is released, and the
  /// block unmarked when no other slot of it is held.
  void abandon(const share& s);
  /// Unmarks the live sent blocks whose every slot was released, and frees
  /// the limbo's ready blocks: the allocator's forced-clear hook.
  void unmark_released();

  /// The sent-data owner's last handle is gone (see sent_data).
  void retire(void* data, std::size_t size, backend::stream_ref stream) noexcept;
  /// Frees limbo blocks with no slot held; with `reclaim`, first takes back
  /// the slots of dead holders. Returns how many blocks it freed.
  std::size_t collect(bool reclaim);

  /// A connection to `peer` opened / closed (counter_slots::connect).
  void connect(const process_identity& peer);
  /// Whether `peer` was revoked (peer::revoke) through any connection.
  [[nodiscard]] bool revoked(const process_identity& peer) const;
  void disconnect(const process_identity& peer);
  /// `peer` is sent nothing more (share_storage throws peer_refused); the
  /// references it holds stay held until it releases them or dies.
  void revoke(const process_identity& peer);
  [[nodiscard]] std::vector<holder_stats> holders() const;

  void add_outbox(const std::shared_ptr<outbox>& box);
  /// collect(true) also closes the receiver's finished mappings.
  void add_receiver(const std::shared_ptr<consumer_state>& receiver);
  [[nodiscard]] sharing_stats stats() const;

  alloc::caching_allocator& allocator;
  const shoal::detail::fork_epoch epoch;  // a fork() child's teardown takes none of the parent's locks
  const sharing_options options;
  /// This context's number in the process, never reused (a context made at
  /// a freed one's address must not find that one's tables: for_producer).
  const std::uint64_t serial;
  /// What this context's consumer tables hold for all producers together
  /// (sharing_options::max_mapped_bytes, max_producer_resources).
  const std::shared_ptr<context_holdings> held_for_producers = std::make_shared<context_holdings>();

 private:
  struct limbo_entry {
    void* data;
    std::size_t size;
    backend::stream_ref stream;
    std::vector<slot_ref> slots;
  };
  struct ready_block {
    void* data;
    backend::stream_ref stream;
  };
  std::vector<std::shared_ptr<const exported_segment>> exports_for(std::uintptr_t data, std::size_t size);
  void on_release(std::uintptr_t base, std::size_t bytes);
  // Recycles the released ones among `slots` (mutex_ held); true when none is left.
  bool prune(std::vector<slot_ref>& slots);
  // Prunes a live sent block's slots; unmarks it when none is left (mutex_ held).
  void prune_held(std::uintptr_t block);
  void unmark(std::uintptr_t block) noexcept;
  std::vector<ready_block> take_ready();  // mutex_ held
  void free_blocks(const std::vector<ready_block>& blocks) noexcept;
  // Retire notices: segments to every connection; a closed counter file to
  // every connection to its holder (connections to one process may share
  // one table there, whichever of them announced the file). Called without
  // mutex_, as soon as files close: a consumer's table of them must not
  // grow until a collect.
  void post_segments(const std::vector<std::uint64_t>& segments);
  void post_files(const std::vector<closed_file>& files) noexcept;

  mutable std::mutex mutex_;
  counter_slots slots_;              // guarded by mutex_
  std::vector<limbo_entry> limbo_;   // guarded by mutex_
  // The slots handed out for each live sent-data owner's block (by block
  // address), pruned now and then. A block is here iff it is marked held
  // outside (mark_held_outside under mutex_, unmarked when it leaves: all
  // its slots released, or retired into the limbo, whose free ends it).
  std::map<std::uintptr_t, std::vector<slot_ref>> held_;  // guarded by mutex_
  std::size_t limbo_bytes_ = 0;      // guarded by mutex_
  std::uint64_t sent_ = 0, limbo_freed_ = 0, reclaimed_ = 0;  // guarded by mutex_

  mutable std::mutex exports_mutex_;
  std::map<std::uintptr_t, std::shared_ptr<exported_segment>> exports_;  // by base; guarded
  // One entry per live connection (receivers: per consumer table, which
  // connections share). Connections come and go, so expired entries are
  // swept whenever a list has doubled since its last sweep:
  //   entries <= 2 * max(live entries at the last sweep, 16).
  weak_list<outbox> outboxes_;           // guarded
  weak_list<consumer_state> receivers_;  // guarded

  std::uint64_t miss_hook_ = 0, forced_clear_hook_ = 0, release_observer_ = 0;
};

}  // namespace shoal::ipc::detail
