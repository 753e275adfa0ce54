// Typed views of storages and their DLPack export, following the array API
// stream contract: __dlpack__(stream=...) names the consumer's stream;
//   None  the host reads it (host backend) / the legacy default stream (CUDA)
//   1, 2  the legacy / per-thread default stream (the default stream on host)
//   ptr   a stream handle of the view's device
//   -1    no synchronization at all
//   0     refused (ambiguous)
// The producer is the current stream at export time. The consumer's stream
// waits for an event recorded there (device-side; only a host consumer
// blocks, with the GIL released), and is recorded as a user of the block,
// so the allocator's free waits for it too. A writable export materializes
// a lazy clone and marks the data shared outside the process (never lazily
// shared again); a read-only one (DLPack 1.x, flagged read-only) does neither:
// it exports a lazy clone of the storage, made for it and held by the
// capsule, so the memory it shows stays allocated and unchanged whatever the
// storage and its clones write later (a write moves the writer to a copy
// while the export lives). A storage that cannot be lazily shared (shared
// outside the process, memory with an owner) keeps its data at one address
// for its life: that read-only export shows the memory itself, held by the
// storage's handle, later writes included.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "bindings.h"
#include "gil.h"
#include "dlpack_abi.h"
#include "dtype_names.h"
#include "shoal/core/error.h"
#include "made_elsewhere.h"

namespace shoal::python {

namespace {

std::string supported_dtypes() {
  std::string known;
  for (const auto& entry : view_dtype_entries()) known += (known.empty() ? "" : ", ") + std::string(entry.name);
  return known + " (shoal.view_dtypes()), or numpy's spellings of them ('f4', '<i8', 'u1', '?', numpy.float32, "
                 "numpy.dtype('float32'))";
}

[[noreturn]] void refuse_byte_order(const std::string& text) {
  throw nb::type_error(("dtype " + text + " is not in this machine's byte order (" +
                        (std::endian::native == std::endian::little ? "little" : "big") +
                        "-endian); views are native only (numpy: array.astype(array.dtype.newbyteorder('=')) "
                        "converts). Views take " + supported_dtypes())
                           .c_str());
}

/// The dtype a view is asked for (dtype_names.h's spellings). A dtype of the
/// other byte order is refused: its name is the native one's, and its values
/// would be read swapped.
const dtype_entry& dtype_of(nb::handle dtype) {
  const dtype_reading read = read_dtype(dtype);
  if (read.entry != nullptr) return *read.entry;
  if (read.shown.empty()) {
    throw nb::type_error(("dtype must be a name such as 'float32' or a numpy dtype, not " +
                          nb::cast<std::string>(nb::str(dtype.type().attr("__name__"))) + "; views take " +
                          supported_dtypes())
                             .c_str());
  }
  if (read.swapped) refuse_byte_order(read.shown);
  throw nb::type_error(("dtype " + read.shown + (read.meaning.empty() ? "" : " (" + read.meaning + ")") +
                        " is not supported; views take " + supported_dtypes())
                           .c_str());
}

/// A tuple of ints, typed as such (tuple[int, ...]) for the stubs.
nb::typed<nb::tuple, int, nb::ellipsis> ints_tuple(const std::vector<std::int64_t>& values) {
  return nb::typed<nb::tuple, int, nb::ellipsis>(nb::tuple(nb::cast(values)));
}

dlpack::DLDevice dl_device_of(const backend::device& device) {
  return {device.kind() == backend::device_kind::host ? dlpack::kDLCPU : dlpack::kDLCUDA, device.ordinal()};
}

/// What a capsule owns until its consumer's deleter (or the capsule's own
/// destructor, when never consumed) drops it. No Python objects: the
/// deleter may run on any thread without the GIL.
struct export_context {
  storage_handle handle;  // the storage viewed
  // A read-only export's lazy clone of it (see the top), whose data is the
  // one exported; empty for a writable export and for a storage that cannot
  // be lazily shared.
  std::optional<storage_handle> snapshot;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::unique_ptr<backend::event> ready;  // the producer point the consumer waits for
  dlpack::DLManagedTensor legacy{};
  dlpack::DLManagedTensorVersioned versioned{};
};

void delete_legacy(dlpack::DLManagedTensor* self) { delete static_cast<export_context*>(self->manager_ctx); }
void delete_versioned(dlpack::DLManagedTensorVersioned* self) {
  delete static_cast<export_context*>(self->manager_ctx);
}

/// Capsule destructors: a capsule still under its unused name was never
/// consumed, so shoal deletes the tensor itself.
void capsule_destructor_legacy(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  auto* tensor = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (tensor != nullptr) tensor->deleter(tensor);
  PyErr_Restore(type, value, traceback);
}
void capsule_destructor_versioned(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor_versioned")) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  auto* tensor = static_cast<dlpack::DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, "dltensor_versioned"));
  if (tensor != nullptr) tensor->deleter(tensor);
  PyErr_Restore(type, value, traceback);
}

/// The consumer stream a `stream=` value names, or nothing for "the host
/// reads it" (nullopt with host_reads) and for -1 (no synchronization).
struct consumer {
  bool host_reads = false;
  std::optional<backend::stream_ref> stream;
};

// `value` as a T, or a TypeError saying what the argument must be (a bare
// nb::cast would raise std::bad_cast as a RuntimeError).
template <class T>
T argument_as(nb::handle value, const char* must_be) {
  T out{};
  if (!nb::try_cast<T>(value, out)) throw nb::type_error(must_be);
  return out;
}

consumer consumer_of(nb::handle stream, const backend::device& device) {
  const bool host = device.kind() == backend::device_kind::host;
  if (stream.is_none()) {
    if (host) return {true, std::nullopt};
    return {false, backend::stream_ref{}};
  }
  if (!nb::isinstance<nb::int_>(stream) || PyBool_Check(stream.ptr())) {
    throw nb::type_error(
        "__dlpack__: stream must be None or an int (1, 2, a "
        "stream handle, or -1)");
  }
  const auto value = argument_as<std::int64_t>(stream, "__dlpack__: stream must be an int of 64 bits (1, 2, a stream handle, or -1)");
  if (value == 0) {
    throw invalid_argument(
        "__dlpack__: stream=0 is ambiguous and not allowed; "
        "pass 1 (legacy default stream), "
        "2 (per-thread default stream), a stream handle, or "
        "-1 (no synchronization)");
  }
  if (value == -1) return {};
  if (value < -1) throw invalid_argument("__dlpack__: stream=" + std::to_string(value) + " is not a stream");
  if (value == 1 || (value == 2 && host)) return {false, backend::stream_ref{}};
  return {false, backend::stream_ref{reinterpret_cast<void*>(static_cast<std::uintptr_t>(value))}};
}

void check_dl_device(nb::handle dl_device, const backend::device& device) {
  if (dl_device.is_none()) return;
  const auto [type, id] =
      argument_as<std::tuple<int, int>>(dl_device, "__dlpack__: dl_device must be None or a (device type, device id) tuple of ints");
  const auto ours = dl_device_of(device);
  if (type != ours.device_type || id != ours.device_id) {
    throw nb::buffer_error(("__dlpack__: dl_device=(" + std::to_string(type) + ", " + std::to_string(id) +
                            ") asks for another device; the data is on (" + std::to_string(ours.device_type) + ", " +
                            std::to_string(ours.device_id) + ") and shoal exports without copying")
                               .c_str());
  }
}

bool wants_versioned(nb::handle max_version) {
  if (max_version.is_none()) return false;
  const auto [major, minor] =
      argument_as<std::tuple<int, int>>(max_version, "__dlpack__: max_version must be None or a (major, minor) tuple of ints");
  (void)minor;
  return major >= 1;
}

nb::object export_view(const py_array_view& view, nb::handle stream, nb::handle max_version, nb::handle dl_device,
                       nb::handle copy) {
  const storage::storage& st = view.handle.get();
  backend::device& device = st.device();
  if (st.allocator().config().memory == alloc::allocator_memory::pinned_host) {
    throw nb::buffer_error(
        "__dlpack__: this storage is pinned host staging memory (an Allocator with memory='pinned_host'), "
        "not device memory; DLPack export of it is not supported");
  }
  check_dl_device(dl_device, device);
  if (!copy.is_none() && argument_as<bool>(copy, "__dlpack__: copy must be None, True or False")) {
    throw nb::buffer_error(
        "__dlpack__: copy=True is not supported; shoal "
        "exports its memory without copying");
  }
  const bool versioned = wants_versioned(max_version);
  if (view.readonly && !versioned) {
    throw nb::buffer_error(
        "__dlpack__: a read-only view needs a DLPack 1.x "
        "consumer (max_version >= (1, 0)), "
        "which is told it is read-only");
  }
  consumer to = consumer_of(stream, device);
  // The consumer's stream is usually another library's: adopted here, and a
  // handle that names no live stream of this device refused, before anything
  // is materialized or marked.
  if (to.stream) to.stream = device.adopt_external_stream(to.stream->native);
  const auto producer = current_stream_state(device);
  view.handle.keep_stream(producer);

  auto context = std::make_unique<export_context>(
      export_context{view.handle, std::nullopt, view.shape, view.strides, nullptr});
  void* data = nullptr;
  {
    released_gil release;
    // The storage whose data is exported: the context's own (never the
    // view's handle, which other threads may share).
    storage::storage exported = context->handle.get();
    if (view.readonly) {
      // A snapshot that keeps its memory: the storage's data alone could be
      // freed under the consumer once a write moves the storage to a copy
      // and the family's last other member goes.
      storage::storage clone = storage::try_lazy_clone(exported, producer->ref());
      if (clone.valid()) {
        exported = clone;
        context->snapshot.emplace(std::move(clone), view.handle.allocator(), view.handle.streams());
      }
      data = const_cast<void*>(exported.data());
    } else {
      // Marked first, in one locked step with any materialization: from then
      // on a lazy_clone on another thread is an eager copy, so the pointer
      // taken next is never shared with a clone (taken first, a clone made
      // between the two steps would share it and never see the consumer's
      // writes coming).
      exported.mark_shared_outside_process(producer->ref());
      data = exported.mutable_data(producer->ref());
    }
    if (to.host_reads || (to.stream && *to.stream != producer->ref())) {
      context->ready = std::make_unique<backend::event>(device);
      context->ready->record(producer->ref());
      if (to.host_reads) {
        context->ready->synchronize();
      } else {
        device.wait(*to.stream, context->ready->ref());
        exported.record_stream(*to.stream);  // memory of the allocator or imported: the release waits for it
      }
    }
  }

  dlpack::DLTensor tensor{};
  tensor.data = data;
  tensor.device = dl_device_of(device);
  tensor.ndim = static_cast<std::int32_t>(context->shape.size());
  tensor.dtype = {view.code, view.bits, 1};
  tensor.shape = context->shape.data();
  tensor.strides = context->strides.data();
  tensor.byte_offset = static_cast<std::uint64_t>(view.offset);

  export_context* raw = context.get();
  PyObject* capsule = nullptr;
  if (versioned) {
    raw->versioned = {{dlpack::major_version, dlpack::minor_version},
                      raw,
                      &delete_versioned,
                      view.readonly ? dlpack::flag_read_only : 0,
                      tensor};
    capsule = PyCapsule_New(&raw->versioned, "dltensor_versioned", &capsule_destructor_versioned);
  } else {
    raw->legacy = {tensor, raw, &delete_legacy};
    capsule = PyCapsule_New(&raw->legacy, "dltensor", &capsule_destructor_legacy);
  }
  if (capsule == nullptr) throw nb::python_error();
  context.release();  // the capsule owns it now
  return nb::steal(capsule);
}

}  // namespace

std::optional<std::vector<std::int64_t>> c_order_strides(std::span<const std::int64_t> shape) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t step = 1;
  bool past = false;  // step passed 64 bits: an error once a stride takes it
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (past) return std::nullopt;
    strides[i] = step;
    past = __builtin_mul_overflow(step, std::max<std::int64_t>(shape[i], 1), &step);
  }
  return strides;
}

std::optional<element_bytes> element_bytes_of(std::span<const std::int64_t> shape,
                                              std::span<const std::int64_t> strides, std::int64_t itemsize) {
  if (std::ranges::find(shape, 0) != shape.end()) return element_bytes{};
  // Each step checked: a product that wraps could land inside the storage.
  std::int64_t lowest = 0;
  std::int64_t highest = 0;
  std::int64_t count = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    std::int64_t reach = 0;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &reach) || __builtin_mul_overflow(reach, itemsize, &reach) ||
        __builtin_add_overflow(reach < 0 ? lowest : highest, reach, reach < 0 ? &lowest : &highest) ||
        __builtin_mul_overflow(count, shape[i], &count)) {
      return std::nullopt;
    }
  }
  element_bytes out{lowest, 0, 0};
  if (__builtin_add_overflow(highest, itemsize, &out.end) || __builtin_mul_overflow(count, itemsize, &out.total)) {
    return std::nullopt;
  }
  return out;
}

py_array_view make_view(const py_storage& s, nb::handle dtype, std::optional<std::vector<std::int64_t>> shape,
                        std::optional<std::vector<std::int64_t>> strides, std::int64_t offset, bool readonly) {
  if (!readonly) s.handle.require_writable("Storage.view(readonly=False)");
  const dtype_entry& entry = dtype_of(dtype);
  const std::string name(entry.name);
  const std::int64_t itemsize = entry.bits / 8;
  const auto size = static_cast<std::int64_t>(s.handle.get().size());
  if (offset < 0 || offset > size) {
    throw invalid_argument("Storage.view: offset " + std::to_string(offset) + " lies outside the storage's " +
                           std::to_string(size) + " bytes");
  }
  if (offset % itemsize != 0) {
    throw invalid_argument("Storage.view: offset " + std::to_string(offset) + " is not a multiple of the " + name +
                           " item size (" + std::to_string(itemsize) + ")");
  }
  if (!shape) shape = std::vector<std::int64_t>{(size - offset) / itemsize};
  for (const auto extent : *shape) {
    if (extent < 0) throw invalid_argument("Storage.view: shape has a negative extent " + std::to_string(extent));
  }
  if (shape->size() > 64) throw invalid_argument("Storage.view: more than 64 dimensions");
  if (!strides) {
    strides = c_order_strides(*shape);
    if (!strides) throw invalid_argument("Storage.view: the C-order strides of that shape pass 2**63 - 1 elements");
  }
  if (strides->size() != shape->size()) {
    throw invalid_argument("Storage.view: " + std::to_string(strides->size()) + " strides for " +
                           std::to_string(shape->size()) + " dimensions");
  }
  const std::optional<element_bytes> reach = element_bytes_of(*shape, *strides, itemsize);
  if (!reach) {
    throw invalid_argument("Storage.view: a " + name + " view of that shape and strides counts more than 2**63 - 1 " +
                           "bytes (its elements', or those from its lowest element to its highest): no storage " +
                           "holds it, this one has " + std::to_string(size));
  }
  // offset lies in [0, size] and lowest <= 0 < end: neither side overflows.
  if (reach->total > 0 && (offset + reach->lowest < 0 || reach->end > size - offset)) {
    throw invalid_argument("Storage.view: a " + name + " view of that shape and strides at offset " +
                           std::to_string(offset) + " reaches outside the storage's " + std::to_string(size) +
                           " bytes");
  }
  return py_array_view{s.handle, name, entry.code, entry.bits, *shape, *strides, offset, readonly};
}

void refuse_numpy_unless_readable(const storage::storage& st, bool of_view) {
  const backend::device& device = st.device();
  const std::string what = of_view ? "view" : "storage";
  const std::string reader = of_view ? "view.storage" : "storage";
  const std::string exported = of_view ? "view" : "storage.view()";
  const std::string place = std::string(backend::to_string(device.kind())) + ":" + std::to_string(device.ordinal());
  // Of either backend, and a CUDA device's storage: checked first. DLPack
  // would name CUDA's pinned memory kDLCUDAHost, which numpy reads, but the
  // export refuses staging memory (export_view), so numpy gets none.
  if (st.allocator().config().memory == alloc::allocator_memory::pinned_host) {
    throw nb::type_error(("numpy.asarray(" + what + "): the " + what + " is pinned host memory of " + place +
                          " (an Allocator with memory='pinned_host': staging memory for copies), which shoal does "
                          "not export through DLPack, so numpy cannot take it in place; copy it with " + reader +
                          ".read() (its bytes: numpy.frombuffer(" + reader + ".read(), numpy.uint8))")
                             .c_str());
  }
  if (device.kind() == backend::device_kind::host) return;
  throw nb::type_error(("numpy.asarray(" + what + "): the " + what + " is device memory of " + place + " (" +
                        device.name() + "), which numpy cannot read; copy it to the host with " + reader +
                        ".read() (" + (of_view ? "the storage's" : "its") + " bytes: numpy.frombuffer(" + reader +
                        ".read(), numpy.uint8)), or take it without copying with torch.from_dlpack(" + exported +
                        ") or cupy.from_dlpack(" + exported + ")")
                           .c_str());
}

// Calling ArrayView() names these.
constexpr char array_view_made_by[] =
    "shoal.ArrayView is not made by calling the class: Storage.view(dtype, shape) makes one.";

void register_dlpack(nb::module_& m) {
  m.def(
      "view_dtypes",
      [] {
        nb::list names;
        for (const auto& entry : view_dtype_entries()) names.append(nb::str(entry.name.data(), entry.name.size()));
        return nb::typed<nb::tuple, nb::str, nb::ellipsis>(nb::tuple(names));
      },
      "The element types a view (Storage.view, ArrayView) can have, by name.");
  nb::class_<py_array_view>(m, "ArrayView", made_elsewhere<array_view_made_by>(),
                            "A typed view (shape, dtype, strides, offset) of a Storage, made by "
                            "Storage.view(); "
                            "exported zero-copy through DLPack, e.g. numpy.from_dlpack(view). Immutable: usable "
                            "(read, exported) from several threads at once.")
      .def_prop_ro(
          "dtype", [](const py_array_view& v) { return v.dtype; }, "The element type's name.")
      .def_prop_ro(
          "shape", [](const py_array_view& v) { return ints_tuple(v.shape); }, "Extents, one per dimension.")
      .def_prop_ro(
          "ndim", [](const py_array_view& v) { return v.shape.size(); }, "The number of dimensions.")
      .def_prop_ro(
          "nbytes",
          // make_view refused any view whose bytes pass 64 bits
          [](const py_array_view& v) { return element_bytes_of(v.shape, v.strides, v.bits / 8).value().total; },
          "The bytes of its elements (itemsize times their number).")
      .def(
          "__len__",
          [](const py_array_view& v) {
            if (v.shape.empty()) throw nb::type_error("len() of a 0-d ArrayView");
            return v.shape.front();
          },
          "The first extent, as a sequence's length (TypeError for a 0-d view).")
      .def_prop_ro(
          "strides", [](const py_array_view& v) { return ints_tuple(v.strides); }, "Strides in elements.")
      .def_prop_ro(
          "offset", [](const py_array_view& v) { return v.offset; }, "Offset in bytes into the storage.")
      .def_prop_ro(
          "readonly", [](const py_array_view& v) { return v.readonly; },
          "True when it is exported read-only (DLPack's read-only flag).")
      .def_prop_ro(
          "itemsize", [](const py_array_view& v) { return v.bits / 8; }, "Bytes per element.")
      .def_prop_ro(
          "storage", [](const py_array_view& v) { return py_storage{v.handle}; }, "The storage viewed (aliases it).")
      .def("__dlpack__", &export_view, nb::kw_only(), nb::arg("stream").none() = nb::none(),
           nb::arg("max_version").none() = nb::none(), nb::arg("dl_device").none() = nb::none(),
           nb::arg("copy").none() = nb::none(),
           nb::sig("def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None, "
                   "dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> "
                   "typing_extensions.CapsuleType"),
           "A DLPack capsule of this view (array API). `stream`: the "
           "consumer's stream (None: the host reads it "
           "on the host backend, 1 or 2: the default stream, a stream handle, "
           "or -1: no synchronization; 0 is "
           "refused); the consumer's stream waits for the work enqueued on the "
           "current stream, and the memory's release waits for the consumer's stream, so a stream handle "
           "must stay a live stream until the storage's memory is released. A versioned "
           "capsule ('dltensor_versioned') when max_version >= (1, 0); strides "
           "are always set.")
      .def(
          "__array__",
          [](nb::handle self, nb::handle dtype, nb::handle copy) {
            const auto& v = nb::cast<const py_array_view&>(self);
            refuse_numpy_unless_readable(v.handle.get(), true);
            nb::object array = nb::module_::import_("numpy").attr("from_dlpack")(self);
            const std::optional<bool> copy_asked =
                copy.is_none() ? std::nullopt
                               : std::optional<bool>(argument_as<python_bool>(copy, "__array__: copy must be None, True or False").value);
            const bool never_copy = copy_asked == false;
            const bool always_copy = copy_asked == true;
            if (!dtype.is_none()) {
              nb::object converted = array.attr("astype")(dtype, nb::arg("copy") = always_copy);
              if (never_copy && !converted.is(array)) {
                throw nb::value_error("the view's dtype differs from the one asked for: that takes a copy, and copy=False");
              }
              return converted;
            }
            return always_copy ? array.attr("copy")() : array;
          },
          nb::arg("dtype").none() = nb::none(), nb::arg("copy").none() = nb::none(),
          nb::sig("def __array__(self, dtype: object | None = None, copy: bool | None = None) -> object"),
          "numpy.asarray(view) on the host backend: the same memory, no copy (unless `dtype` or `copy` "
          "asks for one). TypeError for device memory, which numpy cannot read (view.storage.read() copies "
          "the storage's bytes to the host; torch.from_dlpack(view) or cupy.from_dlpack(view) takes it in "
          "place), and for pinned host memory (an Allocator with memory='pinned_host'), as "
          "Storage.__array__ says.")
      .def(
          "__dlpack_device__",
          [](const py_array_view& v) {
            const auto d = dl_device_of(v.handle.get().device());
            return std::make_tuple(d.device_type, d.device_id);
          },
          "(device type, device id): (1, 0) for the host backend (kDLCPU), (2, "
          "ordinal) for CUDA.")
      .def(
          "__reduce__",
          [](nb::handle) -> nb::tuple {
            throw nb::type_error(
                "a shoal.ArrayView cannot be pickled: its memory belongs to this process. Send it to another "
                "process with shoal.sharing (Producer.put), which maps the same memory there without a copy; or "
                "pickle a copy of its values (numpy.from_dlpack(view).copy() on the host)");
          },
          "Refused (TypeError): a view's memory belongs to this process; shoal.sharing sends it to another.")
      .def("__repr__", [](const py_array_view& v) {
        const auto tuple = [](const std::vector<std::int64_t>& values) {
          std::string text;
          for (const auto e : values) text += (text.empty() ? "" : ", ") + std::to_string(e);
          return "(" + text + (values.size() == 1 ? ",)" : ")");  // as Python writes a 1-tuple
        };
        // Strides only where they are not the shape's C order: a reversed or
        // broadcast view must not read like a plain one.
        const bool c_order = c_order_strides(v.shape) == std::optional(v.strides);
        return "shoal.ArrayView(dtype=" + v.dtype + ", shape=" + tuple(v.shape) +
               (c_order ? "" : ", strides=" + tuple(v.strides)) + ", offset=" + std::to_string(v.offset) +
               ", device=" + v.handle.get().device().name() + (v.readonly ? ", readonly" : "") + ")";
      });
}

}  // namespace shoal::python
