// [lazy clone]: a clone that copies nothing until someone writes.
#include <cstdio>

#include "shoal/storage/storage.h"
#include "tools/shoal/demo_steps.h"

namespace shoal::tools::demo {

namespace {
constexpr std::size_t clone_bytes = 8 << 20;
constexpr std::uint8_t original_byte = 0x33;
constexpr std::uint8_t written_byte = 0x44;
}  // namespace

void show_lazy_clone(backend::device& dev, alloc::caching_allocator& allocator) {
  // Everything here runs on this thread's current stream (the default one).
  auto original = storage::storage::allocate(allocator, clone_bytes);
  dev.fill({}, original.mutable_data(), original_byte, clone_bytes);

  auto start = std::chrono::steady_clock::now();
  auto clone = storage::lazy_clone(original);
  const double clone_us = us_since(start);
  const bool shared = clone.data() == original.data();
  const bool distinct = !clone.aliases(original);
  const bool lazy = clone.is_lazy() && original.is_lazy();
  std::printf("[lazy clone] lazy_clone of a %s storage took %.1f us and copied nothing: both read data at %s "
              "(shared: %s, distinct storages: %s)\n",
              mib(clone_bytes).c_str(), clone_us, hex(clone.data()).c_str(), shared ? "yes" : "NO",
              distinct ? "yes" : "NO");
  expect(shared && distinct && lazy, "lazy_clone did not share the data copy-on-write between two storages");

  start = std::chrono::steady_clock::now();
  void* written = clone.mutable_data();  // the first write materializes the clone: a copy
  dev.fill({}, written, written_byte, clone_bytes / 2);
  const double write_us = us_since(start);
  const auto clone_seen = read_back(dev, clone.data(), clone_bytes, {});
  const auto original_seen = read_back(dev, original.data(), clone_bytes, {});
  const std::span<const std::uint8_t> all(clone_seen);
  const bool clone_right = all_are(all.first(clone_bytes / 2), written_byte) &&
                           all_are(all.subspan(clone_bytes / 2), original_byte);
  const bool original_right = all_are(original_seen, original_byte);
  std::printf("[lazy clone] writing half of the clone materialized it (%.1f us to enqueue): clone at %s, original at "
              "%s; clone holds the write and the copied rest: %s, original unchanged: %s\n",
              write_us, hex(written).c_str(), hex(original.data()).c_str(), clone_right ? "yes" : "NO",
              original_right ? "yes" : "NO");
  expect(written != original.data() && !clone.is_lazy(), "the write through the clone did not give it its own data");
  expect(clone_right && original_right, "after the write, the clone or the original holds the wrong bytes");
}

}  // namespace shoal::tools::demo
