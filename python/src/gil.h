// The GIL released around a blocking call, and taken back in a way that
// survives the interpreter's exit.
//
// Up to Python 3.13, a thread that asks for the GIL back while the
// interpreter finalizes (a daemon thread still in a call when the process
// exits) is ended with pthread_exit. Its unwinding through C++ frames stops
// at the first noexcept frame (nanobind's gil_scoped_release destructor is
// one) with std::terminate, and a process that was exiting cleanly aborts.
// Here that unwinding is caught where the GIL is asked for, and the thread
// sleeps until the process ends instead (what Python 3.14 does itself); a
// handler that returned would abort as well, so it never returns.
//
// Threads that are not Python's own (a transfer engine's), and Python work a
// call starts (an out-of-memory observer), go through the exit gate
// instead: shoal's atexit hook waits for what is in flight and lets no more
// begin, since a C++ thread caught in the GIL's wait could not be parked
// (the interpreter's shutdown joins it).
//
// Thread-safety: as the Python C API: released_gil is made on a thread that
// holds the GIL, and destroyed on the same thread.
#pragma once

#include <nanobind/nanobind.h>

#include <cxxabi.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

namespace shoal::python {

namespace detail {

/// Whether the interpreter is shutting down (after the atexit hooks).
inline bool interpreter_finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// The exit gate. shoal's atexit hook closes it (before the interpreter
/// finalizes) and waits, the GIL released, for the Python work other
/// threads have begun through python_work(); from then on they begin none.
/// A thread that asked for the GIL after finalization began would be ended
/// there, and the ending's unwinding through C++ frames aborts the process
/// (a transfer engine's thread letting go of a source at exit did).
/// The thread that closed it (the one that finalizes the interpreter) goes
/// on: nothing ends it.
inline std::atomic<bool> exit_gate_closed{false};
inline std::atomic<std::thread::id> exit_gate_closer{};
inline std::atomic<int> python_work_in_flight{0};

/// Above zero while this thread keeps the GIL as it has it, whatever it
/// waits for: it runs inside another library's lock (PyTorch's allocator,
/// calling a region pool's slot, holds its mutex; a Python thread holding
/// the GIL may wait for that mutex, so a GIL let go there could not be taken
/// back). without_gil and waiting_without_gil run their work as called then.
inline thread_local int gil_kept = 0;

/// Above zero while this thread runs python_work: a destructor's wait
/// there (waiting_without_gil) keeps the GIL, and a closable's close()
/// there neither waits nor destroys in place (closable.h: the thread may
/// be the one its destruction joins; the main thread counts too when it
/// lets go of a source, and its destruction then goes on a thread of its own). Let go, it could be taken back
/// only after the exit gate's wait, and the finalizing interpreter would
/// park the thread while the interpreter's teardown joins it (a transfer
/// engine's thread dropping a source whose stream has work queued). Waits
/// on a peer (without_gil) still let it go: one that kept it would stall
/// every Python thread, or deadlock with one that needs the GIL to end it.
inline thread_local int in_python_work = 0;

/// Keeps the GIL as it is on this thread for its life (gil_kept).
class keeping_the_gil {
 public:
  keeping_the_gil() noexcept { ++gil_kept; }
  ~keeping_the_gil() { --gil_kept; }
  keeping_the_gil(const keeping_the_gil&) = delete;
  keeping_the_gil& operator=(const keeping_the_gil&) = delete;
};

/// Runs `work` — which takes the GIL itself (or holds it), for a short
/// while — unless the exit gate is closed and this is another thread than
/// the one that closed it; false when it did not run (a reference then
/// leaks, an observer is not called: the process exits).
template <class Work>
bool python_work(Work&& work) {
  ++python_work_in_flight;
  ++in_python_work;
  struct leaves {
    ~leaves() {
      --python_work_in_flight;
      --in_python_work;
    }
  } const left;
  if (Py_IsInitialized() == 0) return false;
  if (exit_gate_closed.load() && std::this_thread::get_id() != exit_gate_closer.load()) return false;
  work();
  return true;
}

/// Where a Python thread running Python code for shoal (an out-of-memory
/// observer) is ended by the finalizing interpreter: it sleeps until the
/// process is gone (returning would abort it). Call it from a catch of
/// abi::__forced_unwind inside the GIL's scope, on a thread Python made.
[[noreturn]] inline void sleep_until_the_process_ends() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

/// Takes the GIL back for `state`; a thread the finalizing interpreter ends
/// meanwhile sleeps until the process is gone.
inline void take_gil_back(PyThreadState* state) {
#ifdef __GLIBCXX__
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    sleep_until_the_process_ends();
  }
#else
  PyEval_RestoreThread(state);  // (libc++ has no forced-unwind type to catch)
#endif
}

}  // namespace detail

/// Releases the GIL for its life: nanobind::gil_scoped_release, safe at exit
/// (also as nb::call_guard<released_gil>).
class released_gil {
 public:
  released_gil() noexcept : state_(PyEval_SaveThread()) {}
  ~released_gil() { detail::take_gil_back(state_); }
  released_gil(const released_gil&) = delete;
  released_gil& operator=(const released_gil&) = delete;
  /// The thread state it saved (retaken_gil).
  [[nodiscard]] PyThreadState* state() const noexcept { return state_; }

 private:
  PyThreadState* state_;
};

/// Takes the GIL back for its life inside `released`'s scope, on the same
/// thread: a check that a blocking call makes while the GIL is released (a
/// borrow's interrupt check). Safe at exit as released_gil is — unlike
/// nanobind::gil_scoped_acquire, whose noexcept constructor turns the
/// finalizing interpreter's thread exit into std::terminate.
class retaken_gil {
 public:
  explicit retaken_gil(const released_gil& released) { detail::take_gil_back(released.state()); }
  ~retaken_gil() { (void)PyEval_SaveThread(); }
  retaken_gil(const retaken_gil&) = delete;
  retaken_gil& operator=(const retaken_gil&) = delete;
};

namespace detail {

/// Whether this thread holds the GIL: its own thread state is the one
/// attached. (PyGILState_Check says yes on every thread once a
/// subinterpreter was ever made, and releasing a GIL the thread does not
/// hold is fatal.) From 3.12 the attached state is per thread; before, it is
/// the process's, whichever thread holds the GIL, so it is compared with this
/// thread's own (a thread Python does not know has none: it holds nothing).
inline bool holds_gil() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return PyThreadState_GetUnchecked() != nullptr;
#elif PY_VERSION_HEX >= 0x030C0000
  return _PyThreadState_UncheckedGet() != nullptr;
#else
  PyThreadState* const own = PyGILState_GetThisThreadState();
  return own != nullptr && own == _PyThreadState_UncheckedGet();
#endif
}

/// Runs `fn` with the GIL released when this thread holds it (taken back as
/// released_gil does, so a daemon thread here at exit sleeps, not aborts),
/// unless the thread keeps it (gil_kept).
template <class Fn>
void without_gil(Fn&& fn) {
  std::optional<released_gil> unlocked;
  if (gil_kept == 0 && holds_gil()) unlocked.emplace();
  fn();
}

/// For a destructor that may wait — a host stream's queued work, pending
/// frees, the streams a DLPack producer's memory was used on — when the last
/// reference is dropped from Python (a dealloc, with the GIL held): `fn` runs
/// with the GIL released, so the wait does not stop every other Python
/// thread. Once the interpreter finalizes (the objects it collects then, C++
/// statics after it) `fn` runs as called: after finalization the GIL cannot be
/// let go, and no other thread waits for it; nor inside python_work
/// (in_python_work). Call it holding no lock that a thread holding the GIL
/// may wait for (the GIL is taken back at its end); a thread inside another
/// library's lock keeps the GIL (keeping_the_gil).
template <class Fn>
void waiting_without_gil(Fn&& fn) {
  if (Py_IsInitialized() == 0 || in_python_work > 0) {
    fn();
    return;
  }
  without_gil(fn);
}

}  // namespace detail

/// The atexit hook: closes the exit gate and waits (the GIL released, at
/// most a second) for the Python work in flight on other threads.
inline void close_exit_gate() {
  detail::exit_gate_closer.store(std::this_thread::get_id());
  detail::exit_gate_closed.store(true);
  const released_gil unlocked;
  for (int i = 0; i < 100 && detail::python_work_in_flight.load() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace shoal::python
