// The shoal command-line program.
#include <cstdio>
#include <exception>
#include <string>

#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "tools/shoal/demo.h"
#if defined(SHOAL_HAVE_DAEMON)
#include "tools/shoal/daemon.h"
#endif

namespace {

void usage(std::FILE* out) {
  std::fputs(
      "usage: shoal <command>\n"
      "  info   the devices shoal can use, and which one is the default\n"
      "  demo   walk through shoal on the default device: a stream-aware free,\n"
      "         a lazy clone, a storage shared with a child process, allocator stats\n"
      "  daemon the memory daemon: lends device memory to borrower processes\n"
      "         (shoal daemon --help; shoal daemon status prints its metrics)\n"
      "Environment: SHOAL_BACKEND=host|cuda forces the default device.\n",
      out);
}

int info() {
  using namespace shoal::backend;
  std::printf("CUDA devices: %d\n", cuda_device_count());
  if (cuda_device_count() == 0) std::printf("  (%s)\n", cuda_unavailable_reason().c_str());
  for (int i = 0; i < cuda_device_count(); ++i) {
    device& d = cuda_device_instance(i);
    const auto m = d.memory();
    std::printf("  cuda:%d  %s  %.1f of %.1f GiB free\n", i, d.name().c_str(), m.free_bytes / 1073741824.0,
                m.total_bytes / 1073741824.0);
  }
  device& d = default_device();
  std::printf("default device: %s:%d (%s)\n", std::string(to_string(d.kind())).c_str(), d.ordinal(), d.name().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  try {
    if (command == "info") return info();
    if (command == "demo") return shoal::tools::run_demo();
    if (command == "demo-child" && argc == 3) return shoal::tools::run_demo_child(argv[2]);
    if (command == "daemon") {
#if defined(SHOAL_HAVE_DAEMON)
      return shoal::tools::run_daemon(argc - 1, argv + 1);
#else
      std::fputs("shoal daemon: this build has no daemon: CLI11, toml++ and spdlog were not found when it was "
                 "configured (scripts/ensure-deps installs them)\n",
                 stderr);
      return 1;
#endif
    }
    if (command == "help" || command == "--help" || command == "-h") {
      usage(stdout);
      return 0;
    }
    usage(stderr);
    return 2;
  } catch (const shoal::error& e) {
    std::fprintf(stderr, "shoal %s: %s\n", command.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal %s: unexpected error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
