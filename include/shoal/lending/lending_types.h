// Values shared by the lender (the memory daemon) and its borrowers: how a
// region is asked for, and what the lender reports about the regions it
// lends. Value types, not thread-safe to modify.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shoal/core/error.h"
#include "shoal/core/process_identity.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending {

/// The protocol's name and version in its hello (channel/protocol.h).
inline constexpr const char* protocol_name = "shoal.lending";
// 2: memory ids, kept mappings, forget; 3: borrow_shared names the writer uid it expects;
// 4: revoke_request (a process of the lender's own uid revokes a region); 5: a borrow may wait for memory;
// 6: refusals for want of memory say which shortage (shortage below)
inline constexpr std::uint16_t protocol_version = 6;
/// The hello of an observer connection (borrower_options::observer), of the
/// same version: a lender older than observers closes such a connection.
inline constexpr const char* observer_protocol_name = "shoal.lending.observer";
/// A region's purpose ("parameters", "computation", a model's name): at most
/// this many bytes, printable ASCII.
inline constexpr std::size_t max_purpose_bytes = 64;

enum class region_mode : std::uint8_t {
  exclusive = 1,  ///< one borrower, who reads and writes it
  /// Published by its writer with a layout: from then on immutable, mapped
  /// read-only by every holder (the writer included), asked for by name.
  shared = 2,
};

[[nodiscard]] const char* to_string(region_mode mode) noexcept;

/// Why the lender had no memory for a borrow (memory_refused::reason).
enum class shortage : std::uint8_t {
  capacity,         ///< not that much is free now, and the borrow did not wait
  wait_expired,     ///< it waited, and not that much was given back in time
  others_waiting,   ///< it did not wait while other borrows wait: memory given back goes to them first
  cannot_fit,       ///< no wait could make it fit: past the capacity, or beside the borrower's own regions
  stopped_waiting,  ///< its borrower stopped waiting (sent a cancel or another request meanwhile)
};

/// "capacity", "wait_expired", "others_waiting", "cannot_fit", "stopped_waiting".
[[nodiscard]] const char* to_string(shortage why) noexcept;

/// The lender refused a borrow for want of memory; reason() says which
/// shortage (the message says it in words).
class memory_refused : public out_of_memory {
 public:
  memory_refused(const std::string& what, std::size_t requested_bytes, shortage reason)
      : out_of_memory(what, requested_bytes), reason_(reason) {}
  [[nodiscard]] shortage reason() const noexcept { return reason_; }

 private:
  shortage reason_;
};

/// What a borrower holds, as the lender sees it.
enum class region_state : std::uint8_t {
  lent = 1,      ///< its borrower is connected (shared: some holder is)
  orphaned = 2,  ///< its borrower hung up but still runs (and may still map it): kept until it exits
                 ///< (shared: every holder hung up, and some still runs)
  revoking = 3,  ///< the lender asked for it back (revoke_deadline); still its borrower's until given back
};

[[nodiscard]] const char* to_string(region_state state) noexcept;

/// One hold of a shared region: a process that mapped it read-only (the
/// writer, once it published, or a reader). A process holding it twice is
/// listed twice.
struct holder_info {
  process_identity process;
  uid_t uid = 0;
  region_state state = region_state::lent;  ///< lent (connected) or orphaned
};

struct region_info {
  std::uint64_t id = 0;
  /// The chunk of memory it is lent from: the same id when a later region
  /// gets the same memory again (lender_config::reuse).
  std::uint64_t memory = 0;
  std::size_t bytes = 0;
  std::string purpose;  ///< also the name a shared region is asked for by
  region_mode mode = region_mode::exclusive;
  region_state state = region_state::lent;
  /// Its borrower; a shared region's writer, who published it (whether it
  /// still holds it or not).
  process_identity borrower;
  uid_t uid = 0;
  /// Shared regions only: every hold, the writer's first while it has one.
  std::vector<holder_info> holders;
  std::chrono::steady_clock::duration age{};
  /// While revoking: when the borrower was to give it back by.
  std::chrono::steady_clock::time_point revoke_deadline{};
};

/// A borrow that did not fit and waits for memory to be given back
/// (borrower::borrow with a wait); served in this order.
struct waiting_info {
  process_identity borrower;
  uid_t uid = 0;
  std::size_t bytes = 0;  ///< rounded up to the device's granularity
  std::string purpose;
  std::chrono::nanoseconds waited{0};
  std::chrono::nanoseconds left{0};  ///< until it is refused
};

/// Memory given back and kept by the lender for a later region of the same
/// size and borrower uid (lender_config::reuse).
struct spare_info {
  std::uint64_t memory = 0;
  std::size_t bytes = 0;
  uid_t uid = 0;              ///< the uid of every borrower it was lent to: the only uid it is lent to again
  std::size_t kept_by = 0;    ///< connections that keep it mapped (told to forget it when it is released)
  std::chrono::steady_clock::duration age{};  ///< since it became spare
};

/// Something the lender did, for its log (lender_config::on_event).
struct lender_event {
  enum class kind : std::uint8_t {
    connected,         ///< a borrower connected
    disconnected,      ///< a borrower's connection closed
    lent,              ///< a region was lent (shared: a reader's hold of it; `detail` its name)
    published,         ///< a writer published its region (`detail`: its name and content hash)
    given_back,        ///< a borrower gave a region back
    refused,           ///< a request or a connection was refused (`detail` says why)
    orphaned,          ///< a borrower hung up alive: its region is kept until it exits
    reclaimed,         ///< a region of a borrower that died was released
    closed_for_error,  ///< a borrower's connection was closed for what it sent (`detail`)
    revoke_requested,  ///< the lender asked a borrower to give a region back (`detail`: the deadline, and the
                       ///< waiting borrow it preempts for, if any)
    revoke_missed,     ///< a borrower did not give a revoked region back in time: it stays its own
    spare_released,    ///< a spare chunk was released (`detail`: why); its keepers were told to forget it
    waiting,           ///< a borrow that did not fit waits for memory (`detail`: its purpose and wait)
  };
  kind what = kind::connected;
  process_identity borrower;
  uid_t uid = 0;
  std::uint64_t region = 0;  ///< 0 when the event concerns no region
  std::size_t bytes = 0;
  std::string detail;  ///< the purpose of a region, or why
};

[[nodiscard]] const char* to_string(lender_event::kind what) noexcept;

struct lender_status {
  std::size_t capacity_bytes = 0;
  std::size_t lent_bytes = 0;  ///< regions lent or orphaned (a shared region once, however many hold it)
  /// Spare chunks, counted against the capacity too (released, oldest
  /// first, when a fresh region would not fit otherwise).
  std::size_t spare_bytes = 0;
  std::vector<spare_info> spares;  ///< oldest first
  /// Prepared chunks not lent yet (lender_config::prepared_chunks), counted
  /// against the capacity too (released after the spares when a fresh
  /// region would not fit otherwise):
  ///   lent_bytes + spare_bytes + prepared_bytes <= capacity_bytes.
  std::size_t prepared_bytes = 0;
  std::size_t prepared_chunks = 0;
  /// Borrowers connected now (their hello said so). A connection whose hello
  /// has not come is in `connections` only, though max_borrowers counts it
  /// until it says which it is (lender.h, max_observers).
  std::size_t borrowers = 0;
  std::size_t observers = 0;   ///< observer connections now (lender_config::max_observers)
  std::size_t connections = 0; ///< every connection now: borrowers, observers, and those not greeted yet
  std::vector<region_info> regions;
  /// Borrows waiting for memory, in the order they are served.
  std::vector<waiting_info> waiting;
  // Counters since the lender started.
  std::uint64_t requests = 0;  ///< borrow, publish and shared-borrow requests
  std::uint64_t refusals = 0;
  std::uint64_t given_back = 0;                     ///< holds given back (an exclusive region is one hold)
  std::uint64_t reclaimed = 0;                      ///< holds of borrowers that died or hung up
  std::uint64_t published = 0;                      ///< regions published
  std::uint64_t connections_closed_for_errors = 0;  ///< malformed or stalled peers
  std::uint64_t revocations = 0;                    ///< regions asked back
  std::uint64_t revocations_missed = 0;             ///< of those, not given back by their deadline
  std::uint64_t preemptions = 0;                    ///< of the revocations, those made for a waiting borrow
  std::uint64_t chunks_made = 0;                    ///< chunks made (created, mapped, exported), prepared ones included
  std::uint64_t prepared_used = 0;                  ///< regions lent from a prepared chunk
  std::uint64_t reuses = 0;                         ///< regions lent from a spare chunk
  std::uint64_t kept_mappings_used = 0;             ///< of those, lent with no chunk frames (a kept mapping)
  std::uint64_t forgets = 0;                        ///< forget messages sent to borrowers keeping a released chunk
  std::uint64_t waits = 0;                          ///< borrows that waited for memory
  std::uint64_t waits_expired = 0;                  ///< of those, refused when their wait ran out
};

}  // namespace shoal::lending

#pragma GCC visibility pop
