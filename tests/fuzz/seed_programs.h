// The seed programs of the fuzz corpus, each with what receiving it must
// give: real shares (one chunk, three chunks, an offset handle, a ready
// point to wait for, one never reached), the refusals a hostile producer
// meets (a range past what was mapped, read-only and pipe descriptors,
// unsealed counter memory, retired segments, garbage bytes) and a program
// larger than a socket's buffer. The driver checks each; `--write-corpus`
// writes them as tests/fuzz/corpus/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shoal::fuzz {

struct seed_program {
  std::string name;
  std::vector<std::uint8_t> bytes;
  std::size_t storages = 0;  ///< storages receiving it must build
  std::size_t notes = 0;
  std::string end;  ///< a part of how receiving it must end ("closed" or the error)
};

[[nodiscard]] std::vector<seed_program> seed_programs();

}  // namespace shoal::fuzz
