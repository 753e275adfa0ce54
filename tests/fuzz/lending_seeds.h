// The seed inputs of the lending fuzz corpus, each with what running it must
// give: each decoder fed its own message; a hostile borrower that borrows,
// gives back and asks for metrics, meets every refusal, sends a lender's
// frame, another protocol's hello, a bad purpose or raw garbage; a hostile
// lender that lends a real region, floods revokes, lends a region larger than
// the memory it sends, refuses, or answers what was not asked. The driver
// checks each; `--write-corpus` writes them as tests/fuzz/lending_corpus/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shoal::fuzz {

struct lending_seed {
  std::string name;
  std::vector<std::uint8_t> bytes;
  std::size_t regions = 0;  ///< lending_outcome::regions running it must give
  std::string end;          ///< a part of lending_outcome::end
};

[[nodiscard]] std::vector<lending_seed> lending_seeds();

}  // namespace shoal::fuzz
