"""The loader race (the seed of shoal.torch): a loader thread makes each batch
on its own stream and hands it over; the model thread reads it after a slow
kernel on its stream and drops the last reference; the loader then allocates
and fills the next batch. Prints one JSON line: iterations and corrupted
batches. Run with --allocator shoal or torch."""

import argparse
import json
import queue
import threading

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=["shoal", "torch"], required=True)
parser.add_argument("--iterations", type=int, default=10_000)
parser.add_argument("--sleep-cycles", type=int, default=1_000_000)
parser.add_argument("--elements", type=int, default=1 << 18)
args = parser.parse_args()

if args.allocator == "shoal":
    import shoal.torch

    shoal.torch.enable(use_environment=False)
import torch

device = torch.device("cuda", 0)
loader_stream = torch.cuda.Stream(device)
model_stream = torch.cuda.Stream(device)
seen = torch.full((args.iterations,), -1.0, device=device)
handoff: "queue.Queue[tuple[torch.Tensor, torch.cuda.Event] | None]" = queue.Queue(maxsize=1)
dropped = threading.Semaphore(0)
errors: list[BaseException] = []


def loader() -> None:
    try:
        torch.cuda.set_stream(loader_stream)
        for i in range(args.iterations):
            batch = torch.empty(args.elements, device=device)
            batch.fill_(float(i))
            ready = torch.cuda.Event()
            ready.record(loader_stream)
            handoff.put((batch, ready))
            del batch  # the model thread holds the last reference
            if not dropped.acquire(timeout=60):
                raise TimeoutError("the model thread did not drop a batch within 60 s")
    except BaseException as e:  # reported by the main thread
        errors.append(e)
    finally:
        handoff.put(None)


def model() -> None:
    try:
        torch.cuda.set_stream(model_stream)
        i = 0
        while True:
            item = handoff.get(timeout=60)
            if item is None:
                return
            batch, ready = item
            model_stream.wait_event(ready)
            torch.cuda._sleep(args.sleep_cycles)  # a slow layer before the batch is read
            seen[i : i + 1].copy_(batch[-1:])  # reads the batch on the model stream
            del batch, item  # the last reference goes on the model thread
            dropped.release()
            i += 1
    except BaseException as e:
        errors.append(e)
        dropped.release()


threads = [threading.Thread(target=loader), threading.Thread(target=model)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=600)
if errors:
    raise errors[0]
torch.cuda.synchronize()
expected = torch.arange(args.iterations, device=device, dtype=seen.dtype)
corrupted = int((seen != expected).sum().item())
del expected, seen
torch.cuda.synchronize()
print(json.dumps({"allocator": args.allocator, "iterations": args.iterations, "corrupted": corrupted,
                  "allocated_at_end": torch.cuda.memory_allocated()}))
