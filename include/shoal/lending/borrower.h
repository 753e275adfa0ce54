// The borrower: a process that borrows device memory from a lender (the
// memory daemon) and maps it at its own address.
//
//   borrower b(device, address);
//   borrowed_region r = b.borrow(1 << 30, "parameters");
//   use(r.data(), r.size());   // device memory, this process's mapping
//   b.give_back(std::move(r)); // or let r go: its destructor gives it back
//
// Errors: the lender's refusals are typed — out_of_memory (its capacity),
// peer_refused (this borrower's quota or region count), invalid_argument (a
// bad request) — and a device failure on its side is backend_error; the
// connection stays usable after any of them. connection_closed when the
// lender is gone (regions already mapped stay valid until given back);
// timeout_error when it does not answer within the deadline (the connection
// is then closed: an answer may still be on its way). protocol_error when it
// sends something malformed (the connection is closed).
//
// Thread-safety: borrow and give_back may be called from several threads;
// requests go one at a time. A borrowed_region is a value (move-only), used
// by one thread at a time; it may outlive its borrower object (it keeps the
// connection alive).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/channel/channel.h"
#include "shoal/lending/lending_types.h"

namespace shoal::lending {

class borrower;

/// A region mapped in this process. Giving it back (or destroying it) unmaps
/// it first, then tells the lender; memory is valid until then.
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

  struct link;

 private:
  friend class borrower;
  borrowed_region(std::shared_ptr<link> link, std::uint64_t id, void* data, std::size_t size)
      : link_(std::move(link)), id_(id), data_(data), size_(size) {}
  void release() noexcept;

  std::shared_ptr<link> link_;
  std::uint64_t id_ = 0;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

class borrower {
 public:
  static constexpr std::chrono::milliseconds default_timeout{5000};

  /// Connects to the lender at `address` (its uid checked against `policy`)
  /// and exchanges hellos within `timeout`.
  borrower(backend::device& device, const channel::channel_address& address, const channel::access_policy& policy = {},
           std::chrono::milliseconds timeout = default_timeout);
  ~borrower();
  borrower(const borrower&) = delete;
  borrower& operator=(const borrower&) = delete;

  /// Borrows a region of at least `bytes` (> 0) for `purpose` (at most
  /// max_purpose_bytes of printable ASCII) and maps it.
  [[nodiscard]] borrowed_region borrow(std::size_t bytes, std::string_view purpose,
                                       region_mode mode = region_mode::exclusive,
                                       std::chrono::milliseconds timeout = default_timeout);
  /// Unmaps `region` and gives it back; returns once the lender confirmed.
  void give_back(borrowed_region region, std::chrono::milliseconds timeout = default_timeout);
  /// The lender's status in the Prometheus text format.
  [[nodiscard]] std::string metrics(std::chrono::milliseconds timeout = default_timeout);

  /// A region the lender asked back, and by when.
  struct revocation {
    std::uint64_t region = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  /// The lender's requests to give regions back that arrived so far (waiting
  /// up to `wait` for a first one when none has): answer each with
  /// give_back before its deadline. Requests that came while another call
  /// waited for its answer are kept for this one: at most one per region
  /// this borrower holds, so a lender flooding revokes cannot grow what is
  /// kept. A revoke for a region this borrower does not hold (or whose give
  /// back the lender has confirmed), or a second one for a region already
  /// revoked, is a protocol_error wherever it is read, and the connection is
  /// closed (later calls: connection_closed): an honest lender never sends
  /// one, and dropping it would hide a broken or hostile lender.
  [[nodiscard]] std::vector<revocation> revocations(std::chrono::milliseconds wait = std::chrono::milliseconds(0));

 private:
  std::shared_ptr<borrowed_region::link> link_;
};

}  // namespace shoal::lending
