// `shoal demo`: walks through the default backend and says what it did.
#pragma once

#include <string>

namespace shoal::tools {

/// Runs the demo on the default device; returns the process exit code.
int run_demo();

/// The child half of the demo, started by run_demo with its socket on fd 3.
int run_demo_child(const std::string& backend_name);

}  // namespace shoal::tools
