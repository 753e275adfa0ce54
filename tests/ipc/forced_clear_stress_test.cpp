// Forced clears of a private pool (live_blocks::invalidate) racing its
// owners: several threads allocate and free raw blocks and storages, record
// streams, and send storages (the producer side of sharing: hand-over,
// held-outside mark, slot claim, abandon), each from its own seeded random
// sequence, while another thread clears the pool again and again. Every
// free and late free must be accepted, no owner's block may be freed by
// another's late free, and at the end the pool must be whole and free
// again with every tombstone gone. Run under TSan by scripts/test.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ipc/producer_state.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/core/process_identity.h"
#include "shoal/storage/storage.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using alloc::live_blocks;
constexpr std::size_t kib = 1024, mib = kib * kib;

// Operations per owner thread; instrumented builds pass fewer
// (SHOAL_TEST_STRESS_OPERATIONS, scripts/test).
std::size_t operations() {
  const char* n = std::getenv("SHOAL_TEST_STRESS_OPERATIONS");
  return n != nullptr ? std::strtoul(n, nullptr, 10) : 3000;
}

TEST(forced_clear_stress, frees_and_sends_racing_forced_clears_lose_nothing_and_free_nothing_newer) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, {});
  constexpr std::size_t region_bytes = 8 * mib;
  void* region = dev.allocate_segment(region_bytes);
  const auto pool = a.create_private_pool(region, region_bytes);
  auto state = std::make_shared<ipc::detail::producer_state>(a, ipc::sharing_options{});
  state->attach();
  const process_identity holder = process_identity::self();
  state->connect(holder);

  constexpr int owners = 3;
  const std::size_t ops = operations();
  std::atomic<int> owners_running{owners};
  std::atomic<std::size_t> unexpected{0}, taken_blocks{0}, clears{0}, refused_clears{0}, refused_sends{0}, sent{0};
  std::vector<std::string> failures(owners);

  // Every owner's stream outlives every owner: a private pool's free block
  // remembers the streams that last used it.
  std::vector<backend::stream> streams;
  for (int i = 0; i < owners; ++i) streams.emplace_back(dev);
  const auto owner = [&](int index) {
    std::mt19937 rng(1000 + index);
    const backend::stream_ref own = streams[index];
    alloc::private_pool_scope scope(a, pool);
    std::vector<void*> raw;
    std::vector<storage::storage> storages;
    std::vector<ipc::detail::producer_state::share> shares;
    const auto pick = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
    const auto size = [&] { return std::size_t{512} << std::uniform_int_distribution<int>(0, 9)(rng); };
    const auto fail = [&](const std::string& what) {
      unexpected.fetch_add(1);
      if (failures[index].empty()) failures[index] = what;
      std::fprintf(stderr, "owner %d: %s\n", index, what.c_str());
    };
    unsigned last_op = 0;
    for (std::size_t i = 0; i < ops; ++i) {
      if (i % 40 == 0) {  // lets a clear come between, so that many do
        const std::size_t seen = clears.load() + refused_clears.load();
        const auto until = std::chrono::steady_clock::now() + 20ms;
        while (clears.load() + refused_clears.load() == seen && std::chrono::steady_clock::now() < until) {
          std::this_thread::yield();
        }
      }
      const backend::stream_ref s = rng() % 2 == 0 ? own : backend::stream_ref{};
      try {
        const unsigned op = rng() % 8;
        last_op = op;
        switch (op) {
          case 0:
          case 1:
            raw.push_back(a.allocate(size(), s));
            break;
          case 2:
            if (!raw.empty()) {
              const std::size_t k = pick(raw.size());
              a.deallocate(raw[k], s);  // a late free when a clear took it: accepted all the same
              raw.erase(raw.begin() + static_cast<std::ptrdiff_t>(k));
            }
            break;
          case 3:
            storages.push_back(storage::storage::allocate(a, size(), s));
            break;
          case 4:
            if (!storages.empty()) {
              const std::size_t k = pick(storages.size());
              storages[k].record_stream(own);  // a tombstone's record_stream does nothing
              storages.erase(storages.begin() + static_cast<std::ptrdiff_t>(k));  // its free, late or not
            }
            break;
          case 5:
            if (!storages.empty()) {
              try {
                shares.push_back(state->share_storage(storages[pick(storages.size())], holder, s));
                sent.fetch_add(1);
              } catch (const invalid_argument&) {
                refused_sends.fetch_add(1);  // a clear took its block: sent no more
              }
            }
            break;
          case 6:
            if (!shares.empty()) {  // the holder lets go (as a send that never arrived would)
              const std::size_t k = pick(shares.size());
              state->abandon(shares[k]);
              shares.erase(shares.begin() + static_cast<std::ptrdiff_t>(k));
            }
            break;
          default:
            if (!raw.empty()) a.record_stream(raw[pick(raw.size())], own);
            break;
        }
      } catch (const out_of_memory&) {  // NOLINT(bugprone-empty-catch): the pool is full for now
      } catch (const std::exception& e) {
        fail(std::string("operation ") + std::to_string(i) + " (kind " + std::to_string(last_op) + "): " + e.what());
      }
    }
    try {
      for (const auto& sh : shares) state->abandon(sh);
      shares.clear();
      for (void* p : raw) a.deallocate(p, own);
      storages.clear();
      dev.synchronize(own);
    } catch (const std::exception& e) {
      fail(std::string("the final frees: ") + e.what());
    }
    owners_running.fetch_sub(1);
  };

  std::thread clearer([&] {
    std::mt19937 rng(7);
    while (owners_running.load() > 0) {
      try {
        const auto taken = a.clear_private_pool(pool, "", live_blocks::invalidate);
        taken_blocks.fetch_add(taken.blocks.size());
        clears.fetch_add(1);
      } catch (const invalid_argument&) {
        refused_clears.fetch_add(1);  // a block held outside: nothing was taken
      } catch (const std::exception& e) {
        unexpected.fetch_add(1);
        ADD_FAILURE() << "the clear threw: " << e.what();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < owners; ++i) threads.emplace_back(owner, i);
  for (auto& t : threads) t.join();
  clearer.join();

  for (const auto& f : failures) EXPECT_TRUE(f.empty()) << f;
  EXPECT_EQ(unexpected.load(), 0u);
  EXPECT_GT(clears.load(), 0u);
  EXPECT_GT(sent.load(), 0u);
  EXPECT_NO_THROW(a.check_invariants());
  (void)state->collect(false);
  const auto st = a.stats();
  EXPECT_EQ(st.allocations.aggregate.current, 0) << st.to_json();
  EXPECT_EQ(st.invalidated.aggregate.current, 0) << "every late free removed its tombstone: " << st.to_json();
  {
    alloc::private_pool_scope scope(a, pool);
    void* whole = a.allocate(region_bytes, {});
    EXPECT_EQ(whole, region) << "the region is one free block again";
    a.deallocate(whole, {});
  }
  RecordProperty("clears", std::to_string(clears.load()));
  RecordProperty("taken_blocks", std::to_string(taken_blocks.load()));
  std::printf("%zu clears (%zu refused), %zu blocks taken, %zu sends (%zu refused)\n", clears.load(),
              refused_clears.load(), taken_blocks.load(), sent.load(), refused_sends.load());
  a.destroy_private_pool(pool);
  state->disconnect(holder);
  state.reset();
  dev.synchronize_device();
  dev.free_segment(region);
}

}  // namespace
}  // namespace shoal::testing
