// Devices, streams, events and the per-thread current stream.
//
// `with shoal.stream(s):` pushes `s` on a per-thread stack and sets the C++
// current stream (backend::stream_guard) of its device, so the allocator's
// free without a stream, and every `stream=None` argument, use it. Scopes
// nest and are left in reverse order (the context manager guarantees it).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "made_elsewhere.h"

namespace shoal::python {

namespace {

// Stream.delay's longest wait (a day): stands in for a kernel, and keeps the
// microseconds far inside their integer.
constexpr double max_delay_seconds = 86400;

// This thread's stream scopes, innermost last; each guard restores the
// stream current when it was made. A scope is left by the token it was
// entered with, unique in the process: one left on another thread matches
// none of that thread's scopes.
struct scope_entry {
  std::uint64_t token;
  std::shared_ptr<stream_state> stream;
  std::unique_ptr<backend::stream_guard> guard;
};
thread_local std::vector<scope_entry> scopes;
std::atomic<std::uint64_t> last_scope_token{0};

backend::device& device_or_default(backend::device* device) {
  return device != nullptr ? *device : backend::default_device();
}

std::uint64_t push_stream(const py_stream& s) {
  const std::uint64_t token = last_scope_token.fetch_add(1, std::memory_order_relaxed) + 1;
  scopes.push_back({token, s.state, std::make_unique<backend::stream_guard>(s.state->device(), s.state->ref())});
  return token;
}

// Leaves the scope `token` entered. One left out of order (a generator's
// scope closed inside a later scope) goes without disturbing those entered
// after it: they are left, innermost first, and entered again, so each then
// restores what the one left would have (its guard alone would restore the
// stream current at its start, over the later scopes').
void pop_stream(std::uint64_t token) {
  const auto it = std::ranges::find(scopes, token, &scope_entry::token);
  if (it == scopes.end()) {
    throw invalid_argument("shoal: that stream scope is not open on this thread (entered on another thread, or "
                           "left already)");
  }
  const auto at = static_cast<std::size_t>(it - scopes.begin());
  std::vector<std::pair<std::uint64_t, std::shared_ptr<stream_state>>> later;
  later.reserve(scopes.size() - at - 1);
  for (std::size_t i = at + 1; i < scopes.size(); ++i) later.emplace_back(scopes[i].token, scopes[i].stream);
  while (scopes.size() > at) scopes.pop_back();
  for (auto& [later_token, stream] : later) {  // no reallocation: the vector held them a moment ago
    scopes.push_back({later_token, stream, std::make_unique<backend::stream_guard>(stream->device(), stream->ref())});
  }
}

}  // namespace

stream_state::stream_state(backend::device& device, std::unique_ptr<backend::stream> owned)
    : device_(&device), owned_(std::move(owned)), ref_(owned_ ? owned_->ref() : backend::stream_ref{}) {}

stream_state::stream_state(backend::device& device, backend::stream_ref adopted) : device_(&device), ref_(adopted) {}

stream_state::~stream_state() {
  if (owned_ == nullptr) return;  // the default stream, another library's: nothing to destroy
  // The destroy returns while the work queued runs on, but may wait briefly
  // for other destroyed streams' threads to end, and for the device's lock:
  // not with the GIL (a dealloc holds it).
  detail::waiting_without_gil([&] { owned_.reset(); });
}

std::shared_ptr<stream_state> stream_state::adopt(backend::device& device, void* native) {
  return std::shared_ptr<stream_state>(new stream_state(device, device.adopt_external_stream(native)));
}

std::shared_ptr<stream_state> stream_state::create(backend::device& device) {
  return std::shared_ptr<stream_state>(new stream_state(device, std::make_unique<backend::stream>(device)));
}

std::shared_ptr<stream_state> stream_state::default_of(backend::device& device) {
  // Asked for on every allocation and free without a stream scope: each
  // thread keeps the last one it made (a device lives for the process, and
  // a default stream's state owns nothing).
  thread_local backend::device* cached_device = nullptr;
  thread_local std::shared_ptr<stream_state> cached;
  if (cached_device != &device) {
    cached = std::shared_ptr<stream_state>(new stream_state(device, nullptr));
    cached_device = &device;
  }
  return cached;
}

std::shared_ptr<stream_state> scoped_stream_state(backend::device& device) {
  if (scopes.empty()) return nullptr;
  const backend::stream_ref current = backend::current_stream(device);
  for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
    if (&it->stream->device() == &device && it->stream->ref() == current) return it->stream;
  }
  return nullptr;
}

std::shared_ptr<stream_state> current_stream_state(backend::device& device) {
  if (auto scoped = scoped_stream_state(device)) return scoped;
  return stream_state::default_of(device);
}

std::shared_ptr<stream_state> stream_or_current(const py_stream* stream, backend::device& device) {
  if (stream == nullptr) return current_stream_state(device);
  if (&stream->state->device() != &device) {
    throw invalid_argument("shoal: the stream belongs to device '" + stream->state->device().name() +
                           "', the memory to device '" + device.name() + "'; use a stream of the memory's device");
  }
  return stream->state;
}

struct py_event {
  backend::device* device;
  std::shared_ptr<backend::event> event;
};

// Calling Device() names these.
constexpr char device_made_by[] =
    "shoal.Device is not made by calling the class: shoal.default_device(), shoal.cuda_device(ordinal) or shoal.host_device() names one.";

void register_streams(nb::module_& m) {
  nb::class_<backend::device>(m, "Device", made_elsewhere<device_made_by>(),
                              "A device: the host backend or a CUDA GPU. Lives for the whole process. Pickles as its "
                              "kind and ordinal: unpickled, it is that device of the receiving process (another GPU "
                              "there under another CUDA_VISIBLE_DEVICES; DeviceUnavailableError where it has none).")
      .def_prop_ro(
          "kind", [](const backend::device& d) { return std::string(backend::to_string(d.kind())); },
          "'host' or 'cuda'.")
      .def_prop_ro("ordinal", &backend::device::ordinal, "Index among devices of its kind (0 for host).")
      .def_prop_ro("name", &backend::device::name, "Human-readable name.")
      .def(
          "memory",
          [](const backend::device& d) {
            const auto info = d.memory();
            return std::make_tuple(info.free_bytes, info.total_bytes);
          },
          "(free_bytes, total_bytes) as the device reports them.")
      .def("__eq__", [](const backend::device& a, const backend::device& b) { return &a == &b; })
      // Against anything else: not equal, as Python objects compare (None, a string).
      .def("__eq__", [](const backend::device&, nb::handle) { return false; }, nb::arg("other").none())
      .def("__hash__", [](const backend::device& d) { return d.serial(); })
      // Pickled (to a worker process, say) as what names it: the same kind
      // and ordinal in the process that unpickles it.
      .def("__reduce__",
           [](const backend::device& d) {
             return nb::make_tuple(nb::module_::import_("shoal._device_defaults").attr("device_named"),
                                   nb::make_tuple(std::string(backend::to_string(d.kind())), d.ordinal()));
           })
      .def("__repr__", [](const backend::device& d) {
        return "shoal.Device(" + std::string(backend::to_string(d.kind())) + ":" + std::to_string(d.ordinal()) + ")";
      });

  m.def("default_device", &backend::default_device, nb::rv_policy::reference,
        "CUDA device 0 when one exists, else the host device. "
        "SHOAL_BACKEND=host or cuda forces the choice "
        "('cuda' raises DeviceUnavailableError where there is none).");
  m.def("host_device", &backend::host_device_instance, nb::rv_policy::reference,
        "The host device: host memory, executor threads as streams.");
  m.def(
      "cuda_device",
      [](const python_int& ordinal) -> backend::device& {
        const auto n = whole_number_of(ordinal, "cuda_device", "ordinal", std::numeric_limits<int>::max());
        return backend::cuda_device_instance(static_cast<int>(n));
      },
      nb::arg("ordinal") = 0, nb::rv_policy::reference,
      "CUDA device `ordinal` (>= 0); raises DeviceUnavailableError when there is "
      "none.");
  m.def("cuda_device_count", &backend::cuda_device_count, "Number of usable CUDA devices (0 without driver or GPU).");

  nb::class_<py_stream>(m, "Stream",
                        "An in-order queue of device work. Stream(device) creates a new stream; "
                        "Stream.default(device) names the device's default stream. Usable from several threads "
                        "at once: work runs in the order the threads enqueue it. A stream lives while this object "
                        "or a storage used on it does; a new stream per request is fine when the request's "
                        "storages go with it: once its work has run, the Allocator lets it go and the next new "
                        "stream takes over the memory it cached; so is one per receive. A storage sent to another "
                        "process, adopted or of a transfer batch keeps its streams for the Allocator's life.")
      .def(
          "__init__",
          [](py_stream* self, backend::device* device) {
            new (self) py_stream{stream_state::create(device_or_default(device))};
          },
          nb::arg("device").none() = nb::none(), "A new stream on `device` (default: default_device()).")
      .def_static(
          "default",
          [](backend::device* device) { return py_stream{stream_state::default_of(device_or_default(device))}; },
          nb::arg("device").none() = nb::none(), "The default stream of `device`.")
      .def_static(
          "from_handle",
          [](const python_int& handle, backend::device* device) {
            const auto native = whole_number_of(handle, "Stream.from_handle", "handle", UINTPTR_MAX);
            return py_stream{stream_state::adopt(device_or_default(device), reinterpret_cast<void*>(native))};
          },
          nb::arg("handle"), nb::arg("device").none() = nb::none(),
          "A stream another library made, by its native handle (e.g. "
          "``torch.cuda.current_stream().cuda_stream``): usable wherever a "
          "shoal stream is. shoal never destroys it; the library that made it "
          "keeps it alive while shoal may use it. InvalidArgumentError when "
          "the handle is not a stream of `device` (the host backend has none).")
      .def_prop_ro(
          "device", [](const py_stream& s) -> backend::device& { return s.state->device(); }, nb::rv_policy::reference)
      .def_prop_ro(
          "handle", [](const py_stream& s) { return reinterpret_cast<std::uintptr_t>(s.state->ref().native); },
          "The native stream handle as an integer (0 for the default stream, "
          "cudaStream_t's null). As a DLPack `stream=` the array API names the "
          "default stream 1 (legacy) or 2 (per-thread) and refuses 0: pass "
          "``handle or 1``.")
      .def(
          "synchronize", [](const py_stream& s) { s.state->device().synchronize(s.state->ref()); },
          nb::call_guard<released_gil>(),
          "Blocks until all work enqueued so far has run (GIL released). It waits as the device "
          "does, with no deadline: Ctrl-C is seen once the work has run (poll query() to stay "
          "interruptible).")
      .def(
          "query", [](const py_stream& s) { return s.state->device().query(s.state->ref()); },
          "True when all work enqueued so far has run.")
      .def(
          "wait_event",
          [](const py_stream& s, const py_event& e) { s.state->device().wait(s.state->ref(), e.event->ref()); },
          nb::arg("event"),
          "Work enqueued from now on waits for `event` (device-side; the "
          "caller does not block).")
      .def(
          "delay",
          [](const py_stream& s, double seconds) {
            // Also refuses NaN, whose comparisons are all false.
            if (!(seconds >= 0 && seconds <= max_delay_seconds)) {
              throw invalid_argument("Stream.delay: seconds must be a number from 0 to " +
                                     std::to_string(static_cast<int>(max_delay_seconds)) + ", not " +
                                     std::to_string(seconds));
            }
            s.state->device().delay(s.state->ref(),
                                    std::chrono::microseconds(static_cast<std::int64_t>(seconds * 1e6)));
          },
          nb::arg("seconds"), "Keeps the stream busy for `seconds` (stands in for a long kernel).")
      .def("__eq__",
           [](const py_stream& a, const py_stream& b) {
             return &a.state->device() == &b.state->device() && a.state->ref() == b.state->ref();
           })
      .def("__eq__", [](const py_stream&, nb::handle) { return false; }, nb::arg("other").none())
      .def("__hash__", [](const py_stream& s) { return reinterpret_cast<std::uintptr_t>(s.state->ref().native); })
      .def("__repr__", [](const py_stream& s) {
        return "shoal.Stream(" + s.state->device().name() +
               ", handle=" + std::to_string(reinterpret_cast<std::uintptr_t>(s.state->ref().native)) + ")";
      });

  nb::class_<py_event>(m, "Event",
                       "A marker recorded into a stream; complete once the "
                       "stream has passed it. Usable from several threads at once: a query or wait sees the "
                       "last record() made before it.")
      .def(
          "__init__",
          [](py_event* self, backend::device* device) {
            backend::device& d = device_or_default(device);
            new (self) py_event{&d, std::make_shared<backend::event>(d)};
          },
          nb::arg("device").none() = nb::none(),
          "An event of `device` (default: the default device), not yet recorded: until its first record(), "
          "query() is True and synchronize() returns at once.")
      .def(
          "record",
          [](const py_event& e, const py_stream* s) { e.event->record(stream_or_current(s, *e.device)->ref()); },
          nb::arg("stream").none() = nb::none(),
          "Marks the point after all work enqueued so far on `stream` "
          "(default: the current stream).")
      .def(
          "query", [](const py_event& e) { return e.event->query(); }, "True when the event is complete.")
      .def(
          "synchronize", [](const py_event& e) { e.event->synchronize(); }, nb::call_guard<released_gil>(),
          "Blocks until the event is complete (GIL released).")
      .def("__repr__", [](const py_event& e) { return "shoal.Event(" + e.device->name() + ")"; });

  m.def(
      "current_stream",
      [](backend::device* device) { return py_stream{current_stream_state(device_or_default(device))}; },
      nb::arg("device").none() = nb::none(),
      "This thread's current stream on `device`: the innermost `with "
      "shoal.stream(s)` scope, else the default stream.");
  m.def("_push_stream", &push_stream, nb::arg("stream"),
        "Enters a stream scope (use `with shoal.stream(s)`); returns its token for _pop_stream.");
  m.def("_pop_stream", &pop_stream, nb::arg("token"),
        "Leaves the stream scope `token` entered, in order or not (the scopes entered after it stay).");
  m.def(
      "synchronize",
      [](const py_stream* s) {
        auto state = stream_or_current(s, s != nullptr ? s->state->device() : backend::default_device());
        released_gil release;
        state->device().synchronize(state->ref());
      },
      nb::arg("stream").none() = nb::none(),
      "Blocks until all work enqueued on `stream` (default: the current stream "
      "of the default device) has run. "
      "The GIL is released meanwhile.");
}

}  // namespace shoal::python
