"""A model's tensors in memory borrowed from a lender, through torch.cuda.MemPool
(shoal.torch.RegionPool), with PyTorch's own allocator in charge.

    python region_pool.py                the borrower: starts the lender, prints JSON
    python region_pool.py lender ADDRESS a lender (CUDA refuses to import memory in the
                                         process that exported it) until stdin closes
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
REGION = 256 * MIB


def lender(address: str) -> None:
    import shoal.lending

    with shoal.lending.Lender(address, capacity_bytes=1 << 30, quota_bytes=1 << 30):
        print("ready", flush=True)
        sys.stdin.read()


def lent_bytes(borrower) -> int:
    for line in borrower.metrics().splitlines():
        if line.startswith("shoal_lending_lent_bytes "):
            return int(float(line.split()[1]))
    raise AssertionError("no shoal_lending_lent_bytes in the lender's metrics")


def borrower_side(address: str) -> dict:
    import shoal
    import shoal.lending
    import shoal.torch
    import torch

    torch.manual_seed(0)
    weights = torch.randn(1024, 1024, device="cuda")
    inputs = torch.randn(64, 1024, device="cuda")

    borrower = shoal.lending.Borrower(address)
    region = borrower.borrow(REGION, "model A")
    pool = shoal.torch.RegionPool(region)
    base, capacity = pool.stats()["base"], pool.stats()["capacity_bytes"]

    def inside(t) -> bool:
        p = t.untyped_storage().data_ptr()
        return base <= p and p + t.untyped_storage().nbytes() <= base + capacity

    with pool.use():
        model = torch.nn.Linear(1024, 1024, bias=False).cuda()
        with torch.no_grad():
            model.weight.copy_(weights)
        x = inputs.clone()
        out = model(x).relu()
        try:
            torch.empty(2 * REGION, dtype=torch.uint8, device="cuda")
            oom = "none"
        except torch.cuda.OutOfMemoryError as e:
            oom = type(e).__name__
    outside = torch.empty(MIB, device="cuda")
    # The same kernel outside the pool (the process's first matmul ran inside
    # it, so cuBLAS's workspace is in the region: close() must let it go).
    expected = torch.nn.functional.linear(inputs, weights).relu()
    torch.cuda.synchronize()
    during = pool.stats()
    result = {
        "in_region": [inside(model.weight), inside(x), inside(out)],
        "outside_in_region": inside(outside),
        "identical": bool(torch.equal(out, expected)),
        "oom": oom,
        "segments_during": during["segments"],
        "reserved_during": during["segment_bytes"],
        "lent_during": lent_bytes(borrower),
    }
    del model, x, out
    slot = pool._slot
    pool.close()
    after = shoal._shoal._segment_source_stats(slot)
    result["bound_after_close"] = after["bound"]
    result["segments_after_close"] = after["segments"]
    del region
    deadline = time.monotonic() + 5
    while lent_bytes(borrower) != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    result["lent_after"] = lent_bytes(borrower)
    return result


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        address = str(pathlib.Path(directory) / "lender.sock")
        child = subprocess.Popen([sys.executable, __file__, "lender", address], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            result = borrower_side(address)
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "lender":
        lender(sys.argv[2])
    else:
        main()
