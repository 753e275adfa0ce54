"""CUDA tensors PyTorch allocated on shoal, sent to another process as they are.

    python share_tensors.py            the consumer: starts the producer, reads
                                       the tensors after the producer dropped
                                       its own, then drops them; prints JSON
    python share_tensors.py producer ADDRESS

The producer sends a tensor and a strided view into another tensor's storage,
drops both, and allocates tensors of the same size: while the consumer holds
the memory none of them may land on the sent blocks (were the blocks freed, the
allocator would hand them out again at once: same size, same stream) and both
stay allocated; once the consumer has dropped them, they are freed.
"""

import json
import subprocess
import sys
import time

ELEMENTS = 1 << 18


def producer(address: str) -> None:
    import shoal.sharing
    import shoal.torch

    shoal.torch.enable(use_environment=False)
    import torch

    # The control: a tensor dropped unshared has its block handed out again
    # at once to one of the same fillers.
    dropped = torch.arange(ELEMENTS, dtype=torch.float32, device="cuda")
    dropped_ptr = dropped.untyped_storage().data_ptr()
    del dropped
    fillers = [torch.full((ELEMENTS,), -1.0, device="cuda") for _ in range(8)]
    control_reused = any(f.untyped_storage().data_ptr() == dropped_ptr for f in fillers)
    del fillers

    baseline = shoal.torch.memory_allocated()
    x = torch.arange(ELEMENTS, dtype=torch.float32, device="cuda")
    base = torch.arange(ELEMENTS, dtype=torch.float32, device="cuda").reshape(512, 512) * 2
    y = base[1:, 3:].t()  # strided, offset into `base`'s storage
    sent = {x.untyped_storage().data_ptr(), base.untyped_storage().data_ptr()}
    with shoal.sharing.Producer(address) as p:
        p.put({"x": x, "y": [y]})
        del x, y, base
        fillers = [torch.full((ELEMENTS,), -1.0, device="cuda") for _ in range(8)]
        reused_while_shared = any(f.untyped_storage().data_ptr() in sent for f in fillers)
        torch.cuda.synchronize()
        allocated_while_shared = shoal.torch.memory_allocated()
        print("dropped", flush=True)
        assert sys.stdin.readline().strip() == "released"
        # The sent blocks go back (from the limbo, once the consumer's drop is
        # seen) while the fillers stay: what is allocated falls by both.
        released = False
        until = time.monotonic() + 20
        while time.monotonic() < until and not released:
            released = shoal.torch.memory_allocated() <= allocated_while_shared - 2 * 4 * ELEMENTS
            time.sleep(0.01)
        del fillers
        print(
            json.dumps(
                {
                    "control_reused": control_reused,
                    "reused_while_shared": reused_while_shared,
                    "released_after_the_consumer_dropped": released,
                    "held_while_shared": allocated_while_shared - baseline,
                    "allocated_at_end": shoal.torch.memory_allocated() - baseline,
                }
            ),
            flush=True,
        )


def consumer() -> None:
    import shoal.sharing
    import torch

    with shoal.sharing.Consumer() as c:
        child = subprocess.Popen(
            [sys.executable, __file__, "producer", c.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        batch = c.get(timeout=60)
        assert child.stdout.readline().strip() == "dropped"
        x = torch.from_dlpack(batch["x"])
        y = torch.from_dlpack(batch["y"][0])
        expected_y = (torch.arange(ELEMENTS, dtype=torch.float32, device="cuda").reshape(512, 512) * 2)[1:, 3:].t()
        x_intact = bool(torch.equal(x, torch.arange(ELEMENTS, dtype=torch.float32, device="cuda")))
        y_intact = bool(torch.equal(y, expected_y))
        layout = [list(y.shape), list(y.stride())]
        torch.cuda.synchronize()
        del x, y, batch
        import gc

        gc.collect()
        child.stdin.write("released\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        result.update({"x_intact": x_intact, "y_intact": y_intact, "y_layout": layout, "producer_exit": child.returncode})
        print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "producer":
        producer(sys.argv[2])
    else:
        consumer()
