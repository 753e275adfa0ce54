// Sharing between processes: the checked channel (Listener, connect,
// Connection) and the C++ sharing layer (SharingContext, Peer). The queue
// API for batches (python/shoal/sharing.py) is written on top of these.
//
// Lifetimes follow sharing.h: a context keeps its allocator, a peer keeps
// its context, and a storage received on a peer keeps that context (and so
// its allocator) alive. Every call that may wait on another process runs
// with the GIL released, and so does every call that takes a lock another
// thread holds meanwhile (the context's collector, a receive mapping memory).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bindings.h"
#include "closable.h"
#include "gil.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/ipc/sharing.h"
#include "made_elsewhere.h"

namespace shoal::python {

channel::channel_address address_of(const std::string& text) {
  if (!text.empty() && text.front() == '@') return channel::channel_address::abstract(text.substr(1));
  return channel::channel_address::at_path(text);
}

std::string text_of(const channel::channel_address& address) {
  return address.is_abstract() ? "@" + address.name() : address.name();
}

namespace {

struct py_listener {
  closable<channel::listener> listener;
};

struct py_connection {
  std::optional<channel::connection> connection;  // empty once closed or given to a Peer
  bool given_to_peer = false;
};

/// A sharing context and the allocator it belongs to.
class sharing_state {
 public:
  sharing_state(std::shared_ptr<allocator_state> allocator, const ipc::sharing_options& options)
      : allocator_(std::move(allocator)),
        context_(std::make_unique<ipc::sharing_context>(allocator_->allocator(), options)),
        receive_spin_(options.receive_spin) {}
  // Before the allocator, and without the GIL: the context's end joins its
  // collector thread and collects once more.
  ~sharing_state() {
    detail::waiting_without_gil([&] { context_.reset(); });
  }
  [[nodiscard]] ipc::sharing_context& context() const noexcept { return *context_; }
  [[nodiscard]] const std::shared_ptr<allocator_state>& allocator() const noexcept { return allocator_; }
  /// How long a receive polls before it sleeps (sharing_options::receive_spin).
  [[nodiscard]] std::chrono::microseconds receive_spin() const noexcept { return receive_spin_; }

 private:
  std::shared_ptr<allocator_state> allocator_;
  std::unique_ptr<ipc::sharing_context> context_;
  std::chrono::microseconds receive_spin_;
};

struct py_sharing_context {
  std::shared_ptr<sharing_state> state;
};

struct py_peer {
  std::shared_ptr<sharing_state> context;
  closable<ipc::peer> peer;
};

using time_point = std::chrono::steady_clock::time_point;

// Peer.receive: try_receive spinning on the ring for the context's
// receive_spin, then a poll of the socket, in slices, so that Ctrl-C and a
// close() from another thread end the wait, and so that a batch that has
// begun to come stays with the connection across slices (its rest is read by
// the next call; a timeout never breaks the stream).
std::optional<ipc::received> receive_in_slices(const closable<ipc::peer>::use& peer, const closable<ipc::peer>& owner,
                                               std::optional<time_point> until, backend::stream_ref stream,
                                               std::chrono::microseconds spin) {
  return wait_in_slices(peer, owner, until, [&](std::chrono::milliseconds slice) -> std::optional<ipc::received> {
    const auto slice_end = std::chrono::steady_clock::now() + slice;
    // A spin on the ring first (its sender told that no wake-up is needed);
    // at least a look, so that the answer to a send the peer imports from
    // is polled for (sharing_options::import_answer_spin) with no spin set.
    const auto first_spin =
        std::max<std::chrono::nanoseconds>(std::chrono::nanoseconds(1), std::min<std::chrono::nanoseconds>(spin, slice));
    if (auto r = peer->try_receive(stream, first_spin)) return r;
    for (;;) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(slice_end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      // Frames already read wait to be taken (announcements past one call's
      // share, another thread's receive): look again soon, not at the socket.
      pollfd readable{peer->native_handle(), POLLIN, 0};
      (void)::poll(&readable, 1, peer->pending() != 0 ? 1 : static_cast<int>(left.count()));
      if (auto r = peer->try_receive(stream)) return r;
    }
  });
}

// An option's value as a whole number of at least 0 that fits T, or
// invalid_argument naming the option (not nanobind's bare std::bad_cast).
template <class T>
T option_value(const std::string& key, nb::handle value) {
  // An int or numpy's integer (never a bool), from 0 to T's largest.
  const std::optional<python_int> whole = index_of(value);
  T out{};
  if (!whole || !nb::try_cast<T>(whole->value, out) || out < T{}) {
    throw invalid_argument("SharingContext: " + key + " takes a whole number of at least 0, not " +
                           nb::cast<std::string>(nb::repr(value)));
  }
  return out;
}

ipc::sharing_options options_of(const nb::kwargs& settings) {
  ipc::sharing_options o;
  for (auto [key_object, value] : settings) {
    const auto key = nb::cast<std::string>(key_object);
    auto ms = [&] { return std::chrono::milliseconds(option_value<std::int64_t>(key, value)); };
    if (key == "collect_interval_ms") {
      o.collect_interval = ms();
    } else if (key == "send_timeout_ms") {
      o.send_timeout = ms();
    } else if (key == "teardown_timeout_ms") {
      o.teardown_timeout = ms();
    } else if (key == "receive_spin_us") {
      o.receive_spin = std::chrono::microseconds(option_value<std::int64_t>(key, value));
    } else if (key == "import_answer_spin_us") {
      o.import_answer_spin = std::chrono::microseconds(option_value<std::int64_t>(key, value));
    } else if (key == "max_metadata_bytes") {
      o.max_metadata_bytes = option_value<std::size_t>(key, value);
    } else if (key == "slots_per_file") {
      o.slots_per_file = option_value<std::uint32_t>(key, value);
    } else if (key == "ring_bytes") {
      o.ring_bytes = option_value<std::size_t>(key, value);
    } else if (key == "max_peer_ring_bytes") {
      o.max_peer_ring_bytes = option_value<std::size_t>(key, value);
    } else if (key == "max_peer_mapped_bytes") {
      o.max_peer_mapped_bytes = option_value<std::size_t>(key, value);
    } else if (key == "max_mapped_bytes") {
      o.max_mapped_bytes = option_value<std::size_t>(key, value);
    } else if (key == "max_producer_resources") {
      o.max_producer_resources = option_value<std::size_t>(key, value);
    } else {
      throw invalid_argument("SharingContext: unknown option " + key +
                             " (collect_interval_ms, send_timeout_ms, teardown_timeout_ms, receive_spin_us, "
                             "import_answer_spin_us, max_metadata_bytes, slots_per_file, ring_bytes, max_peer_ring_bytes, "
                             "max_peer_mapped_bytes, max_mapped_bytes, max_producer_resources)");
    }
  }
  return o;
}

std::span<const std::byte> bytes_of(const nb::bytes& data) {
  return {reinterpret_cast<const std::byte*>(data.c_str()), data.size()};
}

// A received storage's streams, `received_on` among them, are kept by its handles
// (stream_keeper::for_handles), not by the allocator: its release (ipc's
// received_data, src/ipc/consumer_state.cpp) runs in the storage's
// destructor, when the last handle drops it, and uses those streams there
// only (a query, a host task holding no stream, or a wait); the ipc layer
// keeps no copy of the storage or of its owner past the call that made it
// (a received storage cannot be sent on), so the keeper, which goes after
// the storage (storage_handle's members), outlives every use. The receive
// stream is used in that call alone until the storage exists (its wait for
// the producer's ready point): the caller's `received_on` keeps it meanwhile,
// and a storage the call fails to hand out goes before it. Peer.send hands
// a storage's keeper to the allocator before it sends, as it must for any
// storage, then refuses a received one: its streams stay kept for the
// allocator's life (the price of a refused send, not of a receive).
nb::tuple received_tuple(const py_peer& p, ipc::received r, const std::shared_ptr<stream_state>& received_on) {
  nb::bytes metadata(reinterpret_cast<const char*>(r.metadata.data()), r.metadata.size());
  if (!r.storage.valid()) return nb::make_tuple(nb::none(), metadata);
  auto streams = stream_keeper::for_handles();
  streams->keep(received_on, *p.context->allocator());
  storage_handle handle(std::move(r.storage), p.context->allocator(), std::move(streams), p.context);
  return nb::make_tuple(py_storage{std::move(handle)}, metadata);
}

nb::dict holder_dict(const ipc::holder_stats& h) {
  nb::dict d;
  d["pid"] = h.process.pid;
  d["references"] = h.references;
  d["pinned_bytes"] = h.pinned_bytes;
  d["limbo_blocks"] = h.limbo_blocks;
  d["limbo_bytes"] = h.limbo_bytes;
  d["connections"] = h.connections;
  d["revoked"] = h.revoked;
  return d;
}

}  // namespace

// Calling Connection() names these.
constexpr char connection_made_by[] =
    "shoal.Connection is not made by calling the class: shoal.connect(address) or Listener.accept() makes one.";

void register_sharing(nb::module_& m) {
  m.def(
      "runtime_dir_address", [](const std::string& name) { return text_of(channel::channel_address::in_runtime_dir(name)); },
      nb::arg("name"),
      "The recommended socket path for a channel named `name`: in $XDG_RUNTIME_DIR (this user's 0700 "
      "directory), else /tmp/shoal-<uid>. An address is that path, any absolute socket path, or '@name' for "
      "an abstract socket name (no file; the access policy alone decides who connects).");

  m.def(
      "_check_sharing_options", [](const nb::kwargs& options) { (void)options_of(options); },
      "Raises what SharingContext(allocator, **options) would for these options, making nothing: "
      "shoal.sharing.Producer checks its options when made, though its context is made at its first put.");

  nb::class_<py_connection>(m, "Connection", made_elsewhere<connection_made_by>(),
                            "A checked connection to another process (from Listener.accept or connect); "
                            "give it to Peer to share storages over it. A context manager: leaving the block (or "
                            "close()) closes a connection not given to a Peer; one given to a Peer is the Peer's. "
                            "Its calls hold the GIL and never wait, so several threads may use it.")
      .def_prop_ro("peer_pid",
                   [](const py_connection& c) {
                     if (c.given_to_peer) throw invalid_argument("Connection: already given to a Peer");
                     if (!c.connection) throw invalid_argument("Connection: closed");
                     return c.connection->peer().process.pid;
                   })
      .def(
          "close",
          [](py_connection& c) {
            if (c.given_to_peer) return;
            c.connection.reset();
          },
          "Closes the connection, unless it was given to a Peer (then the Peer's close() does). Closing "
          "twice is harmless.")
      .def_prop_ro(
          "closed", [](const py_connection& c) { return !c.connection && !c.given_to_peer; },
          "True once close() closed it (not when it was given to a Peer).")
      .def("__enter__", [](nb::handle self) { return self; }, nb::sig("def __enter__(self) -> Self"))
      .def(
          "__exit__",
          [](py_connection& c, nb::args) {
            if (!c.given_to_peer) c.connection.reset();
          },
          nb::arg("args"))
      .def("__repr__", [](const py_connection& c) -> std::string {
        if (c.given_to_peer) return "shoal.Connection(given to a Peer)";
        if (!c.connection) return "shoal.Connection(closed)";
        return "shoal.Connection(pid " + std::to_string(c.connection->peer().process.pid) + ")";
      });

  nb::class_<py_listener>(m, "Listener",
                          "Listens for connections at an address (see runtime_dir_address). A socket path's "
                          "directory is created with mode 0700 or must be one. Only processes of this user, and "
                          "of `allowed_uids`, are admitted. Closes (and removes its socket file) on close() or "
                          "when collected; a context manager. Usable from several threads at once: each connection "
                          "goes to one accept() call, and close() from another thread ends their waits.")
      .def(
          "__init__",
          [](py_listener* self, const address_text& address, const std::vector<python_int>& allowed_uids) {
            const auto a = address_of(address.text);
            const auto policy = policy_of(allowed_uids, "Listener");
            std::unique_ptr<channel::listener> listener;
            {
              // The socket file's start lock (another process's listener starting there holds it),
              // and a probe of a file left there: whether someone listens.
              released_gil release;
              listener = std::make_unique<channel::listener>(a, policy);
            }
            new (self) py_listener{{"Listener", closed_error::invalid_argument, std::move(listener)}};
          },
          nb::arg("address"), nb::arg("allowed_uids") = std::vector<int>{})
      .def(
          "accept",
          [](const py_listener& l, std::optional<double> timeout) -> std::optional<py_connection> {
            const auto until = until_of(timeout, "Listener.accept");
            const auto listener = l.listener.enter();
            auto c = wait_in_slices(listener, l.listener, until, [&](std::chrono::milliseconds slice) {
              return listener->accept_for(slice);
            });
            if (!c) return std::nullopt;
            return py_connection{std::move(*c)};
          },
          nb::arg("timeout").none() = nb::none(),
          "The next connection, its peer's uid checked; None when `timeout` seconds pass first. A client "
          "whose process ended before it could be identified (another Listener's check that this address is "
          "in use, say) is dropped and the wait goes on. Raises PeerRefusedError for a peer of another user "
          "(the listener keeps working). The wait ends on Ctrl-C "
          "(KeyboardInterrupt) and on close() from another thread (InvalidArgumentError).")
      .def(
          "remove_abandoned_sockets",
          [](const py_listener& l, const std::string& prefix) {
            const auto listener = l.listener.enter();
            released_gil release;  // probes each candidate socket: whether someone listens there
            return listener->remove_abandoned_sockets(prefix);
          },
          nb::arg("prefix"),
          "Removes from this listener's directory the socket files that killed servers naming their sockets "
          "`<prefix><pid>-<rest>.sock` left: named for a pid that no longer runs, sockets of this user (links "
          "are not followed), at least 10 s old (a younger one may be a listener's between bind and listen), "
          "with no one listening. Anything else is left. Returns how many it removed; 0 "
          "for an abstract name.")
      .def_prop_ro("address", [](const py_listener& l) { return text_of(l.listener.enter()->address()); })
      .def("fileno", [](const py_listener& l) { return l.listener.enter()->native_handle(); },
           "The listening socket, for selectors: readable when a connection waits.")
      .def(
          "close", [](py_listener& l) { l.listener.close(); },
          "Stops listening and removes the socket file; an accept() waiting in another thread ends first.")
      .def_prop_ro(
          "closed", [](const py_listener& l) { return l.listener.closed(); }, "True once close() has begun.")
      .def("__enter__", [](nb::handle self) { return self; }, nb::sig("def __enter__(self) -> Self"))
      .def(
          "__exit__", [](py_listener& l, nb::args) { l.listener.close(); }, nb::arg("args"))
      .def("__repr__", [](const py_listener& l) -> std::string {
        const auto listener = l.listener.try_enter();
        if (!listener) return "shoal.Listener(closed)";
        return "shoal.Listener(" + text_of((*listener)->address()) + ")";
      });

  m.def(
      "connect",
      [](const address_text& address, const std::vector<python_int>& allowed_uids, std::optional<double> timeout) {
        const auto a = address_of(address.text);
        const auto policy = policy_of(allowed_uids, "connect");
        const auto t = deadline_of(timeout, "connect").value_or(std::chrono::milliseconds::max());
        released_gil release;
        return py_connection{channel::connection::connect(a, policy, channel::connection::default_max_payload, t)};
      },
      nb::arg("address"), nb::arg("allowed_uids") = std::vector<int>{},
      nb::arg("timeout").none() = 60.0,
      "Connects to the Listener at `address`; the listening process must run as this user or one of "
      "`allowed_uids` (PeerRefusedError otherwise). ConnectionClosedError when no one listens there; "
      "PeerTimeoutError when the listener takes no connection within `timeout` seconds (a server that stopped "
      "accepting; None waits without a deadline).");

  nb::class_<py_sharing_context>(m, "SharingContext", nb::is_weak_referenceable(),
                                 "What sharing storages with other processes needs, for one Allocator: "
                                 "reference counters, the limbo of blocks other processes still hold, and a "
                                 "collector that frees them and reclaims the references of processes that "
                                 "died. Belongs to the process that made it. Thread-safe.")
      .def(
          "__init__",
          [](py_sharing_context* self, const py_allocator& allocator, const nb::kwargs& options) {
            new (self) py_sharing_context{std::make_shared<sharing_state>(allocator.state, options_of(options))};
          },
          nb::arg("allocator"), nb::arg("options"),
          "Options (keywords): collect_interval_ms (100), send_timeout_ms (10000), teardown_timeout_ms (100), "
          "receive_spin_us (50), import_answer_spin_us (200: how long the first receive after a send that brought the peer "
          "memory new to it polls for the answer), max_metadata_bytes (65536), slots_per_file (4096), ring_bytes (65536; 0: the "
          "socket alone), max_peer_ring_bytes (4194304: the largest ring taken from a peer; a peer of another user "
          "could leave its pages unallocated for this process's reads to allocate; raise it on both sides to at least ring_bytes rounded up to a power of two), "
          "max_peer_mapped_bytes (1099511627776: the bytes of one producer's segments mapped here at once, and its largest "
          "segment; mappings no received storage uses are closed to make room, past it a storage is refused), max_mapped_bytes "
          "(35184372088832: the same for all producers together), max_producer_resources (32768: descriptors and "
          "memory mappings held for all producers together: segments and counter files announced, event sources, "
          "segment chunks mapped; past it an announcement or a storage is refused).")
      .def_prop_ro("allocator", [](const py_sharing_context& c) { return py_allocator{c.state->allocator()}; })
      .def(
          "collect", [](const py_sharing_context& c) { return c.state->context().collect(); },
          nb::call_guard<released_gil>(),
          "Reclaims dead holders' references and frees every limbo block no one holds; returns how many.")
      .def(
          "stats",
          [](const py_sharing_context& c) {
            ipc::sharing_stats s;
            {
              released_gil release;  // the context's locks, which its collector holds while it collects
              s = c.state->context().stats();
            }
            nb::dict d;
            d["limbo_blocks"] = s.limbo_blocks;
            d["limbo_bytes"] = s.limbo_bytes;
            d["held_slots"] = s.held_slots;
            d["counter_files"] = s.counter_files;
            d["exported_segments"] = s.exported_segments;
            d["storages_sent"] = s.storages_sent;
            d["limbo_freed"] = s.limbo_freed;
            d["slots_reclaimed"] = s.slots_reclaimed;
            d["producers_mapped_bytes"] = s.producers_mapped_bytes;
            d["producer_resources"] = s.producer_resources;
            return d;
          },
          "Counters as a dict: limbo_blocks/bytes, held_slots, counter_files, exported_segments, "
          "storages_sent, limbo_freed, slots_reclaimed; and what it holds for the producers it receives from, "
          "all together: producers_mapped_bytes (within max_mapped_bytes) and producer_resources (descriptors and "
          "mappings, within max_producer_resources).")
      .def(
          "holders",
          [](const py_sharing_context& c) {
            std::vector<ipc::holder_stats> holders;
            {
              released_gil release;  // the context's locks, as stats()
              holders = c.state->context().holders();
            }
            nb::list out;
            for (const auto& h : holders) out.append(holder_dict(h));
            return out;
          },
          "Per process holding references to this context's memory or connected to it: pid, references, "
          "pinned_bytes, limbo_blocks, limbo_bytes, connections, revoked.")
      .def("__repr__", [](const py_sharing_context& c) {
        ipc::sharing_stats s;
        {
          released_gil release;  // the context's locks, as stats()
          s = c.state->context().stats();
        }
        return "shoal.SharingContext(" + c.state->allocator()->allocator().device().name() + ", " +
               std::to_string(s.storages_sent) + " storages sent, " + std::to_string(s.limbo_blocks) +
               " blocks held by other processes)";
      });

  nb::class_<py_peer>(m, "Peer",
                      "One connection to another process, for sharing storages both ways. send() may be called "
                      "from several threads; receive() from one at a time (a second thread receiving may sleep up to "
                      "0.1 s past a message the first left, while the first spins). A context manager; close() tears "
                      "the connection down (waiting at most the context's teardown timeout), once the calls other threads "
                      "make on it have ended (a receive ends within 0.1 s; a send still waiting after 0.2 s is ended "
                      "by shutting the connection down).")
      .def(
          "__init__",
          [](py_peer* self, const py_sharing_context& context, py_connection& connection) {
            if (connection.given_to_peer) throw invalid_argument("Peer: this Connection was given to a Peer already");
            if (!connection.connection) throw invalid_argument("Peer: this Connection was closed");
            // Taken from the Connection once the Peer is made (the make may fail: the
            // connection is then closed, and says so).
            channel::connection c = std::move(*connection.connection);
            connection.connection.reset();
            // Given before the GIL goes: meanwhile another thread sees it given, not closed.
            connection.given_to_peer = true;
            std::unique_ptr<ipc::peer> p;
            try {
              released_gil release;
              p = std::make_unique<ipc::peer>(context.state->context(), std::move(c));
            } catch (...) {
              connection.given_to_peer = false;  // closed, as it says
              throw;
            }
            // A send still waiting on a peer that stopped reading when close()
            // has waited two slices ends with the connection shut down.
            auto shut_down = [](ipc::peer& peer) { ::shutdown(peer.native_handle(), SHUT_RDWR); };
            new (self) py_peer{context.state, {"Peer", closed_error::connection_closed, std::move(p), shut_down}};
          },
          nb::arg("context"), nb::arg("connection"))
      .def(
          "send",
          [](const py_peer& p, nb::handle data, const nb::bytes& metadata, const py_stream* stream) {
            const storage_handle* handle = nullptr;
            if (nb::isinstance<py_storage>(data)) {
              handle = &nb::cast<const py_storage&>(data).handle;
            } else if (nb::isinstance<py_array_view>(data)) {
              handle = &nb::cast<const py_array_view&>(data).handle;
            } else {
              throw invalid_argument("Peer.send: expected a Storage or an ArrayView, not " +
                                     nb::cast<std::string>(nb::str(data.type().attr("__name__"))));
            }
            auto st = stream_or_current(stream, handle->get().device());
            // The other process's release may come after every handle here:
            // the storage's release records its streams on the block, and the
            // allocator holds each until the block's free (record_stream).
            handle->keep_stream(st);
            const auto peer = p.peer.enter();
            const auto bytes = bytes_of(metadata);
            // Copied with the GIL held: Borrower.publish swaps a storage's handle under the GIL,
            // and refuses while this copy exists.
            const auto held = handle->get();
            released_gil release;
            peer->send(held, bytes, st->ref());
          },
          nb::arg("data").none(), nb::arg("metadata") = nb::bytes(""), nb::arg("stream").none() = nb::none(),
          "Shares a Storage (or an ArrayView's storage) of this context's allocator with the other process, "
          "with `metadata` attached; it waits for the work enqueued on `stream` (default: the current stream) "
          "before using it. The memory is freed only when every process has dropped it. A storage belongs to "
          "the first SharingContext that sends it: another context refuses it (InvalidArgumentError), as it "
          "refuses one received from another process or adopted; send a copy.")
      .def(
          "send_note",
          [](const py_peer& p, const nb::bytes& metadata) {
            const auto peer = p.peer.enter();
            const auto bytes = bytes_of(metadata);
            released_gil release;
            peer->send_note(bytes);
          },
          nb::arg("metadata"), "Sends metadata alone.")
      .def(
          "receive",
          [](const py_peer& p, std::optional<double> timeout, const py_stream* stream) {
            const auto until = until_of(timeout, "Peer.receive");
            const auto peer = p.peer.enter();
            auto st = stream_or_current(stream, p.context->allocator()->allocator().device());
            std::optional<ipc::received> r =
                receive_in_slices(peer, p.peer, until, st->ref(), p.context->receive_spin());
            if (!r) {
              throw timeout_error("Peer.receive: no whole message came from pid " +
                                  std::to_string(peer->credentials().process.pid) + " within " +
                                  seconds_text(*timeout) + " s; the connection stays usable");
            }
            return received_tuple(p, std::move(*r), st);
          },
          nb::arg("timeout").none() = nb::none(), nb::arg("stream").none() = nb::none(),
          nb::sig("def receive(self, timeout: float | None = None, stream: Stream | None = None) -> "
                  "tuple[Storage | None, bytes]"),
          "The next (storage, metadata) from the other process — storage None for a note — ready for work "
          "enqueued on `stream` (default: the current stream). Raises PeerTimeoutError after `timeout` "
          "seconds (what came of a message is kept for the next call), ConnectionClosedError when the peer "
          "has gone or close() was called from another thread, ProtocolError on a malformed message. The "
          "wait ends on Ctrl-C (KeyboardInterrupt).")
      .def(
          "try_receive",
          [](const py_peer& p, const py_stream* stream) -> nb::object {
            const auto peer = p.peer.enter();
            auto st = stream_or_current(stream, p.context->allocator()->allocator().device());
            std::optional<ipc::received> r;
            {
              released_gil release;
              r = peer->try_receive(st->ref());
            }
            if (!r) return nb::none();
            return received_tuple(p, std::move(*r), st);
          },
          nb::arg("stream").none() = nb::none(),
          nb::sig("def try_receive(self, stream: Stream | None = None) -> tuple[Storage | None, bytes] | None"),
          "The next (storage, metadata) if it has come whole, without waiting; None when it has not (what "
          "came of it is kept). For a selector loop: once fileno() is readable, call this until it returns "
          "None. Raises ConnectionClosedError when the peer has gone, ProtocolError on a malformed message.")
      .def(
          "check_greeting",
          [](const py_peer& p) {
            const auto peer = p.peer.enter();
            released_gil release;
            peer->check_greeting();
          },
          "Reads the peer's protocol hello if it has come, without waiting and never past it: "
          "ProtocolError naming both protocols when the other end speaks another (a lender greets as it "
          "accepts). How a Peer that only sends finds out it reached the wrong endpoint.")
      .def(
          "wait_taken",
          [](const py_peer& p, std::optional<double> timeout, const python_int& at_most_given) {
            const auto at_most =
                static_cast<std::size_t>(whole_number_of(at_most_given, "Peer.wait_taken", "at_most"));
            const auto until = until_of(timeout, "Peer.wait_taken");
            const auto peer = p.peer.enter();
            const auto state = wait_in_slices(
                peer, p.peer, until, [&](std::chrono::milliseconds slice) -> std::optional<ipc::taken_state> {
                  const auto s = peer->wait_taken(slice, at_most);
                  if (s == ipc::taken_state::waiting) return std::nullopt;
                  return s;
                });
            if (!state) {
              throw timeout_error("Peer.wait_taken: pid " + std::to_string(peer->credentials().process.pid) +
                                  " had not taken all but " + std::to_string(at_most) + " of the storages sent within " +
                                  seconds_text(*timeout) + " s");
            }
            return *state == ipc::taken_state::all_taken;
          },
          nb::arg("timeout").none() = nb::none(), nb::arg("at_most") = 0,
          "Waits until the other process has taken every storage sent on this connection: received it (its "
          "memory mapped there, from then on outliving this process) or let it go. True then; False when it "
          "hung up first, or this connection was revoked, with some neither. Raises PeerTimeoutError when "
          "`timeout` seconds pass first (None: no limit; 0: looks once). Call it before a producer process "
          "ends, after the work the sends wait on has run (Stream.synchronize): what was not taken goes with "
          "the process (a connection not yet accepted cannot even be identified; on CUDA the memory goes). "
          "Notes are not waited for. With `at_most`, content once no more than that many are untaken. The wait "
          "ends on Ctrl-C (KeyboardInterrupt).")
      .def(
          "untaken",
          [](const py_peer& p) {
            const auto peer = p.peer.enter();
            released_gil release;
            return peer->untaken();
          },
          "Storages sent on this connection that the other process has neither received nor let go yet.")
      .def(
          "pending", [](const py_peer& p) { return p.peer.enter()->pending(); },
          "Not zero while frames that came wait to be taken (in a batch already read, or in the peer's "
          "shared ring): try_receive() may then return more though fileno() is not readable.")
      .def(
          "revoke",
          [](const py_peer& p) {
            const auto peer = p.peer.enter();
            released_gil release;
            peer->revoke();
          },
          "Stops trusting the other process: the connection closes and the context sends it nothing more; "
          "what it holds stays pinned until it releases it or dies.")
      .def_prop_ro("peer_pid", [](const py_peer& p) { return p.peer.enter()->credentials().process.pid; })
      .def_prop_ro("peer_uid", [](const py_peer& p) { return static_cast<std::uint32_t>(p.peer.enter()->credentials().uid); })
      .def(
          "stats",
          [](const py_peer& p) {
            const auto peer = p.peer.enter();
            ipc::peer_stats s;
            {
              released_gil release;  // the receiving side's lock, which a receive holds as it maps memory
              s = peer->stats();
            }
            nb::dict d;
            d["open_mappings"] = s.open_mappings;
            d["counter_files"] = s.counter_files;
            d["event_sources"] = s.event_sources;
            d["held_storages"] = s.held_storages;
            return d;
          },
          "This side's view of the other process: open_mappings, counter_files, event_sources, held_storages.")
      .def("fileno", [](const py_peer& p) { return p.peer.enter()->native_handle(); },
           "The connection's socket, for selectors: readable when a message (or its start) waits; one "
           "readable socket may stand for several messages, or for none left: call try_receive() until None.")
      .def(
          "close", [](py_peer& p) { p.peer.close(); },
          "Tears the connection down; received storages stay usable. A receive() waiting in another thread "
          "ends first (ConnectionClosedError), and a send() in flight finishes (one stuck on a peer that "
          "stopped reading is ended after 0.2 s).")
      .def_prop_ro(
          "closed", [](const py_peer& p) { return p.peer.closed(); }, "True once close() has begun.")
      .def("__enter__", [](nb::handle self) { return self; }, nb::sig("def __enter__(self) -> Self"))
      .def(
          "__exit__", [](py_peer& p, nb::args) { p.peer.close(); }, nb::arg("args"))
      .def("__repr__", [](const py_peer& p) -> std::string {
        const auto peer = p.peer.try_enter();
        if (!peer) return "shoal.Peer(closed)";
        const auto& who = (*peer)->credentials();
        return "shoal.Peer(pid " + std::to_string(who.process.pid) + ", uid " + std::to_string(who.uid) + ")";
      });
}

}  // namespace shoal::python
