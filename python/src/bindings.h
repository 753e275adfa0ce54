// What the binding files share: the C++ state behind the Python objects.
//
// Python objects hold these states through shared_ptr, and so do DLPack
// capsules and arrays handed to other libraries, whose deleters may run on
// any thread without the GIL: nothing here holds a Python object.
//
// Lifetimes: a storage keeps every stream it was used on alive until its
// release (which waits for each, storage.h): its handles share a
// stream_keeper with the storages that share its memory. A storage
// received from another process is one too: its stream keeper holds the
// receive stream as well (sharing.cpp, received_tuple). A storage sent to
// another process or of a transfer batch (its keeper is the batch's, shared
// with its storages' handles) keeps them the same way: a release that comes
// after every handle (the other process's, a part's block freed with its
// group's last storage) finds its streams held by the allocator, whose
// record_stream holds each until the block's free. A storage adopted with
// the by_allocator keeper (lending) has its streams kept by the allocator
// for the allocator's life, as are transfer engines' streams. A stream per
// request thus goes when its storages go, and the caching allocator passes
// its cache to the next new stream. A storage keeps its allocator alive.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/device.h"
#include "shoal/backend/stream.h"
#include "shoal/channel/channel.h"
#include "shoal/storage/storage.h"

namespace shoal::python {

namespace nb = nanobind;

/// A Python int, or anything with __index__ (numpy's integers), taken whole
/// for whole_number_of to check by name: nanobind's own conversion to a C++
/// integer answers a negative or huge one with "incompatible function
/// arguments", naming no argument.
struct python_int {
  nb::object value;
};

/// A bool, or numpy's bool (which nanobind's own caster refuses).
struct python_bool {
  bool value = false;
};

/// Whether `value` is numpy's bool scalar: numpy.bool (numpy 2) or
/// numpy.bool_ (numpy 1), known by its type's name (numpy need not be loaded).
inline bool is_numpy_bool(nb::handle value) noexcept {
  const std::string_view type_name = Py_TYPE(value.ptr())->tp_name;
  return type_name == "numpy.bool" || type_name == "numpy.bool_";
}

/// A socket address as Python gives it: a str, or an os.PathLike whose path
/// is a str (pathlib.Path); a bytes path is no address.
struct address_text {
  std::string text;
};

/// A stream of a device: one this package created (and owns), the device's
/// default stream, or one another library made and keeps alive.
class stream_state {
 public:
  static std::shared_ptr<stream_state> create(backend::device& device);
  static std::shared_ptr<stream_state> default_of(backend::device& device);
  /// A stream another library made (a native handle), which it keeps alive.
  static std::shared_ptr<stream_state> adopt(backend::device& device, void* native);
  /// A stream this package created is destroyed without the GIL: the host
  /// backend's runs the work still queued on it first, which may take long.
  ~stream_state();
  stream_state(const stream_state&) = delete;
  stream_state& operator=(const stream_state&) = delete;
  [[nodiscard]] backend::device& device() const noexcept { return *device_; }
  [[nodiscard]] backend::stream_ref ref() const noexcept { return ref_; }

 private:
  stream_state(backend::device& device, std::unique_ptr<backend::stream> owned);
  stream_state(backend::device& device, backend::stream_ref adopted);
  backend::device* device_;
  std::unique_ptr<backend::stream> owned_;
  backend::stream_ref ref_;
};

/// The calling thread's current stream on `device`: the innermost
/// `with shoal.stream(s)` scope of this thread for that device, else its
/// default stream.
std::shared_ptr<stream_state> current_stream_state(backend::device& device);
/// The stream of this thread's innermost `with shoal.stream(s)` scope that is
/// current on `device`, or null outside every such scope.
std::shared_ptr<stream_state> scoped_stream_state(backend::device& device);

/// A caching allocator and the streams it must outlive. Thread-safe.
class allocator_state {
 public:
  allocator_state(backend::device& device, const alloc::allocator_config& config);
  /// Destroys the allocator first (it waits for pending frees), then the
  /// streams it used, without the GIL; then the observers, with it.
  ~allocator_state();
  [[nodiscard]] alloc::caching_allocator& allocator() noexcept { return *allocator_; }
  /// Keeps `stream` alive as long as the allocator.
  void keep(const std::shared_ptr<stream_state>& stream);
  /// A stream for a transfer engine's copies: one a closed engine gave
  /// back, else a new one kept as long as the allocator. Engines that come
  /// and go reuse their streams (and the blocks cached on them) rather
  /// than pile them up; a stream is only a queue, so a storage still
  /// pending on it frees in order after the next engine's work.
  std::shared_ptr<stream_state> take_copy_stream();
  void give_back_copy_stream(std::shared_ptr<stream_state> stream) noexcept;
  /// The callables given to add_oom_observer, as each registration holds
  /// them, with the registration's id: remove_oom_observer sets one to None
  /// (a call already under way on another thread then calls nothing), ends
  /// its registration and lets it go, as does the garbage collector breaking
  /// a cycle through one (allocator.cpp: seen while one Allocator object is
  /// this state's only holder). Touched with the GIL held.
  struct oom_observer {
    std::shared_ptr<nb::object> callable;
    std::uint64_t registration = 0;
  };
  std::vector<oom_observer> oom_observers;

 private:
  std::mutex mutex_;
  std::set<std::shared_ptr<stream_state>> streams_;
  std::vector<std::shared_ptr<stream_state>> idle_copy_streams_;  // kept in streams_ too
  std::unique_ptr<alloc::caching_allocator> allocator_;
};

/// The streams storages sharing one memory (a storage, its handles and
/// views, its lazy clones) were used on from Python, kept alive for their
/// releases: each goes with the last handle of them, after their memory's
/// release has used it (a release after that, the other process's of a
/// storage sent, finds them held by the allocator's record_stream until the
/// block's free). The by_allocator keeper keeps them for the allocator's
/// life instead. Thread-safe.
class stream_keeper {
 public:
  /// Kept by the storages' handles.
  [[nodiscard]] static std::shared_ptr<stream_keeper> for_handles() {
    return std::make_shared<stream_keeper>(false);
  }
  /// Kept by the allocator from the start: for storages the library may
  /// hold past every handle (one shared keeper, nothing in it).
  [[nodiscard]] static std::shared_ptr<stream_keeper> by_allocator();
  explicit stream_keeper(bool by_allocator) : by_allocator_(by_allocator) {}
  stream_keeper(const stream_keeper&) = delete;
  stream_keeper& operator=(const stream_keeper&) = delete;
  /// Keeps `stream` alive (the default stream needs nothing).
  void keep(const std::shared_ptr<stream_state>& stream, allocator_state& allocator);

 private:
  const bool by_allocator_;  // fixed when made: nothing hands a keeper's streams on later
  std::mutex mutex_;
  std::vector<std::shared_ptr<stream_state>> streams_;  // guarded by mutex_; always empty when by_allocator_
};

/// Whether a storage's memory may be written from Python: read-only memory
/// (a shared region, mapped read-only; an array imported read-only) is
/// refused every write, where a write through the mapping would fault.
enum class storage_access { read_write, read_only };

/// One handle to a storage and the allocator it came from. The storage's
/// release waits for the streams it was used on (storage.h), each kept alive
/// by `streams` (keep_stream) when it was used. `keep_alive` (say, the
/// sharing context a storage was received through) outlives the storage too.
class storage_handle {
 public:
  /// A storage whose streams the allocator keeps (the library may hold it
  /// past every handle).
  storage_handle(storage::storage storage, std::shared_ptr<allocator_state> allocator,
                 std::shared_ptr<const void> keep_alive = nullptr, storage_access access = storage_access::read_write)
      : storage_handle(std::move(storage), std::move(allocator), stream_keeper::by_allocator(), std::move(keep_alive),
                       access) {}
  /// A storage whose streams `streams` keeps: a new storage's own keeper
  /// (stream_keeper::for_handles), or the keeper of the storage it shares
  /// memory with.
  storage_handle(storage::storage storage, std::shared_ptr<allocator_state> allocator,
                 std::shared_ptr<stream_keeper> streams, std::shared_ptr<const void> keep_alive = nullptr,
                 storage_access access = storage_access::read_write)
      : allocator_(std::move(allocator)),
        streams_(std::move(streams)),
        keep_alive_(std::move(keep_alive)),
        storage_(std::move(storage)),
        read_only_(access == storage_access::read_only) {}
  storage_handle(const storage_handle&) = default;
  /// The handle replaced goes as a dropped one does (the destructor: its
  /// storage released before its streams), not member by member.
  storage_handle& operator=(storage_handle other) noexcept {
    std::swap(allocator_, other.allocator_);
    std::swap(streams_, other.streams_);
    std::swap(keep_alive_, other.keep_alive_);
    std::swap(storage_, other.storage_);
    std::swap(read_only_, other.read_only_);
    return *this;
  }
  /// The last handle dropped inside a `shoal.stream` scope: the memory's free
  /// waits for the work enqueued on the scope's stream too, as a free on the
  /// current stream does in C++ (recorded as a use). A copy dropped while
  /// other handles live records nothing.
  ~storage_handle();
  /// The storage (its handle operations, mutable_data included, are
  /// thread-safe and change no handle, hence usable through a const handle).
  [[nodiscard]] storage::storage& get() const noexcept { return storage_; }
  [[nodiscard]] const std::shared_ptr<allocator_state>& allocator() const noexcept { return allocator_; }
  /// The keeper of the streams this storage was used on (shared with the
  /// storages sharing its memory).
  [[nodiscard]] const std::shared_ptr<stream_keeper>& streams() const noexcept { return streams_; }
  /// Keeps `stream`, about to be used on the storage, alive for its release.
  void keep_stream(const std::shared_ptr<stream_state>& stream) const { streams_->keep(stream, *allocator_); }
  [[nodiscard]] bool read_only() const noexcept { return read_only_; }
  /// Throws invalid_argument naming `what` when the memory is read-only.
  void require_writable(const char* what) const;

 private:
  // Declared first so that it is destroyed last: the storage frees into it.
  std::shared_ptr<allocator_state> allocator_;
  // Before the storage, so destroyed after it: its release uses the streams.
  std::shared_ptr<stream_keeper> streams_;
  std::shared_ptr<const void> keep_alive_;
  mutable storage::storage storage_;
  bool read_only_;
};

/// Python `Stream`; `stream` may be None for the current stream of `device`.
struct py_stream {
  std::shared_ptr<stream_state> state;
};
struct py_allocator {
  std::shared_ptr<allocator_state> state;
};
struct py_storage {
  storage_handle handle;
};

/// A typed view of a storage: what DLPack exports. Strides in elements,
/// offset in bytes; checked to lie inside the storage when made.
struct py_array_view {
  storage_handle handle;
  std::string dtype;
  std::uint8_t code;
  std::uint8_t bits;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::int64_t offset;
  bool readonly;
};

/// The C-order strides (in elements) of `shape`; nullopt when one passes 64 bits.
std::optional<std::vector<std::int64_t>> c_order_strides(std::span<const std::int64_t> shape);
/// Where an array's elements lie, in bytes from its first element's:
/// [lowest, end), lowest <= 0 < end; and `total`, the bytes of its elements
/// (their number times the item size). All 0 when an extent is 0.
struct element_bytes {
  std::int64_t lowest = 0;
  std::int64_t end = 0;
  std::int64_t total = 0;
};
/// element_bytes of `shape` with `strides` (in elements, one per extent);
/// nullopt when any of them, or a step toward them, passes 64 bits.
std::optional<element_bytes> element_bytes_of(std::span<const std::int64_t> shape,
                                              std::span<const std::int64_t> strides, std::int64_t itemsize);

/// Storage.view(dtype, shape=None, strides=None, offset=0, readonly=False).
py_array_view make_view(const py_storage& storage, nb::handle dtype, std::optional<std::vector<std::int64_t>> shape,
                        std::optional<std::vector<std::int64_t>> strides, std::int64_t offset, bool readonly);

/// numpy.asarray of a storage (`of_view` false) or a view of it: returns for
/// memory numpy can take in place (the host backend's own), else raises a
/// TypeError saying what the memory is (device memory of cuda:0, pinned host
/// memory) and how to copy it to the host or take it without copying.
void refuse_numpy_unless_readable(const storage::storage& storage, bool of_view);

/// The stream a Python `stream=` argument names: the given Stream, or the
/// current stream of `device` when None.
std::shared_ptr<stream_state> stream_or_current(const py_stream* stream, backend::device& device);

/// The settings of an allocator made from Python: `defaults` (SHOAL_ALLOC_CONF
/// text), then SHOAL_ALLOC_CONF (when `use_environment`), then `conf`, then
/// keyword `settings`; a later setting of a key wins. Each keyword is a key of
/// SHOAL_ALLOC_CONF with a bool, number or string value.
alloc::allocator_config config_from_python(const std::optional<std::string>& conf, bool use_environment,
                                           const nb::kwargs& settings, const std::string& defaults = {});

/// Allocator.allocate: a storage of `nbytes` for use on `stream` (default:
/// the current stream).
py_storage allocate_storage(const py_allocator& allocator, const python_int& nbytes, const py_stream* stream);

/// Storage.record_stream for memory imported through from_dlpack: its
/// release to the producer also waits for `stream`. False for other memory.
bool record_stream_on_import(const storage::storage& storage, const std::shared_ptr<stream_state>& stream);

/// A timeout in seconds as milliseconds, rounded up; None is no deadline.
/// invalid_argument (naming `who` and the argument, `what`) for a negative
/// or non-finite value. Past a century it is a century: a deadline that far
/// stays within the clock's range.
std::optional<std::chrono::milliseconds> deadline_of(std::optional<double> seconds, const char* who,
                                                     const char* what = "timeout");

/// A channel address from its text: a path, or "@name" for an abstract name.
channel::channel_address address_of(const std::string& text);
std::string text_of(const channel::channel_address& address);
/// `value` as a size, count or id, from 0 (1 when `positive`) to `most`:
/// anything else is invalid_argument naming `who` and the argument (`what`).
std::uint64_t whole_number_of(const python_int& value, const char* who, const char* what,
                              std::uint64_t most = std::numeric_limits<std::int64_t>::max(), bool positive = false);
/// `value` as a whole number when it is an int or has __index__ (numpy's
/// integers); nullopt for anything else: a bool, or an object whose
/// __index__ refuses (a numpy array of more than one value).
std::optional<python_int> index_of(nb::handle value);
/// The dtype kind ('b', 'i', 'f', ...) of a numpy scalar or 0-d array (or
/// anything shaped like one); 0 for anything else.
char numpy_scalar_kind(nb::handle value);
/// `value` as a signed 64-bit number (an offset or stride the caller checks
/// further): anything past that is invalid_argument naming `who` and `what`;
/// a bool is TypeError, as for whole_number_of.
std::int64_t signed_number_of(const python_int& value, const char* who, const char* what);
/// The calling user plus `allowed_uids`, each refused by name (`who`) unless
/// a uid (0 .. 2^32 - 2).
channel::access_policy policy_of(const std::vector<python_int>& allowed_uids, const char* who);

/// Keeps a Python object alive from C++; the last owner may be any thread
/// (it takes the GIL to let go).
std::shared_ptr<const void> hold(nb::handle object);

void register_errors(nb::module_& m);
/// Raises CancelledError(message) from a wait its caller's cancel event
/// ended (the GIL held): sets it and throws nb::python_error.
[[noreturn]] void raise_cancelled(const std::string& message);
void register_streams(nb::module_& m);
void register_allocator(nb::module_& m);
void register_storages(nb::module_& m);
void register_dlpack(nb::module_& m);
void register_dlpack_import(nb::module_& m);
void register_sharing(nb::module_& m);
void register_torch_api(nb::module_& m);
void register_transfer(nb::module_& m);
void register_grouped_load(nb::module_& m);
void register_lending(nb::module_& m);
void register_segment_sources(nb::module_& m);

}  // namespace shoal::python

namespace nanobind::detail {

template <>
struct type_caster<shoal::python::python_int> {
  NB_TYPE_CASTER(shoal::python::python_int, const_name("int"))
  // The flags' type differs between nanobind releases.
  template <class Flags>
  bool from_python(handle src, Flags flags, cleanup_list*) noexcept {
    if (PyLong_Check(src.ptr())) {
      value.value = borrow(src);
      return true;
    }
    if ((flags & static_cast<Flags>(cast_flags::convert)) == 0 || PyIndex_Check(src.ptr()) == 0) return false;
    PyObject* whole = PyNumber_Index(src.ptr());
    if (whole == nullptr) {
      PyErr_Clear();
      return false;
    }
    value.value = steal(whole);
    return true;
  }
  static handle from_cpp(const shoal::python::python_int& v, rv_policy, cleanup_list*) noexcept {
    return v.value.inc_ref();
  }
};

template <>
struct type_caster<shoal::python::python_bool> {
  NB_TYPE_CASTER(shoal::python::python_bool, const_name("bool"))
  template <class Flags>
  bool from_python(handle src, Flags flags, cleanup_list*) noexcept {
    if (src.ptr() == Py_True || src.ptr() == Py_False) {
      value.value = src.ptr() == Py_True;
      return true;
    }
    const bool converting = (flags & static_cast<Flags>(cast_flags::convert)) != 0;
    if (!converting || !shoal::python::is_numpy_bool(src)) return false;
    const int truth = PyObject_IsTrue(src.ptr());
    if (truth < 0) {
      PyErr_Clear();
      return false;
    }
    value.value = truth != 0;
    return true;
  }
  static handle from_cpp(const shoal::python::python_bool& v, rv_policy, cleanup_list*) noexcept {
    return handle(v.value ? Py_True : Py_False).inc_ref();
  }
};

template <>
struct type_caster<shoal::python::address_text> {
  NB_TYPE_CASTER(shoal::python::address_text, const_name("str | os.PathLike[str]"))
  template <class Flags>
  bool from_python(handle src, Flags flags, cleanup_list*) noexcept {
    object text;
    if (PyUnicode_Check(src.ptr())) {
      text = borrow(src);
    } else if ((flags & static_cast<Flags>(cast_flags::convert)) != 0 &&
               PyObject_HasAttrString(src.ptr(), "__fspath__") != 0) {
      text = steal(PyOS_FSPath(src.ptr()));
      if (!text.is_valid() || !PyUnicode_Check(text.ptr())) {
        PyErr_Clear();
        return false;
      }
    } else {
      return false;
    }
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(text.ptr(), &size);
    if (utf8 == nullptr) {
      PyErr_Clear();
      return false;
    }
    value.text.assign(utf8, static_cast<std::size_t>(size));
    return true;
  }
  static handle from_cpp(const shoal::python::address_text& v, rv_policy, cleanup_list*) noexcept {
    return PyUnicode_FromStringAndSize(v.text.data(), static_cast<Py_ssize_t>(v.text.size()));
  }
};

}  // namespace nanobind::detail
