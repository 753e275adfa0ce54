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
// Thread-safety: as the Python C API: released_gil is made on a thread that
// holds the GIL, and destroyed on the same thread.
#pragma once

#include <nanobind/nanobind.h>

#include <cxxabi.h>

#include <chrono>
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

/// Whether this thread may take the GIL: it holds it already, or the
/// interpreter is up and not finalizing (another thread asking then would be
/// ended). A C++ thread that may not lets go of Python objects by leaking
/// them: the process is exiting.
inline bool may_take_gil() noexcept {
  return Py_IsInitialized() != 0 && (PyGILState_Check() != 0 || !interpreter_finalizing());
}

/// Takes the GIL back for `state`; a thread the finalizing interpreter ends
/// meanwhile sleeps until the process is gone.
inline void take_gil_back(PyThreadState* state) {
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
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

 private:
  PyThreadState* state_;
};

}  // namespace shoal::python
