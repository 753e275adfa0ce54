// Every C++ error type of shoal/core/error.h as a Python exception class with
// the same message, most derived C++ type first:
//
// clang-format off
//   ShoalError(RuntimeError)                           error
//   InvalidArgumentError(ShoalError, ValueError)       invalid_argument
//   ProtocolError(InvalidArgumentError)                protocol_error
//   OutOfMemoryError(ShoalError, MemoryError)          out_of_memory (.requested_bytes, .reason)
//   DeviceUnavailableError(ShoalError)                 device_unavailable
//   BackendError(ShoalError)                           backend_error (.call, .detail)
//   SystemCallError(OSError, BackendError)             os_error (.errno, .strerror too)
//   StreamError(ShoalError)                            stream_error
//   OrderingViolationError(ShoalError)                 ordering_violation
//   InvariantViolationError(ShoalError)                invariant_violation (.invariant)
//   ConnectionClosedError(ShoalError, ConnectionError) connection_closed (.no_listener)
//   PeerRefusedError(ShoalError, ConnectionRefusedError) peer_refused
//   PeerTimeoutError(ShoalError, TimeoutError)         timeout_error
//   ContentMismatchError(ShoalError)                   content_mismatch
// clang-format on
//
// and one with no C++ type: CancelledError(ShoalError), a wait its caller's
// cancel event ended (raise_cancelled).
#include <nanobind/stl/string.h>

#include <cerrno>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bindings.h"
#include "shoal/core/error.h"
#include "shoal/lending/lending_types.h"

namespace shoal::python {

namespace {

struct exception_types {
  PyObject* error = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* protocol_error = nullptr;
  PyObject* out_of_memory = nullptr;
  PyObject* device_unavailable = nullptr;
  PyObject* backend_error = nullptr;
  PyObject* os_error = nullptr;
  PyObject* stream_error = nullptr;
  PyObject* ordering_violation = nullptr;
  PyObject* invariant_violation = nullptr;
  PyObject* connection_closed = nullptr;
  PyObject* peer_refused = nullptr;
  PyObject* timeout = nullptr;
  PyObject* content_mismatch = nullptr;
  PyObject* cancelled = nullptr;
};
exception_types types;  // set once at import; the module keeps them alive

PyObject* new_type(nb::module_& m, const char* name, const char* doc, std::vector<PyObject*> bases) {
  nb::tuple base_tuple = nb::steal<nb::tuple>(PyTuple_New(static_cast<Py_ssize_t>(bases.size())));
  for (std::size_t i = 0; i < bases.size(); ++i) {
    PyTuple_SET_ITEM(base_tuple.ptr(), static_cast<Py_ssize_t>(i), nb::borrow(bases[i]).release().ptr());
  }
  const std::string qualified = std::string("shoal.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base_tuple.ptr(), nullptr);
  if (type == nullptr) throw nb::python_error();
  m.attr(name) = nb::steal(type);
  return type;
}

// The library's messages start with the C++ operation that failed; a Python
// user reads the Python name of what they called instead. Longest names
// first where one begins another.
constexpr std::pair<std::string_view, std::string_view> python_names[] = {
    {"connection::adopt_pair_end", "Connection"},
    {"connection::connect", "shoal.connect"},
    {"connection::adopt", "Connection"},
    {"connection::start_ring", "Connection"},
    {"connection::receive", "receiving"},
    {"connection::send", "sending"},
    {"listener", "Listener"},
    {"channel_address::in_runtime_dir", "runtime_dir_address"},
    {"channel_address", "address"},
    {"caching_allocator::allocate", "Allocator.allocate"},
    {"caching_allocator", "Allocator"},
    {"lender::revoke", "shoal.lending.Lender.revoke"},
    {"lender", "shoal.lending.Lender"},
    {"borrower::borrow_shared", "shoal.lending.Borrower.borrow_shared"},
    {"borrower::borrow", "shoal.lending.Borrower.borrow"},
    {"borrower::publish", "shoal.lending.Borrower.publish"},
    {"borrower::give_back", "shoal.lending.Borrower (giving memory back)"},
    {"borrower::revoke", "shoal.lending.Borrower.revoke"},
    {"borrower::revocations", "shoal.lending.Borrower.revocations"},
    {"borrower::metrics", "shoal.lending.Borrower.metrics"},
    {"borrower", "shoal.lending.Borrower"},
    {"peer::send_note", "Peer.send_note"},
    {"peer::send", "Peer.send"},
    {"peer::receive_for", "Peer.receive"},
    {"peer::try_receive", "Peer.receive"},
    {"peer::receive", "Peer.receive"},
    {"transfer_engine::submit", "shoal.transfer.Engine.submit"},
    {"transfer_engine::try_next", "shoal.transfer.Engine.get"},
    {"transfer_engine::next", "shoal.transfer.Engine.get"},
    {"transfer_engine", "shoal.transfer.Engine"},
    {"grouped_load", "shoal.loading.GroupedLoad"},
    {"sharing_options::max_metadata_bytes", "SharingContext's max_metadata_bytes"},
    {"sharing_options::max_peer_ring_bytes", "SharingContext's max_peer_ring_bytes"},
    {"sharing_options::max_peer_mapped_bytes", "SharingContext's max_peer_mapped_bytes"},
    {"sharing_options::max_mapped_bytes", "SharingContext's max_mapped_bytes"},
    {"sharing_options::max_producer_resources", "SharingContext's max_producer_resources"},
    {"borrower_options::observer", "Borrower(observer=True)"},
    {"cuda_device::adopt_external_stream", "Stream.from_handle"},
    {"adopt_external_stream", "Stream.from_handle"},
};

// A Storage whose memory went to a region (Borrower.publish) says so in
// Python's words; the C++ text speaks of handles.
constexpr std::string_view empty_storage = "storage: this handle is empty";

// Whether what follows a name ends it as a word: not a longer name, not a
// method of it ("::") that the table does not name.
bool ends_a_name(std::string_view rest) {
  if (rest.starts_with("::")) return false;
  return rest.empty() || rest.front() == ':' || rest.front() == ' ' || rest.front() == '(' || rest.front() == ')';
}

// A qualified name ("connection::receive") also stands in the middle of a
// message (after a peer's "peer pid N (uid U): ", or in parentheses): never
// prose, so each is put in Python's words wherever it stands as a word.
std::string qualified_names_in_python_words(std::string text) {
  for (const auto& [cpp, python] : python_names) {
    if (cpp.find("::") == std::string_view::npos) continue;
    for (std::size_t at = text.find(cpp); at != std::string::npos; at = text.find(cpp, at)) {
      const bool starts = at == 0 || text[at - 1] == ' ' || text[at - 1] == '(';
      if (starts && ends_a_name(std::string_view(text).substr(at + cpp.size()))) {
        text.replace(at, cpp.size(), python);
        at += python.size();
      } else {
        at += cpp.size();
      }
    }
  }
  return text;
}

std::string in_python_words(std::string_view message) {
  if (message.starts_with(empty_storage)) {
    return "Storage: this Storage has no memory any more: it was handed on (a Storage given to "
           "shoal.lending.Borrower.publish belongs to the region now; read it through the SharedRegion "
           "publish returned: its entry() views)";
  }
  for (const auto& [cpp, python] : python_names) {
    if (!message.starts_with(cpp) || !ends_a_name(message.substr(cpp.size()))) continue;
    return qualified_names_in_python_words(std::string(python) + std::string(message.substr(cpp.size())));
  }
  return qualified_names_in_python_words(std::string(message));
}

// Messages may quote what a peer sent: bytes that are no UTF-8 are kept as
// \xNN escapes rather than fail the conversion (and lose the error).
// (Out of memory even for that: an empty text, so that the error itself still comes.)
nb::str python_text(std::string_view message) {
  PyObject* text = PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "backslashreplace");
  if (text == nullptr) {
    PyErr_Clear();
    return nb::str("");
  }
  return nb::steal<nb::str>(text);
}

/// Raises `type(message)` with the given attributes set on the instance, the
/// message's leading C++ name put in Python's words.
void raise(PyObject* type, const char* message, std::vector<std::pair<const char*, nb::object>> attributes = {}) {
  const nb::str text = python_text(in_python_words(message));
  nb::object instance = nb::steal(PyObject_CallOneArg(type, text.ptr()));
  if (!instance.is_valid()) return;  // the call itself raised; that error stands
  for (auto& [name, value] : attributes) nb::setattr(instance, name, value);
  PyErr_SetObject(type, instance.ptr());
}

// Made as OSError(errno, message) is, so that errno and strerror are its
// arguments (str() reads "[Errno N] <message>"; pickle and copy keep them).
void raise_os_error(const os_error& e) {
  const nb::str text = python_text(in_python_words(e.what()));
  nb::object instance = nb::steal(PyObject_CallFunction(types.os_error, "iO", e.code(), text.ptr()));
  if (!instance.is_valid()) return;  // the call itself raised; that error stands
  nb::setattr(instance, "call", python_text(in_python_words(e.call())));
  nb::setattr(instance, "detail", python_text(e.detail()));
  PyErr_SetObject(types.os_error, instance.ptr());
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const protocol_error& e) {
    raise(types.protocol_error, e.what());
  } catch (const invalid_argument& e) {
    raise(types.invalid_argument, e.what());
  } catch (const lending::memory_refused& e) {
    raise(types.out_of_memory, e.what(),
          {{"requested_bytes", nb::int_(e.requested_bytes())}, {"reason", nb::str(lending::to_string(e.reason()))}});
  } catch (const out_of_memory& e) {
    raise(types.out_of_memory, e.what(), {{"requested_bytes", nb::int_(e.requested_bytes())}, {"reason", nb::none()}});
  } catch (const device_unavailable& e) {
    raise(types.device_unavailable, e.what());
  } catch (const os_error& e) {
    raise_os_error(e);
  } catch (const backend_error& e) {
    raise(types.backend_error, e.what(),
          {{"call", python_text(e.call())}, {"detail", python_text(e.detail())}});
  } catch (const stream_error& e) {
    raise(types.stream_error, e.what());
  } catch (const ordering_violation& e) {
    raise(types.ordering_violation, e.what());
  } catch (const invariant_violation& e) {
    raise(types.invariant_violation, e.what(), {{"invariant", python_text(e.invariant())}});
  } catch (const connection_closed& e) {
    raise(types.connection_closed, e.what(), {{"no_listener", nb::bool_(e.no_listener())}});
  } catch (const peer_refused& e) {
    raise(types.peer_refused, e.what());
  } catch (const timeout_error& e) {
    raise(types.timeout, e.what());
  } catch (const content_mismatch& e) {
    raise(types.content_mismatch, e.what());
  } catch (const error& e) {
    raise(types.error, e.what());
  }
}

/// Throws the C++ error named `kind` with `message`: lets the tests check the
/// translation of errors no Python call can provoke yet (peer errors).
void throw_cpp_error(const std::string& kind, const nb::object& given) {
  // bytes as they are (a message that is no UTF-8, as a peer's may be), or a str's UTF-8
  const std::string message = PyBytes_Check(given.ptr()) != 0
                                  ? std::string(PyBytes_AS_STRING(given.ptr()),
                                                static_cast<std::size_t>(PyBytes_GET_SIZE(given.ptr())))
                                  : nb::cast<std::string>(given);
  const std::vector<std::pair<std::string, std::function<void()>>> throwers = {
      {"error", [&] { throw error(message); }},
      {"invalid_argument", [&] { throw invalid_argument(message); }},
      {"protocol_error", [&] { throw protocol_error(message); }},
      {"out_of_memory", [&] { throw out_of_memory(message, 4096); }},
      {"memory_refused", [&] { throw lending::memory_refused(message, 4096, lending::shortage::wait_expired); }},
      {"device_unavailable", [&] { throw device_unavailable(message); }},
      {"backend_error", [&] { throw backend_error("a_call", message); }},
      {"os_error", [&] { throw os_error(EADDRINUSE, "a_call", message); }},
      {"stream_error", [&] { throw stream_error(message); }},
      {"ordering_violation", [&] { throw ordering_violation(message); }},
      {"invariant_violation", [&] { throw invariant_violation("an_invariant", message); }},
      {"connection_closed", [&] { throw connection_closed(message); }},
      {"peer_refused", [&] { throw peer_refused(message); }},
      {"timeout_error", [&] { throw timeout_error(message); }},
      {"content_mismatch", [&] { throw content_mismatch(message); }},
  };
  for (const auto& [name, thrower] : throwers) {
    if (name == kind) thrower();
  }
  throw nb::value_error(("_throw_cpp_error: unknown kind '" + kind + "'").c_str());
}

}  // namespace

void raise_cancelled(const std::string& message) {
  raise(types.cancelled, message.c_str());
  throw nb::python_error();
}

void register_errors(nb::module_& m) {
  types.error = new_type(m, "ShoalError", "Base of every error shoal raises.", {PyExc_RuntimeError});
  types.invalid_argument =
      new_type(m, "InvalidArgumentError", "The call got something it cannot accept; nothing was changed.",
               {types.error, PyExc_ValueError});
  types.protocol_error = new_type(m, "ProtocolError", "Another process sent something the protocol does not allow.",
                                  {types.invalid_argument});
  types.out_of_memory = new_type(m, "OutOfMemoryError",
                                 "The device (or the configured limit) cannot provide the memory "
                                 "asked for; "
                                 "`requested_bytes` says how much the request was; `reason` says why a lender "
                                 "refused a borrow ('capacity', 'wait_expired', 'others_waiting', 'cannot_fit', "
                                 "'stopped_waiting'), None for this process's own device or limit.",
                                 {types.error, PyExc_MemoryError});
  // An instance made in Python (a test double, not from a C++ error) has
  // every attribute the stubs promise: the class holds a default.
  nb::setattr(nb::handle(types.out_of_memory), "reason", nb::none());
  nb::setattr(nb::handle(types.out_of_memory), "requested_bytes", nb::int_(0));
  types.device_unavailable =
      new_type(m, "DeviceUnavailableError", "The requested backend or device does not exist here.", {types.error});
  types.backend_error = new_type(m, "BackendError",
                                 "A device runtime or operating-system call "
                                 "failed; `call` names it, `detail` "
                                 "holds its own error text.",
                                 {types.error});
  nb::setattr(nb::handle(types.backend_error), "call", nb::str(""));
  nb::setattr(nb::handle(types.backend_error), "detail", nb::str(""));
  types.os_error = new_type(m, "SystemCallError",
                            "An operating-system call failed (an address already in use, a directory that does not "
                            "exist, a descriptor limit reached): an OSError made as OSError(errno, message) is, and a "
                            "BackendError (`call`, `detail`). Not the per-errno subclasses (FileNotFoundError...): "
                            "compare `errno`.",
                            {PyExc_OSError, types.backend_error});  // OSError first: its constructor
  types.stream_error =
      new_type(m, "StreamError",
               "Work enqueued on a stream failed after the call returned. On CUDA a kernel fault is raised by "
               "every later call of the process, which must restart.",
               {types.error});
  types.ordering_violation = new_type(m, "OrderingViolationError",
                                      "Memory was about to be handed out while a stream could still use it "
                                      "(the allocator's debug mode).",
                                      {types.error});
  types.invariant_violation = new_type(m, "InvariantViolationError",
                                       "An invariant of shoal's own state does not hold (a bug in shoal); "
                                       "`invariant` names it.",
                                       {types.error});
  nb::setattr(nb::handle(types.invariant_violation), "invariant", nb::str(""));
  types.connection_closed =
      new_type(m, "ConnectionClosedError", "The process at the other end of a connection closed it or died.",
               {types.error, PyExc_ConnectionError});
  // False unless a connect found no one listening (set on the instance):
  // one raised in Python has it too.
  nb::setattr(nb::handle(types.connection_closed), "no_listener", nb::bool_(false));
  types.peer_refused = new_type(m, "PeerRefusedError",
                                "A peer process was refused (credentials not allowed, a peer revoked), or refused "
                                "this one (a lender turning a borrower away, or a borrow past its quota).",
                                {types.error, PyExc_ConnectionRefusedError});
  types.timeout = new_type(m, "PeerTimeoutError",
                           "A wait ran past its deadline, whether on another process or within this one: for a "
                           "peer's message, a lender's answer, a batch (shoal.sharing.Consumer.get, "
                           "shoal.transfer.Engine.get), room to submit (Engine.submit), another call of the same "
                           "Borrower to end. The operation says whether its connection, where it has one, is still "
                           "usable.",
                           {types.error, PyExc_TimeoutError});
  types.content_mismatch = new_type(m, "ContentMismatchError",
                                    "Memory's content is not what the caller expected: a published region's content "
                                    "hash is not the one asked for.",
                                    {types.error});
  types.cancelled =
      new_type(m, "CancelledError",
               "A wait was ended by its caller's cancel event (e.g. shoal.lending.Borrower.borrow(cancel=...)); "
               "nothing it asked for is held.",
               {types.error});
  nb::register_exception_translator(translate);
  m.def("_throw_cpp_error", &throw_cpp_error, nb::arg("kind"), nb::arg("message"),
        "Test hook: throws the C++ error type `kind` (e.g. 'out_of_memory') "
        "with `message` (a str, or bytes taken as they are).");
}

}  // namespace shoal::python
