"""A CUDA tensor sent through torch.multiprocessing's own reduction (what
mp.Queue and DataLoader workers use) from a producer to a spawned consumer,
each with the allocator its mode names:

    native             PyTorch's allocator
    native-expandable  PyTorch's allocator with expandable segments
    shoal              shoal.torch.enable() (growable segments)
    shoal-plain        shoal.torch.enable(expandable_segments=False)

Prints one JSON object: what the consumer read, or the producer's refusal."""

import json
import sys
import time

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor


def set_allocator(mode: str) -> None:
    if mode == "native-expandable":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    elif mode.startswith("shoal"):
        import shoal.torch

        settings = {"expandable_segments": False} if mode == "shoal-plain" else {}
        shoal.torch.enable(use_environment=False, **settings)


def consume(mode: str, inbox, outbox) -> None:
    set_allocator(mode)
    rebuild, args = inbox.recv()
    tensor = rebuild(*args)
    outbox.send({
        "sum": float(tensor.double().sum().item()),
        "first": float(tensor[0].item()),
        "numel": tensor.numel(),
        "backend": torch.cuda.get_allocator_backend(),
    })
    del tensor
    torch.cuda.synchronize()
    outbox.send("released")


def main() -> None:
    producer, consumer = sys.argv[1], sys.argv[2]
    set_allocator(producer)
    context = mp.get_context("spawn")
    to_consumer, inbox = context.Pipe()
    outbox, from_consumer = context.Pipe()
    # A view inside a larger block, inside a segment other blocks share:
    # the handle's offset and the segment's export both count.
    keep = torch.ones(1 << 18, device="cuda")
    base = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    sent = base[1000:3000]
    try:
        reduced = reduce_tensor(sent)
    except RuntimeError as e:
        print(json.dumps({"refused": str(e)}))
        return
    process = context.Process(target=consume, args=(consumer, inbox, outbox))
    process.start()
    to_consumer.send(reduced)
    deadline = time.monotonic() + 120
    while not from_consumer.poll(0.5):
        if not process.is_alive():
            raise RuntimeError(f"the consumer ended (exit code {process.exitcode}) without an answer")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError("the consumer did not answer in 120 s")
    read = from_consumer.recv()
    released = from_consumer.recv() if from_consumer.poll(60) else None
    process.join(60)
    del sent, base, keep
    torch.cuda.synchronize()
    print(json.dumps({**read, "expected_sum": float(sum(range(1000, 3000))), "released": released,
                      "exitcode": process.exitcode, "producer": torch.cuda.get_allocator_backend()}))


if __name__ == "__main__":
    main()
