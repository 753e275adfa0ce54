// shoal_bench_threads: what sharing one allocator costs threads that each
// work on a stream of their own, at 1, 2, 4, 8 and 16 threads, against
//   - the same threads with an allocator each (nothing shared at all: the
//     ceiling of shoal's own code on this machine), and
//   - private work (32 xorshift rounds a pair, in registers: a ceiling of
//     the machine that touches no memory). One dependent chain: it keeps
//     about one instruction a cycle busy, so it also runs at full speed
//     where two threads share a core;
//   - the same rounds on four independent chains (several instructions a
//     cycle, as the allocator's loop runs): it slows where threads share a
//     core, which the first cannot show;
//   - a free list per thread (a pop and a push a pair, in the thread's own
//     cache lines; 64 times the pairs of the others, so that it runs as
//     long): the least any allocator's loop can do.
// Each thread runs compare_allocators' thread-row loop: allocate and free
// one block, cycling through eight sizes of 4–7.5 KiB.
//
//   shoal_bench_threads [--backend host|cuda] [--pairs N] [--rounds N] [--pin]
//
// --pin puts thread i on CPU i (modulo the CPUs there are). Prints M pairs/s aggregate, the median over
// the rounds (each round runs the three side by side), with min–max.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "bench/common/spread.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"

namespace {

using shoal::bench::spread;
using shoal::bench::summarize;
using shoal::bench::text;

using namespace shoal;
using clock_type = std::chrono::steady_clock;

struct options {
  std::string backend = "cuda";
  long pairs = 2'000'000;  // per thread
  int rounds = 3;
  bool pin = false;
};

std::size_t block_size(long i) { return 4096 + 512 * static_cast<std::size_t>(i & 7); }

// Runs body(thread, pairs) on `threads` threads started together; returns
// M pairs/s over the wall time from the start to the last one's end. Each
// thread first runs a short warm-up (body(thread, 1000)) before the start.
template <class Body>
double aggregate_rate(int threads, long pairs, bool pin, const Body& body) {
  std::atomic<int> ready{0};
  std::atomic<bool> start{false};
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      if (pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(static_cast<unsigned>(t) % std::max(1u, std::thread::hardware_concurrency()), &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
      }
      body(t, 1000);
      ready.fetch_add(1);
      while (!start.load(std::memory_order_acquire)) {
      }
      body(t, pairs);
    });
  }
  while (ready.load() < threads) {
  }
  const auto t0 = clock_type::now();
  start.store(true, std::memory_order_release);
  for (auto& w : workers) w.join();
  const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  return static_cast<double>(threads) * static_cast<double>(pairs) / seconds / 1e6;
}

void pairs_on(alloc::caching_allocator& a, backend::device& dev, backend::stream& s, long pairs) {
  const backend::stream_guard on_s(dev, s);
  for (long i = 0; i < pairs; ++i) {
    void* p = a.allocate(block_size(i));
    asm volatile("" : : "r"(p) : "memory");
    a.deallocate(p);
  }
}

void private_work(int thread, long pairs) {
  std::uint64_t x = 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(thread);
  for (long i = 0; i < pairs; ++i) {
    for (int r = 0; r < 32; ++r) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
    }
    asm volatile("" : "+r"(x));
  }
}

// Four independent chains of the same rounds: the same work per pair in a
// quarter of the dependent steps.
void private_work_four_chains(int thread, long pairs) {
  std::uint64_t x[4];
  for (int c = 0; c < 4; ++c) x[c] = 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(thread * 4 + c + 1);
  for (long i = 0; i < pairs; ++i) {
    for (int r = 0; r < 8; ++r) {
      for (auto& v : x) {
        v ^= v << 13;
        v ^= v >> 7;
        v ^= v << 17;
      }
    }
    asm volatile("" : "+r"(x[0]), "+r"(x[1]), "+r"(x[2]), "+r"(x[3]));
  }
}

// One node per size, each the head of its size's free list, on a cache line
// of the thread's own stack: a pair pops the size's node and pushes it back.
void free_list_pairs(int, long pairs) {
  struct alignas(64) node {
    node* next;
    std::size_t size;
  };
  node nodes[8];
  node* heads[8];
  for (int k = 0; k < 8; ++k) {
    nodes[k] = {nullptr, block_size(k)};
    heads[k] = &nodes[k];
  }
  for (long i = 0; i < pairs; ++i) {
    const auto k = static_cast<std::size_t>(i & 7);
    node* n = heads[k];
    heads[k] = n->next;
    asm volatile("" : : "r"(n) : "memory");
    n->next = heads[k];
    heads[k] = n;
  }
}

int run(const options& o) {
  backend::device& dev = o.backend == "host" ? backend::host_device_instance() : backend::cuda_device_instance(0);
  std::printf("thread scaling on %s (%s backend), %ld pairs a thread, %d rounds%s; M pairs/s aggregate, "
              "median (min–max); × one thread in the scaling columns\n\n",
              dev.name().c_str(), o.backend.c_str(), o.pairs, o.rounds, o.pin ? ", thread i on CPU i" : "");
  std::printf("| threads | one shared allocator | an allocator each | shared / each | private work "
              "| private work, four chains | a free list each "
              "| scaling: shared / each / private work / four chains / free list |\n"
              "| ---: | --- | --- | ---: | --- | --- | --- | --- |\n");
  double one_shared = 0, one_each = 0, one_private = 0, one_chains = 0, one_list = 0;
  for (const int threads : {1, 2, 4, 8, 16}) {
    std::vector<std::unique_ptr<backend::stream>> streams;
    for (int t = 0; t < threads; ++t) streams.push_back(std::make_unique<backend::stream>(dev));
    std::vector<double> shared, each, priv, chains, list, ratio;
    for (int r = 0; r < o.rounds; ++r) {
      {
        alloc::caching_allocator a(dev, {});
        shared.push_back(aggregate_rate(threads, o.pairs, o.pin,
                                        [&](int t, long n) { pairs_on(a, dev, *streams[t], n); }));
      }
      {
        std::vector<std::unique_ptr<alloc::caching_allocator>> own;
        for (int t = 0; t < threads; ++t) own.push_back(std::make_unique<alloc::caching_allocator>(dev, alloc::allocator_config{}));
        each.push_back(aggregate_rate(threads, o.pairs, o.pin,
                                      [&](int t, long n) { pairs_on(*own[t], dev, *streams[t], n); }));
      }
      priv.push_back(aggregate_rate(threads, o.pairs, o.pin, private_work));
      chains.push_back(aggregate_rate(threads, o.pairs, o.pin, private_work_four_chains));
      list.push_back(aggregate_rate(threads, o.pairs * 64, o.pin, free_list_pairs));
      ratio.push_back(shared.back() / each.back());
    }
    const spread s = summarize(shared), e = summarize(each), p = summarize(priv), c = summarize(chains),
                 l = summarize(list), q = summarize(ratio);
    if (threads == 1) {
      one_shared = s.median;
      one_each = e.median;
      one_private = p.median;
      one_chains = c.median;
      one_list = l.median;
    }
    std::printf("| %d | %s | %s | %.2f | %s | %s | %s | %.2f× / %.2f× / %.2f× / %.2f× / %.2f× |\n", threads,
                text(s).c_str(), text(e).c_str(), q.median, text(p).c_str(), text(c).c_str(), text(l).c_str(),
                s.median / one_shared, e.median / one_each, p.median / one_private, c.median / one_chains,
                l.median / one_list);
    std::fflush(stdout);
  }
  return 0;
}

[[noreturn]] void usage(const char* program) {
  std::fprintf(stderr, "usage: %s [--backend host|cuda] [--pairs N] [--rounds N] [--pin]\n", program);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--pin") {
      o.pin = true;
    } else if (i + 1 < argc && flag == "--backend") {
      o.backend = argv[++i];
    } else if (i + 1 < argc && flag == "--pairs") {
      o.pairs = std::max(1L, std::atol(argv[++i]));
    } else if (i + 1 < argc && flag == "--rounds") {
      o.rounds = std::max(1, std::atoi(argv[++i]));
    } else {
      usage(argv[0]);
    }
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_threads: %s\n", e.what());
    return 1;
  }
}
