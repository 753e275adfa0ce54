// The command line shared by shoal_replay (shoal only) and
// shoal_replay_compare (shoal and the allocators it is compared with):
//
//   <program> [--conf TEXT]... <trace>...
//       replays each trace through shoal, once per --conf (SHOAL_ALLOC_CONF
//       syntax; default: the SHOAL_ALLOC_CONF environment variable), then
//       through each other allocator; prints one markdown table.
//   <program> --generate-mix <events> <seed> [<streams>]
//       writes a random-size-mix trace (random_mix.h) to standard output.
//
// shoal runs on backend::default_device() (CUDA where there is a GPU, else
// host; SHOAL_BACKEND forces one).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/common/allocator_adapter.h"

namespace shoal::bench {

/// Makes a fresh adapter per replay, so each peak counts from zero.
struct adapter_factory {
  std::string name;
  std::function<std::unique_ptr<allocator_adapter>()> make;
};

/// Runs the command line above; `others` are replayed after shoal. Returns
/// the exit status: 0; 1 when a trace could not be read, a replay failed
/// (the table says which), memory ran out, or standard output could not
/// take everything (a full disk); 2 for a usage error.
int replay_main(int argc, char** argv, const std::vector<adapter_factory>& others);

}  // namespace shoal::bench
