// Value types of storage sharing (sharing.h): the protocol's name, options,
// statistics and what a receive returns. Plain values, not thread-safe to modify while shared.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "shoal/channel/protocol.h"
#include "shoal/core/process_identity.h"
#include "shoal/storage/storage.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::ipc {

/// What a peer sends before its first message (channel/protocol.h). The
/// version changes with any change to the sharing messages (2: a consumer
/// marks each reference received once it mapped the memory).
inline constexpr channel::protocol_id sharing_protocol{"shoal.sharing", 2};

/// What peer::wait_taken found.
enum class taken_state {
  all_taken,  ///< every storage sent was received there (mapped) or let go
  peer_gone,  ///< the peer hung up, or the connection was shut down, with some neither
  waiting,    ///< the timeout passed first
};

struct sharing_options {
  /// How often the background collector frees limbo blocks and reclaims the
  /// slots of dead holders; zero: no background thread (collect() only).
  std::chrono::milliseconds collect_interval{100};
  /// Reference-counter slots per counter file.
  std::uint32_t slots_per_file = 4096;
  /// Largest metadata a message may carry (both directions).
  std::size_t max_metadata_bytes = 64 * 1024;
  /// How long a peer's receive polls before it sleeps: a message arriving
  /// meanwhile saves the wake-up of a blocked thread (~5 us each way) at the
  /// cost of a busy core for that long. Zero: never spin.
  std::chrono::microseconds receive_spin{50};
  /// After a send that brought the peer memory new to it (a segment or a
  /// counter file, which it maps before it can answer: 50-150 us for a CUDA
  /// IPC segment on an H100, past receive_spin), the next receive() of this
  /// peer, and its next try_receive() that spins at all, polls until this
  /// long after that send (at most a second) before its own receive_spin
  /// and sleep, so an answer costs no wake-up (10-20 us). Only until a
  /// message is received, and only within that time of the send; zero:
  /// receive_spin alone. It polls the peer's ring (ring_bytes), which this
  /// side knows once it has read what the peer sent first: on a connection
  /// where nothing was received yet, the receive sleeps as before.
  std::chrono::microseconds import_answer_spin{200};
  /// Each peer sends its messages through a ring of this many bytes in
  /// memory shared with the other process (channel::connection::start_ring):
  /// a receive spinning for a message takes it without a system call on
  /// either side. Zero: the socket alone (a peer of an older shoal).
  std::size_t ring_bytes = 64 * 1024;
  /// How long a send may wait for a peer that does not read what was sent
  /// to it: then timeout_error (connection::set_send_timeout). Zero: no
  /// deadline. Durations here and in peer::receive_for saturate: a huge one
  /// (milliseconds::max()) never overflows into a deadline in the past; a
  /// send's is cut to a year.
  std::chrono::milliseconds send_timeout{10'000};
  /// The most that tearing a peer down waits on the other process: ~peer
  /// (and a receive that closes the connection on a malformed message) reads
  /// what has already arrived for this long to release the references it
  /// names, and cuts off a peer that stalls in the middle of a message; the
  /// last peer of a producer waits this long for received storages' releases
  /// that still wait on that producer's ready points.
  std::chrono::milliseconds teardown_timeout{100};

  // What one producer process may have announced to this process at once
  // (its connections together; retired resources no longer count). Each
  // announcement holds a descriptor or a mapping here, so a peer past a
  // limit is refused with protocol_error and its connection closed.
  /// Producer segments (or growable-segment chunks) announced, and segment
  /// chunks mapped here at once (a storage's mapping counts each chunk it
  /// spans; mappings no storage uses are closed to make room). Each is a
  /// descriptor on the host backend and a memory mapping: the default stays
  /// well under Linux's 65,530 mappings a process.
  std::size_t max_peer_segments = 16384;
  /// Bytes of its segment chunks mapped here at once, counted as
  /// max_peer_segments counts chunks (mappings no storage uses are closed to
  /// make room; past it a storage is refused), and the largest segment it
  /// may announce. Each mapping takes this process's address space for its
  /// whole announced size: without a bound, a producer announcing sparse
  /// segments of terabytes (a memfd costs it nothing) could leave this
  /// process none for its own memory. 1 TiB by default, past any one
  /// device's memory. At least 1 (invalid_argument).
  std::size_t max_peer_mapped_bytes = std::size_t{1} << 40;
  /// Bytes of every producer's segments this context maps at once, all
  /// producers together (each also within max_peer_mapped_bytes): the
  /// address space what peers sent may take of this process's (128 TiB on
  /// x86-64 Linux), whatever their number. Past it a storage is refused,
  /// once its producer's mappings no storage uses are closed. 32 TiB by
  /// default. At least 1 (invalid_argument).
  std::size_t max_mapped_bytes = std::size_t{32} << 40;
  /// Descriptors and memory mappings this context holds for all producers
  /// together (each also within its max_peer_* limits): segments announced,
  /// counter files (until the last storage using one goes), event sources
  /// opened, segment chunks mapped. When it is full, the mappings no storage
  /// uses are closed, every producer's; past that an announcement or a
  /// storage is refused. 32,768 by default: many producers, each
  /// within its own limits, could otherwise take every descriptor of this
  /// process, or the 65,530 memory mappings Linux allows it. At least 1
  /// (invalid_argument).
  std::size_t max_producer_resources = 32768;
  /// Counter files announced.
  std::size_t max_peer_counter_files = 1024;
  /// Event sources announced (one per producer stream that sent).
  std::size_t max_peer_event_sources = 1024;
  /// Slots in one announced counter file (32 bytes each).
  std::uint32_t max_peer_slots_per_file = 1u << 16;
  /// Bytes of the ring a peer sends through (its ring_bytes, rounded up to a
  /// power of two). A peer of another user can make this side allocate up
  /// to this much, charged to this process: a page of its ring it never
  /// allocated is allocated by this side's first read (one of this user's
  /// with such a page is refused). With ring_bytes past
  /// 4 MiB, raise it on both sides to at least ring_bytes rounded up to a
  /// power of two. At least 4096 (invalid_argument).
  std::size_t max_peer_ring_bytes = std::size_t{4} << 20;
};

struct sharing_stats {
  std::size_t limbo_blocks = 0;    ///< dropped by this process, still held elsewhere
  std::size_t limbo_bytes = 0;
  std::size_t held_slots = 0;      ///< references other processes hold on this one's memory
  std::size_t counter_files = 0;
  std::size_t exported_segments = 0;
  std::uint64_t storages_sent = 0;
  std::uint64_t limbo_freed = 0;        ///< limbo blocks freed so far
  std::uint64_t slots_reclaimed = 0;    ///< references of dead holders taken back
  /// What this context holds for the producers it receives from, all of them
  /// together: their segment chunks mapped here, in bytes (within
  /// max_mapped_bytes), and the descriptors and mappings counted against
  /// max_producer_resources.
  std::size_t producers_mapped_bytes = 0;
  std::size_t producer_resources = 0;
};

/// One process holding references to this context's memory, or connected to
/// it (sharing_context::holders()).
struct holder_stats {
  process_identity process;
  std::size_t references = 0;    ///< references it holds (slots not released)
  std::size_t pinned_bytes = 0;  ///< the blocks those references are on, each counted once
  std::size_t limbo_blocks = 0;  ///< blocks in the limbo that only this process still holds
  std::size_t limbo_bytes = 0;
  std::size_t connections = 0;   ///< connections of this context to it still open
  bool revoked = false;          ///< peer::revoke(); remembered until the process dies
};

struct peer_stats {
  std::size_t open_mappings = 0;   ///< producer segments mapped here (cached)
  std::size_t counter_files = 0;   ///< the producer's counter files mapped here
  std::size_t event_sources = 0;
  std::size_t held_storages = 0;   ///< received storages not yet released
};


/// What receive() returns: a storage (valid() is false for a note) and the
/// metadata the sender attached.
struct received {
  storage::storage storage;
  std::vector<std::byte> metadata;
};

}  // namespace shoal::ipc

#pragma GCC visibility pop
