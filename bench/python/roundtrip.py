"""Python round trip of one tensor between two processes, shoal against
torch.multiprocessing, side by side in one run:

  producer put -> consumer get -> touch (one element to the host) -> release
  -> acknowledgement back to the producer

timed at the producer, median and p90 over the iterations, at 4 KiB and
64 MiB. shoal goes through shoal.Peer (the layer under shoal.sharing); the
producer re-sends one preallocated storage. torch.multiprocessing sends a
CUDA tensor through its Queue (the producer keeps it alive until the
acknowledgement, as torch requires) and only runs when PyTorch with CUDA is
importable and shoal's device is CUDA. Prints a markdown table.

  python bench/python/roundtrip.py [--iterations 2000] [--rounds 3]
"""

import argparse
import multiprocessing as mp
import statistics
import time

SIZES = [4 << 10, 64 << 20]
WARMUP = 100


def timed_round_trips(round_trip, iterations: int) -> list:
    """Microseconds of each of `iterations` calls of round_trip(), after WARMUP untimed ones."""
    times = []
    for i in range(iterations + WARMUP):
        start = time.perf_counter_ns()
        round_trip()
        if i >= WARMUP:
            times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def shoal_consumer(address_queue, sizes_count: int, iterations: int) -> None:
    import shoal

    context = shoal.SharingContext(shoal.default_allocator())
    with shoal.Listener(shoal.runtime_dir_address(f"roundtrip-{mp.current_process().pid}.sock")) as listener:
        address_queue.put(listener.address)
        connection = listener.accept(timeout=60)
        with shoal.Peer(context, connection) as peer:
            for _ in range(sizes_count * (iterations + WARMUP)):
                storage, _ = peer.receive(timeout=60)
                storage.read(0, 4)  # one element to the host
                del storage  # the release goes back to the producer
                peer.send_note(b"ack")


def shoal_producer(address: str, iterations: int, results) -> None:
    import shoal

    context = shoal.SharingContext(shoal.default_allocator())
    with shoal.Peer(context, shoal.connect(address)) as peer:
        for size in SIZES:
            storage = shoal.allocate(size)
            storage.fill(1)

            def round_trip() -> None:
                peer.send(storage)
                peer.receive(timeout=60)  # the acknowledgement

            results.put((size, timed_round_trips(round_trip, iterations)))


def torch_consumer(tensors, acks, sizes_count: int, iterations: int) -> None:
    for _ in range(sizes_count * (iterations + WARMUP)):
        x = tensors.get(timeout=60)
        x[0].item()
        del x
        acks.put(1)


def torch_producer(tensors, acks, iterations: int, results) -> None:
    import torch

    for size in SIZES:
        x = torch.ones(size // 4, device="cuda")

        def round_trip() -> None:
            tensors.put(x)
            acks.get(timeout=60)

        results.put((size, timed_round_trips(round_trip, iterations)))


def results_of(producer, consumer, results) -> dict:
    """Starts `producer` (the consumer runs already) and gathers its times per size."""
    producer.start()
    out = dict(results.get(timeout=600) for _ in SIZES)
    producer.join(60)
    consumer.join(60)
    return out


def run_shoal(iterations: int) -> dict:
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=shoal_consumer, args=(addresses, len(SIZES), iterations))
    consumer.start()
    producer = ctx.Process(target=shoal_producer, args=(addresses.get(timeout=60), iterations, results))
    return results_of(producer, consumer, results)


def run_torch(iterations: int) -> dict:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    tensors, acks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=torch_consumer, args=(tensors, acks, len(SIZES), iterations))
    consumer.start()
    producer = ctx.Process(target=torch_producer, args=(tensors, acks, iterations, results))
    return results_of(producer, consumer, results)


def p90(values: list) -> float:
    return statistics.quantiles(values, n=10)[-1]


def torch_available() -> bool:
    try:
        import shoal
        import torch

        return torch.cuda.is_available() and shoal.default_device().kind == "cuda"
    except Exception:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with_torch = torch_available()
    medians = {"shoal": {s: [] for s in SIZES}, "torch": {s: [] for s in SIZES}}
    tails = {"shoal": {s: [] for s in SIZES}, "torch": {s: [] for s in SIZES}}
    for _ in range(args.rounds):
        runs = {"shoal": run_shoal(args.iterations)}
        if with_torch:
            runs["torch"] = run_torch(args.iterations)
        for name, result in runs.items():
            for size, times in result.items():
                medians[name][size].append(statistics.median(times))
                tails[name][size].append(p90(times))
    print("| size | shoal median (µs) | shoal p90 | torch.mp median (µs) | torch.mp p90 | torch.mp/shoal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in SIZES:
        name = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        sm, st = medians["shoal"][size], tails["shoal"][size]
        cell = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})"  # noqa: E731
        if with_torch:
            tm, tt = medians["torch"][size], tails["torch"][size]
            ratio = f"{statistics.median(tm) / statistics.median(sm):.1f}×"
            print(f"| {name} | {cell(sm)} | {cell(st)} | {cell(tm)} | {cell(tt)} | {ratio} |")
        else:
            print(f"| {name} | {cell(sm)} | {cell(st)} | (no PyTorch with CUDA here) | | |")


if __name__ == "__main__":
    main()
