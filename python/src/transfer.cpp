// Python bindings of the transfer engine: TransferEngine (submit raw host
// buffers, take TransferredBatch) — shoal.transfer builds the nested-batch
// API on top.
//
// GIL: every call that may wait (submit under backpressure, next, close,
// synchronize) releases it, and so does every call that takes the engine's
// lock (stats, __repr__, the timeout errors' counts); the engine's thread
// lets go of source objects by taking the GIL for the decref, never under
// its lock, so nothing that holds the GIL ever waits for that thread.
//
// A batch and its layout (what shoal.transfer keeps of it: its structure)
// never part: submit hands the layout to the engine with the batch (its
// tag), and next hands both back together, appended to the caller's list
// before it returns. CPython runs a signal's handler (Ctrl-C's
// KeyboardInterrupt) at the next bytecode boundary, so one that arrives
// while the call waits is raised as the call returns, before the caller can
// store what it returned: the caller finds the batch in its list all the
// same, and puts back what it could not deliver (put_back), which the next
// next() hands out first (one already waiting in another thread, at the end
// of its wait slice: from the put-back queue to the caller's list nothing
// releases the GIL).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "closable.h"
#include "gil.h"
#include "shoal/core/error.h"
#include "shoal/transfer/transfer_engine.h"
#include "made_elsewhere.h"

namespace shoal::python {

std::shared_ptr<const void> hold(nb::handle object) {
  object.inc_ref();
  return std::shared_ptr<const void>(object.ptr(), [](const void* p) {
    (void)detail::python_work([p] {  // at exit it leaks
      const nb::gil_scoped_acquire gil;
      Py_DECREF(static_cast<PyObject*>(const_cast<void*>(p)));
    });
  });
}

namespace {

using transfer::transfer_engine;

/// The engine's counters, read with the GIL released: stats() takes the
/// engine's lock, which a thread that waits for the GIL may hold.
transfer::transfer_stats stats_without_gil(const transfer_engine& engine) {
  transfer::transfer_stats s;
  detail::without_gil([&] { s = engine.stats(); });
  return s;
}

/// The stream an engine copies on, lent by its allocator for the engine's
/// life (allocator_state::take_copy_stream) and given back after it.
class copy_stream_lease {
 public:
  explicit copy_stream_lease(std::shared_ptr<allocator_state> allocator)
      : allocator_(std::move(allocator)), stream_(allocator_->take_copy_stream()) {}
  ~copy_stream_lease() { allocator_->give_back_copy_stream(std::move(stream_)); }
  copy_stream_lease(const copy_stream_lease&) = delete;
  copy_stream_lease& operator=(const copy_stream_lease&) = delete;
  [[nodiscard]] backend::stream_ref ref() const noexcept { return stream_->ref(); }

 private:
  std::shared_ptr<allocator_state> allocator_;
  std::shared_ptr<stream_state> stream_;
};

/// An engine on a lent stream: the engine goes first (its copies and
/// thread finished), then the stream is given back.
struct engine_on_lent_stream {
  engine_on_lent_stream(const std::shared_ptr<allocator_state>& allocator, const transfer::transfer_config& config)
      : stream(allocator), engine(allocator->allocator(), stream.ref(), config) {}
  copy_stream_lease stream;
  transfer_engine engine;
};

// close() waits for the engine's thread, which may need the GIL to let go
// of sources: closable destroys the engine with the GIL released.
struct py_transfer_engine {
  std::shared_ptr<allocator_state> allocator;
  closable<engine_on_lent_stream> engine;
  // Batches taken from the engine that a call could not deliver (Ctrl-C,
  // an error building the result), put back in sequence order: (sequence,
  // (TransferredBatch, layout)). Read and written with the GIL held only,
  // never released in between; close() empties it.
  std::deque<std::pair<std::uint64_t, nb::object>> undelivered;
  // Batches taken whose (TransferredBatch, layout) could not be made (no
  // memory for the Python objects): the next call makes them and puts them
  // with the undelivered ones before it takes another. Kept without
  // allocating: each call reserves a place before it takes anything, so the
  // capacity covers every call inside next() (`takers`) that has not put
  // one here yet — two threads' calls that both fail keep both batches.
  // GIL held, as undelivered.
  std::vector<transfer_engine::taken_batch> unmade;
  std::size_t takers = 0;

  /// Keeps `item`, a (TransferredBatch, layout) of batch `sequence`, for the next next().
  void keep_undelivered(std::uint64_t sequence, nb::object item) {
    const auto at =
        std::find_if(undelivered.begin(), undelivered.end(), [&](const auto& u) { return u.first > sequence; });
    undelivered.emplace(at, sequence, std::move(item));
  }
};

/// What submit gave the engine with a batch, as Python sees it (None when
/// nothing was given).
nb::object layout_of(const std::shared_ptr<const void>& tag) {
  if (!tag) return nb::none();
  return nb::borrow(static_cast<PyObject*>(const_cast<void*>(tag.get())));
}

transfer::transfer_config::stores parse_staging_stores(const std::string& name) {
  using stores = transfer::transfer_config::stores;
  if (name == "cached") return stores::cached;
  if (name == "streaming") return stores::streaming;
  if (name == "automatic") return stores::automatic;
  throw invalid_argument("shoal.transfer.Engine: staging_stores is '" + name +
                         "'; expected 'automatic', 'streaming' or 'cached'");
}

struct py_transferred_batch {
  std::shared_ptr<allocator_state> allocator;  // first: destroyed after the batch's storages
  // The streams the batch was waited on and its storages used on (shared
  // with their handles and lazy clones): kept until the batch and every one
  // of them is gone, after the storages' releases. A release that comes
  // later still (a part's block, freed with its group's last storage) finds
  // each stream held by the allocator (record_stream holds it until the free).
  std::shared_ptr<stream_keeper> streams = stream_keeper::for_handles();
  transfer::transferred_batch batch;
};

// Test hook (_refuse_transfer_results): how many more results next() makes,
// and appends of one to the caller's list, fail with MemoryError, as when
// Python has no memory left. The GIL guards them.
int refused_results = 0;
int refused_appends = 0;

[[noreturn]] void refused_by_the_test() {
  PyErr_NoMemory();
  throw nb::python_error();
}

/// The (TransferredBatch, layout) next() appends for `taken`, a batch that
/// was transferred. The batch is copied (a value shared by its copies): when
/// the Python objects cannot be made, `taken` still holds it.
nb::object result_of(const py_transfer_engine& e, const transfer_engine::taken_batch& taken) {
  if (refused_results > 0) {
    --refused_results;
    refused_by_the_test();
  }
  return nb::make_tuple(py_transferred_batch{e.allocator, stream_keeper::for_handles(), *taken.batch},
                        layout_of(taken.tag));
}

}  // namespace

// Calling TransferredBatch() names these.
constexpr char transferred_batch_made_by[] =
    "shoal.transfer.TransferredBatch is not made by calling the class: shoal.transfer.Engine.next() hands one out.";

void register_transfer(nb::module_& m) {
  m.def(
      "_refuse_transfer_results",
      [](int results, int appends) {
        refused_results = results;
        refused_appends = appends;
      },
      nb::arg("results"), nb::arg("appends"),
      "Test hook: the next `results` (batch, layout) results shoal.transfer.Engine's next() makes, and the "
      "next `appends` appends of one to its list, fail with MemoryError, as when Python has no memory left.");
  nb::class_<py_transferred_batch>(m, "TransferredBatch", made_elsewhere<transferred_batch_made_by>(),
                                   "One batch whose host-to-device copies are enqueued: a Storage per buffer "
                                   "submitted. wait() before using them on a stream.")
      .def_prop_ro("sequence", [](const py_transferred_batch& b) { return b.batch.sequence(); },
                   "The batch's place in submission order, from 0.")
      .def_prop_ro(
          "storages",
          [](const py_transferred_batch& b) {
            std::vector<py_storage> out;
            for (const auto& s : b.batch.storages()) out.push_back(py_storage{storage_handle(s, b.allocator, b.streams)});
            return out;
          },
          "The device storages, in the order of the buffers submitted.")
      .def(
          "wait",
          [](const py_transferred_batch& b, const py_stream* stream) {
            auto s = stream_or_current(stream, b.allocator->allocator().device());
            b.streams->keep(s, *b.allocator);  // the storages' release waits for it
            b.batch.wait_on(s->ref());
          },
          nb::arg("stream").none() = nb::none(),
          "Work enqueued on ``stream`` (default: the current stream) from now on sees the batch's bytes "
          "(a GPU-side wait), and the storages' memory is reused only after that stream passes what "
          "was enqueued on it before they are dropped.")
      .def(
          "synchronize", [](const py_transferred_batch& b) { b.batch.synchronize(); },
          nb::call_guard<released_gil>(), "Blocks until the batch's copies have run.")
      .def("ready", [](const py_transferred_batch& b) { return b.batch.is_ready(); },
           "True once the batch's copies have run.")
      .def("__repr__", [](const py_transferred_batch& b) {
        return "shoal.transfer.TransferredBatch(sequence=" + std::to_string(b.batch.sequence()) + ", " +
               std::to_string(b.batch.storages().size()) + " storages" + (b.batch.is_ready() ? ", ready" : "") + ")";
      });

  nb::class_<py_transfer_engine>(m, "TransferEngine",
                                 "Background host-to-device transfer: a thread and a stream of its own copy "
                                 "submitted host buffers into device storages (shoal.transfer.Engine is the "
                                 "batch API).")
      .def(
          "__init__",
          [](py_transfer_engine* self, const py_allocator& allocator, std::size_t max_batches_in_flight,
             std::size_t max_pinned_bytes, std::size_t staging_chunk_bytes, std::optional<std::size_t> staging_helpers,
             const std::string& staging_stores, std::size_t max_coalesced_bytes, std::size_t max_bytes_in_flight) {
            const transfer::transfer_config config{
                .max_batches_in_flight = max_batches_in_flight,
                .max_bytes_in_flight = max_bytes_in_flight,
                .max_pinned_bytes = max_pinned_bytes,
                .staging_chunk_bytes = staging_chunk_bytes,
                .staging_helpers = staging_helpers.value_or(transfer::transfer_config::automatic_staging_helpers),
                .staging_stores = parse_staging_stores(staging_stores),
                .max_coalesced_bytes = max_coalesced_bytes};
            std::unique_ptr<engine_on_lent_stream> engine;
            {
              released_gil release;  // starts the engine's threads, may reserve pinned staging memory
              engine = std::make_unique<engine_on_lent_stream>(allocator.state, config);
            }
            new (self) py_transfer_engine{
                allocator.state, {"shoal.transfer.Engine", closed_error::invalid_argument, std::move(engine)}};
          },
          nb::arg("allocator"), nb::arg("max_batches_in_flight") = 32, nb::arg("max_pinned_bytes") = 32u << 20,
          nb::arg("staging_chunk_bytes") = 4u << 20, nb::arg("staging_helpers").none() = nb::none(),
          nb::arg("staging_stores") = "automatic", nb::arg("max_coalesced_bytes") = 4u << 20,
          nb::arg("max_bytes_in_flight") = 64u << 20)
      .def(
          "submit",
          [](const py_transfer_engine& e, const std::vector<std::tuple<std::uintptr_t, std::size_t, bool, nb::object>>&
                                              buffers,
             std::optional<double> timeout, const nb::object& layout) {
            std::vector<transfer::host_buffer> batch;
            batch.reserve(buffers.size());
            for (const auto& [address, nbytes, pinned, owner] : buffers) {
              batch.push_back({reinterpret_cast<const void*>(address), nbytes, pinned, hold(owner)});
            }
            const std::shared_ptr<const void> tag = layout.is_none() ? nullptr : hold(layout);
            const auto until = until_of(timeout, "shoal.transfer.Engine.submit");
            const auto engine = e.engine.enter();
            const auto sequence = wait_in_slices(
                engine, e.engine, until, [&](std::chrono::milliseconds slice) -> std::optional<std::uint64_t> {
                  try {
                    return engine->engine.submit(batch, slice, tag);
                  } catch (const timeout_error&) {
                    return std::nullopt;
                  }
                });
            if (!sequence) {
              const auto s = stats_without_gil(engine->engine);
              throw timeout_error("shoal.transfer.Engine.submit: no room for the batch within " +
                                  seconds_text(*timeout) + " s: " + std::to_string(s.in_flight) + " batches of " +
                                  std::to_string(s.bytes_in_flight) +
                                  " bytes in all are in flight; take batches or raise max_batches_in_flight or "
                                  "max_bytes_in_flight (nothing was queued)");
            }
            return *sequence;
          },
          nb::arg("buffers"), nb::arg("timeout").none() = nb::none(), nb::arg("layout").none() = nb::none(),
          "Queues a batch of (address, nbytes, pinned, owner) host buffers; ``owner`` is kept alive while "
          "the engine reads the memory, ``layout`` until the batch is taken (next() hands it back with the "
          "batch). Returns the batch's sequence number. A Ctrl-C that comes as the batch is queued is "
          "raised after: the batch stays queued. Blocks while the batch does "
          "not fit within max_batches_in_flight and max_bytes_in_flight; past max_bytes_in_flight a batch "
          "still goes while at most one other batch is in flight (so two are always allowed, whatever "
          "their bytes). PeerTimeoutError after ``timeout`` seconds. The wait ends on Ctrl-C "
          "(KeyboardInterrupt) and on close() from another thread (InvalidArgumentError).")
      .def(
          "next",
          [](py_transfer_engine& e, nb::list into, std::optional<double> timeout) {
            const auto until = until_of(timeout, "shoal.transfer.Engine (get, next)");
            const auto engine = e.engine.enter();
            // This call's place among the unmade, taken before any batch is (a failure here loses nothing).
            e.unmade.reserve(e.unmade.size() + e.takers + 1);
            ++e.takers;
            const struct leaving {
              std::size_t& takers;
              ~leaving() { --takers; }  // the GIL is held wherever the call leaves
            } left{e.takers};
            while (!e.unmade.empty()) {  // earlier calls' batches first; one still unmade stays for the next
              const auto& first = e.unmade.back();
              e.keep_undelivered(first.batch->sequence(), result_of(e, first));
              e.unmade.pop_back();
            }
            const auto put_back = [&] { return !e.undelivered.empty(); };
            // No wait when a batch was put back (one an interrupted call took); one that another
            // thread puts back meanwhile ends the wait at the slice's end.
            std::optional<transfer_engine::taken_batch> taken;
            if (!put_back()) {
              taken = wait_in_slices(
                  engine, e.engine, until,
                  [&](std::chrono::milliseconds slice) -> std::optional<transfer_engine::taken_batch> {
                    try {
                      return engine->engine.take(slice);
                    } catch (const timeout_error&) {
                      return std::nullopt;
                    }
                  },
                  put_back);
            }
            if (!taken && !put_back()) {
              throw timeout_error("shoal.transfer.Engine: no batch came within " + seconds_text(*timeout) + " s (" +
                                  std::to_string(stats_without_gil(engine->engine).in_flight) + " in flight)");
            }
            if (taken && taken->error) std::rethrow_exception(taken->error);  // its layout goes with it
            // From here to the append no Python code runs, so no signal's handler: the batch
            // is in `into` when the call returns, whatever is raised then.
            nb::object item;
            std::uint64_t sequence = 0;
            if (taken) {
              sequence = taken->batch->sequence();
              try {
                item = result_of(e, *taken);
              } catch (...) {
                // Delivered by the next call, first. Room reserved above (unless close() took the
                // vector meanwhile: then this push may allocate, and the closed engine drops it anyway).
                e.unmade.push_back(std::move(*taken));
                throw;
              }
            }
            if (item && put_back()) {
              // Put back by another thread as this slice took a later batch: that one goes first,
              // this one waits behind it. (A failed batch's error is raised at once, above; with no
              // room to keep it, it goes now, out of order rather than lost.)
              try {
                e.keep_undelivered(sequence, item);
                item = nb::object();
              } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): delivered below
              }
            }
            if (!item) {  // the GIL held since the check: first, in sequence order
              into.append(e.undelivered.front().second);  // a failed append leaves it queued
              e.undelivered.pop_front();
              return;
            }
            try {
              if (refused_appends > 0) {
                --refused_appends;
                refused_by_the_test();
              }
              into.append(item);
            } catch (...) {
              // No memory for the list's room: the batch is the next call's, first (a
              // keep refused too raises its own MemoryError, the batch lost with it).
              e.keep_undelivered(sequence, std::move(item));
              throw;
            }
          },
          nb::arg("into"), nb::arg("timeout").none() = nb::none(),
          "Appends (batch, layout) to ``into``: the next batch in submission order once its copies are "
          "enqueued, and the layout submit gave with it — first any batch put back (put_back), also one "
          "put back by another thread while this call waits (seen within one wait slice, 0.1 s) — and "
          "returns None. Raises the batch's own error when it failed (the batch is taken all the same; "
          "before a batch put back by another thread during the call), "
          "PeerTimeoutError after ``timeout`` seconds (no batch taken). The wait ends on Ctrl-C "
          "(KeyboardInterrupt) and on close() from another thread (InvalidArgumentError). A Ctrl-C that "
          "comes as a batch is taken is raised after the call: the batch is in ``into`` then.")
      .def(
          "put_back",
          [](py_transfer_engine& e, const nb::tuple& item) {
            if (item.size() != 2) throw invalid_argument("shoal.TransferEngine.put_back: expected (batch, layout)");
            const std::uint64_t sequence = nb::cast<const py_transferred_batch&>(item[0]).batch.sequence();
            if (e.engine.closed()) return;  // close() dropped the others: this one goes too
            e.keep_undelivered(sequence, item);
          },
          nb::arg("item"),
          "Gives back a (batch, layout) that next() appended and the caller could not deliver: the next "
          "next() hands it out first (batches put back go in sequence order), and a next() already waiting "
          "in another thread within one wait slice (0.1 s). Dropped once closed.")
      .def_prop_ro(
          "waiting",
          [](const py_transfer_engine& e) {
            const auto engine = e.engine.enter();
            return stats_without_gil(engine->engine).in_flight + e.undelivered.size() + e.unmade.size();
          },
          "Batches submitted and not yet delivered: in flight in the engine, and put back (a snapshot: "
          "while another thread's next() moves a batch from one to the other it may count it twice).")
      .def(
          "stats",
          [](const py_transfer_engine& e) {
            const auto s = stats_without_gil(e.engine.enter()->engine);
            nb::dict d;
            d["batches_submitted"] = s.batches_submitted;
            d["batches_transferred"] = s.batches_transferred;
            d["batches_failed"] = s.batches_failed;
            d["batches_taken"] = s.batches_taken;
            d["coalesced_groups"] = s.coalesced_groups;
            d["bytes_copied"] = s.bytes_copied;
            d["bytes_staged"] = s.bytes_staged;
            d["copies"] = s.copies;
            d["in_flight"] = s.in_flight;
            d["peak_in_flight"] = s.peak_in_flight;
            d["bytes_in_flight"] = s.bytes_in_flight;
            d["peak_bytes_in_flight"] = s.peak_bytes_in_flight;
            d["pinned_reserved_bytes"] = s.pinned.reserved_bytes.aggregate.current;
            d["pinned_peak_reserved_bytes"] = s.pinned.reserved_bytes.aggregate.peak;
            return d;
          },
          "Counters as a dict: batches submitted, transferred, failed and taken, coalesced_groups (the groups "
          "of batches the engine's thread took together, each sharing one ready event and one device block; "
          "failed ones count), bytes copied and staged, copies (host-to-device copies enqueued: a run of "
          "small pageable buffers packed together is one), batches and their bytes in flight (now and at "
          "the peak), pinned staging memory (now and at the peak).")
      .def(
          "close",
          [](py_transfer_engine& e) {
            // Taken out first (under the GIL, as every use of it): dropped even when close()
            // raises (Ctrl-C while it waits for the copies).
            const auto dropped = std::move(e.undelivered);
            e.undelivered.clear();
            const auto dropped_unmade = std::move(e.unmade);
            e.unmade.clear();
            e.engine.close();
          },
           "Ends the waits of other threads' submit() and next() (InvalidArgumentError), finishes the batches "
           "submitted, waits for their copies and stops the thread. Idempotent.")
      .def_prop_ro(
          "closed", [](const py_transfer_engine& e) { return e.engine.closed(); }, "True once close() has begun.")
      .def("__repr__", [](const py_transfer_engine& e) -> std::string {
        const auto engine = e.engine.try_enter();
        if (!engine) return "shoal.TransferEngine(closed)";
        transfer::transfer_stats s;
        try {
          s = stats_without_gil((*engine)->engine);
        } catch (const device_unavailable&) {
          return "shoal.TransferEngine(the parent process's: this is a fork() child)";
        }
        return "shoal.TransferEngine(" + std::to_string(s.batches_submitted) + " batches submitted, " +
               std::to_string(s.in_flight) + " in flight, " + std::to_string(s.bytes_copied) + " bytes copied)";
      });
}

}  // namespace shoal::python
