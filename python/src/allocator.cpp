// The caching allocator: construction from keyword settings and
// SHOAL_ALLOC_CONF, reports as Python dicts (through the C++ JSON export and
// Python's json module), empty_cache, out-of-memory observers.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "closable.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"

namespace shoal::python {

namespace {

/// "key:value" for one keyword setting, as SHOAL_ALLOC_CONF writes it. numpy's
/// scalars are taken as the bools and numbers they are.
std::string setting_text(const std::string& key, nb::handle value) {
  // A name of other characters could carry settings of its own into the text ("debug:true,memory").
  if (key.empty() || key.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
    throw invalid_argument("Allocator: '" + key + "' is no setting's name (lowercase letters, digits and '_')");
  }
  std::string text;
  if (PyBool_Check(value.ptr()) != 0 || is_numpy_bool(value)) {
    const int truth = PyObject_IsTrue(value.ptr());
    if (truth < 0) throw nb::python_error();
    text = truth != 0 ? "true" : "false";
  } else if (const std::optional<python_int> whole = index_of(value)) {
    text = nb::cast<std::string>(nb::str(whole->value));
  } else if (PyFloat_Check(value.ptr()) != 0 || numpy_scalar_kind(value) == 'f') {
    PyObject* const number = PyNumber_Float(value.ptr());
    if (number == nullptr) throw nb::python_error();
    text = nb::cast<std::string>(nb::str(nb::steal(number)));
  } else if (nb::isinstance<nb::str>(value)) {
    text = nb::cast<std::string>(value);
  } else {
    throw invalid_argument("Allocator: setting " + key + " must be a bool, a number or a string, not " +
                           nb::cast<std::string>(nb::str(value.type().attr("__name__"))));
  }
  // A ',' only inside one bracketed list ("[1,2]"): else it would begin another setting.
  const bool one_list = text.starts_with('[') && text.find(']') == text.size() - 1;
  if (text.find(',') != std::string::npos && !one_list) {
    throw invalid_argument("Allocator: setting " + key + "=" + text + " holds a ',' outside one [list]");
  }
  return key + ":" + text;
}

// The json module's C scanner, made when the module is imported (never in a
// function's static: its initializer would run imports, waiting for the GIL
// while another thread holding it waits for the initializer) and never
// destroyed; null without the C accelerator.
const nb::object* json_scanner = nullptr;

// JSON text as Python objects through the C scanner, which runs no Python
// code: a daemon thread reading stats at exit was ended inside json.loads,
// and the ending's unwinding through this binding crashed.
nb::object parse_json(const std::string& json) {
  if (json_scanner == nullptr) return nb::module_::import_("json").attr("loads")(json);
  return nb::object((*json_scanner)(json, 0))[0];
}

nb::dict oom_report_dict(const alloc::oom_report& r) {
  nb::dict d;
  d["requested_bytes"] = r.requested_bytes;
  d["device_free_bytes"] = r.device_free_bytes;
  d["reserved_bytes"] = r.reserved_bytes;
  d["allocated_bytes"] = r.allocated_bytes;
  d["largest_free_block"] = r.largest_free_block;
  d["limit_bytes"] =
      r.limit_bytes == alloc::allocator_config::no_limit ? nb::object(nb::none()) : nb::object(nb::int_(r.limit_bytes));
  d["stream"] = reinterpret_cast<std::uintptr_t>(r.stream.native);
  return d;
}

/// What `read` makes of the allocator (JSON text), read without the GIL: the
/// reports take every pool's lock, which a thread growing or shrinking a pool
/// holds across the device's call (cudaMalloc; cudaFree, which waits for the
/// device) while it has let the GIL go.
template <class Read>
std::string report_without_gil(const py_allocator& a, Read read) {
  std::string json;
  {
    released_gil release;
    json = read(a.state->allocator());
  }
  return json;
}

// The garbage collector's view of an Allocator object: the out-of-memory
// observers its state holds (so that a cycle through one, such as an object
// holding the Allocator and observing with a method of its own, is
// collected), seen only while this object is the state's one holder. A state
// that storages, exports or other Allocator objects share holds the
// observers for them too, and the collector must see each reference once.
int allocator_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;  // before or during __init__
  const std::shared_ptr<allocator_state>& state = nb::inst_ptr<py_allocator>(self)->state;
  if (state.use_count() != 1) return 0;
  for (const auto& observer : state->oom_observers) Py_VISIT(observer.callable->ptr());
  return 0;
}

// Breaks a cycle the collector found through the observers traverse showed:
// each is removed as remove_oom_observer does.
int allocator_clear(PyObject* self) {
  if (!nb::inst_ready(self)) return 0;
  const std::shared_ptr<allocator_state>& state = nb::inst_ptr<py_allocator>(self)->state;
  if (state.use_count() != 1) return 0;  // not shown by traverse: not this object's to clear
  std::vector<allocator_state::oom_observer> observers;
  observers.swap(state->oom_observers);  // the callables' ends may run Python code: the list is left first
  for (auto& observer : observers) {
    *observer.callable = nb::none();
    (void)state->allocator().remove_oom_observer(observer.registration);
  }
  return 0;
}

PyType_Slot allocator_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(allocator_traverse)},
                                 {Py_tp_clear, reinterpret_cast<void*>(allocator_clear)},
                                 {0, nullptr}};

}  // namespace

alloc::allocator_config config_from_python(const std::optional<std::string>& conf, bool use_environment,
                                           const nb::kwargs& settings, const std::string& defaults) {
  std::string text = defaults;
  const char* env = std::getenv("SHOAL_ALLOC_CONF");
  if (use_environment && env != nullptr) text += std::string(",") + env;
  if (conf) text += "," + *conf;
  for (auto [key, value] : settings) text += "," + setting_text(nb::cast<std::string>(key), value);
  try {
    return alloc::allocator_config::parse(text);
  } catch (const invalid_argument& e) {
    // The parser speaks of the environment variable; here the settings may
    // come from keywords or conf= as well.
    std::string message = e.what();
    const std::string_view parser_prefix = "SHOAL_ALLOC_CONF: ";
    if (message.starts_with(parser_prefix)) message.erase(0, parser_prefix.size());
    throw invalid_argument("Allocator settings (keywords, conf=" +
                           std::string(use_environment && env != nullptr ? ", SHOAL_ALLOC_CONF" : "") +
                           "): " + message);
  }
}

allocator_state::allocator_state(backend::device& device, const alloc::allocator_config& config)
    : allocator_(std::make_unique<alloc::caching_allocator>(device, config)) {}

allocator_state::~allocator_state() {
  // The last Allocator (or storage) dropped from Python: the allocator's end
  // waits for pending frees, and a host stream's for its queued work. The
  // observers go after, with the GIL as they were (each takes it to go).
  detail::waiting_without_gil([&] {
    allocator_.reset();
    idle_copy_streams_.clear();
    streams_.clear();
  });
}

void allocator_state::keep(const std::shared_ptr<stream_state>& stream) {
  if (stream->ref().is_default()) return;  // default streams live as long as their device
  std::lock_guard lock(mutex_);
  streams_.insert(stream);
}

std::shared_ptr<stream_keeper> stream_keeper::by_allocator() {
  static const auto shared = std::make_shared<stream_keeper>(true);
  return shared;
}

void stream_keeper::keep(const std::shared_ptr<stream_state>& stream, allocator_state& allocator) {
  if (stream->ref().is_default()) return;  // default streams live as long as their device
  if (by_allocator_) {
    allocator.keep(stream);
    return;
  }
  std::lock_guard lock(mutex_);
  if (std::ranges::find(streams_, stream) == streams_.end()) streams_.push_back(stream);
}

std::shared_ptr<stream_state> allocator_state::take_copy_stream() {
  {
    std::lock_guard lock(mutex_);
    if (!idle_copy_streams_.empty()) {
      auto stream = std::move(idle_copy_streams_.back());
      idle_copy_streams_.pop_back();
      return stream;
    }
  }
  auto stream = stream_state::create(allocator_->device());
  keep(stream);
  std::lock_guard lock(mutex_);
  idle_copy_streams_.reserve(streams_.size());  // room for each: giving one back cannot fail
  return stream;
}

void allocator_state::give_back_copy_stream(std::shared_ptr<stream_state> stream) noexcept {
  std::lock_guard lock(mutex_);
  idle_copy_streams_.push_back(std::move(stream));
}

void register_allocator(nb::module_& m) {
  if (const nb::object make = nb::module_::import_("json.scanner").attr("c_make_scanner"); !make.is_none()) {
    json_scanner = new nb::object(make(nb::module_::import_("json").attr("JSONDecoder")()));
  }
  nb::class_<py_allocator>(m, "Allocator",
                           "The stream-ordered caching allocator of one "
                           "device. A freed block is handed out again "
                           "only once every stream that may touch it has "
                           "passed its last use. Thread-safe.",
                           nb::type_slots(allocator_slots))
      .def(
          "__init__",
          [](py_allocator* self, backend::device* device, const std::optional<std::string>& conf, bool use_environment,
             const nb::kwargs& settings) {
            const auto config = config_from_python(conf, use_environment, settings);
            backend::device& d = device != nullptr ? *device : backend::default_device();
            new (self) py_allocator{std::make_shared<allocator_state>(d, config)};
          },
          nb::arg("device").none() = nb::none(), nb::kw_only(), nb::arg("conf").none() = nb::none(),
          nb::arg("use_environment") = true, nb::arg("settings"),
          "An allocator on `device` (default: default_device()). Settings come "
          "from SHOAL_ALLOC_CONF (unless "
          "use_environment is False), then `conf` (the same 'key:value,...' "
          "text), then keyword arguments with "
          "the same keys, e.g. Allocator(max_split_size_mb=256, "
          "expandable_segments=True, trace_entries=1000). "
          "An unknown key or a bad value raises InvalidArgumentError.")
      .def(
          "__eq__", [](const py_allocator& a, const py_allocator& b) { return a.state == b.state; },
          "True for two objects of one allocator (SharingContext.allocator gives a new object each time).")
      .def("__eq__", [](const py_allocator&, nb::handle) { return false; }, nb::arg("other").none())
      .def("__hash__", [](const py_allocator& a) { return reinterpret_cast<std::uintptr_t>(a.state.get()); })
      .def("allocate", &allocate_storage, nb::arg("nbytes"), nb::arg("stream").none() = nb::none(),
           "A Storage of `nbytes` (> 0) for use on `stream` (default: the "
           "current stream). Short of memory it may wait on the host for pending frees (blocks freed "
           "while another stream still used them) and give the cache back before it raises "
           "OutOfMemoryError, when neither the cache nor the device can provide "
           "it. The GIL is released meanwhile.")
      .def_prop_ro(
          "device", [](const py_allocator& a) -> backend::device& { return a.state->allocator().device(); },
          nb::rv_policy::reference)
      .def_prop_ro(
          "config", [](const py_allocator& a) { return a.state->allocator().config().to_string(); },
          "The settings in force, as SHOAL_ALLOC_CONF text.")
      .def(
          "stats",
          [](const py_allocator& a) {
            return parse_json(report_without_gil(a, [](auto& x) { return x.stats().to_json(); }));
          },
          nb::sig("def stats(self) -> dict[str, Any]"),
          "Counters as a dict: allocations, segments, active, allocated_bytes, "
          "reserved_bytes, ... each with "
          "current/peak/allocated/freed per pool, plus num_alloc_retries, num_ooms, "
          "num_device_alloc, num_device_free, vmm_calls (the growable segments' "
          "device calls: creates, releases, maps, unmaps, access_grants), and "
          "expandable_segments_fallback "
          "(True when expandable_segments was asked for but the device has no "
          "growable segments, so plain ones serve and config says false).")
      .def(
          "snapshot",
          [](const py_allocator& a) {
            return parse_json(report_without_gil(a, [](auto& x) { return x.take_snapshot().to_json(); }));
          },
          nb::sig("def snapshot(self) -> dict[str, Any]"),
          "Every segment and block as a dict.")
      .def(
          "trace",
          [](const py_allocator& a) {
            return parse_json(report_without_gil(a, [](auto& x) { return alloc::to_json(x.trace()); }));
          },
          nb::sig("def trace(self) -> list[dict[str, Any]]"),
          "The trace ring, oldest first (empty unless trace_entries > 0).")
      .def(
          "empty_cache", [](const py_allocator& a) { a.state->allocator().empty_cache(); },
          nb::call_guard<released_gil>(),
          "Waits for pending frees, then returns every cached segment to the "
          "device (GIL released).")
      .def(
          "reset_peak_stats", [](const py_allocator& a) { a.state->allocator().reset_peak_stats(); },
          nb::call_guard<released_gil>(), "Sets every peak to its current value.")
      .def(
          "add_oom_observer",
          [](const py_allocator& a, nb::callable observer) {
            // Dropped with the allocator, possibly on a thread without the
            // GIL (a DLPack consumer's deleter): take it for the decref.
            std::shared_ptr<nb::object> held(new nb::object(std::move(observer)), [](nb::object* o) {
              (void)detail::python_work([o] {  // at exit it leaks
                const nb::gil_scoped_acquire gil;
                delete o;
              });
            });
            a.state->oom_observers.reserve(a.state->oom_observers.size() + 1);  // no failure once registered
            const std::uint64_t registration = a.state->allocator().add_oom_observer([held](const alloc::oom_report& report) {
              // A thread Python made (an allocation from Python, the GIL released or not).
              const bool python_thread = PyGILState_GetThisThreadState() != nullptr;
              (void)detail::python_work([&] {  // at exit observers are not called
                const nb::gil_scoped_acquire gil;
                if (held->is_none()) return;  // removed
                const observer_scope observing;  // closing a transfer engine here could join this very thread
                try {
                  (*held)(oom_report_dict(report));
                } catch (nb::python_error& e) {
                  e.discard_as_unraisable("shoal out-of-memory observer");
#ifdef __GLIBCXX__
                } catch (abi::__forced_unwind&) {
                  // Still running when the interpreter finalized (gil.h).
                  if (python_thread) detail::sleep_until_the_process_ends();
                  throw;
#endif
                }
              });
            });
            a.state->oom_observers.push_back({held, registration});
          },
          nb::arg("observer"),
          "Calls observer(report: dict) before OutOfMemoryError is raised (on "
          "the allocating thread, holding none of the allocator's locks, nor that of a storage whose write or "
          "clone asked for the memory: it may use both). "
          "The report: requested_bytes, device_free_bytes, reserved_bytes, allocated_bytes, "
          "largest_free_block (bytes), limit_bytes (the configured limit on reserved bytes, None when none) "
          "and stream (the native handle of the allocation's stream). The allocation may still succeed "
          "without an error: a storage whose write found no memory for its copy uses the copy another thread's "
          "write made meanwhile. An "
          "exception it raises is reported as unraisable and does not replace "
          "the OutOfMemoryError. The allocator holds the observer until "
          "remove_oom_observer. A cycle through it (an object that holds this Allocator and observes "
          "with a method of its own) is collected by the garbage collector while this Allocator object "
          "is the allocator's one holder; a Storage of it, a view or export of one, or another object of "
          "the allocator alive keeps the cycle until remove_oom_observer.")
      .def(
          "remove_oom_observer",
          [](const py_allocator& a, nb::handle observer) {
            auto& held = a.state->oom_observers;
            const auto found =
                std::find_if(held.begin(), held.end(), [&](const auto& o) { return o.callable->is(observer); });
            if (found == held.end()) return false;
            *found->callable = nb::none();  // a call under way now calls nothing, and the callable goes
            const std::uint64_t registration = found->registration;
            held.erase(found);
            (void)a.state->allocator().remove_oom_observer(registration);  // and the registration
            return true;
          },
          nb::arg("observer").none(),
          "Stops calling `observer` (the object given to add_oom_observer, "
          "once per time it was added) and lets it go; False when it is not "
          "an observer of this allocator.")
      .def("__repr__", [](const py_allocator& a) {
        auto& allocator = a.state->allocator();
        alloc::allocator_stats s;
        {
          released_gil release;  // the pools' locks, as stats()
          s = allocator.stats();
        }
        return "shoal.Allocator(" + allocator.device().name() + ", " +
               std::to_string(s.allocations.aggregate.current) + " allocations, " +
               std::to_string(s.allocated_bytes.aggregate.current) + " bytes allocated, " +
               std::to_string(s.reserved_bytes.aggregate.current) + " reserved)";
      });
}

}  // namespace shoal::python
