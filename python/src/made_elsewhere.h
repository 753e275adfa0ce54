// Classes whose objects only other calls make (a Storage comes from an
// Allocator, a Connection from a Listener): calling the class itself raises a
// TypeError that names those calls, where nanobind would say only
// "no constructor defined". The type stubs keep showing no constructor.
#pragma once

#include <nanobind/nanobind.h>

namespace shoal::python {

namespace nb = nanobind;

template <const char* made_by>
int refuse_direct_construction(PyObject*, PyObject*, PyObject*) {
  PyErr_SetString(PyExc_TypeError, made_by);
  return -1;
}

/// The type slots of a class whose objects come from the calls its message
/// `made_by` names: `nb::class_<T>(m, "T", made_elsewhere<message>(), ...)`
/// with `constexpr char message[] = "shoal.T is not made by calling the class:
/// f() makes one.";` at namespace scope (a template argument must have static
/// storage; each class gets a refusal function of its own).
template <const char* made_by>
nb::type_slots made_elsewhere() {
  static PyType_Slot slots[] = {{Py_tp_init, reinterpret_cast<void*>(&refuse_direct_construction<made_by>)},
                                {0, nullptr}};
  return nb::type_slots(slots);
}

}  // namespace shoal::python
