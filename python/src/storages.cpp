// Storages: allocation, lazy clones, record_stream, and reads and writes in
// stream order (a write materializes a lazily shared storage first).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "bindings.h"
#include "gil.h"
#include "shoal/core/error.h"
#include "made_elsewhere.h"

namespace shoal::python {

namespace {

/// A contiguous, readable buffer of a Python object (bytes, bytearray,
/// memoryview, a C-contiguous numpy array, ...).
class buffer_view {
 public:
  /// TypeError naming `who` for an object with no buffer; Python's own error
  /// (BufferError, ValueError) for one that is not C-contiguous.
  buffer_view(nb::handle object, const char* who) {
    if (PyObject_GetBuffer(object.ptr(), &buffer_, PyBUF_C_CONTIGUOUS) == 0) return;
    if (PyErr_ExceptionMatches(PyExc_TypeError) == 0) throw nb::python_error();
    PyErr_Clear();
    throw nb::type_error((std::string(who) + ": data must be a bytes-like object (bytes, bytearray, memoryview, a "
                          "numpy array), not " + nb::cast<std::string>(nb::str(object.type().attr("__name__"))))
                             .c_str());
  }
  buffer_view(const buffer_view&) = delete;
  buffer_view& operator=(const buffer_view&) = delete;
  ~buffer_view() { PyBuffer_Release(&buffer_); }
  [[nodiscard]] const void* data() const noexcept { return buffer_.buf; }
  [[nodiscard]] std::size_t size() const noexcept { return static_cast<std::size_t>(buffer_.len); }

 private:
  Py_buffer buffer_{};
};

void check_range(const py_storage& s, std::int64_t offset, std::size_t bytes, const char* what) {
  const std::size_t size = s.handle.get().size();
  if (offset < 0) {
    throw invalid_argument(std::string(what) + ": offset " + std::to_string(offset) +
                           " is negative; offsets count bytes from the storage's start");
  }
  if (static_cast<std::size_t>(offset) > size || bytes > size - static_cast<std::size_t>(offset)) {
    throw invalid_argument(std::string(what) + ": " + std::to_string(bytes) + " bytes at offset " +
                           std::to_string(offset) + " do not fit the storage's " + std::to_string(size) + " bytes");
  }
}

}  // namespace

storage_handle::~storage_handle() {
  // The last handle only: a copy dropped while others live (a temporary
  // `view.storage`, a slice) would move last_used_on() and make the free
  // wait for a stream the memory's last user never named.
  if (storage_.handles() != 1) return;
  std::shared_ptr<stream_state> scoped;
  try {
    scoped = scoped_stream_state(storage_.device());
    if (scoped == nullptr) return;
    streams_->keep(scoped, *allocator_);  // a stream recorded outlives the memory's release
    detail::waiting_without_gil([&] {  // the storage's lock, as Storage.record_stream
      if (!record_stream_on_import(storage_, scoped)) storage_.record_stream(scoped->ref());
    });
  } catch (...) {
    // No room to record it: the work enqueued there is waited for here.
    if (scoped == nullptr) return;
    try {
      detail::waiting_without_gil([&] { scoped->device().synchronize(scoped->ref()); });
    } catch (...) {
      std::fprintf(stderr, "shoal: a storage dropped inside a stream scope could not wait for its stream\n");
    }
  }
}

void storage_handle::require_writable(const char* what) const {
  if (!read_only_) return;
  throw invalid_argument(std::string(what) +
                         ": this storage's memory is read-only (a shared region is mapped read-only, an array "
                         "imported read-only stays so); write to a copy instead: lazy_clone() makes one");
}

py_storage allocate_storage(const py_allocator& a, const python_int& nbytes, const py_stream* stream) {
  constexpr std::uint64_t most = std::numeric_limits<std::int64_t>::max();
  const auto bytes = static_cast<std::size_t>(whole_number_of(nbytes, "Allocator.allocate", "nbytes", most, true));
  auto s = stream_or_current(stream, a.state->allocator().device());
  auto streams = stream_keeper::for_handles();
  streams->keep(s, *a.state);
  storage::storage st;
  {
    released_gil release;  // may wait for pending frees
    st = storage::storage::allocate(a.state->allocator(), bytes, s->ref());
  }
  return py_storage{storage_handle(std::move(st), a.state, std::move(streams))};
}

// Calling Storage() names these.
constexpr char storage_made_by[] =
    "shoal.Storage is not made by calling the class: shoal.allocate(nbytes) or Allocator.allocate(nbytes) makes one, Storage.lazy_clone() copies one, and Peer.receive() or a shoal.sharing.Consumer takes one from another process.";

void register_storages(nb::module_& m) {
  nb::class_<py_storage>(m, "Storage", made_elsewhere<storage_made_by>(),
                         "A reference-counted block of device memory from an "
                         "Allocator. Copies of this object "
                         "alias; lazy_clone() makes a copy-on-write clone that "
                         "copies nothing until written. Usable from several threads at once: each call takes "
                         "its own reference to the memory with the GIL held, and lets the GIL go for what may "
                         "wait long (allocation, copies, synchronization, the storage's own lock, which another "
                         "thread materializing or cloning it holds); order the threads' writes with streams and "
                         "events.")
      .def_prop_ro(
          "nbytes", [](const py_storage& s) { return s.handle.get().size(); }, "Size in bytes.")
      .def("__len__", [](const py_storage& s) { return s.handle.get().size(); })
      .def_prop_ro(
          "device", [](const py_storage& s) -> backend::device& { return s.handle.get().device(); },
          nb::rv_policy::reference)
      .def_prop_ro(
          "ptr", [](const py_storage& s) { return reinterpret_cast<std::uintptr_t>(s.handle.get().data()); },
          "Address of the data for reading (never copies; a lazy clone shows "
          "the shared data).")
      .def(
          "same_allocator",
          [](const py_storage& s, const py_allocator& a) {
            return &s.handle.get().allocator() == &a.state->allocator();
          },
          nb::arg("allocator"),
          "Whether this storage's memory is `allocator`'s: allocated by it, or adopted "
          "by it (received from another process, imported through DLPack). Compares the "
          "allocators themselves, not addresses: reads nothing of either.")
      .def_prop_ro(
          "is_lazy", [](const py_storage& s) { return s.handle.get().is_lazy(); },
          "True while the storage reads data shared copy-on-write: until its "
          "first write, which copies it (or takes it over when no other storage "
          "shares it any more).")
      .def_prop_ro(
          "shared_outside_process",
          [](const py_storage& s) {
            const storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            released_gil release;  // the storage's lock, which a thread materializing or cloning it holds
            return held.shared_outside_process();
          },
          "True once the data was exported (DLPack, IPC): it is never lazily "
          "shared from then on.")
      .def(
          "mutable_ptr",
          [](const py_storage& s, const py_stream* stream) {
            s.handle.require_writable("Storage.mutable_ptr");
            auto st = stream_or_current(stream, s.handle.get().device());
            s.handle.keep_stream(st);
            storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            released_gil release;
            return reinterpret_cast<std::uintptr_t>(held.mutable_data(st->ref()));
          },
          nb::arg("stream").none() = nb::none(),
          "Address of the data for writing on `stream`: materializes a lazy "
          "clone first (in stream order). An address taken before a lazy_clone() or a "
          "read-only export (a readonly view's DLPack) must not be written after it: they "
          "share that data; take a new address, which gives this storage a copy of its own. "
          "InvalidArgumentError for read-only memory.")
      .def(
          "lazy_clone",
          [](const py_storage& s, const py_stream* stream) {
            auto st = stream_or_current(stream, s.handle.get().device());
            s.handle.keep_stream(st);
            storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            storage::storage clone;
            {
              released_gil release;  // an eager copy's allocation may wait for pending frees
              clone = storage::lazy_clone(held, st->ref());
            }
            // An eager copy shares nothing with the source: its streams are its own.
            auto streams = clone.is_lazy() ? s.handle.streams() : stream_keeper::for_handles();
            streams->keep(st, *s.handle.allocator());
            return py_storage{storage_handle(std::move(clone), s.handle.allocator(), std::move(streams))};
          },
          nb::arg("stream").none() = nb::none(),
          "A new storage sharing this one's data copy-on-write, in O(1), for use "
          "on `stream` (default: the current stream); its data is what this "
          "storage holds once `stream` and every stream it was used on have "
          "passed the work enqueued so far (`stream` waits for those other "
          "streams on the GPU, so reads of the clone on it see this storage's "
          "earlier writes). The first write of either storage moves the "
          "writer to a copy while the other still shares the data; once the "
          "other storage is gone, the one left takes the data over and writes "
          "in place. Data exported writable through "
          "DLPack is copied at once instead. A read-only export does not stop "
          "sharing: it is a snapshot of the data the storage had when exported, "
          "kept alive and unchanged while the consumer holds it, whatever "
          "either storage writes later (export again after writing to see "
          "the new data).")
      .def(
          "record_stream",
          [](const py_storage& s, const py_stream& stream) {
            auto st = stream_or_current(&stream, s.handle.get().device());
            s.handle.keep_stream(st);
            const storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            // The storage's lock (and an import's), which a thread materializing or cloning it holds
            // across device calls with the GIL let go.
            released_gil release;
            if (record_stream_on_import(held, st)) return;
            held.record_stream(st->ref());
          },
          nb::arg("stream"),
          "The memory is also used on `stream`: its free (for imported memory, its release to the producer) "
          "waits for the work enqueued there until then. The GIL is released meanwhile (it takes the "
          "storage's lock).")
      .def(
          "aliases", [](const py_storage& a, const py_storage& b) { return a.handle.get().aliases(b.handle.get()); },
          nb::arg("other"), "True iff both name the same storage object.")
      .def(
          "write",
          [](const py_storage& s, nb::handle data, const python_int& offset_given, const py_stream* stream) {
            const std::int64_t offset = signed_number_of(offset_given, "Storage.write", "offset");
            s.handle.require_writable("Storage.write");
            buffer_view buffer(data, "Storage.write");
            check_range(s, offset, buffer.size(), "Storage.write");
            auto st = stream_or_current(stream, s.handle.get().device());
            s.handle.keep_stream(st);
            storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            released_gil release;
            // One step with taking the pointer: a read-only export's clone made meanwhile never shares it.
            held.enqueue_write(st->ref(), [&](void* data) {
              st->device().copy(st->ref(), static_cast<std::byte*>(data) + offset, buffer.data(), buffer.size());
            });
            st->device().synchronize(st->ref());  // the source buffer is the caller's
          },
          // None reaches buffer_view, which names what a write takes; the signature says it.
          nb::arg("data").none(), nb::arg("offset") = 0, nb::arg("stream").none() = nb::none(),
          nb::sig("def write(self, data: typing_extensions.Buffer, offset: int = 0, stream: Stream | None = None) "
                  "-> None"),
          "Copies a bytes-like object into the storage at `offset`, on "
          "`stream` (default: the current stream), "
          "materializing a lazy clone first; returns once the copy has run "
          "(GIL released meanwhile). InvalidArgumentError for read-only memory.")
      .def(
          "read",
          [](const py_storage& s, const python_int& offset_given, const std::optional<python_int>& nbytes_given,
             const py_stream* stream) {
            const std::int64_t offset = signed_number_of(offset_given, "Storage.read", "offset");
            std::optional<std::int64_t> nbytes;
            if (nbytes_given) nbytes = signed_number_of(*nbytes_given, "Storage.read", "nbytes");
            const std::int64_t size = static_cast<std::int64_t>(s.handle.get().size());
            // Without nbytes, to the end: an offset past the end is named as such by check_range.
            const std::int64_t count =
                nbytes.value_or(std::max<std::int64_t>(size - std::max<std::int64_t>(offset, 0), 0));
            if (count < 0) throw invalid_argument("Storage.read: nbytes must be >= 0, got " + std::to_string(count));
            check_range(s, offset, static_cast<std::size_t>(count), "Storage.read");
            auto st = stream_or_current(stream, s.handle.get().device());
            s.handle.keep_stream(st);
            nb::bytes out = nb::steal<nb::bytes>(PyBytes_FromStringAndSize(nullptr, count));
            if (!out.is_valid()) throw nb::python_error();
            char* dst = PyBytes_AsString(out.ptr());
            const storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            {
              released_gil release;
              if (count > 0) {
                // Under the storage's lock from recording the stream to the enqueue: another
                // thread's write that moves the storage, or the family's steal or free,
                // comes wholly before or after this read.
                held.enqueue_read(st->ref(), [&](const void* data) {
                  st->device().copy(st->ref(), dst, static_cast<const std::byte*>(data) + offset,
                                    static_cast<std::size_t>(count));
                });
              }
              st->device().synchronize(st->ref());
            }
            return out;
          },
          nb::arg("offset") = 0, nb::arg("nbytes").none() = nb::none(), nb::arg("stream").none() = nb::none(),
          "The bytes at [offset, offset + nbytes) (default: to the end), "
          "copied on `stream` after the work "
          "enqueued there; never materializes a lazy clone. Blocks until `stream` has run the copy "
          "(GIL released meanwhile).")
      .def(
          "fill",
          [](const py_storage& s, const python_int& value_given, const py_stream* stream) {
            const auto value = whole_number_of(value_given, "Storage.fill", "value (a byte)", 255);
            s.handle.require_writable("Storage.fill");
            auto st = stream_or_current(stream, s.handle.get().device());
            s.handle.keep_stream(st);
            storage::storage held = s.handle.get();  // with the GIL: another thread may assign s.handle
            released_gil release;
            held.enqueue_write(st->ref(), [&](void* data) {  // as write's
              st->device().fill(st->ref(), data, static_cast<std::uint8_t>(value), held.size());
            });
          },
          nb::arg("value"), nb::arg("stream").none() = nb::none(),
          "Sets every byte to `value` in stream order (enqueued; does not "
          "wait), materializing a lazy clone first. InvalidArgumentError for read-only memory.")
      .def(
          "view",
          [](const py_storage& s, nb::handle dtype, const std::optional<std::vector<python_int>>& shape,
             const std::optional<std::vector<python_int>>& strides, const python_int& offset,
             std::optional<python_bool> readonly) {
            const auto numbers = [](const std::optional<std::vector<python_int>>& given, const char* what) {
              std::optional<std::vector<std::int64_t>> out;
              if (!given) return out;
              out.emplace();
              for (const auto& n : *given) out->push_back(signed_number_of(n, "Storage.view", what));
              return out;
            };
            const nb::object chosen = dtype.is_none() ? nb::object(nb::str("uint8")) : nb::borrow<nb::object>(dtype);
            return make_view(s, chosen, numbers(shape, "shape"), numbers(strides, "strides"),
                             signed_number_of(offset, "Storage.view", "offset"),
                             readonly ? readonly->value : s.handle.read_only());
          },
          nb::arg("dtype").none() = "uint8", nb::arg("shape").none() = nb::none(),
          nb::arg("strides").none() = nb::none(),
          nb::arg("offset") = 0, nb::arg("readonly").none() = nb::none(),
           "A typed ArrayView of the storage without copying: `dtype` a name "
           "('float32', 'int64', 'bool', ...: shoal.view_dtypes()), numpy's spelling of one ('f4', '<i8', "
           "'u1', '?', 'single'), a numpy dtype or scalar type (numpy.float32), in this machine's byte "
           "order (None: 'uint8'; anything else is a TypeError naming those taken); `shape` (default: as many elements as fit after "
           "`offset`); `strides` in elements "
           "(default: C order); `offset` in bytes. The view must lie inside "
           "the storage. A readonly view is "
           "exported without materializing a lazy clone (to DLPack 1.x "
           "consumers only), as a snapshot: the consumer sees the data the "
           "storage has at export, kept alive and unchanged while it holds it "
           "(a later write moves the writing storage to a copy, see "
           "lazy_clone), except for memory that is never lazily shared "
           "(exported writable, shared with another process, imported, a "
           "region, a part of one block such as a transfer batch's storages), "
           "which the export shows itself, later writes included; `readonly` "
           "defaults to whether the storage's "
           "memory is read-only, and a writable view of read-only memory is refused.")
      .def(
          "__array__",
          [](const py_storage& s, nb::handle dtype, nb::handle copy) {
            refuse_numpy_unless_readable(s.handle.get(), false);
            // The export of storage.view(), as numpy.asarray(storage.view()) takes it.
            nb::object view = nb::cast(make_view(s, nb::str("uint8"), std::nullopt, std::nullopt, 0,
                                                 s.handle.read_only()));
            return view.attr("__array__")(dtype, copy);
          },
          nb::arg("dtype").none() = nb::none(), nb::arg("copy").none() = nb::none(),
          nb::sig("def __array__(self, dtype: object | None = None, copy: bool | None = None) -> object"),
          "numpy.asarray(storage) on the host backend: its bytes as a uint8 array over the same memory, "
          "no copy (unless `dtype` or `copy` asks for one; copy=False with a `dtype` other than uint8 "
          "raises ValueError), as numpy.asarray(storage.view()) gives. The export is that of a writable "
          "view (a read-only one for read-only memory): it materializes a lazy clone and marks the storage "
          "shared outside the process for good (a later lazy_clone() copies at once); "
          "numpy.from_dlpack(storage.view(readonly=True)) reads a snapshot instead. TypeError for device "
          "memory, which numpy cannot read: storage.read() copies its bytes to the host "
          "(torch.from_dlpack(storage.view()) or cupy.from_dlpack(storage.view()) takes it in place). "
          "TypeError too for pinned host memory (an Allocator with memory='pinned_host'), on either backend, "
          "though the CPU reads it: DLPack names CUDA's pinned memory kDLCUDAHost, which numpy would take, "
          "but shoal's DLPack export refuses staging memory (BufferError), so "
          "storage.read() copies its bytes.")
      .def(
          "__eq__",
          [](nb::handle self, nb::handle other) -> nb::object {
            if (!nb::isinstance<py_storage>(other)) return nb::borrow(Py_NotImplemented);
            return nb::bool_(self.is(other));
          },
          nb::arg("other").none(), nb::sig("def __eq__(self, other: object, /) -> bool"),
          "Identity, as for any Python object: True only for this very Storage object. Two objects of "
          "one storage (view.storage taken twice, say) compare unequal; aliases() says whether they name "
          "the same storage, which is what sharing memory means.")
      .def(
          "__hash__", [](nb::handle self) { return PyBaseObject_Type.tp_hash(self.ptr()); },
          "Identity's hash, as for any Python object (see __eq__).")
      // Refused with the way that works: pickle's own refusal names no way on.
      .def(
          "__reduce__",
          [](nb::handle) -> nb::tuple {
            throw nb::type_error(
                "a shoal.Storage cannot be pickled: its memory belongs to this process. Send it to another "
                "process with shoal.sharing (Producer.put, or Peer.send), which maps the same memory there "
                "without a copy; or pickle a copy of what it holds");
          },
          "Refused (TypeError): a Storage's memory belongs to this process; shoal.sharing sends it to another.")
      .def("__repr__", [](const py_storage& s) -> std::string {
        if (!s.handle.get().valid()) return "shoal.Storage(released: its memory was handed on, as by publish)";
        return "shoal.Storage(nbytes=" + std::to_string(s.handle.get().size()) +
               ", device=" + s.handle.get().device().name() + (s.handle.get().is_lazy() ? ", lazy" : "") +
               (s.handle.read_only() ? ", read-only" : "") + ")";
      });
}

}  // namespace shoal::python
