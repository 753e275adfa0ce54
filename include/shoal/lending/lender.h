// The lender: one process owns a device's memory and lends it, region by
// region, to borrower processes over a checked channel (the memory daemon's
// core; runnable in-process for tests).
//
// A borrower connects (its uid checked against the access policy), says the
// protocol's hello, and asks for regions of N bytes with a purpose. The
// lender lends each region from a chunk of device memory that can be
// exported (CUDA VMM with a POSIX fd, a memfd on the host backend), sends its
// handle, and counts it against the capacity, the borrower's quota and,
// when set, its uid's quota over all its connections; the borrower maps it
// at its own address. A refusal says why (capacity, quota,
// a bad request, a device failure) and the connection stays open.
//
// Memory reuse (config.reuse): with same_uid (the default) an exclusive
// region's chunk, once given back or reclaimed, stays a spare — mapped and
// exported — and a later region of the same rounded size for a borrower of
// the same uid gets it again (no create, map or export). A borrower may keep
// its mapping when it gives a region back; when the same memory is lent to
// it again the lender sends no chunk (the borrower uses its kept mapping).
// Since the lender cannot unmap another process's mapping, spare memory goes
// only to the uid every earlier borrower of it had: a borrower of another
// uid always gets memory no other uid has mapped. Memory a borrower keeps
// mapped counts against its quota and its uid's until it lets it go (a
// forget, a hang-up, or the memory lent to it again); a borrow that would
// pass a quota has the lender drop kept mappings as it lends — oldest first,
// as many as make the room, each keeper sent forget; none for a borrow that
// waits or is refused — or is refused when dropping all would not be enough.
// Spare bytes count against
// the capacity (lent + spare <= capacity); when a fresh region would not
// fit, spares are released oldest first and the connections keeping them
// mapped are sent forget (an idle borrower unmaps only when it next reads
// from the lender: until then the device may refuse a fresh chunk, a typed
// capacity refusal). Shared regions' memory is never reused (holders of
// several uids map it); with `never`, every region is fresh memory and is
// released when its last hold goes.
//
// Where the memory comes from — two modes, which combine:
//   - growing on demand (the default): a region that no spare or prepared
//     chunk serves gets a fresh chunk, made (created, mapped, exported)
//     while the borrower waits — on CUDA the export alone is ~0.8 ms per
//     GiB — as long as lent + spare + prepared bytes stay within the
//     capacity;
//   - prepared (config.prepared_chunks): chunks of the given sizes are made
//     when the lender starts (the constructor throws the device's error when
//     it cannot make them), and a region of one of those sizes (rounded up
//     to the device's granularity) is lent from one with no device call at
//     borrow time: the borrower pays only its import and map. A prepared
//     chunk was never mapped by anyone, so it goes to a borrower of any uid;
//     once lent it is an ordinary chunk (a spare of that uid when given
//     back). Prepared bytes count against the capacity.
// A fresh chunk that would pass the capacity makes room by releasing spares
// (oldest first), then prepared chunks not lent yet. When the device itself
// refuses a fresh chunk (other processes use the memory), every spare is
// released, and prepared chunks until as many bytes as the region's, and the
// chunk is tried once more; a second refusal is a capacity refusal
// (out_of_memory at the borrower). A released spare a borrower keeps mapped
// returns to the device only once that borrower unmaps it (see above).
//
// Waiting borrows: a borrow that does not fit and was sent with a wait
// (borrow_wait) is kept in a line and lent as memory is given back, the
// line served strictly in order; one whose wait runs out is refused
// (capacity), and its uid's borrows then wait behind the other uids' for as
// long as it held the line, as after a wait its borrower ended
// (config.max_wait). While any borrow waits, a borrow without a wait is
// refused at once (while only borrows behind wait, only one of their uids);
// a waiting borrower that sends anything (cancel_wait, or another
// request) has its borrow refused first, and one that hangs up leaves the
// line. What waiting cannot make fit (past the capacity or a quota) is
// refused at once. With config.preempt_after set, the lender also asks other
// borrowers to give regions back for the head of the line (preemption).
//
// Shared regions: a borrower may publish an exclusive region it holds, with
// a layout and content hash (layout.h; refused — bad_request — when the
// layout does not fit the region or the name, its purpose, is published
// already); from then on it is read-only for every holder, and any borrower
// may ask for it by name (borrow_shared), getting a hold of its own. A region
// lives while it has a hold; its bytes count once against the capacity and
// in full against the quota of each holder. Shared regions are not revoked.
//
// Reclaim: when a borrower's connection closes — it gave up, crashed or was
// SIGKILLed — its holds are dropped at once if its process is gone
// (pid and start time: a reused pid is not mistaken for it); if it still
// runs, it may still map them, so they stay counted as orphaned until it
// exits. A region's memory is never lent to a borrower of another uid while
// its borrower might map it (and with reuse == never, to no one at all).
// The process is the one that connected: memory received on a connection a
// helper made, or passed on in a descriptor, may stay mapped in a process
// the books no longer count (no memory crosses to another uid; admitted uids
// are trusted not to hoard past the capacity that way).
//
// Trust: a borrower is untrusted. Every frame is checked (the codec names the
// field at fault); a malformed frame, a frame a borrower may not send, or a
// batch it stalls in the middle of closes that borrower's connection (and
// reclaims its regions as above) and harms no one else: each borrower's
// frames are read as they come, without waiting on it, so one that stalls
// mid-batch holds no other borrower up until it is hung up on. Nor are
// answers to a borrower waited on: what its socket does not take waits in
// its connection's queue (connection::post) and goes out, in order, as it
// reads, so one that stops reading holds no one else up either. While any
// answer waits, nothing more is read from that borrower: its queue holds at
// most one answer (with at most one descriptor) and the revokes and forgets
// sent meanwhile, one per region it holds or memory it keeps mapped.
// Every wait on a borrower has a deadline (config.peer_timeout): one that
// leaves an answer queued for longer, read in part or not at all, has its
// connection closed too. The lender never exits or aborts on a borrower's
// or the device's error, nor when its own heap runs out: the borrower it
// was taking on is refused (its connect fails), the one whose request or
// answer it was making is closed for error, and its counts stay whole.
//
// Thread-safety: the lender serves on its own thread; status() and
// address() may be called from any thread. Destruction stops the thread,
// closes every connection and releases every region.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/channel/channel.h"
#include "shoal/lending/lending_types.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending {

/// Whether memory given back is lent again (docs/architecture.md, "Choice:
/// spare chunks, lent again within one uid").
enum class reuse_policy : std::uint8_t {
  /// Kept as a spare chunk and lent again, only to borrowers of the uid
  /// every earlier borrower of it had; borrowers may keep their mappings.
  same_uid = 1,
  /// Every region is fresh memory, released when given back (no spares, no
  /// kept mappings): the cost of a create, map and export per region.
  never = 2,
};

struct lender_config {
  /// Bytes the lender may lend at once, over all borrowers (> 0).
  std::size_t capacity_bytes = std::size_t{1} << 30;
  /// Bytes one borrower (one connection) may hold at once (> 0), counting
  /// the memory it gave back and keeps mapped (see the contract above).
  std::size_t quota_bytes = std::size_t{1} << 30;
  /// Bytes one uid may hold at once over all its connections, its orphaned
  /// regions and the spares its connections keep mapped included (a
  /// borrower cannot pass quota_bytes by opening more connections); 0: no
  /// such limit.
  std::size_t quota_bytes_per_uid = 0;
  /// Borrowers connected at once, of each class (the lender's own uid and
  /// root; the other uids: see max_observers); one more is refused at once.
  std::size_t max_borrowers = 64;
  /// Observer connections (borrower_options::observer: metrics and revokes,
  /// never a region) at once, counted apart from max_borrowers, so that an
  /// operator's `shoal daemon status` or `revoke` is served while the lender
  /// has all the borrowers it admits. While borrowers or observers have no
  /// room, the lender reads a new connection's hello before it sends its
  /// own, and turns it away (closed before its hello: peer_refused at
  /// connect) when its kind has no room by then; a connection greeted at once
  /// keeps room for either kind until its hello says which it is (a borrower
  /// or observer held back for such connections alone waits for their
  /// hellos, up to peer_timeout, and is taken on if one turns out the other
  /// kind). 0: none.
  /// Connections of the lender's own uid and root are bounded apart from the
  /// others' — each class to max_borrowers + max_observers connections (those
  /// whose hello has not come included), max_borrowers borrowers and
  /// max_observers observers at once — so another admitted uid, idle
  /// borrowers of its own included, cannot keep the operator out.
  std::size_t max_observers = 4;
  /// Connections at once of any one uid other than the lender's own and
  /// root (borrowers, observers and those whose hello has not come); one
  /// more is refused at once, as past max_borrowers. The other uids share
  /// one bound (above), and a greeted connection is never timed out, however
  /// idle: without this cap one admitted uid can take every place and keep
  /// the others out. 0: no cap beyond that bound (the default: most
  /// deployments run every borrower as one uid).
  std::size_t max_connections_per_uid = 0;
  /// Regions one borrower may hold at once.
  std::size_t max_regions_per_borrower = 1024;
  /// Deadline of every wait on a borrower: its hello (from when it was
  /// accepted), a batch it started sending, an answer it does not read
  /// (from when the answer was posted). Above 0, at most a day.
  std::chrono::milliseconds peer_timeout{1000};
  /// The longest a borrow may wait for memory (above 0, at most the
  /// protocol's ~49 days): a longer wait is cut to this. Bounds how long one
  /// borrower at the head of the line, asking for more than will come free,
  /// holds every later borrow up. A uid whose wait ends unserved (it runs
  /// out, its borrower cancels it or hangs up, or it is refused at its turn)
  /// then waits behind the other uids for as long as that wait held the
  /// line: meanwhile its waits are served after theirs and hold up none of
  /// theirs, and take back their places by arrival once that lapses. So a uid that keeps
  /// asking for more than will come free holds the others up for one wait,
  /// then waits behind them as long: with one wait at a time, at most half
  /// the time even when it pauses between waits, never while it re-asks at
  /// once. Within one uid the line stays strictly in order (most deployments
  /// run every borrower as one uid: nothing changes for them).
  /// docs/architecture.md, "What bounds one borrower's hold on the line".
  std::chrono::milliseconds max_wait{std::chrono::minutes(5)};
  /// Preemption, off when empty: once the first borrow in the waiting line
  /// has waited this long (zero: at once) and the capacity has no room for
  /// it, the lender revokes exclusive regions of other borrowers — lent
  /// longest ago first, only as many as the shortfall needs, none when all it
  /// may revoke would not cover it — each to be given back within
  /// preempt_deadline, as revoke() asks. Below max_wait (else every wait
  /// would run out first). What it may revoke: a region lent at least
  /// preempt_after ago (the least turn; 0 gives none, and borrows that join
  /// the line and leave may then revoke a region as often as they like);
  /// across uids, only while the region's uid holds more than the head's uid
  /// (holdings evened out at most); never shared or orphaned regions, nor the
  /// head's own. A borrower whose own borrow waits behind the head has
  /// that wait refused first (stopped_waiting) when its region is taken, and
  /// a borrower asked to give a region back may not wait for memory until it
  /// has. A region being revoked counts as coming back until its deadline
  /// passes; then the lender revokes others (the late borrower keeps its
  /// region, named, as with revoke()). A head is looked at as soon as it has
  /// waited preempt_after, then at each periodic check (50 ms). The borrowers
  /// must answer revokes (borrower::revocations()). docs/architecture.md,
  /// "Choice: preemption".
  std::optional<std::chrono::milliseconds> preempt_after;
  /// The time a preempted region's borrower has to give it back (1 ms to
  /// about 49 days).
  std::chrono::milliseconds preempt_deadline{std::chrono::seconds(10)};
  /// Whether given-back memory is lent again (see the contract above).
  reuse_policy reuse = reuse_policy::same_uid;
  /// How long the serving thread keeps polling without sleeping after it
  /// served a request: a borrower's next request arriving meanwhile is read
  /// without the wake-up of a blocked thread (several microseconds of the
  /// round trip), at the cost of a busy core for at most this long after
  /// each request; zero always sleeps. It spins only while at most half as
  /// many borrowers are connected as the lender may use CPUs: each may spin
  /// for its own reply, and past that a lender that never sleeps waits behind
  /// them for whole time slices. The default, automatic_poll_spin, spins
  /// 50 us where the lender may run on at least 8 CPUs, never on fewer.
  std::chrono::microseconds poll_spin = automatic_poll_spin;
  static constexpr std::chrono::microseconds automatic_poll_spin{-1};
  /// Chunks made when the lender starts, by size (each > 0, rounded up to
  /// the device's granularity; their sum at most capacity_bytes): a region
  /// of one of these sizes is lent from one without a device call (see the
  /// contract above). Empty: every chunk is made on demand.
  std::vector<std::size_t> prepared_chunks;
  /// Uids allowed besides the lender's own.
  channel::access_policy policy;
  /// Called on the serving thread for each event, outside the lender's
  /// locks (may be empty). What it throws is ignored.
  std::function<void(const lender_event&)> on_event;
};

class lender {
 public:
  /// Makes the prepared chunks, listens at `address` and starts serving;
  /// regions come from `device`. invalid_argument for a config out of range;
  /// the listener's errors (channel.h) when the address cannot be used; the
  /// device's (out_of_memory when it has not that much) when a prepared
  /// chunk cannot be made. Raises the process's soft limit of open
  /// descriptors to its hard one first (each chunk it may lend again keeps
  /// one open), for the whole process and its children, whether or not it
  /// then throws.
  lender(backend::device& device, const channel::channel_address& address, lender_config config = {});
  ~lender();
  lender(const lender&) = delete;
  lender& operator=(const lender&) = delete;

  [[nodiscard]] lender_status status() const;
  /// status() in the Prometheus text format (also what a borrower's
  /// metrics() reads over the socket), at most one frame's payload (1 MiB):
  /// past that, per-region, per-hold and per-spare samples are left out,
  /// counted in shoal_lending_samples_left_out and marked "# truncated".
  [[nodiscard]] std::string metrics_text() const;
  [[nodiscard]] const channel::channel_address& address() const noexcept;

  /// Asks the borrower of `region` to give it back within `deadline` (the
  /// next model's turn); returns at once. The region shows as revoking; a
  /// borrower that lets the deadline pass is named once (a revoke_missed
  /// event) and keeps it, counted, until it gives it back or exits — it is
  /// never lent to anyone else meanwhile. invalid_argument when the region is
  /// not lent to a connected borrower, or is being revoked already.
  void revoke(std::uint64_t region, std::chrono::milliseconds deadline);

  class __attribute__((visibility("hidden"))) state;  // hidden: the library's own

 private:
  std::unique_ptr<state> state_;
};

}  // namespace shoal::lending

#pragma GCC visibility pop
