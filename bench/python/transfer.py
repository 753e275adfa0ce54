"""Background host-to-device transfer with a model consuming, against SPDL; and the pinned
allocator's pair against PyTorch's pinned host allocator.

    SHOAL_BACKEND=cuda python bench/python/transfer.py [--batches N] [--rounds R]

A producer thread feeds batches of pageable CPU tensors ({"x": float32 (B, 3, 224, 224),
"y": int64 (B,)}); the main thread takes each batch, runs a "model" on the default
stream (a fixed spin kernel, then a reduction that reads the whole batch) and drops the
batch. SPDL (spdl.io.transfer_tensor_h2d in a one-thread executor: pin_memory, .to on its
own stream, a stream synchronization, the last 4 batches held) against shoal
(shoal.transfer.Engine: the producer submits, the engine stages and copies, the consumer's
stream waits on the GPU). Reported per round: batches per second end to end, process CPU
time per batch (every thread), and peak device memory reserved by the transfer's allocator.
A second shoal row gives the engine an allocator with a memory limit of 8 batches: the
engine's thread then waits for the consumer's stream instead of growing. Medians with
(min-max) over the rounds. Needs torch with CUDA; SPDL rows are skipped when spdl.io is not
importable.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import threading
import time

import torch

import shoal
import shoal.transfer


def make_batches(count: int, batch_size: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "x": torch.rand((batch_size, 3, 224, 224), generator=generator),
            "y": torch.randint(0, 1000, (batch_size,), generator=generator),
        }
        for _ in range(count)
    ]


def model_step(x: torch.Tensor, y: torch.Tensor, spin_cycles: int) -> torch.Tensor:
    torch.cuda._sleep(spin_cycles)
    return x.sum() + y.sum()


def run_spdl(batches: list[dict], spin_cycles: int) -> tuple[float, float, int]:
    from spdl.io import transfer_tensor_h2d

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    results = []
    wall, cpu = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        futures = [executor.submit(transfer_tensor_h2d, b) for b in batches[:4]]
        for i in range(len(batches)):
            if i + 4 < len(batches):
                futures.append(executor.submit(transfer_tensor_h2d, batches[i + 4]))
            batch = futures[i].result()
            results.append(model_step(batch["x"], batch["y"], spin_cycles))
            futures[i] = None
            del batch
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return len(batches) / wall, cpu / len(batches) * 1e6, torch.cuda.max_memory_reserved()


def run_shoal(
    batches: list[dict], spin_cycles: int, engine: shoal.transfer.Engine, allocator: shoal.Allocator
) -> tuple[float, float, int]:
    torch.cuda.synchronize()
    allocator.reset_peak_stats()
    results = []
    wall, cpu = time.perf_counter(), time.process_time()
    producer = threading.Thread(target=lambda: [engine.submit(b) for b in batches])
    producer.start()
    for _ in range(len(batches)):
        batch = engine.get(timeout=60)  # the current (default) stream waits for the copies
        results.append(model_step(torch.from_dlpack(batch["x"]), torch.from_dlpack(batch["y"]), spin_cycles))
        del batch
    producer.join()
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return len(batches) / wall, cpu / len(batches) * 1e6, allocator.stats()["reserved_bytes"]["all"]["peak"]


def pair_times(iterations: int) -> list[tuple[str, float, float]]:
    pinned = shoal.Allocator(memory="pinned_host")
    rows = []
    for nbytes in (64 << 10, 1 << 20, 16 << 20):
        for name, make in (
            ("shoal Allocator(memory='pinned_host').allocate + drop", lambda: pinned.allocate(nbytes)),
            ("torch.empty(pin_memory=True) + del", lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
        ):
            make()
            start = time.perf_counter()
            for _ in range(iterations):
                make()
            rows.append((name, nbytes, (time.perf_counter() - start) / iterations * 1e6))
    return rows


def median_range(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spin-cycles", type=int, default=2_000_000, help="the model's kernel, in GPU cycles")
    parser.add_argument("--pair-iterations", type=int, default=20000)
    args = parser.parse_args()
    assert shoal.default_device().kind == "cuda", "run with SHOAL_BACKEND=cuda on a GPU machine"
    batches = make_batches(args.batches, args.batch_size)
    mib = sum(t.numel() * t.element_size() for t in batches[0].values()) / 2**20
    try:
        import spdl.io  # noqa: F401

        have_spdl = True
    except Exception as error:  # noqa: BLE001 - any import failure means no SPDL rows
        print(f"SPDL not importable ({error}); its rows are left out")
        have_spdl = False
    bounded_mb = int(mib * 8) + 1  # 4 batches in flight, 1 held, 3 the consumer's stream still reads
    bounded_name = f"shoal, allocator memory_limit_mb={bounded_mb}"
    figures: dict[str, list[tuple[float, float, int]]] = {"shoal": [], bounded_name: [], "spdl": []}
    bounded = shoal.Allocator(memory_limit_mb=bounded_mb)
    with shoal.transfer.Engine() as engine, shoal.transfer.Engine(bounded) as bounded_engine:
        for _ in range(args.rounds):
            figures["shoal"].append(run_shoal(batches, args.spin_cycles, engine, shoal.default_allocator()))
            figures[bounded_name].append(run_shoal(batches, args.spin_cycles, bounded_engine, bounded))
            if have_spdl:
                figures["spdl"].append(run_spdl(batches, args.spin_cycles))
    print(f"\n{args.batches} batches of {mib:.1f} MiB (pageable), model spin {args.spin_cycles} cycles, "
          f"{args.rounds} rounds; medians (min-max)\n")
    print("| transfer | batches/s | CPU µs per batch (all threads) | peak reserved MiB |")
    print("| --- | --- | --- | --- |")
    for name in figures:
        rows = figures[name]
        if not rows:
            continue
        print(f"| {name} | {median_range([r[0] for r in rows])} | {median_range([r[1] for r in rows], digits=0)} | "
              f"{median_range([r[2] for r in rows], scale=1 / 2**20, digits=0)} |")
    if figures["spdl"]:
        ratio = statistics.median(r[0] for r in figures["shoal"]) / statistics.median(r[0] for r in figures["spdl"])
        print(f"\nthroughput shoal/SPDL: {ratio:.2f}x")
    print("\n| pinned pair | bytes | µs per pair |")
    print("| --- | --- | --- |")
    for name, nbytes, micros in pair_times(args.pair_iterations):
        print(f"| {name} | {nbytes} | {micros:.3f} |")


if __name__ == "__main__":
    main()
