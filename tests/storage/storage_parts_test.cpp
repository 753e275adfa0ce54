// Storages over the parts of one block (storage::allocate_parts), on every
// backend under every allocator configuration: one allocator call, parts in
// order and apart, each storage's bytes its own, the block freed once after
// the streams of every part whatever the order the parts go in (the seed
// race with the parts of one block read on two streams), and the control
// where a read that was not recorded lets the block be reused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using storage_t = storage::storage;
constexpr std::size_t part_bytes = 64 * 1024 + 100;  // not a multiple of the alignment

/// Holds `s` until `open` is set, or for at most 10 s (which only keeps a
/// failing test from hanging the stream).
void hold(backend::device& dev, backend::stream_ref s, std::atomic<bool>& open) {
  dev.host_task(s, [&open] {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (!open.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  });
}

std::size_t pending_frees(alloc::caching_allocator& a) {
  a.process_pending_frees();
  return count_blocks(a.take_snapshot(), alloc::block_state::pending_free);
}

template <class Param>
class storage_parts_test : public allocator_test<Param> {
 public:
  /// A new stream that outlives the test's allocator.
  backend::stream_ref new_stream() { return streams_.emplace_back(this->device()); }
  /// Two parts, filled with 0x11 and 0x22 on `own` and finished.
  std::vector<storage_t> two_filled_parts(backend::stream_ref own) {
    const std::size_t sizes[] = {part_bytes, part_bytes};
    auto parts = storage_t::allocate_parts(*this->allocator_, sizes, own);
    this->device().fill(own, parts[0].mutable_data(own), 0x11, part_bytes);
    this->device().fill(own, parts[1].mutable_data(own), 0x22, part_bytes);
    this->device().synchronize(own);
    return parts;
  }
  /// A copy of `source` into device memory enqueued on `s` (a copy into
  /// pageable host memory would run at once on CUDA, not queued behind a hold).
  storage_t queued_copy(const storage_t& source, backend::stream_ref s) {
    auto copy = storage_t::allocate(*this->allocator_, source.size(), s);
    this->device().copy(s, copy.mutable_data(s), source.data(), source.size());
    return copy;
  }
  void TearDown() override { this->allocator_.reset(); }  // before streams_

 private:
  std::deque<stream> streams_;
};
TYPED_TEST_SUITE(storage_parts_test, backend_config_types, backend_config_names);

TYPED_TEST(storage_parts_test, parts_are_one_allocation_in_order_and_each_holds_its_own_bytes) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref s = this->new_stream();
  const std::size_t sizes[] = {100, 256, 4096 + 1, 1};
  auto parts = storage_t::allocate_parts(a, sizes, s);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1) << "one allocator call for every part";
  const auto* base = static_cast<const std::byte*>(parts[0].data());
  const std::size_t offsets[] = {0, 256, 512, 4096 + 512 + 256};
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(parts[i].size(), sizes[i]);
    EXPECT_EQ(static_cast<const std::byte*>(parts[i].data()) - base, static_cast<std::ptrdiff_t>(offsets[i])) << i;
    for (std::size_t j = 0; j < i; ++j) EXPECT_FALSE(parts[i].aliases(parts[j]));
    EXPECT_FALSE(parts[i].shared_outside_process());
    dev.fill(s, parts[i].mutable_data(s), static_cast<std::uint8_t>(0x40 + i), sizes[i]);
  }
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(all_equal(this->read(parts[i].data(), sizes[i], s), static_cast<std::uint8_t>(0x40 + i))) << i;
  }
  // Dropping all but one keeps the block: it goes with the last part.
  parts.erase(parts.begin(), parts.begin() + 3);
  dev.synchronize(s);
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
  parts.clear();
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
}

TYPED_TEST(storage_parts_test, a_lazy_clone_of_a_part_is_an_eager_copy_of_its_own) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref s = this->new_stream();
  auto parts = this->two_filled_parts(s);
  auto clone = storage::lazy_clone(parts[1], s);
  EXPECT_FALSE(clone.is_lazy());
  EXPECT_NE(clone.data(), parts[1].data());
  EXPECT_EQ(a.stats().allocations.aggregate.current, 2);
  parts.clear();  // the block goes; the copy stays
  dev.fill(s, clone.mutable_data(s), 0x33, 1);
  auto bytes = this->read(clone.data(), part_bytes, s);
  EXPECT_EQ(bytes[0], 0x33);
  EXPECT_TRUE(all_equal(std::vector<std::uint8_t>(bytes.begin() + 1, bytes.end()), 0x22));
}

TYPED_TEST(storage_parts_test, bad_part_lists_are_refused_with_nothing_allocated) {
  auto& a = this->make();
  const backend::stream_ref s = this->new_stream();
  EXPECT_THROW((void)storage_t::allocate_parts(a, std::span<const std::size_t>{}, s), invalid_argument);
  const std::size_t with_empty[] = {16, 0};
  EXPECT_THROW((void)storage_t::allocate_parts(a, with_empty, s), invalid_argument);
  const std::size_t overflowing[] = {SIZE_MAX - 10, 16};
  EXPECT_THROW((void)storage_t::allocate_parts(a, overflowing, s), invalid_argument);
  EXPECT_EQ(a.stats().allocations.aggregate.allocated, 0);
}

// The seed race on one block: part 0 read on `reader` (held, so the read is
// still queued) and recorded there, part 1 used on `other`; both dropped, in
// either order, on a thread whose current stream is neither. The block must
// stay pending until the reader has run, and the read see part 0's bytes.
TYPED_TEST(storage_parts_test, a_block_is_freed_after_the_streams_of_every_part_whichever_goes_last) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref own = this->new_stream(), reader = this->new_stream(), other = this->new_stream(),
                            elsewhere = this->new_stream();
  for (const bool reader_part_last : {false, true}) {
    auto parts = this->two_filled_parts(own);
    std::atomic<bool> open{false};
    hold(dev, reader, open);
    auto seen = this->queued_copy(parts[0], reader);
    parts[0].record_stream(reader);
    parts[1].record_stream(other);
    {
      backend::stream_guard on_elsewhere(dev, elsewhere);
      if (reader_part_last) std::swap(parts[0], parts[1]);
      parts[0] = storage_t();
      parts[1] = storage_t();
    }
    EXPECT_EQ(pending_frees(a), 1u) << "the block was freed while a part's read was queued (reader's part last: "
                                    << reader_part_last << ")";
    // What a reuse would write: a block as large, on the block's own stream.
    auto next = storage_t::allocate(a, 2 * part_bytes + 256, own);
    dev.fill(own, next.mutable_data(own), 0x99, next.size());
    open.store(true);
    dev.synchronize(reader);
    EXPECT_TRUE(all_equal(this->read(seen.data(), part_bytes, reader), 0x11)) << reader_part_last;
    dev.synchronize(own);
    EXPECT_EQ(pending_frees(a), 0u);
  }
}

// What PyTorch's Tensor.record_stream reaches with shoal as its allocator:
// the allocator's record_stream with a part's pointer, which starts no block
// unless it is part 0. Either way the whole block's free waits for the
// stream (the same read as the control below, recorded this way).
TYPED_TEST(storage_parts_test, the_allocators_record_stream_on_any_part_holds_the_whole_blocks_free) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref own = this->new_stream(), reader = this->new_stream();
  for (const std::size_t read_part : {0, 1}) {
    auto parts = this->two_filled_parts(own);
    std::atomic<bool> open{false};
    hold(dev, reader, open);
    auto seen = this->queued_copy(parts[read_part], reader);
    a.record_stream(const_cast<void*>(parts[read_part].data()), reader);
    parts.clear();
    EXPECT_EQ(pending_frees(a), 1u) << "part " << read_part << ": the block was freed under the recorded read";
    auto next = storage_t::allocate(a, 2 * part_bytes + 256, own);
    dev.fill(own, next.mutable_data(own), 0x99, next.size());
    open.store(true);
    dev.synchronize(reader);
    EXPECT_TRUE(all_equal(this->read(seen.data(), part_bytes, reader), read_part == 0 ? 0x11 : 0x22)) << read_part;
    dev.synchronize(own);
    EXPECT_EQ(pending_frees(a), 0u);
  }
  auto one = storage_t::allocate(a, part_bytes, own);
  void* inside = static_cast<std::byte*>(one.mutable_data(own)) + 4096;
  one = storage_t();
  a.process_pending_frees();
  EXPECT_THROW(a.record_stream(inside, reader), invalid_argument) << "inside a free block";
}

// The control: the reader's use of part 0 is never recorded, so nothing
// tells the block's free about it, and the block is reused under the read.
TYPED_TEST(storage_parts_test, control_a_part_read_unrecorded_on_another_stream_is_overwritten) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a real data race between two streams, on purpose: not under ThreadSanitizer";
#endif
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref own = this->new_stream(), reader = this->new_stream();
  auto parts = this->two_filled_parts(own);
  std::atomic<bool> open{false};
  hold(dev, reader, open);
  auto seen = this->queued_copy(parts[0], reader);
  parts.clear();
  EXPECT_EQ(pending_frees(a), 0u);
  auto next = storage_t::allocate(a, 2 * part_bytes + 256, own);
  dev.fill(own, next.mutable_data(own), 0x99, next.size());
  dev.synchronize(own);
  open.store(true);
  dev.synchronize(reader);
  EXPECT_FALSE(all_equal(this->read(seen.data(), part_bytes, reader), 0x11))
      << "the race did not show: the safe test would prove nothing";
}

}  // namespace
}  // namespace shoal::testing
