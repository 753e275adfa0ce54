// The borrower: a process that borrows device memory from a lender (the
// memory daemon) and maps it at its own address.
//
//   borrower b(device, address);
//   borrowed_region r = b.borrow(1 << 30, "parameters");
//   use(r.data(), r.size());   // device memory, this process's mapping
//   b.give_back(std::move(r)); // or let r go: its destructor gives it back
//
// Shared read-only regions: several processes serving one model map one copy
// of its weights. A writer borrows an exclusive region under the model's
// name, fills it, and publishes it with a layout (layout.h); from then on
// the region is immutable, and readers ask for it by name:
//
//   auto w = writer.borrow(bytes, "llama-7b@v3");           // exclusive
//   ... fill it; layout.hash = hash_entries(device, w.data(), w.size(), layout) ...
//   w = writer.publish(std::move(w), layout);                // now read-only
//   auto r = reader.borrow_shared("llama-7b@v3", layout.hash);
//   r.address_of("embed");                                   // the same entry, by name
//
// Every holder maps a shared region read-only (device::import_memory with
// memory_access::read_only: a write through it faults). Publishing gives the
// writer's writable mapping up before the lender makes the region shared, so
// no holder writes it afterwards through shoal (what a hostile holder can do
// with the descriptor it got is in docs/architecture.md: the read-only
// mapping guards against mistakes, not against a hostile process of an
// allowed uid). The region lives while any holder holds it; each hold is
// given back on its own (give_back, or the region's destructor), and the
// lender reclaims the holds of a holder that dies.
//
// Kept mappings: giving an exclusive region back keeps its mapping (up to
// borrower_options::kept_mapping_bytes), when the lender records it, so that
// the same memory lent to this borrower again — the lender lends spare
// memory again within one uid, lender.h — needs no import or map: the region
// comes back at the same address, with what was last written in it. The
// lender tells the borrower to unmap a kept mapping (forget) when it
// releases that memory; the borrower does so whenever it next reads from the
// lender (any call below, revocations() included), so an idle borrower keeps
// it until then. The memory stays mapped in this process meanwhile: keep
// nothing in a region after giving it back.
//
// Errors: the lender's refusals are typed — out_of_memory (its capacity:
// not that much free, a wait for memory that ran out, a borrow without a
// wait while others wait; the lender's `capacity` refusal), peer_refused
// (this borrower's quota or region count), invalid_argument (a
// bad request: an unknown region or name, a malformed layout, a name
// published already), content_mismatch (a shared region's hash, or its
// writer's uid, is not the one asked for) — and a device failure on its side is backend_error; the
// connection stays usable after any of them. connection_closed when the
// lender is gone (regions already mapped stay valid until given back);
// timeout_error when it does not answer within the deadline (a borrow's
// timeout counts from the end of its wait for memory): the connection
// stays usable — answers come in the order asked, and those no call waits
// for any more are read first by the next call, revocations(), or the
// connection's end (within 1 s): a region a borrow or borrow_shared was lent
// late is given back unmapped, so the lender does not keep it lent, and a
// give_back that timed out was sent all the same (its confirmation read
// later). An answer that stopped part-way closes the connection instead.
// protocol_error when it sends something malformed (the connection is
// closed).
//
// Thread-safety: borrow and give_back may be called from several threads;
// requests go one at a time, each waiting for the connection no longer than
// its own timeout (timeout_error: a borrow waiting for memory holds it for
// its whole wait; a region given back or dropped meanwhile is unmapped at
// once and given back at the next call). revocations() waits without
// holding the connection, so a thread watching for revokes never holds up
// another's give_back; a revoke that another call reads reaches it within
// 10 ms, whatever that call is doing. A borrowed_region is a value (move-only), used
// by one thread at a time; it may outlive its borrower object (it keeps the
// connection alive).
//
// Processes: a borrower and its regions belong to the process that
// connected. In a fork() child, dropping an inherited region (or giving it
// back) and dropping the borrower do nothing — no message, no unmap, no
// wait for a lock another of the parent's threads may hold — and the
// connection is closed for the child (channel's fork rule), so its calls
// fail with connection_closed. A child borrows through a borrower of its own.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/channel/channel.h"
#include "shoal/lending/layout.h"
#include "shoal/lending/lending_types.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending {

class borrower;

struct borrower_options {
  /// Keep the mapping of an exclusive region given back (see above).
  bool keep_mappings = true;
  /// At most this many bytes kept mapped at once; a region that would pass
  /// it is unmapped when given back.
  std::size_t kept_mapping_bytes = std::size_t{16} << 30;
  /// How long a request polls for the lender's answer before it sleeps
  /// (channel::connection::set_receive_spin): an answer arriving meanwhile
  /// saves the wake-up of a blocked thread, at the cost of a busy core for
  /// at most this long per request; zero never spins. The default,
  /// automatic_reply_spin, spins 50 us where this process may run on at
  /// least 8 CPUs and never on fewer: on an H100 host (16 cores) a
  /// re-borrow took 15 us with it and 25 us without, while on a 2-core
  /// machine the spinning borrower takes the core the lender needs (a
  /// re-borrow ~75 us, not ~22). Many borrowing threads per core pay for it:
  /// 64 threads on 16 cores served 11% fewer requests (shoal_bench_lending
  /// --reply-spin-us compares).
  std::chrono::microseconds reply_spin = automatic_reply_spin;
  static constexpr std::chrono::microseconds automatic_reply_spin{-1};
  /// Connect as an observer: metrics() and revoke() only (borrow and
  /// borrow_shared throw invalid_argument), never counted among the lender's
  /// borrowers, and served while it has all the borrowers it admits, within
  /// lender_config::max_observers — how an operator's tools and health
  /// checks look at a full lender. A lender older than observers closes the
  /// connection (the first request: connection_closed).
  bool observer = false;
};

/// How a borrow waits (borrower::borrow's last argument).
struct borrow_wait {
  /// How long the lender may keep the borrow waiting for memory when it does
  /// not fit (0 to about 49 days; 0, the default: refused at once). Waiting
  /// borrows are served strictly in the order they came, as regions are
  /// given back (a revoke answered, a borrower gone); one whose wait runs
  /// out is refused (out_of_memory). While borrows wait, a borrow without a
  /// wait is refused at once: given-back memory goes to the line first. The
  /// call waits for its answer up to this plus its timeout; this borrower's
  /// other calls wait behind it (a region given back or dropped meanwhile
  /// is unmapped at once and given back at the next call, see give_back),
  /// so a process that must give back while it waits uses another borrower
  /// (connection). The lender cuts a wait to its max_wait (lender.h) and
  /// refuses at once what waiting cannot make fit: more than its capacity,
  /// this borrower's regions and this one past the capacity, a quota (a
  /// uid's waiting bytes count against its per-uid quota too).
  std::chrono::milliseconds for_memory{0};
  /// Called on the borrowing thread at least every 50 ms while no answer
  /// has come (empty: never). What it throws ends the call at once and
  /// propagates, as a timeout would end it; either way the lender is told to
  /// stop waiting (its place in line goes to the next), its answer is owed —
  /// a region it lent just before is given back unmapped at this borrower's
  /// next call (or within 1 s of its end) — and the borrower stays usable.
  /// How a caller stops a long wait (a signal, a shutdown). Throw anything
  /// but shoal::protocol_error, which is taken for the lender's and closes
  /// the connection.
  std::function<void()> interrupt_check;
};

/// A region mapped in this process. Giving it back (or destroying it) unmaps
/// it first — or keeps the mapping for a later lend of the same memory —
/// then tells the lender; the region is usable until then. A shared
/// region is mapped read-only (writing it faults) and carries its layout.
class borrowed_region {
 public:
  borrowed_region() = default;
  borrowed_region(borrowed_region&& other) noexcept;
  borrowed_region& operator=(borrowed_region&& other) noexcept;
  ~borrowed_region();
  borrowed_region(const borrowed_region&) = delete;
  borrowed_region& operator=(const borrowed_region&) = delete;

  [[nodiscard]] bool valid() const noexcept { return data_ != nullptr; }
  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  /// The lender's chunk this region is lent from: the same id when a later
  /// region gets the same memory again.
  [[nodiscard]] std::uint64_t memory_id() const noexcept { return memory_; }
  /// exclusive (read-write) or shared (read-only).
  [[nodiscard]] region_mode mode() const noexcept { return layout_ ? region_mode::shared : region_mode::exclusive; }
  /// A shared region's layout and content hash (as its writer committed
  /// them); nullptr for an exclusive region.
  [[nodiscard]] const region_layout* layout() const noexcept { return layout_.get(); }
  /// data() + the offset of the layout's entry `name`. invalid_argument for
  /// an exclusive region or a name the layout does not have.
  [[nodiscard]] const void* address_of(std::string_view name) const;

  struct __attribute__((visibility("hidden"))) link;  // hidden: the library's own

 private:
  friend class borrower;
  borrowed_region(std::shared_ptr<link> to_lender, std::uint64_t id, std::uint64_t memory, void* data, std::size_t size,
                  std::shared_ptr<const region_layout> layout = nullptr)
      : link_(std::move(to_lender)), id_(id), memory_(memory), data_(data), size_(size), layout_(std::move(layout)) {}
  void release() noexcept;

  std::shared_ptr<link> link_;
  std::uint64_t id_ = 0;
  std::uint64_t memory_ = 0;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  std::shared_ptr<const region_layout> layout_;  // set iff shared
};

class borrower {
 public:
  static constexpr std::chrono::milliseconds default_timeout{5000};

  /// Connects to the lender at `address` (its uid checked against `policy`)
  /// and exchanges hellos within `timeout`.
  borrower(backend::device& device, const channel::channel_address& address, const channel::access_policy& policy = {},
           std::chrono::milliseconds timeout = default_timeout, borrower_options options = {});
  ~borrower();
  borrower(const borrower&) = delete;
  borrower& operator=(const borrower&) = delete;

  /// Borrows a region of at least `bytes` (> 0) for `purpose` (at most
  /// max_purpose_bytes of printable ASCII) and maps it. `mode` must be
  /// exclusive (invalid_argument otherwise): a shared region is made by
  /// publish and mapped by borrow_shared. With `wait.for_memory`, a region
  /// that does not fit waits at the lender for memory to be given back
  /// (borrow_wait); without, it is refused at once (out_of_memory).
  [[nodiscard]] borrowed_region borrow(std::size_t bytes, std::string_view purpose,
                                       region_mode mode = region_mode::exclusive,
                                       std::chrono::milliseconds timeout = default_timeout,
                                       const borrow_wait& wait = {});
  /// borrow(bytes, purpose, exclusive, timeout, wait): an exclusive region
  /// that may wait for memory, e.g. borrow(bytes, "model B", {.for_memory = 30s}).
  [[nodiscard]] borrowed_region borrow(std::size_t bytes, std::string_view purpose, const borrow_wait& wait,
                                       std::chrono::milliseconds timeout = default_timeout) {
    return borrow(bytes, purpose, region_mode::exclusive, timeout, wait);
  }
  /// Publishes `region` (exclusive, borrowed through this borrower) under
  /// its purpose with `layout` (well-formed for it: layout.h; its hash the
  /// writer's claim about the entries' bytes) and returns it mapped
  /// read-only, with its layout: the writable mapping is unmapped first, so
  /// data() changes and pointers into the old mapping are invalid. The
  /// region counts against this borrower's quota as before.
  /// invalid_argument, with `region` untouched, for a malformed layout or a
  /// region that is not an exclusive one of this borrower. When the lender
  /// refuses (the name is published already, the region is being revoked)
  /// the region is given back, its content lost, and the refusal thrown.
  [[nodiscard]] borrowed_region publish(borrowed_region&& region, const region_layout& layout,
                                        std::chrono::milliseconds timeout = default_timeout);
  /// Maps, read-only, the region published under `name`, with its layout: a
  /// hold of its own, given back like any region; its bytes count in full
  /// against this borrower's quota. With `expected`, refused with
  /// content_mismatch unless the writer committed that hash; with
  /// `expected_writer_uid`, refused with content_mismatch unless a process of
  /// that uid published it (names are first come among the uids the lender
  /// admits: this is how a reader refuses a region another uid took the name
  /// of). invalid_argument when nothing is published under `name`.
  [[nodiscard]] borrowed_region borrow_shared(std::string_view name, std::optional<content_hash> expected = {},
                                              std::optional<uid_t> expected_writer_uid = {},
                                              std::chrono::milliseconds timeout = default_timeout);
  /// Gives `region` back, unmapped or its mapping kept (see above); returns
  /// once the lender confirmed. When another call holds the connection past
  /// `timeout` (a borrow waiting for memory), the region is unmapped at once
  /// and its give back sent at this borrower's next call: timeout_error says
  /// so. Dropping a region does the same within 1 s, and never throws.
  void give_back(borrowed_region region, std::chrono::milliseconds timeout = default_timeout);
  /// The lender's status in the Prometheus text format.
  [[nodiscard]] std::string metrics(std::chrono::milliseconds timeout = default_timeout);
  /// Asks the lender to revoke `region` (any borrower's: its id as status
  /// and the metrics name it) with `deadline` (1 ms to about 49 days) for its
  /// borrower to give it back, as lender::revoke does in the lender's own
  /// process; returns once the lender has accepted. The lender's operator
  /// only: peer_refused unless this process runs as the lender's uid or root;
  /// invalid_argument for a region not lent to a connected borrower, or a
  /// shared one. How `shoal daemon revoke` takes one model's memory for
  /// another's turn.
  void revoke(std::uint64_t region, std::chrono::milliseconds deadline,
              std::chrono::milliseconds timeout = default_timeout);

  /// A region the lender asked back, and by when.
  struct revocation {
    std::uint64_t region = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  /// The lender's requests to give regions back that arrived so far (waiting
  /// up to `wait` for a first one when none has, and no longer for another
  /// thread's request in progress): answer each with give_back before its
  /// deadline. A wait that ends while a message has
  /// come only in part keeps that part for the next call. Requests that came while another call
  /// waited for its answer are kept for this one: at most one per region
  /// this borrower holds, so a lender flooding revokes cannot grow what is
  /// kept. A revoke for a region this borrower does not hold (or whose give
  /// back the lender has confirmed), or a second one for a region already
  /// revoked, is a protocol_error wherever it is read, and the connection is
  /// closed (later calls: connection_closed): an honest lender never sends
  /// one, and dropping it would hide a broken or hostile lender.
  [[nodiscard]] std::vector<revocation> revocations(std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  /// Puts back revocations that revocations() returned and the caller did
  /// not handle (a revocation_watcher stopped part-way through a batch): the
  /// next revocations() call returns them before it reads the connection.
  /// Those whose give back the lender has confirmed meanwhile, or that are
  /// back already, are left out (a give back not confirmed yet — deferred
  /// behind a waiting borrow, or timed out — leaves its revoke in). Never
  /// waits for the connection. std::bad_alloc when host memory runs out.
  void return_revocations(std::span<const revocation> unhandled);

  /// The mappings this borrower keeps now (without asking the lender: a
  /// forget on its way is applied only when the borrower next reads).
  struct kept_mappings {
    std::size_t count = 0;
    std::size_t bytes = 0;
  };
  [[nodiscard]] kept_mappings kept() const;

 private:
  std::shared_ptr<borrowed_region::link> link_;
};

}  // namespace shoal::lending

#pragma GCC visibility pop
