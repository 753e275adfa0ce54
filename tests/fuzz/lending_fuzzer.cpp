// The lending protocol's fuzz target (lending_target.h): libFuzzer's entry,
// built with clang and -DSHOAL_BUILD_FUZZERS=ON (scripts/fuzz). The ctest
// driver (lending_fuzz_driver.cpp) runs the same target in every build.
#include <cstddef>
#include <cstdint>

#include "fuzz/lending_target.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  (void)shoal::fuzz::run_lending_input({data, size});
  return 0;
}
