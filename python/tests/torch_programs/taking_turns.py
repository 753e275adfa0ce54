"""Two models taking turns on one region's worth of memory: each server borrows from a
lender that preempts, puts its model into the region through shoal.torch.RegionPool,
checks its output, fills the rest of the region (what the other model finds next), and
gives the region back when its RevocationWatcher says so.

    python taking_turns.py                          the lender: starts two servers, prints JSON
    python taking_turns.py server ADDRESS SEED      a server (CUDA refuses to import memory in
                                                    the process that exported it)
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20
REGION = 256 * MIB
TURNS = 3


def server(address: str, seed: int) -> dict:
    import shoal.lending
    import shoal.torch
    import torch

    torch.manual_seed(seed)
    weights = torch.randn(1024, 1024).pin_memory()
    inputs = torch.randn(64, 1024, device="cuda")
    expected = torch.nn.functional.linear(inputs, weights.cuda()).relu()  # outside any region
    give_up = threading.Event()
    revoked: list[int] = []

    def on_revoke(region: int, seconds_left: float) -> None:
        revoked.append(region)
        give_up.set()

    turns = []
    with shoal.lending.Borrower(address, timeout=30.0) as borrower, borrower.watch_revocations(on_revoke) as watcher:
        for turn in range(TURNS):
            give_up.clear()
            region = borrower.borrow(REGION, f"model {seed}", wait=60.0)
            region_id = borrower.region_id(region)
            pool = shoal.torch.RegionPool(region)
            with pool.use():
                model = torch.nn.Linear(1024, 1024, bias=False).cuda()
                with torch.no_grad():
                    model.weight.copy_(weights, non_blocking=True)
                    out = model(inputs).relu()
                    identical = bool(torch.equal(out, expected))
                    # What the other model finds in this memory next: it must not matter.
                    scratch = torch.full((REGION // 2 // 4,), float(seed), device="cuda")
                torch.cuda.synchronize()
            # Every turn but a server's last ends by the lender's revoke (the other waits);
            # the last ends by itself (the other may have taken all its turns).
            asked = give_up.wait(timeout=30.0) if turn < TURNS - 1 else None
            del model, out, scratch
            pool.close()
            del pool, region
            turns.append({"identical": identical, "revoked": asked, "region": region_id})
        watcher_error = repr(watcher.error)
    return {"turns": turns, "revokes": revoked, "watcher_error": watcher_error}


def main() -> None:
    import shoal.lending

    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        address = str(pathlib.Path(directory) / "lender.sock")
        with shoal.lending.Lender(address, capacity_bytes=REGION, quota_bytes=REGION, preempt_after=0.0,
                                  preempt_deadline=20.0) as lender:
            children = [subprocess.Popen([sys.executable, __file__, "server", address, str(seed)],
                                         stdout=subprocess.PIPE, text=True) for seed in (1, 2)]
            outputs = [child.communicate(timeout=240)[0] for child in children]
            deadline = time.monotonic() + 5  # the last give back may still be on its way
            while lender.status()["lent_bytes"] != 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            status = lender.status()
            result = {
                "exit": [child.returncode for child in children],
                "servers": [json.loads(out.strip().splitlines()[-1]) if out.strip() else None for out in outputs],
                "preemptions": status["preemptions"],
                "revocations_missed": status["revocations_missed"],
                "lent_after": status["lent_bytes"],
            }
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "server":
        print(json.dumps(server(sys.argv[2], int(sys.argv[3]))), flush=True)
    else:
        main()
