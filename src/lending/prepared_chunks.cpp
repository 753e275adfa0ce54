#include "lending/prepared_chunks.h"

#include <algorithm>
#include <iterator>
#include <limits>

namespace shoal::lending::detail {

void prepared_chunks::put(chunk_record chunk) {
  const std::size_t size = chunk.memory->size();
  chunks_.push_back(std::move(chunk));  // counted once it is in
  bytes_ += size;
}

std::optional<chunk_record> prepared_chunks::take(std::size_t bytes) {
  const auto it =
      std::find_if(chunks_.begin(), chunks_.end(), [&](const chunk_record& c) { return c.memory->size() == bytes; });
  if (it == chunks_.end()) return std::nullopt;
  chunk_record taken = std::move(*it);
  chunks_.erase(it);
  bytes_ -= taken.memory->size();
  return taken;
}

std::vector<chunk_record> prepared_chunks::take_at_least(std::size_t bytes) {
  std::size_t got = 0;
  auto end = chunks_.begin();
  for (; end != chunks_.end() && got < bytes; ++end) got += end->memory->size();
  // Room first: a failed allocation leaves the pool as it was.
  std::vector<chunk_record> taken;
  taken.reserve(static_cast<std::size_t>(end - chunks_.begin()));
  std::move(chunks_.begin(), end, std::back_inserter(taken));
  chunks_.erase(chunks_.begin(), end);
  bytes_ -= got;
  return taken;
}

std::optional<std::size_t> prepared_total(const std::vector<std::size_t>& sizes, std::size_t granularity) noexcept {
  std::size_t total = 0;
  for (const std::size_t size : sizes) {
    const std::size_t rounded = round_up(size, granularity);
    if (size == 0 || rounded == 0 || rounded > std::numeric_limits<std::size_t>::max() - total) return std::nullopt;
    total += rounded;
  }
  return total;
}

}  // namespace shoal::lending::detail
