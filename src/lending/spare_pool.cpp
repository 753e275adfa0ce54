#include "lending/spare_pool.h"

#include <algorithm>

namespace shoal::lending::detail {
namespace {

// Where take() looks: the spare of `bytes` and `uid` that connection
// `serial` keeps mapped, else the oldest of them; end() when none fits.
template <class Chunks>
auto where(Chunks& chunks, std::size_t bytes, uid_t uid, std::uint64_t serial) {
  auto fits = [&](const spare_chunk& s) { return s.uid == uid && s.chunk.memory->size() == bytes; };
  auto kept = [&](const spare_chunk& s) { return fits(s) && s.chunk.kept_by(serial); };
  auto it = std::find_if(chunks.begin(), chunks.end(), kept);
  return it != chunks.end() ? it : std::find_if(chunks.begin(), chunks.end(), fits);
}

}  // namespace

bool chunk_record::kept_by(std::uint64_t serial) const noexcept {
  return std::find(keepers.begin(), keepers.end(), serial) != keepers.end();
}

bool chunk_record::drop_keeper(std::uint64_t serial) noexcept {
  return std::erase(keepers, serial) > 0;
}

void spare_pool::put(chunk_record&& chunk, uid_t uid, std::chrono::steady_clock::time_point now) {
  // The node is made first: a failed allocation leaves `chunk` and the pool as they were.
  std::list<spare_chunk> node(1);
  node.front() = {std::move(chunk), uid, now};
  bytes_ += node.front().chunk.memory->size();
  chunks_.splice(chunks_.end(), node);
}

std::optional<spare_chunk> spare_pool::take(std::size_t bytes, uid_t uid, std::uint64_t serial) {
  const auto it = where(chunks_, bytes, uid, serial);
  if (it == chunks_.end()) return std::nullopt;
  return remove(it);
}

const spare_chunk* spare_pool::find(std::size_t bytes, uid_t uid, std::uint64_t serial) const noexcept {
  const auto it = where(chunks_, bytes, uid, serial);
  return it != chunks_.end() ? &*it : nullptr;
}

std::optional<spare_chunk> spare_pool::take_oldest() {
  if (chunks_.empty()) return std::nullopt;
  return remove(chunks_.begin());
}

void spare_pool::drop_keeper(std::uint64_t serial) noexcept {
  for (auto& s : chunks_) s.chunk.drop_keeper(serial);
}

void spare_pool::clear() noexcept {
  chunks_.clear();
  bytes_ = 0;
}

spare_chunk spare_pool::remove(std::list<spare_chunk>::iterator it) {
  spare_chunk taken = std::move(*it);
  chunks_.erase(it);
  bytes_ -= taken.chunk.memory->size();
  return taken;
}

}  // namespace shoal::lending::detail
