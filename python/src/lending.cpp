// Python bindings of the lending layer: Lender (the memory daemon's core,
// in-process) and Borrower, whose regions come back as Storages (adopted
// memory: views, DLPack and copies work as for any storage; the region is
// given back once the storage and every view of it are gone). Shared
// regions come back as Storages too, mapped read-only; shoal/lending.py
// wraps them so that only read-only views of them are made.
//
// GIL: every call that waits on the other side releases it, and so does every
// call that takes a lock another thread holds meanwhile (the lender's, which
// its serving thread takes; a storage's, for the region behind it).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "closable.h"
#include "dtype_names.h"
#include "gil.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/layout.h"
#include "shoal/lending/lender.h"

namespace shoal::python {

namespace {

/// The longest wait for memory a borrow may ask (the protocol's 32-bit milliseconds).
constexpr double max_wait_seconds = 4294967.295;

/// `seconds` of the argument `what` of `who` as a duration; refused unless
/// finite and > 0. One past a century is a century, as sharing's waits take
/// it (deadline_of): "forever" written as sys.maxsize must not overflow.
std::chrono::milliseconds timeout_of(double seconds, const char* who, const char* what = "timeout") {
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    throw invalid_argument(std::string(who) + ": " + what + " must be a finite number of seconds > 0");
  }
  constexpr double century = 100.0 * 365.25 * 24 * 3600;
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::min(seconds, century) * 1000.0 + 0.5));
}

/// A borrowed region behind a storage: given back (unmapped, then the lender
/// told) once the storage's last handle is gone and the streams it was used
/// on have passed their work.
class region_owner final : public storage::storage_owner {
 public:
  region_owner(backend::device& device, lending::borrowed_region region)
      : device_(device), region_(std::move(region)) {}
  [[nodiscard]] std::uint64_t id() const noexcept { return region_.id(); }
  [[nodiscard]] const lending::borrowed_region& region() const noexcept { return region_; }
  /// Takes the region out (to publish it); the owner then gives nothing back.
  [[nodiscard]] lending::borrowed_region take() noexcept { return std::move(region_); }
  // Both without the GIL: the give back may wait (up to a second) for the
  // borrower's connection, which a borrow waiting for memory holds while it
  // takes the GIL to check for signals; the streams' wait is a destructor's
  // device wait (waiting_without_gil: kept inside python_work).
  ~region_owner() override {
    detail::without_gil([&] { region_ = {}; });
  }
  void storage_released(std::span<const backend::stream_ref> used_on) noexcept override {
    detail::waiting_without_gil([&] {
      for (auto stream : used_on) {
        try {
          device_.synchronize(stream);
        } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream runs nothing more on the region
        }
      }
    });
  }

 private:
  backend::device& device_;
  lending::borrowed_region region_;  // its destructor gives the region back
};

/// A flag another thread sets, read without the GIL: what a revocation
/// watcher stops by (shoal.lending._StopFlag).
struct stop_flag {
  std::atomic<bool> set{false};
};

/// A cancel event: None, a stop_flag (read without the GIL), or anything
/// with is_set(), read as Python reads a truth value (any object, not only a
/// bool; what it raises, the call raises). Made and called with the GIL held,
/// but for set_without_gil().
class cancel_event {
 public:
  explicit cancel_event(const nb::object& event) {
    if (event.is_none()) return;
    if (nb::isinstance<stop_flag>(event)) {
      flag_ = nb::cast<const stop_flag*>(event);  // the caller's argument keeps it alive
    } else {
      is_set_ = event.attr("is_set");
    }
  }
  [[nodiscard]] bool given() const noexcept { return flag_ != nullptr || is_set_.is_valid(); }
  [[nodiscard]] bool is_flag() const noexcept { return flag_ != nullptr; }
  [[nodiscard]] bool set_without_gil() const noexcept { return flag_ != nullptr && flag_->set.load(); }
  /// Whether it is set. A Python is_set() goes through the exit gate: once
  /// the interpreter exits, a thread running Python code may be ended
  /// mid-call (and the unwinding through this frame would abort the
  /// process), so it is not asked then.
  bool operator()() const {
    if (flag_ != nullptr) return flag_->set.load();
    if (!is_set_.is_valid()) return false;
    int truth = 0;
    const bool asked = detail::python_work([&] {
      const nb::object set = is_set_();
      truth = PyObject_IsTrue(set.ptr());
      if (truth < 0) throw nb::python_error();
    });
    return asked && truth != 0;
  }

 private:
  const stop_flag* flag_ = nullptr;
  nb::object is_set_;
};

/// A layout entry as Python sees it: (name, offset, nbytes, dtype, shape).
using py_entry = std::tuple<std::string, std::uint64_t, std::uint64_t, std::string, std::vector<std::uint64_t>>;
/// One as Python gives it: its dtype spelled as a view's may be (dtype_names.h:
/// 'float32', 'f4', numpy.float32, numpy.dtype('float16')).
using py_entry_given = std::tuple<std::string, std::uint64_t, std::uint64_t, nb::object, std::vector<std::uint64_t>>;

/// The dtypes a layout takes, by name.
std::string layout_dtypes() {
  std::string known;
  for (int code = 1;; ++code) {
    const auto type = static_cast<lending::dtype>(code);
    if (lending::itemsize(type) == 0) break;
    known += (known.empty() ? "" : ", ") + std::string(lending::to_string(type));
  }
  return known + ", or numpy's spellings of them ('f4', '<i8', '?', numpy.float32, numpy.dtype('float16'))";
}

/// The layout of `entries`, each dtype read as a view's and named as shoal
/// names it; one that is no dtype of a layout is invalid_argument naming
/// `who`. Needs the GIL.
lending::region_layout layout_of(const std::vector<py_entry_given>& entries, const char* who) {
  lending::region_layout layout;
  for (const auto& [name, offset, bytes, type, shape] : entries) {
    const dtype_reading read = read_dtype(type);
    const auto known = read.entry == nullptr ? std::nullopt : lending::dtype_named(read.entry->name);
    if (!known) {
      const std::string shown =
          read.shown.empty() ? "an object of type " + nb::cast<std::string>(nb::str(type.type().attr("__name__")))
                            : read.shown;
      throw invalid_argument(std::string(who) + ": layout entry '" + name + "': " + shown +
                             (read.meaning.empty() ? "" : " (" + read.meaning + ")") +
                             (read.swapped ? " is not in this machine's byte order; a layout's dtypes are native: "
                                           : " is not a dtype shoal knows for a layout: ") +
                             "layouts take " + layout_dtypes());
    }
    layout.entries.push_back({name, offset, bytes, *known, shape});
  }
  return layout;
}

std::vector<py_entry> entries_of(const lending::region_layout& layout) {
  std::vector<py_entry> out;
  for (const auto& e : layout.entries) out.emplace_back(e.name, e.offset, e.bytes, lending::to_string(e.type), e.shape);
  return out;
}

lending::content_hash hash_of(const nb::bytes& bytes) {
  lending::content_hash hash{};
  if (bytes.size() != hash.size()) {
    throw invalid_argument("a content hash is " + std::to_string(hash.size()) + " bytes (SHA-256); got " +
                           std::to_string(bytes.size()));
  }
  std::memcpy(hash.data(), bytes.c_str(), hash.size());
  return hash;
}

nb::bytes bytes_of(const lending::content_hash& hash) {
  return nb::bytes(reinterpret_cast<const char*>(hash.data()), hash.size());
}

/// The owner of `storage`'s memory — with the GIL released: owner() takes the storage's lock,
/// which a thread materializing or cloning it holds across device calls with the GIL let go
/// — and the region behind it (nullptr when it is none). The owner keeps the region alive.
struct region_of_storage {
  std::shared_ptr<storage::storage_owner> owner;
  region_owner* region = nullptr;
};
region_of_storage region_behind(const py_storage& storage) {
  const storage::storage held = storage.handle.get();  // with the GIL: _publish may assign the handle
  if (!held.valid()) return {};
  region_of_storage found;
  {
    released_gil release;
    found.owner = held.owner();
  }
  found.region = dynamic_cast<region_owner*>(found.owner.get());
  return found;
}

py_storage storage_of(const py_allocator& allocator, lending::borrowed_region region) {
  auto& device = allocator.state->allocator().device();
  void* data = region.data();
  const std::size_t size = region.size();
  // Shared regions are mapped read-only, for their writer too once published.
  const auto access = region.mode() == lending::region_mode::shared ? storage_access::read_only
                                                                     : storage_access::read_write;
  auto owner = std::make_shared<region_owner>(device, std::move(region));
  return py_storage{
      storage_handle(storage::storage::adopt(allocator.state->allocator(), data, size, std::move(owner)),
                     allocator.state, nullptr, access)};
}

struct py_borrower {
  closable<lending::borrower> borrower;
};

struct py_lender {
  closable<lending::lender> lender;
};

nb::dict status_dict(const lending::lender_status& s) {
  nb::dict d;
  d["capacity_bytes"] = s.capacity_bytes;
  d["lent_bytes"] = s.lent_bytes;
  d["borrowers"] = s.borrowers;
  d["observers"] = s.observers;
  d["connections"] = s.connections;
  d["requests"] = s.requests;
  d["refusals"] = s.refusals;
  d["given_back"] = s.given_back;
  d["reclaimed"] = s.reclaimed;
  d["closed_for_errors"] = s.connections_closed_for_errors;
  d["revocations"] = s.revocations;
  d["revocations_missed"] = s.revocations_missed;
  d["published"] = s.published;
  d["spare_bytes"] = s.spare_bytes;
  d["prepared_bytes"] = s.prepared_bytes;
  d["prepared_chunks"] = s.prepared_chunks;
  d["prepared_used"] = s.prepared_used;
  d["chunks_made"] = s.chunks_made;
  d["reuses"] = s.reuses;
  d["kept_mappings_used"] = s.kept_mappings_used;
  d["forgets"] = s.forgets;
  nb::list spares;
  for (const auto& spare : s.spares) {
    nb::dict one;
    one["memory"] = spare.memory;
    one["bytes"] = spare.bytes;
    one["uid"] = spare.uid;
    one["kept_by"] = spare.kept_by;
    one["age_seconds"] = std::chrono::duration<double>(spare.age).count();
    spares.append(one);
  }
  d["spares"] = spares;
  nb::list regions;
  for (const auto& r : s.regions) {
    nb::dict region;
    region["id"] = r.id;
    region["memory"] = r.memory;
    region["bytes"] = r.bytes;
    region["purpose"] = r.purpose;
    region["state"] = lending::to_string(r.state);
    region["mode"] = lending::to_string(r.mode);
    nb::list holders;
    for (const auto& h : r.holders) {
      nb::dict holder;
      holder["pid"] = h.process.pid;
      holder["uid"] = h.uid;
      holder["state"] = lending::to_string(h.state);
      holders.append(holder);
    }
    region["holders"] = holders;
    region["pid"] = r.borrower.pid;
    region["uid"] = r.uid;
    region["age_seconds"] = std::chrono::duration<double>(r.age).count();
    regions.append(region);
  }
  d["regions"] = regions;
  d["waits"] = s.waits;
  d["waits_expired"] = s.waits_expired;
  d["preemptions"] = s.preemptions;
  nb::list waiting;
  for (const auto& w : s.waiting) {
    nb::dict one;
    one["bytes"] = w.bytes;
    one["purpose"] = w.purpose;
    one["pid"] = w.borrower.pid;
    one["uid"] = w.uid;
    one["waited_seconds"] = std::chrono::duration<double>(w.waited).count();
    one["left_seconds"] = std::chrono::duration<double>(w.left).count();
    waiting.append(one);
  }
  d["waiting"] = waiting;
  return d;
}

}  // namespace

void register_lending(nb::module_& m) {
  nb::class_<py_lender>(m, "Lender",
                        "Lends regions of this process's device memory to borrower processes over a UNIX socket "
                        "(the memory daemon's core, serving on its own thread). Usable from several threads at "
                        "once: status(), metrics() and revoke() answer at once, close() from any thread.")
      .def(
          "__init__",
          [](py_lender* self, const address_text& address, backend::device* device, std::size_t capacity_bytes,
             std::size_t quota_bytes, std::size_t max_borrowers, std::size_t max_regions_per_borrower,
             double peer_timeout, const std::vector<python_int>& allowed_uids, const std::string& reuse,
             const std::vector<std::size_t>& prepared_chunks, double max_wait, std::optional<double> preempt_after,
             double preempt_deadline, std::size_t max_observers, std::size_t max_connections_per_uid) {
            if (reuse != "same_uid" && reuse != "never") {
              throw invalid_argument("shoal.lending.Lender: reuse='" + reuse + "' is not 'same_uid' or 'never'");
            }
            lending::lender_config config;
            config.capacity_bytes = capacity_bytes;
            config.quota_bytes = quota_bytes;
            config.max_borrowers = max_borrowers;
            config.max_observers = max_observers;
            config.max_connections_per_uid = max_connections_per_uid;
            config.max_regions_per_borrower = max_regions_per_borrower;
            config.peer_timeout = timeout_of(peer_timeout, "shoal.lending.Lender", "peer_timeout");
            if (!(max_wait <= max_wait_seconds)) {
              throw invalid_argument(
                  "shoal.lending.Lender: max_wait must be a finite number of seconds from 0.001 to about 49 days");
            }
            config.max_wait = timeout_of(max_wait, "shoal.lending.Lender", "max_wait");
            if (preempt_after) {
              if (!(*preempt_after >= 0 && *preempt_after <= max_wait_seconds)) {
                throw invalid_argument(
                    "shoal.lending.Lender: preempt_after must be None or a finite number of seconds from 0 to about 49 "
                    "days");
              }
              config.preempt_after = std::chrono::milliseconds(std::llround(*preempt_after * 1000.0));
            }
            if (!(preempt_deadline <= max_wait_seconds)) {
              throw invalid_argument(
                  "shoal.lending.Lender: preempt_deadline must be a finite number of seconds from 0.001 to about 49 "
                  "days");
            }
            config.preempt_deadline = timeout_of(preempt_deadline, "shoal.lending.Lender", "preempt_deadline");
            config.policy = policy_of(allowed_uids, "shoal.lending.Lender");
            config.reuse = reuse == "never" ? lending::reuse_policy::never : lending::reuse_policy::same_uid;
            config.prepared_chunks = prepared_chunks;
            auto& d = device != nullptr ? *device : backend::default_device();
            const auto a = address_of(address.text);
            std::unique_ptr<lending::lender> lender;
            {
              released_gil release;  // makes the prepared chunks on the device, binds the socket
              lender = std::make_unique<lending::lender>(d, a, config);
            }
            new (self) py_lender{{"shoal.lending.Lender", closed_error::invalid_argument, std::move(lender)}};
          },
          nb::arg("address"), nb::arg("device").none() = nb::none(), nb::arg("capacity_bytes") = std::size_t{1} << 30,
          nb::arg("quota_bytes") = std::size_t{1} << 30, nb::arg("max_borrowers") = 64,
          nb::arg("max_regions_per_borrower") = 1024, nb::arg("peer_timeout") = 1.0,
          nb::arg("allowed_uids") = std::vector<int>{}, nb::arg("reuse") = "same_uid",
          nb::arg("prepared_chunks") = std::vector<std::size_t>{}, nb::arg("max_wait") = 300.0,
          nb::arg("preempt_after").none() = nb::none(), nb::arg("preempt_deadline") = 10.0,
          nb::arg("max_observers") = lending::lender_config{}.max_observers,
          nb::arg("max_connections_per_uid") = lending::lender_config{}.max_connections_per_uid,
          "Listens at ``address`` (a path in a 0700 directory, or '@name'); lends at most ``capacity_bytes`` "
          "in all and ``quota_bytes`` per borrower. ``reuse``: 'same_uid' lends given-back memory again to "
          "borrowers of the same uid (borrowers keep their mappings); 'never' makes every region fresh memory. "
          "``prepared_chunks``: sizes in bytes of chunks made now (each rounded up to the device's granularity, "
          "their sum at most ``capacity_bytes``); a region of one of those sizes is lent from one with no device "
          "call at borrow time (``shoal daemon --prepare``). ``max_wait``: the longest a borrow may wait for memory; "
          "``preempt_after``: seconds the borrow first in line waits before the lender revokes other borrowers' "
          "regions for it (None: never), each to be given back within ``preempt_deadline`` seconds (see "
          "shoal.lending.Lender). ``max_connections_per_uid``: connections at once of any one uid other than this "
          "process's and root (0: no cap). Raises the device's error (``OutOfMemoryError``) when they cannot be made.")
      .def(
          "status",
          [](const py_lender& l) {
            const auto lender = l.lender.enter();
            lending::lender_status s;
            {
              released_gil release;  // the lender's lock, which its serving thread takes
              s = lender->status();
            }
            return status_dict(s);
          },
          "Regions lent (``regions``: id, memory, bytes, purpose, mode, state, pid, uid, age_seconds, and a shared "
          "region's holders), spare chunks (``spares``: memory, bytes, uid, kept_by, age_seconds), borrows waiting "
          "for memory in the order they are served (``waiting``: bytes, purpose, pid, uid, waited_seconds, "
          "left_seconds) and counters (requests, refusals, revocations, revocations_missed, preemptions, waits, "
          "waits_expired, ...), as a dict.")
      .def(
          "revoke",
          [](const py_lender& l, const python_int& region, double deadline) {
            const auto id = whole_number_of(region, "shoal.lending.Lender.revoke", "region");
            const auto d = timeout_of(deadline, "shoal.lending.Lender.revoke", "deadline");
            const auto lender = l.lender.enter();
            released_gil release;  // the lender's lock, as status()
            lender->revoke(id, d);
          },
          nb::arg("region"), nb::arg("deadline"),
          "Asks the region's borrower to give it back within ``deadline`` seconds; returns at once.")
      .def(
          "metrics",
          [](const py_lender& l) {
            const auto lender = l.lender.enter();
            released_gil release;  // the lender's lock, as status()
            return lender->metrics_text();
          },
          "The status in the Prometheus text format.")
      .def(
          "close",
          [](py_lender& l) { l.lender.close(); },
          "Stops serving and closes every connection. Idempotent.")
      .def_prop_ro(
          "closed", [](const py_lender& l) { return l.lender.closed(); }, "True once close() has begun.");

  m.def(
      "_region_id",
      [](const py_storage& storage) -> std::optional<std::uint64_t> {
        const auto behind = region_behind(storage);  // an emptied storage (published) has none
        if (behind.region == nullptr) return std::nullopt;
        return behind.region->id();
      },
      nb::arg("storage"), "The id of the borrowed region behind ``storage``, or None.");

  m.def(
      "_region_layout",
      [](const py_storage& storage) -> std::optional<std::pair<std::vector<py_entry>, nb::bytes>> {
        const auto behind = region_behind(storage);
        const region_owner* owner = behind.region;
        if (owner == nullptr || owner->region().layout() == nullptr) return std::nullopt;
        const auto& layout = *owner->region().layout();
        return std::make_pair(entries_of(layout), bytes_of(layout.hash));
      },
      nb::arg("storage"), "The layout (entries, content hash) of the shared region behind ``storage``, or None.");
  m.def(
      "_content_hash",
      [](const py_storage& storage, const std::vector<py_entry_given>& entries) {
        const auto layout = layout_of(entries, "shoal.lending.SharedRegion.verify");
        const storage::storage st = storage.handle.get();  // a copy, with the GIL: _publish may assign the handle
        lending::content_hash hash;
        {
          released_gil release;
          hash = lending::hash_entries(st.device(), st.data(), st.size(), layout);
        }
        return bytes_of(hash);
      },
      nb::arg("storage"), nb::arg("entries"),
      "SHA-256 of the entries' bytes in offset order, read from ``storage`` (device memory included).");

  nb::class_<stop_flag>(m, "_StopFlag",
                        "A flag set once, read without the GIL by a revocations() wait it is the cancel of "
                        "(shoal.lending.RevocationWatcher's).")
      .def(nb::init<>())
      .def(
          "set", [](stop_flag& f, const nb::object& /*reference*/) { f.set.store(true); },
          nb::arg("reference").none() = nb::none(),
          "Sets it. Takes an argument it ignores: the weak reference whose callback it is (a C call, which no "
          "Ctrl-C interrupts).")
      .def("is_set", [](const stop_flag& f) { return f.set.load(); }, "Whether it is set.");
  nb::class_<py_borrower>(m, "Borrower",
                          "A connection to a lender, through which regions are borrowed. Usable from several "
                          "threads: its requests go one at a time, each call waiting behind the one in progress "
                          "up to its own timeout (revocations() waits without a turn), and close() from another "
                          "thread ends a waiting call.")
      .def(
          "__init__",
          [](py_borrower* self, const address_text& address, backend::device* device,
             const std::vector<python_int>& allowed_uids, double timeout, bool keep_mappings,
             std::size_t kept_mapping_bytes, bool observer) {
            auto& d = device != nullptr ? *device : backend::default_device();
            const auto a = address_of(address.text);
            const auto policy = policy_of(allowed_uids, "shoal.lending.Borrower");
            const auto t = timeout_of(timeout, "shoal.lending.Borrower");
            lending::borrower_options options;
            options.keep_mappings = keep_mappings;
            options.kept_mapping_bytes = kept_mapping_bytes;
            options.observer = observer;
            std::unique_ptr<lending::borrower> b;
            {
              released_gil release;
              b = std::make_unique<lending::borrower>(d, a, policy, t, options);
            }
            new (self) py_borrower{{"shoal.lending.Borrower", closed_error::connection_closed, std::move(b)}};
          },
          nb::arg("address"), nb::arg("device").none() = nb::none(), nb::arg("allowed_uids") = std::vector<int>{},
          nb::arg("timeout") = 5.0, nb::arg("keep_mappings") = true,
          nb::arg("kept_mapping_bytes") = lending::borrower_options{}.kept_mapping_bytes, nb::arg("observer") = false)
      .def(
          "kept",
          [](const py_borrower& b) {
            const auto borrower = b.borrower.enter();
            lending::borrower::kept_mappings k;
            {
              released_gil release;  // waits behind a call in progress, which may take the GIL
              k = borrower->kept();
            }
            return std::pair{k.count, k.bytes};
          },
          "(count, bytes) of the mappings of given-back regions this borrower keeps for a later lend.")
      .def(
          "_borrow",
          [](const py_borrower& b, const py_allocator& allocator, std::size_t nbytes, const std::string& purpose,
             double timeout, double wait, nb::object cancel) {
            auto& device = allocator.state->allocator().device();
            const auto t = timeout_of(timeout, "shoal.lending.Borrower.borrow");
            if (!(wait >= 0) || !std::isfinite(wait) || wait > max_wait_seconds) {
              throw invalid_argument(
                  "shoal.lending.Borrower.borrow: wait must be a finite number of seconds from 0 to about 49 days");
            }
            const auto borrower = b.borrower.enter();
            // While the borrow waits: Ctrl-C (KeyboardInterrupt), close() from
            // another thread and the cancel event end it; a region lent later
            // is given back.
            const cancel_event cancelled(cancel);
            if (cancelled()) {
              raise_cancelled("shoal.lending.Borrower.borrow: cancelled before it was sent (its cancel event was set)");
            }
            const released_gil* released = nullptr;  // set below, before the borrow calls the check
            // Rounded to the millisecond; a wait above 0 is at least 1 ms.
            const auto wait_ms = std::max<std::int64_t>(std::llround(wait * 1000.0), wait > 0 ? 1 : 0);
            const lending::borrow_wait waiting{std::chrono::milliseconds(wait_ms), [&] {
                  const retaken_gil gil(*released);  // safe when the interpreter exits meanwhile
                  if (PyErr_CheckSignals() != 0) throw nb::python_error();
                  if (borrower.closing()) b.borrower.throw_closed();
                  if (cancelled()) {
                    raise_cancelled(
                        "shoal.lending.Borrower.borrow: cancelled while it waited for memory (its cancel event was "
                        "set); the lender was told");
                  }
                }};
            std::optional<lending::borrowed_region> region;
            {
              released_gil release;
              released = &release;
              region.emplace(borrower->borrow(nbytes, purpose, lending::region_mode::exclusive, t, waiting));
            }
            return storage_of(allocator, std::move(*region));
          },
          nb::arg("allocator"), nb::arg("nbytes"), nb::arg("purpose"), nb::arg("timeout"), nb::arg("wait"),
          nb::arg("cancel").none())
      .def(
          "_publish",
          [](const py_borrower& b, const py_allocator& allocator, py_storage& storage,
             const std::vector<py_entry_given>& entries, std::optional<nb::bytes> hash, double timeout) {
            const auto t = timeout_of(timeout, "shoal.lending.Borrower.publish");
            const auto borrower = b.borrower.enter();
            const auto behind = region_behind(storage);
            region_owner* owner = behind.region;
            if (owner == nullptr || !owner->region().valid() ||
                owner->region().mode() != lending::region_mode::exclusive) {
              throw invalid_argument("shoal.lending.Borrower.publish: the storage is not an exclusive borrowed region");
            }
            if (const long others = storage.handle.get().handles() - 1; others > 0) {
              throw invalid_argument("shoal.lending.Borrower.publish: " + std::to_string(others) +
                                     (others == 1 ? " other handle of the region (a view, DLPack export or tensor) is"
                                                  : " other handles of the region (views, DLPack exports, tensors) are") +
                                     " alive; drop them first: publishing unmaps the writable mapping under them");
            }
            auto layout = layout_of(entries, "shoal.lending.Borrower.publish");
            const auto& region = owner->region();
            if (auto problem = lending::layout_problem(layout, region.size()); !problem.empty()) {
              throw invalid_argument("shoal.lending.Borrower.publish: the layout is malformed: " + problem);
            }
            std::optional<lending::content_hash> given;
            if (hash) given = hash_of(*hash);
            std::optional<lending::borrowed_region> shared;
            // The handle is assigned with the GIL held (other threads read it
            // with the GIL, then use a copy); the storage it held goes below,
            // without the GIL, since its release may wait.
            std::optional<storage_handle> old(storage.handle);
            storage.handle = storage_handle(storage::storage(), allocator.state);
            {
              released_gil release;
              // Keeps the owner while the storage goes: its release waits for
              // the streams that used the region, so the hash reads what they
              // wrote; then the region is taken out (and given back if
              // anything below fails).
              const auto keep = old->get().owner();
              old.reset();
              auto& device = allocator.state->allocator().device();
              layout.hash = given ? *given : lending::hash_entries(device, region.data(), region.size(), layout);
              shared.emplace(borrower->publish(owner->take(), layout, t));
            }
            return storage_of(allocator, std::move(*shared));
          },
          nb::arg("allocator"), nb::arg("storage"), nb::arg("entries"), nb::arg("hash").none(), nb::arg("timeout"))
      .def(
          "_borrow_shared",
          [](const py_borrower& b, const py_allocator& allocator, const std::string& name,
             std::optional<nb::bytes> expected, std::optional<std::uint32_t> writer_uid, double timeout) {
            const auto t = timeout_of(timeout, "shoal.lending.Borrower.borrow_shared");
            const auto borrower = b.borrower.enter();
            std::optional<lending::content_hash> want;
            if (expected) want = hash_of(*expected);
            std::optional<lending::borrowed_region> region;
            {
              released_gil release;
              region.emplace(borrower->borrow_shared(name, want, writer_uid, t));
            }
            return storage_of(allocator, std::move(*region));
          },
          nb::arg("allocator"), nb::arg("name"), nb::arg("expected").none(), nb::arg("writer_uid").none(),
          nb::arg("timeout"))
      .def(
          "revocations",
          [](const py_borrower& b, double wait, nb::object cancel) {
            const cancel_event cancelled(cancel);
            const auto borrower = b.borrower.enter();
            // In slices, so that Ctrl-C, a close() and the cancel event end a
            // long wait; revokes that came already are returned whatever the
            // event says (it ends the wait, it does not hide them).
            const auto until = until_of(wait, "shoal.lending.Borrower.revocations", "wait");
            // A stop flag is looked at every 10 ms without the GIL (set, the
            // wait ends with nothing read); a Python event between slices of
            // 10 ms, with the GIL.
            const auto attempt = [&](std::chrono::milliseconds slice)
                -> std::optional<std::vector<lending::borrower::revocation>> {
              const auto end = std::chrono::steady_clock::now() + slice;
              for (;;) {
                const auto left =
                    std::max(std::chrono::ceil<std::chrono::milliseconds>(end - std::chrono::steady_clock::now()),
                             std::chrono::milliseconds(0));
                auto got =
                    borrower->revocations(cancelled.is_flag() ? std::min(left, std::chrono::milliseconds(10)) : left);
                if (!got.empty()) return got;
                if (cancelled.set_without_gil()) return std::vector<lending::borrower::revocation>{};
                if (std::chrono::steady_clock::now() >= end) return std::nullopt;
              }
            };
            std::vector<lending::borrower::revocation> asked;
            const auto slice = cancelled.given() && !cancelled.is_flag() ? std::chrono::milliseconds(10) : wait_slice;
            for (;;) {
              const auto slice_end = std::chrono::steady_clock::now() + slice;
              auto got = wait_in_slices(borrower, b.borrower, until ? std::min(*until, slice_end) : slice_end, attempt);
              if (got) {
                asked = std::move(*got);
                break;
              }
              if (until && std::chrono::steady_clock::now() >= *until) break;
              if (cancelled()) break;
            }
            const auto now = std::chrono::steady_clock::now();
            std::vector<std::pair<std::uint64_t, double>> out;
            for (const auto& r : asked)
              out.emplace_back(r.region, std::chrono::duration<double>(r.deadline - now).count());
            return out;
          },
          nb::arg("wait") = 0.0, nb::arg("cancel").none() = nb::none(),
          "The lender's requests to give regions back: (region id, seconds left), waiting up to ``wait`` "
          "seconds for a first one, or until ``cancel`` (an object with is_set()) is set.")
      .def(
          "return_revocations",
          [](const py_borrower& b, const std::vector<std::pair<std::uint64_t, double>>& unhandled) {
            const auto borrower = b.borrower.enter();
            const auto now = std::chrono::steady_clock::now();
            std::vector<lending::borrower::revocation> back;
            for (const auto& [region, seconds_left] : unhandled) {
              const double left = std::isfinite(seconds_left) ? std::clamp(seconds_left, -1e9, 1e9) : 0.0;
              back.push_back({region, now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                std::chrono::duration<double>(left))});
            }
            borrower->return_revocations(back);
          },
          nb::arg("unhandled"),
          "Puts back (region id, seconds left) pairs that revocations() returned and were not handled: the "
          "next revocations() returns them first (those given back meanwhile left out).")
      .def(
          "metrics",
          [](const py_borrower& b, double timeout) {
            const auto t = timeout_of(timeout, "shoal.lending.Borrower.metrics");
            const auto borrower = b.borrower.enter();
            released_gil release;
            return borrower->metrics(t);
          },
          nb::arg("timeout") = 5.0, "The lender's status in the Prometheus text format.")
      .def(
          "revoke",
          [](const py_borrower& b, const python_int& region, double deadline, double timeout) {
            const auto id = whole_number_of(region, "shoal.lending.Borrower.revoke", "region");
            const auto d = timeout_of(deadline, "shoal.lending.Borrower.revoke", "deadline");
            const auto t = timeout_of(timeout, "shoal.lending.Borrower.revoke");
            const auto borrower = b.borrower.enter();
            released_gil release;
            borrower->revoke(id, d, t);
          },
          nb::arg("region"), nb::arg("deadline"), nb::arg("timeout") = 5.0,
          "Asks the lender to revoke ``region`` (any borrower's: its id as the status and the metrics name it), "
          "giving its borrower ``deadline`` seconds; returns once the lender accepted. The lender's operator only: "
          "PeerRefusedError unless this process runs as the lender's uid or root; InvalidArgumentError for a region "
          "not lent to a connected borrower, or a shared one.")
      .def(
          "close", [](py_borrower& b) { b.borrower.close(); },
          "Closes the connection; regions already borrowed stay mapped until their storages are gone.")
      .def_prop_ro(
          "closed", [](const py_borrower& b) { return b.borrower.closed(); }, "True once close() has begun.");
}

}  // namespace shoal::python
