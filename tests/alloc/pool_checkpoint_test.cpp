// Checkpoints of growing private pools (checkpoint_private_pool,
// restore_private_pool): CUDA graph trees take a graph pool's layout after
// a capture and lay the pool out that way again before replaying another
// path, its allocated blocks allocated again at the same addresses.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <new>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"
#include "support/forwarding_device.h"
#include "support/refused_allocations.h"
#include "support/region_pool.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Param>
using pool_checkpoints = allocator_test<Param>;
TYPED_TEST_SUITE(pool_checkpoints, backend_config_types, backend_config_names);

std::uintptr_t at(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

void* allocate_in(alloc::caching_allocator& a, alloc::private_pool_id pool, std::size_t bytes,
                  backend::stream_ref on = {}) {
  alloc::private_pool_scope scope(a, pool);
  return a.allocate(bytes, on);
}

/// What two layouts differ in, segment by segment ("" when they agree).
std::string difference(const alloc::pool_checkpoint& want, const alloc::pool_checkpoint& got) {
  std::map<std::uintptr_t, const alloc::pool_checkpoint::segment_state*> got_by_base;
  for (const auto& s : got.segments) got_by_base[s.base] = &s;
  for (const auto& s : want.segments) {
    const auto found = got_by_base.find(s.base);
    if (found == got_by_base.end()) return "no segment at " + std::to_string(s.base);
    const auto& blocks = found->second->blocks;
    if (blocks.size() != s.blocks.size()) {
      return "segment " + std::to_string(s.base) + ": " + std::to_string(blocks.size()) + " blocks, not " +
             std::to_string(s.blocks.size());
    }
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const auto& w = s.blocks[i];
      const auto& g = blocks[i];
      if (w.address != g.address || w.size != g.size || w.allocated != g.allocated || w.requested != g.requested ||
          w.stream != g.stream) {
        return "segment " + std::to_string(s.base) + ", block " + std::to_string(i) + " differs";
      }
    }
  }
  return "";
}

std::set<std::uintptr_t> allocated_in(const alloc::pool_checkpoint& c) {
  std::set<std::uintptr_t> out;
  for (const auto& s : c.segments) {
    for (const auto& b : s.blocks) {
      if (b.allocated) out.insert(b.address);
    }
  }
  return out;
}

TYPED_TEST(pool_checkpoints, a_restore_lays_the_pool_out_again_and_allocates_its_blocks_again) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  void* first = allocate_in(a, pool, 1 * mib);
  void* gone = allocate_in(a, pool, 64 * kib);
  void* kept = allocate_in(a, pool, 3000);
  a.deallocate(gone, {});
  const auto saved = a.checkpoint_private_pool(pool);
  EXPECT_EQ(allocated_in(saved), (std::set{at(first), at(kept)}));
  const auto bytes_then = a.stats().allocated_bytes.aggregate.current;

  a.deallocate(first, {});
  void* later = allocate_in(a, pool, 2 * mib);
  void* small = allocate_in(a, pool, 512);
  const auto result = a.restore_private_pool(pool, saved);

  EXPECT_EQ(std::set(result.freed.begin(), result.freed.end()), (std::set{at(kept), at(later), at(small)}));
  std::set<std::uintptr_t> made;
  for (const auto& b : result.allocated) made.insert(b.address);
  EXPECT_EQ(made, (std::set{at(first), at(kept)}));
  EXPECT_EQ(difference(saved, a.checkpoint_private_pool(pool)), "");
  EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, bytes_then);
  EXPECT_EQ(a.stats().requested_bytes.aggregate.current, static_cast<std::int64_t>(1 * mib + 3000));
  a.check_invariants();
  if (at(later) != at(first) && at(later) != at(kept)) {
    EXPECT_THROW(a.deallocate(later, {}), shoal::invalid_argument) << "a freed block is no one's to free";
  }
  a.deallocate(first, {});  // the new owners free theirs
  a.deallocate(kept, {});
  EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, 0);
  a.check_invariants();
  a.destroy_private_pool(pool);
}

TYPED_TEST(pool_checkpoints, segments_taken_since_the_checkpoint_are_left_free) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  void* p = allocate_in(a, pool, 1 * mib);
  const auto saved = a.checkpoint_private_pool(pool);
  void* big = allocate_in(a, pool, 40 * mib);  // a segment of its own
  const auto reserved = a.stats().reserved_bytes.aggregate.current;
  ASSERT_GT(a.checkpoint_private_pool(pool).segments.size(), saved.segments.size());
  const auto result = a.restore_private_pool(pool, saved);
  EXPECT_EQ(std::set(result.freed.begin(), result.freed.end()), (std::set{at(p), at(big)}));
  const auto after = a.checkpoint_private_pool(pool);
  EXPECT_EQ(difference(saved, after), "");
  for (const auto& s : after.segments) {
    if (s.base <= at(big) && at(big) < s.base + s.size) {
      ASSERT_EQ(s.blocks.size(), 1u);
      EXPECT_FALSE(s.blocks[0].allocated) << "the segment taken since is one free block";
    }
  }
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, reserved) << "no memory goes back";
  a.check_invariants();
  a.deallocate(p, {});
  a.destroy_private_pool(pool);
}

TYPED_TEST(pool_checkpoints, a_checkpoint_that_does_not_fit_the_pool_is_refused_and_changes_nothing) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  const auto other = a.create_growing_private_pool();
  void* p = allocate_in(a, pool, 64 * kib);
  const auto saved = a.checkpoint_private_pool(pool);
  void* q = allocate_in(a, pool, 4 * kib);
  const auto now = a.checkpoint_private_pool(pool);

  EXPECT_THROW(a.restore_private_pool(other, saved), shoal::invalid_argument) << "another pool's checkpoint";
  auto untiled = saved;
  untiled.segments[0].blocks[0].size += 512;
  EXPECT_THROW(a.restore_private_pool(pool, untiled), shoal::invalid_argument) << "blocks that do not tile the segment";
  auto moved = saved;
  moved.segments[0].base += 2 * mib;
  EXPECT_THROW(a.restore_private_pool(pool, moved), shoal::invalid_argument) << "a segment the pool does not have";
  auto twice = saved;
  twice.segments.push_back(twice.segments[0]);
  EXPECT_THROW(a.restore_private_pool(pool, twice), shoal::invalid_argument) << "one segment listed twice";
  a.mark_held_outside(q);
  EXPECT_THROW(a.restore_private_pool(pool, saved), shoal::invalid_argument) << "a block another process holds";
  a.unmark_held_outside(q);
  EXPECT_EQ(difference(now, a.checkpoint_private_pool(pool)), "") << "nothing changed";
  a.check_invariants();

  region_pool region(this->device(), a, 4 * mib);
  EXPECT_THROW((void)a.checkpoint_private_pool(region.id), shoal::invalid_argument) << "memory handed in";
  a.deallocate(p, {});
  a.deallocate(q, {});
  a.destroy_private_pool(pool);
  a.destroy_private_pool(other);
  a.destroy_private_pool(region.id);
}

// The old owners' work queued on the pool's memory must be passed before the
// restored owners' work touches it: a late write on another stream must not
// land after the restored block's new owner wrote it.
TYPED_TEST(pool_checkpoints, the_restored_owners_stream_waits_for_the_old_users_work) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream owner(dev), old_user(dev);
  const auto pool = a.create_growing_private_pool();
  constexpr std::size_t bytes = 256 * kib;
  void* p = allocate_in(a, pool, bytes, owner);
  const auto saved = a.checkpoint_private_pool(pool);
  a.deallocate(p, owner);
  dev.synchronize(owner);
  void* taken = allocate_in(a, pool, bytes, old_user);
  ASSERT_EQ(taken, p) << "the old user got the same memory";
  dev.delay(old_user, 300ms);
  dev.fill(old_user, taken, 0x22, bytes);  // the old user's late write, queued
  const auto result = a.restore_private_pool(pool, saved);
  ASSERT_EQ(result.allocated.size(), 1u);
  ASSERT_EQ(result.allocated[0].address, at(p));
  EXPECT_EQ(result.allocated[0].stream, owner) << "allocated again on the stream the checkpoint names";
  dev.fill(owner, p, 0x33, bytes);
  dev.synchronize(old_user);  // the late write has landed, before or after the new owner's
  EXPECT_TRUE(all_equal(this->read(p, bytes, owner), 0x33)) << "the old user's late write overtook the new owner's";
  a.deallocate(p, owner);
  dev.synchronize(owner);
  a.destroy_private_pool(pool);
}

// The same for memory the restore leaves free: whoever is handed it next,
// on any stream, waits for the old users' work first.
TYPED_TEST(pool_checkpoints, memory_a_restore_leaves_free_waits_for_the_old_users_work) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream first_user(dev), old_user(dev), next_user(dev);
  const auto pool = a.create_growing_private_pool();
  constexpr std::size_t bytes = 256 * kib;
  // The segment taken (and its free rest's last stream) on another stream
  // than the old user's, so that the restore's drain does not wait for it.
  a.deallocate(allocate_in(a, pool, bytes, first_user), first_user);
  dev.synchronize(first_user);
  const auto saved = a.checkpoint_private_pool(pool);  // nothing allocated
  void* taken = allocate_in(a, pool, bytes, old_user);
  dev.delay(old_user, 300ms);
  dev.fill(old_user, taken, 0x22, bytes);  // the old user's late write, queued
  (void)a.restore_private_pool(pool, saved);
  void* next = allocate_in(a, pool, bytes, next_user);
  ASSERT_EQ(next, taken);
  dev.fill(next_user, next, 0x33, bytes);
  dev.synchronize(old_user);
  EXPECT_TRUE(all_equal(this->read(next, bytes, next_user), 0x33)) << "the old user's late write overtook the next";
  a.deallocate(next, next_user);
  dev.synchronize(next_user);
  a.destroy_private_pool(pool);
}

// Debug mode poisons what a restore frees, as it poisons every free; the
// blocks it allocates again keep their bytes.
TYPED_TEST(pool_checkpoints, debug_mode_poisons_what_a_restore_leaves_free_but_not_what_it_allocates_again) {
  auto& dev = this->device();
  auto& a = this->make("debug:true");
  backend::stream mine(dev), other(dev);
  const auto pool = a.create_growing_private_pool();
  constexpr std::size_t bytes = 64 * kib;
  void* kept = allocate_in(a, pool, bytes, mine);
  const auto saved = a.checkpoint_private_pool(pool);
  void* freed = allocate_in(a, pool, bytes, other);
  dev.fill(mine, kept, 0x11, bytes);
  dev.delay(other, 200ms);
  dev.fill(other, freed, 0x22, bytes);  // the old user's late write, queued
  (void)a.restore_private_pool(pool, saved);
  dev.synchronize(mine);
  dev.synchronize(other);
  EXPECT_TRUE(all_equal(this->read(freed, bytes, other), 0xDB))
      << "memory the restore freed does not hold the poison pattern, after its old user's write";
  EXPECT_TRUE(all_equal(this->read(kept, bytes, mine), 0x11)) << "a block the restore allocated again lost its bytes";
  a.deallocate(kept, mine);
  dev.synchronize(mine);
  a.destroy_private_pool(pool);
}

// The poison comes after the work of every stream that used the memory,
// though no block the restore allocates makes the streams wait (an empty
// checkpoint) and the fill's stream is not the late writer's.
TYPED_TEST(pool_checkpoints, debug_mode_poisons_what_a_restore_leaves_free_after_every_old_user) {
  auto& dev = this->device();
  auto& a = this->make("debug:true");
  backend::stream mine(dev), other(dev);
  const auto pool = a.create_growing_private_pool();
  const auto saved = a.checkpoint_private_pool(pool);  // no segment yet
  constexpr std::size_t bytes = 64 * kib;
  void* first = allocate_in(a, pool, bytes, mine);
  void* late = allocate_in(a, pool, bytes, other);
  dev.delay(other, 200ms);
  dev.fill(other, late, 0x22, bytes);  // the old user's late write, queued
  const auto result = a.restore_private_pool(pool, saved);
  EXPECT_EQ(std::set(result.freed.begin(), result.freed.end()), (std::set{at(first), at(late)}));
  dev.synchronize(mine);
  dev.synchronize(other);
  EXPECT_TRUE(all_equal(this->read(late, bytes, other), 0xDB)) << "the old user's late write overtook the poison";
  a.check_invariants();
  a.destroy_private_pool(pool);
}

TYPED_TEST(pool_checkpoints, a_free_waiting_for_a_stream_completes_before_the_restore) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream mine(dev), other(dev);
  const auto pool = a.create_growing_private_pool();
  void* p = allocate_in(a, pool, 64 * kib, mine);
  const auto saved = a.checkpoint_private_pool(pool);
  void* q = allocate_in(a, pool, 64 * kib, mine);
  dev.delay(other, 100ms);
  a.deallocate(q, other);  // waits for `other`
  const auto result = a.restore_private_pool(pool, saved);
  EXPECT_EQ(std::set(result.freed.begin(), result.freed.end()), std::set{at(p)}) << "q was its owner's free";
  EXPECT_EQ(difference(saved, a.checkpoint_private_pool(pool)), "");
  a.check_invariants();
  a.deallocate(p, mine);
  dev.synchronize(mine);
  a.destroy_private_pool(pool);
}

// A checkpoint whose free blocks lie side by side (none the allocator takes
// has them: they merge) is laid out with them merged.
TYPED_TEST(pool_checkpoints, free_neighbours_in_a_checkpoint_become_one_free_block) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  (void)allocate_in(a, pool, 64 * kib);  // freed by the restore
  auto saved = a.checkpoint_private_pool(pool);
  ASSERT_EQ(saved.segments.size(), 1u);
  auto& blocks = saved.segments[0].blocks;
  ASSERT_EQ(blocks.size(), 2u);  // p, then the free rest
  ASSERT_TRUE(blocks[0].allocated);
  const auto rest = blocks[1];
  const std::size_t half = rest.size / 2 / 512 * 512;
  // [free 16 KiB, free 48 KiB, allocated: the rest's first half, free, free]
  const auto p_address = blocks[0].address;
  blocks = {{p_address, 16 * kib, false, 0, {}},
            {p_address + 16 * kib, 48 * kib, false, 0, {}},
            {rest.address, half, true, 1000, {}},
            {rest.address + half, 512, false, 0, {}},
            {rest.address + half + 512, rest.size - half - 512, false, 0, {}}};
  const auto result = a.restore_private_pool(pool, saved);
  ASSERT_EQ(result.allocated.size(), 1u);
  EXPECT_EQ(result.allocated[0], (alloc::pool_restore_result::allocated_block{rest.address, half, {}}));
  const auto after = a.checkpoint_private_pool(pool).segments[0].blocks;
  ASSERT_EQ(after.size(), 3u) << "free neighbours merged";
  EXPECT_EQ(after[0].size, 64 * kib);
  EXPECT_TRUE(after[1].allocated);
  EXPECT_EQ(after[2].size, rest.size - half);
  a.check_invariants();
  a.deallocate(reinterpret_cast<void*>(rest.address), {});
  a.destroy_private_pool(pool);
}

TYPED_TEST(pool_checkpoints, a_pool_over_memory_handed_in_is_refused) {
  auto& a = this->make();
  region_pool region(this->device(), a, 4 * mib);
  alloc::pool_checkpoint made;
  made.pool = region.id;
  EXPECT_THROW(a.restore_private_pool(region.id, made), shoal::invalid_argument);
  a.destroy_private_pool(region.id);
}

// A device that refuses to make a stream wait, once asked to.
class refusing_waits : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void wait(backend::stream_ref stream, backend::event_ref event) override {
    if (refuse) throw backend_error("cudaStreamWaitEvent", "refused by the test");
    forwarding_device::wait(stream, event);
  }
  bool refuse = false;
};

TEST(pool_checkpoints_errors, a_device_error_while_the_streams_wait_leaves_the_layout_as_it_was) {
  backend::host_device host;
  refusing_waits dev(host);
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  backend::stream owner(dev), other(dev);
  const auto pool = a.create_growing_private_pool();
  void* p = allocate_in(a, pool, 64 * kib, owner);
  const auto saved = a.checkpoint_private_pool(pool);
  a.deallocate(p, owner);
  void* q = allocate_in(a, pool, 64 * kib, other);  // the restored owner will have to wait for `other`
  const auto before = a.checkpoint_private_pool(pool);
  dev.refuse = true;
  EXPECT_THROW(a.restore_private_pool(pool, saved), backend_error);
  dev.refuse = false;
  EXPECT_EQ(difference(before, a.checkpoint_private_pool(pool)), "") << "nothing changed";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
  a.check_invariants();
  const auto result = a.restore_private_pool(pool, saved);  // the same restore, once the device agrees
  EXPECT_EQ(result.freed, std::vector{at(q)});
  a.deallocate(p, owner);
  dev.synchronize(owner);
  a.destroy_private_pool(pool);
}

// Phase 1 takes every piece of host memory a restore needs (block objects,
// room for their last streams, the index, the result's lists): refused any
// one of them, the restore throws std::bad_alloc and the layout, the
// counters and the blocks' owners are as they were. Each refusal gets a
// fresh allocator in the same state (an attempt's reserves would otherwise
// serve the next, which would skip steps).
struct restore_scenario {
  backend::host_device dev;
  alloc::caching_allocator a{dev, alloc::allocator_config{}};
  std::vector<backend::stream> streams;  // more than any block object's room for last streams so far
  alloc::private_pool_id pool;
  std::vector<void*> first;
  alloc::pool_checkpoint saved, before;

  restore_scenario() {
    for (int i = 0; i < 6; ++i) streams.emplace_back(dev);
    pool = a.create_growing_private_pool();
    for (std::size_t i = 0; i < 6; ++i) first.push_back(allocate_in(a, pool, (i + 1) * 64 * kib, on(i)));
    a.deallocate(first[1], on(1));
    a.deallocate(first[2], on(2));  // free neighbours: merged in the checkpoint's layout
    saved = a.checkpoint_private_pool(pool);
    for (std::size_t i : {0, 3, 4, 5}) a.deallocate(first[i], on(i));
    for (std::size_t i = 0; i < 40; ++i) (void)allocate_in(a, pool, 4 * kib, on(i));  // the index grows
    (void)allocate_in(a, pool, 40 * mib, on(1));  // a segment taken since
    before = a.checkpoint_private_pool(pool);
  }
  ~restore_scenario() {
    if (!difference(saved, a.checkpoint_private_pool(pool)).empty()) (void)a.restore_private_pool(pool, saved);
    for (std::size_t i : {0, 3, 4, 5}) a.deallocate(first[i], {});
    for (auto& s : streams) dev.synchronize(s);
    a.destroy_private_pool(pool);
  }
  backend::stream_ref on(std::size_t i) { return streams[i % streams.size()]; }
};

TEST(pool_checkpoints_errors, a_restore_refused_host_memory_at_any_step_changes_nothing) {
  int refusals = 0;
  for (int nth = 1;; ++nth) {
    restore_scenario t;
    const auto stats_before = t.a.stats().to_json();
    bool threw = false;
    bool refused = false;
    {
      refusing_one_allocation refuse(nth, [] {});
      try {
        (void)t.a.restore_private_pool(t.pool, t.saved);  // frees the blocks allocated since: no one's to free
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      refused = refuse.refused();
    }
    ASSERT_TRUE(refused || !threw) << "allocation " << nth << ": only a refusal makes the restore fail";
    ASSERT_NO_THROW(t.a.check_invariants());
    if (!refused) {  // the restore made fewer allocations: it went through
      EXPECT_EQ(difference(t.saved, t.a.checkpoint_private_pool(t.pool)), "");
      break;
    }
    if (!threw) {
      // Absorbed after the restore (builds that check invariants after every
      // step skip a check the host has no memory for): it went through.
      EXPECT_EQ(difference(t.saved, t.a.checkpoint_private_pool(t.pool)), "") << "refused at allocation " << nth;
      continue;
    }
    ++refusals;
    ASSERT_EQ(difference(t.before, t.a.checkpoint_private_pool(t.pool)), "") << "refused at allocation " << nth;
    ASSERT_EQ(t.a.stats().to_json(), stats_before) << "refused at allocation " << nth;
  }
  EXPECT_GE(refusals, 5) << "the restore took host memory in fewer steps than the test names";
}

// Over seeded random schedules (allocations of 512 B to 6 MiB on two streams,
// frees, checkpoints kept, restores of any kept one), after every restore the
// pool's layout is the checkpoint's, the blocks the test holds are exactly
// its allocated ones, and the invariants hold.
TYPED_TEST(pool_checkpoints, restores_over_random_schedules_give_back_each_checkpoints_layout) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream s0(dev), s1(dev);
  const backend::stream_ref streams[] = {s0, s1};
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    std::mt19937 random(seed);
    const auto pool = a.create_growing_private_pool();
    std::map<std::uintptr_t, backend::stream_ref> live;
    std::vector<alloc::pool_checkpoint> kept;
    int restores = 0;
    for (int step = 0; step < 200; ++step) {
      const auto choice = random() % 20;
      const std::string where = "seed " + std::to_string(seed) + ", step " + std::to_string(step);
      if (choice < 9 || live.empty()) {
        const std::size_t bytes = random() % 4 != 0 ? 512 + random() % (256 * kib) : mib + random() % (5 * mib);
        const auto on = streams[random() % 2];
        live.emplace(at(allocate_in(a, pool, bytes, on)), on);
      } else if (choice < 16) {
        auto it = live.begin();
        std::advance(it, static_cast<long>(random() % live.size()));
        a.deallocate(reinterpret_cast<void*>(it->first), it->second);
        live.erase(it);
      } else if (choice < 18 || kept.empty()) {
        kept.push_back(a.checkpoint_private_pool(pool));
      } else {
        const auto& saved = kept[random() % kept.size()];
        const auto result = a.restore_private_pool(pool, saved);
        ++restores;
        std::set<std::uintptr_t> freed(result.freed.begin(), result.freed.end());
        std::set<std::uintptr_t> held;
        for (const auto& [address, on] : live) held.insert(address);
        ASSERT_EQ(freed, held) << where << ": every block held was freed";
        live.clear();
        for (const auto& s : saved.segments) {
          for (const auto& b : s.blocks) {
            if (b.allocated) live.emplace(b.address, b.stream);
          }
        }
        ASSERT_EQ(result.allocated.size(), live.size()) << where;
        ASSERT_EQ(difference(saved, a.checkpoint_private_pool(pool)), "") << where;
        a.check_invariants();
      }
    }
    EXPECT_GT(restores, 5) << "seed " << seed;
    for (const auto& [address, on] : live) a.deallocate(reinterpret_cast<void*>(address), on);
    for (const auto s : streams) dev.synchronize(s);
    a.destroy_private_pool(pool);
    a.check_invariants();
  }
  EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, 0);
}

}  // namespace
}  // namespace shoal::testing
