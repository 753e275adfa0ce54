// shoal.from_dlpack: another library's array (or a DLPack capsule) as a
// shoal storage and view, zero-copy.
//
// The capsule is consumed (renamed "used_..."), so it cannot be consumed
// twice. The producer's memory is adopted by a storage whose owner calls the
// producer's deleter when the storage's last handle is gone, after the
// calling thread's current stream has passed its work (an event waited for
// on the host: the release never runs ahead of shoal's last use there).
// Imported memory counts as shared outside the process: never lazily shared.
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "dlpack_abi.h"
#include "shoal/core/error.h"

namespace shoal::python {

namespace {

/// Holds a consumed DLPack tensor; its destructor hands it back to its
/// producer (no Python objects: it may run on any thread).
class imported_tensor final : public storage::storage_owner {
 public:
  /// `streams`: the keeper of the storages over it (their handles'), held
  /// here too: the streams they were used on outlive the wait below.
  imported_tensor(backend::device& device, dlpack::DLManagedTensorVersioned* versioned, dlpack::DLManagedTensor* legacy,
                  std::shared_ptr<stream_keeper> streams)
      : device_(device), versioned_(versioned), legacy_(legacy), keeper_(std::move(streams)) {}
  imported_tensor(const imported_tensor&) = delete;
  imported_tensor& operator=(const imported_tensor&) = delete;
  /// Waits for the current stream and every recorded stream to pass the
  /// work enqueued on them so far (the GIL released: the last view dropped
  /// from Python must not stop the other threads meanwhile), then hands the
  /// tensor back.
  ~imported_tensor() override {
    detail::waiting_without_gil([&] {
      wait_for(backend::current_stream(device_));
      for (const auto& s : streams_) wait_for(s->ref());
      for (const auto s : used_on_) wait_for(s);
    });
    // A producer's deleter may take the GIL (numpy's does): not once the
    // process exits (gil.h); the tensor goes with the process then.
    (void)detail::python_work([this] {
      if (versioned_ != nullptr && versioned_->deleter != nullptr) versioned_->deleter(versioned_);
      if (legacy_ != nullptr && legacy_->deleter != nullptr) legacy_->deleter(legacy_);
    });
  }
  /// `stream` uses the memory too (Storage.record_stream).
  void add_stream(std::shared_ptr<stream_state> stream) {
    std::lock_guard lock(mutex_);
    streams_.push_back(std::move(stream));
  }

  /// A storage over the tensor is gone: the tensor goes back only after the
  /// streams it was used on (a DLPack consumer's among them) have passed.
  /// Where recording them fails for want of memory, waits for them now.
  void storage_released(std::span<const backend::stream_ref> used_on) noexcept override {
    try {
      std::lock_guard lock(mutex_);
      used_on_.insert(used_on_.end(), used_on.begin(), used_on.end());
    } catch (...) {
      for (const auto s : used_on) wait_for(s);
    }
  }

 private:
  void wait_for(backend::stream_ref stream) noexcept {
    try {
      backend::event passed(device_);
      passed.record(stream);
      passed.synchronize();
    } catch (const std::exception&) {
      // A failed stream cannot be waited for further; the memory goes back.
    }
  }

  backend::device& device_;
  dlpack::DLManagedTensorVersioned* versioned_;
  dlpack::DLManagedTensor* legacy_;
  std::shared_ptr<stream_keeper> keeper_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<stream_state>> streams_;
  std::vector<backend::stream_ref> used_on_;  // from released storages
};

struct dtype_name_entry {
  std::uint8_t code;
  std::uint8_t bits;
  const char* name;
};
constexpr dtype_name_entry dtype_names[] = {
    {dlpack::kDLBool, 8, "bool"},      {dlpack::kDLInt, 8, "int8"},           {dlpack::kDLInt, 16, "int16"},
    {dlpack::kDLInt, 32, "int32"},     {dlpack::kDLInt, 64, "int64"},         {dlpack::kDLUInt, 8, "uint8"},
    {dlpack::kDLUInt, 16, "uint16"},   {dlpack::kDLUInt, 32, "uint32"},       {dlpack::kDLUInt, 64, "uint64"},
    {dlpack::kDLFloat, 16, "float16"}, {dlpack::kDLBfloat, 16, "bfloat16"},   {dlpack::kDLFloat, 32, "float32"},
    {dlpack::kDLFloat, 64, "float64"}, {dlpack::kDLComplex, 64, "complex64"},
};

const char* dtype_name_of(const dlpack::DLDataType& t) {
  if (t.lanes != 1) throw nb::buffer_error("shoal.from_dlpack: vector dtypes (lanes != 1) are not supported");
  for (const auto& e : dtype_names) {
    if (e.code == t.code && e.bits == t.bits) return e.name;
  }
  // Named as numpy names it where the code is one of DLPack's own, so the
  // user sees which of their arrays' types it is.
  const char* kind = t.code == dlpack::kDLInt       ? "int"
                     : t.code == dlpack::kDLUInt    ? "uint"
                     : t.code == dlpack::kDLFloat   ? "float"
                     : t.code == dlpack::kDLBfloat  ? "bfloat"
                     : t.code == dlpack::kDLComplex ? "complex"
                     : t.code == dlpack::kDLBool    ? "bool"
                                                    : nullptr;
  std::string supported;
  for (const auto& e : dtype_names) supported += std::string(supported.empty() ? "" : ", ") + e.name;
  throw nb::buffer_error(("shoal.from_dlpack: dtype " +
                          (kind != nullptr ? kind + std::to_string(t.bits) + " " : std::string()) + "(DLPack code " +
                          std::to_string(t.code) + ", " + std::to_string(t.bits) +
                          " bits) is not supported; shoal takes " + supported)
                             .c_str());
}

}  // namespace

// The `stream` a producer's __dlpack__ is asked for: None on the host
// backend (the consumer is the host), else the current stream.
nb::object consumer_stream(const py_allocator& allocator) {
  backend::device& device = allocator.state->allocator().device();
  if (device.kind() == backend::device_kind::host) return nb::none();
  // The array API names the legacy default stream 1 (0 is ambiguous).
  const auto native = reinterpret_cast<std::uintptr_t>(current_stream_state(device)->ref().native);
  return nb::int_(native == 0 ? 1 : native);
}

py_array_view import_dlpack(const py_allocator& allocator, nb::handle capsule) {
  backend::device& device = allocator.state->allocator().device();
  const bool host = device.kind() == backend::device_kind::host;
  if (!PyCapsule_CheckExact(capsule.ptr())) {
    throw nb::type_error("shoal.from_dlpack: __dlpack__ did not return a capsule");
  }
  const char* name = PyCapsule_GetName(capsule.ptr());
  if (name == nullptr) throw nb::python_error();
  const std::string capsule_name = name;
  if (capsule_name == "used_dltensor" || capsule_name == "used_dltensor_versioned") {
    throw nb::buffer_error(
        "shoal.from_dlpack: this DLPack capsule was consumed "
        "already; ask its producer for a new one");
  }
  const bool versioned = capsule_name == "dltensor_versioned";
  if (!versioned && capsule_name != "dltensor") {
    throw nb::type_error(("shoal.from_dlpack: a capsule named '" + capsule_name + "' is not a DLPack tensor").c_str());
  }
  void* pointer = PyCapsule_GetPointer(capsule.ptr(), name);
  if (pointer == nullptr) throw nb::python_error();
  auto* managed_versioned = versioned ? static_cast<dlpack::DLManagedTensorVersioned*>(pointer) : nullptr;
  auto* managed_legacy = versioned ? nullptr : static_cast<dlpack::DLManagedTensor*>(pointer);
  if (versioned && managed_versioned->version.major != dlpack::major_version) {
    throw nb::buffer_error(("shoal.from_dlpack: DLPack version " + std::to_string(managed_versioned->version.major) +
                            " is not supported (shoal reads version 1)")
                               .c_str());
  }
  const dlpack::DLTensor& t = versioned ? managed_versioned->dl_tensor : managed_legacy->dl_tensor;
  const bool readonly = versioned && (managed_versioned->flags & dlpack::flag_read_only) != 0;

  // Checked before the capsule is consumed: a refused capsule stays its
  // producer's (its destructor releases it).
  const std::int32_t wanted_type = host ? dlpack::kDLCPU : dlpack::kDLCUDA;
  if (t.device.device_type != wanted_type || (!host && t.device.device_id != device.ordinal())) {
    throw nb::buffer_error(("shoal.from_dlpack: the array lives on DLPack device (" +
                            std::to_string(t.device.device_type) + ", " + std::to_string(t.device.device_id) +
                            "), not on the allocator's device " + device.name())
                               .c_str());
  }
  const char* dtype = dtype_name_of(t.dtype);
  if (t.ndim < 0 || t.ndim > 64 || (t.ndim > 0 && t.shape == nullptr)) {
    throw nb::buffer_error("shoal.from_dlpack: the tensor's ndim or shape is malformed");
  }
  const std::vector<std::int64_t> shape(t.shape, t.shape + t.ndim);
  if (std::ranges::any_of(shape, [](std::int64_t extent) { return extent < 0; })) {
    throw nb::buffer_error("shoal.from_dlpack: the tensor has a negative extent");
  }
  if (std::ranges::find(shape, 0) != shape.end()) {
    throw nb::buffer_error("shoal.from_dlpack: arrays without elements are not imported");
  }
  const std::optional<std::vector<std::int64_t>> strides =
      t.strides != nullptr ? std::vector<std::int64_t>(t.strides, t.strides + t.ndim) : c_order_strides(shape);
  // The bytes the elements reach, from the lowest to past the highest.
  const std::int64_t itemsize = t.dtype.bits / 8;
  const std::optional<element_bytes> reach = strides ? element_bytes_of(shape, *strides, itemsize) : std::nullopt;
  std::int64_t span = 0;
  if (!reach || __builtin_sub_overflow(reach->end, reach->lowest, &span)) {
    throw nb::buffer_error("shoal.from_dlpack: the tensor spans more than 2**63 - 1 bytes");
  }
  auto* first = static_cast<std::byte*>(t.data) + t.byte_offset + reach->lowest;
  const std::int64_t offset = -reach->lowest;

  // Consumed from here on: the storage's owner releases it.
  if (PyCapsule_SetName(capsule.ptr(), versioned ? "used_dltensor_versioned" : "used_dltensor") != 0) {
    throw nb::python_error();
  }
  // The streams it is used on go with its handles and the tensor (not kept for the allocator's
  // life: a stream per request, each importing an array, would pile up).
  auto streams = stream_keeper::for_handles();
  auto owner = std::make_shared<imported_tensor>(device, managed_versioned, managed_legacy, streams);
  storage::storage adopted =
      storage::storage::adopt(allocator.state->allocator(), first, static_cast<std::size_t>(span), std::move(owner));
  const auto access = readonly ? storage_access::read_only : storage_access::read_write;
  return make_view(py_storage{storage_handle(std::move(adopted), allocator.state, std::move(streams), nullptr, access)},
                   nb::str(dtype), shape, *strides, offset, readonly);
}

bool record_stream_on_import(const storage::storage& storage, const std::shared_ptr<stream_state>& stream) {
  auto* imported = dynamic_cast<imported_tensor*>(storage.owner().get());
  if (imported == nullptr) return false;
  imported->add_stream(stream);
  return true;
}

void register_dlpack_import(nb::module_& m) {
  // The producer's __dlpack__ is called in Python (shoal.from_dlpack): run
  // from here, its Python code could end a daemon thread at exit inside
  // this binding (gil.h).
  m.def("_from_dlpack", &import_dlpack, nb::arg("allocator"), nb::arg("capsule"),
        "An ArrayView over a DLPack capsule's array, zero-copy (the capsule is consumed).");
  m.attr("_capsule_type") = nb::borrow(reinterpret_cast<PyObject*>(&PyCapsule_Type));
  m.def("_dlpack_consumer_stream", &consumer_stream, nb::arg("allocator"),
        nb::sig("def _dlpack_consumer_stream(allocator: Allocator) -> int | None"),
        "The stream argument for a producer's __dlpack__: None on the host backend, else the current stream.");
}

}  // namespace shoal::python
