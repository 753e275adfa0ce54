// The extension module shoal._shoal; python/shoal/__init__.py re-exports it.
#include <cstdlib>
#include <string_view>

#include "bindings.h"
#include "gil.h"

NB_MODULE(_shoal, m) {
  m.doc() =
      "shoal's C++ runtime: devices, streams, the caching allocator, "
      "storages, DLPack export.";
  shoal::python::register_errors(m);
  shoal::python::register_streams(m);
  shoal::python::register_allocator(m);
  shoal::python::register_storages(m);
  shoal::python::register_dlpack(m);
  shoal::python::register_dlpack_import(m);
  shoal::python::register_sharing(m);
  shoal::python::register_torch_api(m);
  shoal::python::register_transfer(m);
  shoal::python::register_grouped_load(m);
  shoal::python::register_lending(m);
  shoal::python::register_segment_sources(m);
  // Objects C++ holds until the process ends (an out-of-memory observer left
  // registered, a load or a wait still alive at exit) are let go with the
  // process, not one by one (gil.h): nanobind's report of them would read as
  // a binding bug to every user whose program exits that way. The test runs
  // keep the report (SHOAL_LEAK_WARNINGS=1), where a real leak shows.
  const char* leak_warnings = std::getenv("SHOAL_LEAK_WARNINGS");
  nanobind::set_leak_warnings(leak_warnings != nullptr && std::string_view(leak_warnings) == "1");
  // Other threads begin no Python work once the process exits (gil.h).
  m.def("_close_exit_gate", &shoal::python::close_exit_gate);
  nanobind::module_::import_("atexit").attr("register")(m.attr("_close_exit_gate"));
}
