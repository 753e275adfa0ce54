#include "ipc/peer_link.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <optional>
#include <string>

#include "core/deadline.h"
#include "ipc/messages.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"

namespace shoal::ipc::detail {

peer_link::peer_link(std::shared_ptr<producer_state> state, channel::connection link)
    : state_(std::move(state)),
      link_(std::move(link)),
      receiver_(consumer_state::for_producer(link_.peer().process, state_->serial, state_->allocator, state_->options,
                                             state_->held_for_producers)),
      outbox_(std::make_shared<outbox>(link_.peer().process)) {
  limits_.max_metadata = state_->options.max_metadata_bytes;
  // A storage message must fit a frame: 8 bytes per segment id.
  limits_.max_segments_per_storage = link_.max_payload() / sizeof(std::uint64_t);
  link_.set_receive_spin(state_->options.receive_spin);
  link_.set_send_timeout(shoal::detail::channel_timeout(state_->options.send_timeout));
  link_.allow_peer_ring(state_->options.max_peer_ring_bytes);
  // Before this link is registered anywhere: when the system refuses the
  // ring, nothing is left to undo. A peer gone already gets no ring; what it
  // sent before it went is received all the same.
  if (state_->options.ring_bytes > 0) {
    try {
      (void)link_.start_ring(state_->options.ring_bytes);
    } catch (const protocol_error& e) {
      // The peer takes no descriptors, which every sharing peer passes: an
      // endpoint of another protocol, whose greeting, if it came (a lender
      // greets as it accepts), names it.
      check_greeting();
      throw protocol_error(std::string(e.what()) + (hello_checked_ ? "" : "; its greeting has not come to say what it is"));
    }
  }
  state_->add_outbox(outbox_);
  state_->add_receiver(receiver_);
  state_->connect(link_.peer().process);
}

void peer_link::outgoing::add(message_type type, std::vector<std::byte> payload, int fd) {
  add_frame(static_cast<std::uint16_t>(type), std::move(payload), fd);
}

void peer_link::outgoing::add_frame(std::uint16_t type, std::vector<std::byte> payload, int fd) {
  payloads.push_back(std::move(payload));
  frames.push_back({type, payloads.back(), fd});
}

peer_link::retirements peer_link::take_retirements() {
  retirements r;
  {
    std::lock_guard lock(outbox_->mutex);
    r.segments.swap(outbox_->segments);
    r.files.swap(outbox_->files);
  }
  // Segments: only what this peer was told about. Files: all its holder's,
  // since another connection may have announced them to the same table.
  std::erase_if(r.segments, [&](std::uint64_t id) { return !segments_sent_.contains(id); });
  return r;
}

void peer_link::outgoing::add(const retirements& r) {
  // A frame of at most this many ids (32 KiB) fits the channel's default
  // payload (64 KiB), which sharing connections use or exceed: a producer
  // giving back many segments at once must not have its peers refuse it.
  constexpr std::size_t ids_per_frame = 4096;
  const auto add_all = [&](message_type type, std::span<const std::uint64_t> ids) {
    for (std::size_t at = 0; at < ids.size(); at += ids_per_frame) {
      add(type, encode_ids(ids.subspan(at, std::min(ids_per_frame, ids.size() - at))));
    }
  };
  add_all(message_type::retire_segments, r.segments);
  add_all(message_type::retire_files, r.files);
}

template <class Send>
void peer_link::send_with_retirements(const Send& send) {
  retirements retired = take_retirements();
  try {
    outgoing out;
    if (!hello_sent_) out.add_frame(channel::hello_frame_type, channel::encode_hello(sharing_protocol));
    out.add(retired);
    send(out);
    hello_sent_ = true;
  } catch (...) {
    // Not sent: the next send carries them. (Sent twice at worst, which the
    // receiver takes as a no-op.)
    std::lock_guard lock(outbox_->mutex);
    outbox_->segments.insert(outbox_->segments.end(), retired.segments.begin(), retired.segments.end());
    outbox_->files.insert(outbox_->files.end(), retired.files.begin(), retired.files.end());
    throw;
  }
  for (auto id : retired.segments) segments_sent_.erase(id);  // so an id is retired once
  for (auto id : retired.files) files_sent_.erase(id);
}

void peer_link::send(const storage::storage& st, std::span<const std::byte> metadata, backend::stream_ref stream) {
  if (metadata.size() > limits_.max_metadata) {
    throw invalid_argument("peer::send: " + std::to_string(metadata.size()) + " bytes of metadata is over the limit of " +
                           std::to_string(limits_.max_metadata) + " (sharing_options::max_metadata_bytes)");
  }
  check_not_revoked();
  std::lock_guard lock(send_mutex_);
  send_with_retirements([&](outgoing& out) { send_storage(st, metadata, stream, out); });
}

void peer_link::send_storage(const storage::storage& st, std::span<const std::byte> metadata, backend::stream_ref stream,
                             outgoing& out) {
  auto share = state_->share_storage(st, link_.peer().process, stream);
  bool sent = false;
  try {
    // Marked as sent only once the batch has gone.
    const bool new_file = !files_sent_.contains(share.slot.file_id);
    if (new_file) {
      out.add(message_type::counter_file, encode(counter_file_message{share.slot.file_id, state_->options.slots_per_file}),
              share.file->fd());
    }
    storage_message m;
    std::vector<std::uint64_t> new_segments;
    for (const auto& seg : share.segments) {
      if (!segments_sent_.contains(seg->id)) {
        out.add(message_type::segment, encode_segment(seg->id, seg->handle), seg->handle.fd.get());
        new_segments.push_back(seg->id);
      }
      m.segment_ids.push_back(seg->id);
    }
    backend::device& dev = state_->allocator.device();
    std::optional<backend::event_source> new_source;  // its descriptor must stay open until sent
    if (!dev.query(stream)) {  // writes still queued: the consumer must wait for them
      m.ready = dev.export_event(stream);
      if (!sources_sent_.contains(m.ready->source_id)) {
        new_source = dev.describe_event_source(m.ready->source_id);
        out.add(message_type::event_source, new_source->serialize(), new_source->fd.get());
      }
    }
    m.offset = share.offset;
    m.size = share.size;
    m.file_id = share.slot.file_id;
    m.slot = share.slot.ticket;
    m.metadata = metadata;
    out.add(message_type::storage, encode(m));  // last: a message ends its batch (peer::native_handle)
    if (!new_segments.empty()) {
      // Before the send: a retirement posted from now on reaches this
      // connection (one for a segment the send did not name is dropped by
      // take_retirements).
      std::lock_guard box_lock(outbox_->mutex);
      outbox_->announced.insert(new_segments.begin(), new_segments.end());
    }
    {
      std::lock_guard awaited_lock(awaited_mutex_);
      forget_taken();
      awaited_.push_back({share.file, share.slot.ticket});
    }
    link_.send(out.frames);
    sent = true;
    if ((new_file || !new_segments.empty()) && state_->options.import_answer_spin.count() > 0) {
      // At most a second: a huge setting must not overflow the clock.
      const auto due = std::chrono::steady_clock::now() +
                       std::min<std::chrono::microseconds>(state_->options.import_answer_spin, std::chrono::seconds(1));
      import_answer_due_.store(due.time_since_epoch().count(), std::memory_order_relaxed);
    }
    if (new_file) files_sent_.insert(share.slot.file_id);
    segments_sent_.insert(new_segments.begin(), new_segments.end());
    if (new_source) sources_sent_.insert(new_source->source_id);
  } catch (const connection_closed& e) {
    // Once sent, the consumer holds it; and a send that met the end after
    // part of it went — the storage frame published in the ring, its
    // wake-up refused — may have reached a consumer that still reads the
    // ring: the slot stays held (reclaimed once that process is gone, or
    // revoked), since freeing it would hand a block it maps to the next
    // allocation.
    if (!sent && !e.part_sent()) state_->abandon(share);
    throw;
  } catch (...) {
    // A send that left the connection usable sent nothing; one that broke
    // it may have sent part (held, as above).
    if (!sent && !link_.broken()) state_->abandon(share);
    throw;
  }
}

void peer_link::send_note(std::span<const std::byte> metadata) {
  if (metadata.size() > limits_.max_metadata) {
    throw invalid_argument("peer::send_note: " + std::to_string(metadata.size()) +
                           " bytes of metadata is over the limit of " + std::to_string(limits_.max_metadata));
  }
  check_not_revoked();
  if (state_->revoked(link_.peer().process)) {
    throw peer_refused("peer::send_note: process " + std::to_string(link_.peer().process.pid) +
                       " was revoked (peer::revoke); this context sends it nothing more");
  }
  std::lock_guard lock(send_mutex_);
  send_with_retirements([&](outgoing& out) {
    out.add(message_type::note, encode_note(metadata));
    link_.send(out.frames);
  });
}

peer_link::~peer_link() {
  // In a fork() child the socket is still the parent's too: reading what
  // waits on it would take the parent's messages. Only the descriptor goes.
  if (epoch_.forked_since()) return;
  if (!broken_) release_unread();
  try {
    state_->disconnect(link_.peer().process);
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): its files then close when the peer dies
  }
}

void peer_link::revoke() {
  revoked_.store(true);
  state_->revoke(link_.peer().process);
  ::shutdown(link_.native_handle(), SHUT_RDWR);
}

void peer_link::forget_taken() {
  while (!awaited_.empty() && awaited_.front().file->taken(awaited_.front().ticket)) awaited_.pop_front();
  if (awaited_.size() >= sweep_at_) sweep_at_ = std::max<std::size_t>(64, 2 * sweep_taken());
}

std::size_t peer_link::sweep_taken() {
  std::erase_if(awaited_, [](const awaited_share& a) { return a.file->taken(a.ticket); });
  return awaited_.size();
}

std::size_t peer_link::untaken() {
  std::lock_guard lock(awaited_mutex_);
  return sweep_taken();
}

taken_state peer_link::wait_taken(std::chrono::milliseconds timeout, std::size_t at_most) {
  const auto until = shoal::detail::deadline_after(timeout);
  auto pause = std::chrono::microseconds(20);
  const auto all_taken = [&] { return untaken() <= at_most; };
  for (;;) {
    if (all_taken()) return taken_state::all_taken;
    const auto now = std::chrono::steady_clock::now();
    // Looks at least once, for a timeout of zero too.
    const auto wait = std::clamp(std::chrono::ceil<std::chrono::microseconds>(until - now),
                                 std::chrono::microseconds(0), pause);
    const timespec slice{static_cast<time_t>(wait.count() / 1'000'000), static_cast<long>(wait.count() % 1'000'000) * 1000};
    // POLLIN is not asked for: notes the peer sent must not end the pause.
    pollfd hang_up{link_.native_handle(), POLLRDHUP, 0};
    if (::ppoll(&hang_up, 1, &slice, nullptr) > 0 && (hang_up.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
      // Its teardown released what it had not received before it hung up.
      return all_taken() ? taken_state::all_taken : taken_state::peer_gone;
    }
    if (now >= until) return all_taken() ? taken_state::all_taken : taken_state::waiting;
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
}

void peer_link::check_not_revoked() const {
  if (revoked_.load()) throw connection_closed("this connection was revoked (peer::revoke)");
}

void peer_link::release_unread() noexcept {
  try {
    // Never waits for more than has arrived, and a batch that arrived only
    // in part is given up on by the deadline (which shuts the socket down);
    // a peer that keeps sending is cut off by the same deadline.
    const auto until = shoal::detail::deadline_after(state_->options.teardown_timeout);
    while (!link_.broken() && std::chrono::steady_clock::now() < until) {
      std::optional<channel::frame> f = link_.try_receive();
      if (!f) {
        if (!link_.incomplete_since()) break;  // nothing more has come
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
        pollfd rest{link_.native_handle(), POLLIN, 0};
        (void)::poll(&rest, 1, static_cast<int>(std::max<std::int64_t>(0, left.count())));
        continue;
      }
      if (!hello_checked_) {
        channel::check_hello(*f, sharing_protocol);
        hello_checked_ = true;
      } else if (f->type == static_cast<std::uint16_t>(message_type::counter_file)) {
        receiver_->add_counter_file(decode_counter_file(f->payload, state_->options.max_peer_slots_per_file), std::move(f->fd));
      } else if (f->type == static_cast<std::uint16_t>(message_type::storage)) {
        receiver_->release_unclaimed(decode_storage(f->payload, limits_));
      }
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): best effort, as documented
  }
}

void peer_link::fail(const protocol_error& e) {
  release_unread();
  broken_ = true;
  ::shutdown(link_.native_handle(), SHUT_RDWR);
  throw e;
}

channel::frame peer_link::next_frame(const std::optional<std::chrono::steady_clock::time_point>& until) {
  if (!until) return link_.receive();
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - std::chrono::steady_clock::now());
  return link_.receive_for(shoal::detail::channel_timeout(left));
}

std::chrono::nanoseconds peer_link::take_import_spin() noexcept {
  if (import_answer_due_.load(std::memory_order_relaxed) == 0) return {};
  const std::chrono::steady_clock::time_point due{
      std::chrono::steady_clock::duration(import_answer_due_.exchange(0, std::memory_order_relaxed))};
  const std::chrono::nanoseconds left = due - std::chrono::steady_clock::now();
  return left.count() > 0 ? left : std::chrono::nanoseconds{};
}

received peer_link::receive(backend::stream_ref stream, std::optional<std::chrono::steady_clock::time_point> until) {
  check_not_revoked();
  if (broken_) throw connection_closed("peer::receive: the connection was closed after a malformed message");
  // The peer answers only once it has mapped what the last send brought:
  // poll for that answer rather than sleep through it and pay a wake-up.
  if (auto spin = take_import_spin(); spin.count() > 0) {
    if (until) spin = std::min<std::chrono::nanoseconds>(spin, *until - std::chrono::steady_clock::now());
    if (spin.count() > 0) {
      if (std::optional<received> r = try_receive(stream, spin)) return std::move(*r);
    }
  }
  for (bool first = true;; first = false) {
    // Frames that arrive in time but end no message (announcements,
    // retirements) do not stretch the deadline: a peer that keeps sending
    // them is timed out at a frame boundary, the stream still in step.
    if (until && !first && std::chrono::steady_clock::now() >= *until) {
      throw timeout_error("peer::receive_for: the deadline passed while the peer sent no whole message");
    }
    if (std::optional<received> r = take_frame(next_frame(until), stream)) {
      import_answer_due_.store(0, std::memory_order_relaxed);  // answered: no later receive polls for it
      return std::move(*r);
    }
  }
}

std::optional<received> peer_link::try_receive(backend::stream_ref stream, std::chrono::nanoseconds spin) {
  check_not_revoked();
  if (broken_) throw connection_closed("peer::try_receive: the connection was closed after a malformed message");
  // At most one batch's worth of frames, so that a peer sending
  // announcements without end cannot hold the caller; the spin is one
  // `spin` in all (longer once after a send the peer imports from).
  if (spin.count() > 0) spin = std::max(spin, take_import_spin());
  const auto spin_end = std::chrono::steady_clock::now() + spin;
  for (std::size_t frames = 0; frames < channel::max_batch_frames; ++frames) {
    const auto left = spin_end - std::chrono::steady_clock::now();
    std::optional<channel::frame> f = left.count() > 0 ? link_.try_receive(left) : link_.try_receive();
    if (!f) return std::nullopt;
    if (std::optional<received> r = take_frame(std::move(*f), stream)) {
      import_answer_due_.store(0, std::memory_order_relaxed);
      return r;
    }
  }
  return std::nullopt;
}

void peer_link::check_greeting() {
  check_not_revoked();
  if (broken_ || hello_checked_) return;
  // The peer's first frame is its hello: taken and checked here, never a
  // message, so nothing past it is read.
  if (std::optional<channel::frame> f = link_.try_receive()) (void)take_frame(std::move(*f), {});
}

std::optional<received> peer_link::take_frame(channel::frame f, backend::stream_ref stream) {
  try {
    if (!hello_checked_) {
      channel::check_hello(f, sharing_protocol);
      hello_checked_ = true;
      return std::nullopt;
    }
    switch (static_cast<message_type>(f.type)) {
      case message_type::counter_file:
        receiver_->add_counter_file(decode_counter_file(f.payload, state_->options.max_peer_slots_per_file), std::move(f.fd));
        return std::nullopt;
      case message_type::segment:
        receiver_->add_segment(decode_segment(f.payload, std::move(f.fd)));
        return std::nullopt;
      case message_type::event_source:
        receiver_->add_event_source(backend::event_source::deserialize(f.payload, std::move(f.fd)));
        return std::nullopt;
      case message_type::storage: {
        const storage_message m = decode_storage(f.payload, limits_);
        if (f.fd) {
          receiver_->release_unclaimed(m);
          throw protocol_error("storage message: came with a descriptor; it carries none");
        }
        received r;
        r.metadata.assign(m.metadata.begin(), m.metadata.end());
        r.storage = receiver_->make_storage(m, stream);
        return r;
      }
      case message_type::retire_segments:
        receiver_->retire_segments(decode_ids(f.payload, "retire_segments"));
        return std::nullopt;
      case message_type::retire_files:
        receiver_->retire_files(decode_ids(f.payload, "retire_files"));
        return std::nullopt;
      case message_type::note: {
        if (f.fd) throw protocol_error("note message: came with a descriptor; it carries none");
        received r;
        const auto metadata = decode_note(f.payload, limits_);
        r.metadata.assign(metadata.begin(), metadata.end());
        return r;
      }
      default:
        throw protocol_error("unknown message type " + std::to_string(f.type) +
                             "; the sender is not a matching shoal version or sent garbage");
    }
  } catch (const protocol_error& e) {
    fail(e);
  }
}

}  // namespace shoal::ipc::detail
