// shoal_bench_import_contention: what a consumer's import of a legacy CUDA
// IPC segment (cudaIpcOpenMemHandle) costs around the import itself, straight
// through the CUDA runtime (no shoal code). A first share's consumer side has
// measured 70-170 µs on machines whose import alone costs 44-92; this asks
// whether the consumer's state adds to it:
//   alone          one import open at a time (opened, then closed),
//   with k open    while k other imports of the same producer stay open
//                  (a consumer's retired mappings wait for its collector),
//   during closes  while another thread closes half of them (the
//                  collector's batch of closes).
// The producer is a second process (forked before CUDA starts) holding
// --segments segments of 64 MiB; their handles come through a pipe.
//
//   shoal_bench_import_contention [--segments N]   (N: 16 to 1024, default 96)
//
// Prints µs, median (min–max), one line per case.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/spread.h"

namespace {

using clock_type = std::chrono::steady_clock;
using shoal::bench::summarize;
using shoal::bench::text;

constexpr std::size_t segment_bytes = std::size_t{64} << 20;

// A failed runtime call ends the process with the call's name and error.
void check(cudaError_t result, const char* call) {
  if (result == cudaSuccess) return;
  std::fprintf(stderr, "shoal_bench_import_contention: %s failed: %s\n", call, cudaGetErrorString(result));
  std::_Exit(1);
}

double micros_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
}

void* open_handle(const cudaIpcMemHandle_t& handle) {
  void* base = nullptr;
  check(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return base;
}

bool read_all(int fd, void* to, std::size_t bytes) {
  auto* at = static_cast<char*>(to);
  while (bytes > 0) {
    const ssize_t got = ::read(fd, at, bytes);
    if (got <= 0) return false;
    at += got;
    bytes -= static_cast<std::size_t>(got);
  }
  return true;
}

void print_row(const char* what, const std::vector<double>& samples) {
  if (!samples.empty()) std::printf("| %s | %s |\n", what, text(summarize(samples)).c_str());
}

// The consumer: each case three times over every handle.
void consume(const std::vector<cudaIpcMemHandle_t>& handles) {
  const std::size_t n = handles.size();
  std::vector<double> alone, close_alone, few_open, half_open, most_open, during_closes;
  for (int round = 0; round < 3; ++round) {
    for (const auto& h : handles) {
      auto start = clock_type::now();
      void* base = open_handle(h);
      alone.push_back(micros_since(start));
      start = clock_type::now();
      check(cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle");
      close_alone.push_back(micros_since(start));
    }
    std::vector<void*> open(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto start = clock_type::now();
      open[i] = open_handle(handles[i]);
      (i < n / 8 ? few_open : i < n / 2 ? half_open : most_open).push_back(micros_since(start));
    }
    // Half stay open and are closed by another thread while the main thread
    // opens the other half again.
    for (std::size_t i = n / 2; i < n; ++i) check(cudaIpcCloseMemHandle(open[i]), "cudaIpcCloseMemHandle");
    std::atomic<bool> go{false};
    std::thread closer([&] {
      while (!go.load(std::memory_order_acquire)) {
      }
      for (std::size_t i = 0; i < n / 2; ++i) check(cudaIpcCloseMemHandle(open[i]), "cudaIpcCloseMemHandle");
    });
    go.store(true, std::memory_order_release);
    for (std::size_t i = n / 2; i < n; ++i) {
      const auto start = clock_type::now();
      open[i] = open_handle(handles[i]);
      during_closes.push_back(micros_since(start));
    }
    closer.join();
    for (std::size_t i = n / 2; i < n; ++i) check(cudaIpcCloseMemHandle(open[i]), "cudaIpcCloseMemHandle");
  }
  std::printf("| what (%zu segments of 64 MiB) | µs, median (min–max) |\n|---|---|\n", n);
  print_row("import alone (one open at a time)", alone);
  print_row("close alone", close_alone);
  const std::string few = "import with fewer than " + std::to_string(n / 8) + " others open";
  const std::string half = "import with " + std::to_string(n / 8) + " to " + std::to_string(n / 2 - 1) + " open";
  const std::string most = "import with " + std::to_string(n / 2) + " to " + std::to_string(n - 1) + " open";
  print_row(few.c_str(), few_open);
  print_row(half.c_str(), half_open);
  print_row(most.c_str(), most_open);
  const std::string during = "import while another thread closes " + std::to_string(n / 2);
  print_row(during.c_str(), during_closes);
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t segments = 96;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--segments") {
      segments = std::strtoul(argv[i + 1], nullptr, 10);
    } else {
      std::fprintf(stderr, "shoal_bench_import_contention: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (segments < 16 || segments > 1024) {
    std::fprintf(stderr, "shoal_bench_import_contention: --segments takes 16 to 1024\n");
    return 2;
  }
  int to_consumer[2], to_producer[2];
  if (::pipe(to_consumer) != 0 || ::pipe(to_producer) != 0) return 1;
  const pid_t consumer = ::fork();  // before CUDA starts in either process
  if (consumer < 0) return 1;
  std::vector<cudaIpcMemHandle_t> handles(segments);
  const std::size_t handle_bytes = sizeof(cudaIpcMemHandle_t) * segments;
  if (consumer == 0) {
    check(cudaSetDevice(0), "cudaSetDevice");
    check(cudaFree(nullptr), "cudaFree");  // the context, before anything is timed
    if (!read_all(to_consumer[0], handles.data(), handle_bytes)) std::_Exit(1);
    consume(handles);
    std::fflush(stdout);
    const char done = 1;
    std::_Exit(::write(to_producer[1], &done, 1) == 1 ? 0 : 1);
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  std::vector<void*> memory(segments);
  for (std::size_t i = 0; i < segments; ++i) {
    check(cudaMalloc(&memory[i], segment_bytes), "cudaMalloc");
    check(cudaIpcGetMemHandle(&handles[i], memory[i]), "cudaIpcGetMemHandle");
  }
  if (::write(to_consumer[1], handles.data(), handle_bytes) != static_cast<ssize_t>(handle_bytes)) return 1;
  char done = 0;
  const bool answered = ::read(to_producer[0], &done, 1) == 1;  // the consumer is done with them
  int status = 0;
  ::waitpid(consumer, &status, 0);
  for (void* m : memory) check(cudaFree(m), "cudaFree");
  return answered && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
