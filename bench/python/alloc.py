"""Allocation and DLPack costs from Python, side by side in one process:

  - shoal: Allocator.allocate + drop, per pair, at several sizes;
  - CuPy's MemoryPool malloc + drop (when CuPy is importable and shoal runs on CUDA);
  - torch.from_dlpack(shoal view), shoal.from_dlpack(torch tensor), and
    torch.from_dlpack(cupy array) per call (when PyTorch / CuPy are there).

Median over rounds with the spread (min–max), in µs. Prints a markdown table.
  python bench/python/alloc.py [--iterations 100000] [--rounds 5]
"""

import argparse
import statistics
import time

import shoal

SIZES = [512, 65536, 1 << 20, 64 << 20]


def per_call(fn, iterations: int) -> float:
    for _ in range(min(1000, iterations)):
        fn()
    start = time.perf_counter_ns()
    for _ in range(iterations):
        fn()
    return (time.perf_counter_ns() - start) / iterations / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    on_cuda = shoal.default_device().kind == "cuda"
    allocator = shoal.Allocator()
    rows: dict[str, list[float]] = {}

    def add(name: str, fn) -> None:
        rows.setdefault(name, []).append(per_call(fn, args.iterations))

    try:
        import cupy

        pool = cupy.cuda.MemoryPool() if on_cuda else None
    except ImportError:
        cupy, pool = None, None
    try:
        import torch

        torch_cuda = on_cuda and torch.cuda.is_available()
    except ImportError:
        torch, torch_cuda = None, False

    for _ in range(args.rounds):
        for n in SIZES:
            add(f"shoal allocate + drop, {n} B", lambda n=n: allocator.allocate(n))
            if pool is not None:
                add(f"CuPy MemoryPool malloc + drop, {n} B", lambda n=n: pool.malloc(n))
        view = allocator.allocate(4096).view("float32", (1024,))
        if torch_cuda:
            t = torch.ones(1024, device="cuda")
            add("torch.from_dlpack(shoal view)", lambda: torch.from_dlpack(view))
            add("shoal.from_dlpack(torch tensor)", lambda: shoal.from_dlpack(t, allocator))
            if cupy is not None:
                c = cupy.ones(1024, dtype=cupy.float32)
                add("torch.from_dlpack(cupy array)", lambda: torch.from_dlpack(c))
        del view

    print(f"| call ({shoal.default_device()}) | µs per call, median (min–max over {args.rounds} rounds) |")
    print("| --- | --- |")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f}) |")


if __name__ == "__main__":
    main()
