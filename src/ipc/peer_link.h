// One connection's sharing protocol, both directions: the producer's
// announcements and storage messages going out, the consumer's tables
// coming in (consumer_state).
//
// Thread-safety: sends are serialized by send_mutex_ (an announcement and
// the storage message that needs it go out together, in one batch when the
// limits allow); receive is for one thread at a time.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <mutex>
#include <unordered_set>

#include "core/fork_epoch.h"
#include "ipc/consumer_state.h"
#include "ipc/producer_state.h"
#include "shoal/core/error.h"
#include "shoal/channel/channel.h"

namespace shoal::ipc::detail {

class peer_link {
 public:
  peer_link(std::shared_ptr<producer_state> state, channel::connection link);
  /// Releases the references of storage messages still unread.
  ~peer_link();
  peer_link(const peer_link&) = delete;
  peer_link& operator=(const peer_link&) = delete;

  void send(const storage::storage& st, std::span<const std::byte> metadata, backend::stream_ref stream);
  void send_note(std::span<const std::byte> metadata);
  /// Receives by `until` (nullopt: no deadline); throws timeout_error after.
  received receive(backend::stream_ref stream, std::optional<std::chrono::steady_clock::time_point> until);
  /// The next message if it has come whole, without waiting.
  std::optional<received> try_receive(backend::stream_ref stream, std::chrono::nanoseconds spin = {});
  /// The peer's hello if it has come, checked and nothing past it read (peer::check_greeting).
  void check_greeting();
  /// Closes the connection and revokes the peer process (peer::revoke).
  void revoke();
  /// Waits for the peer to take all but `at_most` of the storages sent here (peer::wait_taken).
  taken_state wait_taken(std::chrono::milliseconds timeout, std::size_t at_most);
  /// Storages sent here not taken yet (peer::untaken).
  std::size_t untaken();

  [[nodiscard]] const channel::peer_credentials& credentials() const noexcept { return link_.peer(); }
  [[nodiscard]] peer_stats stats() const { return receiver_->stats(); }
  [[nodiscard]] alloc::caching_allocator& allocator() const noexcept { return state_->allocator; }
  [[nodiscard]] int native_handle() const noexcept { return link_.native_handle(); }
  [[nodiscard]] std::size_t pending() const { return link_.pending(); }

 private:
  // Ids this peer was told about whose resources the producer has let go.
  struct retirements {
    std::vector<std::uint64_t> segments, files;
  };
  // The frames of one send, going out together (connection::send packs them
  // into as few system calls as it can); owns their payloads.
  struct outgoing {
    // Frames point into the payloads' own buffers, which moving a vector
    // (as this one grows) keeps where they are.
    std::vector<std::vector<std::byte>> payloads;
    std::vector<channel::outgoing_frame> frames;
    void add(message_type type, std::vector<std::byte> payload, int fd = -1);
    void add_frame(std::uint16_t type, std::vector<std::byte> payload, int fd = -1);
    void add(const retirements& r);
  };
  // All with send_mutex_ held. `send` gets the frames that go first: the
  // protocol hello on a connection's first send (channel/protocol.h), then
  // the retirements waiting in the outbox, which are forgotten only once it
  // returns; when it throws, they wait for the next send.
  retirements take_retirements();
  template <class Send>
  void send_with_retirements(const Send& send);
  void send_storage(const storage::storage& st, std::span<const std::byte> metadata, backend::stream_ref stream,
                    outgoing& out);
  void check_not_revoked() const;  // connection_closed once revoked
  // Closes the connection after a protocol error, so nothing more is read.
  [[noreturn]] void fail(const protocol_error& e);
  // Reads what has already arrived and releases the references its storage
  // messages name: the producer would otherwise wait for them until this
  // process exits. Best effort: anything malformed ends it, and so does
  // options.teardown_timeout (a peer that stalls in the middle of a batch).
  void release_unread() noexcept;
  // Takes one frame in: a message, or nullopt for an announcement or a
  // retirement. Closes the connection on a protocol error.
  std::optional<received> take_frame(channel::frame f, backend::stream_ref stream);
  // How long a receive polls beyond its own spin because the last send made
  // the peer map memory: until import_answer_due_ (taken once); zero when
  // no such send came or that time has passed.
  std::chrono::nanoseconds take_import_spin() noexcept;
  // The next frame: by `until` when there is one.
  channel::frame next_frame(const std::optional<std::chrono::steady_clock::time_point>& until);

  std::shared_ptr<producer_state> state_;
  channel::connection link_;
  std::shared_ptr<consumer_state> receiver_;
  std::shared_ptr<outbox> outbox_;

  // A storage sent on this connection whose slot its peer had not taken
  // (received or released) when last looked at; the file stays open while listed.
  struct awaited_share {
    std::shared_ptr<const counter_file> file;
    slot_ticket ticket;
  };
  // Forgets the awaited shares that were taken: the oldest ones at every
  // call, and all of them once the list has doubled since the last sweep
  // (a consumer keeping its first reference unreceived must not make the
  // list, and the counter files it keeps open, grow with every send).
  void forget_taken();
  // Forgets every awaited share that was taken; returns how many are left.
  std::size_t sweep_taken();

  std::mutex send_mutex_;
  // Oldest first; listed before its send, so a share that failed is listed
  // too (its slot released: taken) or held by a peer that got part of it.
  std::deque<awaited_share> awaited_;  // guarded by awaited_mutex_
  std::size_t sweep_at_ = 64;          // guarded by awaited_mutex_
  std::mutex awaited_mutex_;
  std::unordered_set<std::uint64_t> files_sent_, segments_sent_, sources_sent_;  // guarded by send_mutex_
  bool hello_sent_ = false;                                                       // guarded by send_mutex_
  std::atomic<bool> revoked_{false};
  // When a send brought the peer a segment or counter file to map: that
  // send's time plus options.import_answer_spin (steady clock, ns; 0: none).
  // The next receive that waits takes it and polls until then.
  std::atomic<std::int64_t> import_answer_due_{0};
  const shoal::detail::fork_epoch epoch_;  // a fork() child's teardown reads and tells nothing
  bool broken_ = false;         // a protocol error closed it; receive side only
  bool hello_checked_ = false;  // the peer's first frame named the sharing protocol; receive side only
  limits limits_;
};

}  // namespace shoal::ipc::detail
