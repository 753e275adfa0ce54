#include "bench/replay/replay_cli.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/common/shoal_adapter.h"
#include "bench/replay/peak_waste.h"
#include "bench/replay/random_mix.h"
#include "bench/replay/replayer.h"
#include "bench/replay/trace.h"
#include "shoal/alloc/config.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"

namespace shoal::bench {

namespace {

/// A trace's name in the table: its file name without ".gz" and ".trace".
std::string trace_name(const std::filesystem::path& path) {
  std::filesystem::path name = path.filename();
  if (name.extension() == ".gz") name = name.stem();
  if (name.extension() == ".trace") name = name.stem();
  return name.string();
}

void usage(std::FILE* out, const char* program) {
  std::fprintf(out,
               "usage: %s [--conf TEXT]... [--waste] <trace>...\n"
               "       %s --generate-mix <events> <seed> [<streams>]  > file.trace\n"
               "Replays allocation traces (docs/traces.md) and prints peak reserved / peak requested.\n"
               "  --conf TEXT   a shoal configuration in SHOAL_ALLOC_CONF syntax; repeat to compare\n"
               "                several (default: the SHOAL_ALLOC_CONF environment variable)\n"
               "  --waste       also replay each trace through each shoal configuration again, slowly,\n"
               "                and print where its peak reserved memory went (peak_waste.h)\n"
               "  --generate-mix  write a random-size-mix trace to standard output\n"
               "Environment: SHOAL_BACKEND=host|cuda picks shoal's device.\n",
               program, program);
}

template <class T>
std::optional<T> parse_integer(std::string_view text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

int generate(const std::vector<std::string>& args, const char* program) {
  // args: --generate-mix <events> <seed> [<streams>]
  if (args.size() != 3 && args.size() != 4) {
    usage(stderr, program);
    return 2;
  }
  const auto events = parse_integer<std::size_t>(args[1]);
  const auto seed = parse_integer<std::uint64_t>(args[2]);
  const auto streams = args.size() == 4 ? parse_integer<std::uint32_t>(args[3]) : std::optional<std::uint32_t>(1);
  if (!events || !seed || !streams) {
    std::fprintf(stderr, "%s: --generate-mix takes non-negative integers: <events> <seed> [<streams>]\n", program);
    return 2;
  }
  // Whether it all reached standard output is checked on the way out (replay_main).
  write_mix(std::cout, {.events = *events, .seed = *seed, .streams = *streams});
  return 0;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

/// A device-call count, or "-" where the allocator does not count them.
std::string count(std::int64_t n) { return n < 0 ? "-" : std::to_string(n); }

struct shoal_conf {
  std::string name;
  alloc::allocator_config config;
};

struct named_trace {
  std::string name;
  trace data;
};

int replay_all(const std::vector<named_trace>& traces, const std::vector<adapter_factory>& allocators) {
  int status = 0;
  std::printf(
      "| trace | allocator | events | streams | peak requested MiB | peak reserved MiB | reserved / requested "
      "| replay ms | ns / event | device allocs | device frees "
      "| VMM creates / releases / maps / unmaps / access grants |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& t : traces) {
    for (const auto& allocator : allocators) {
      try {
        const auto adapter = allocator.make();
        const replay_result r = replay(t.data, *adapter);
        const double ns = static_cast<double>(r.elapsed.count());
        std::printf("| %s | %s | %zu | %zu | %.1f | %.1f | %.3f | %.2f | %.1f | %s | %s | %s |\n", t.name.c_str(),
                    allocator.name.c_str(), r.events, r.streams, mib(r.peak_requested_bytes),
                    mib(r.peak_reserved_bytes), r.fragmentation(), ns / 1e6,
                    r.events == 0 ? 0.0 : ns / static_cast<double>(r.events), count(r.device_allocations).c_str(),
                    count(r.device_frees).c_str(), r.vmm_calls.c_str());
      } catch (const std::exception& e) {
        // One allocator failing (out of memory, most likely) must not hide
        // the others' rows.
        std::printf("| %s | %s | failed: %s | | | | | | | | | |\n", t.name.c_str(), allocator.name.c_str(), e.what());
        status = 1;
      }
      std::fflush(stdout);
    }
  }
  return status;
}

int print_waste(const std::vector<named_trace>& traces, const std::vector<shoal_conf>& confs, backend::device& device) {
  int status = 0;
  std::printf("\nWhere the peak reserved memory went (MiB):\n\n%s", waste_header().c_str());
  for (const auto& t : traces) {
    for (const auto& c : confs) {
      try {
        std::printf("%s", waste_rows(t.name + " | " + c.name, analyse_peak(t.data, c.config, device)).c_str());
      } catch (const std::exception& e) {
        // As in the main table: one replay failing must not hide the others' rows.
        std::printf("| %s | %s | failed: %s | | | | | | | | | | |\n", t.name.c_str(), c.name.c_str(), e.what());
        status = 1;
      }
      std::fflush(stdout);
    }
  }
  return status;
}

/// Whether everything written to standard output reached it (not so on a
/// full disk, say).
bool output_complete() {
  std::cout.flush();
  return std::cout && std::fflush(stdout) == 0 && std::ferror(stdout) == 0;
}

/// Replays each trace through shoal once per conf, then through `others`;
/// prints the table (and with `waste`, the waste table). Returns the exit status.
int replay_traces(const std::vector<std::string>& confs, const std::vector<std::filesystem::path>& paths, bool waste,
                  const std::vector<adapter_factory>& others) {
  std::vector<named_trace> traces;
  for (const auto& path : paths) traces.push_back({trace_name(path), read_trace_file(path)});

  backend::device& device = backend::default_device();
  std::printf("device: %s:%d (%s)\n", std::string(backend::to_string(device.kind())).c_str(), device.ordinal(),
              device.name().c_str());
  std::vector<adapter_factory> allocators;
  std::vector<shoal_conf> shoal_confs;
  const auto add_shoal = [&](std::string name, const alloc::allocator_config& config) {
    std::printf("%s: %s\n", name.c_str(), config.to_string().c_str());
    shoal_confs.push_back({name, config});
    allocators.push_back(
        {std::move(name), [&device, config] { return std::make_unique<shoal_adapter>(device, config); }});
  };
  if (confs.empty()) {
    add_shoal("shoal", alloc::allocator_config::from_environment());
  } else {
    for (const auto& conf : confs)
      add_shoal("shoal " + (conf.empty() ? "(defaults)" : conf), alloc::allocator_config::parse(conf));
  }
  allocators.insert(allocators.end(), others.begin(), others.end());
  std::printf("\n");
  const int table_status = replay_all(traces, allocators);
  const int waste_status = waste ? print_waste(traces, shoal_confs, device) : 0;
  return std::max(table_status, waste_status);
}

/// The command line, with the program name taken off; returns the exit status.
int run(const std::vector<std::string>& args, const char* program, const std::vector<adapter_factory>& others) {
  if (args.empty()) {
    usage(stderr, program);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h") {
    usage(stdout, program);
    return 0;
  }
  if (args[0] == "--generate-mix") return generate(args, program);

  std::vector<std::string> confs;
  std::vector<std::filesystem::path> paths;
  bool waste = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--waste") {
      waste = true;
    } else if (args[i] == "--conf") {
      if (i + 1 == args.size()) {
        std::fprintf(stderr, "%s: --conf needs a value, e.g. --conf expandable_segments:true\n", program);
        return 2;
      }
      confs.push_back(args[++i]);
    } else if (args[i].starts_with("-")) {
      std::fprintf(stderr, "%s: unknown option '%s'\n", program, args[i].c_str());
      usage(stderr, program);
      return 2;
    } else {
      paths.emplace_back(args[i]);
    }
  }
  if (paths.empty()) {
    usage(stderr, program);
    return 2;
  }

  return replay_traces(confs, paths, waste, others);
}

/// run, with an error that ends it (an unreadable trace, out of memory)
/// printed, and exit status 1.
int run_reporting_errors(int argc, char** argv, const char* program, const std::vector<adapter_factory>& others) {
  try {
    return run({argv + std::min(argc, 1), argv + argc}, program, others);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory (is a trace too large for this machine's memory?)\n", program);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  return 1;
}

}  // namespace

int replay_main(int argc, char** argv, const std::vector<adapter_factory>& others) {
  const char* program = argc > 0 ? argv[0] : "shoal_replay";
  const int status = run_reporting_errors(argc, argv, program, others);
  if (!output_complete()) {
    std::fprintf(stderr, "%s: writing to standard output failed; what it holds is incomplete\n", program);
    return 1;
  }
  return status;
}

}  // namespace shoal::bench
