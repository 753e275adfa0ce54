#!/usr/bin/env python3
"""Two PyTorch models taking turns on one GPU: through shoal's lender, and by hand with
PyTorch's own allocator (the anchor), in the same run.

    python bench/python/taking_turns.py [--model resnet50|gpt2-medium] [--turns 20]
        [--turn-seconds 0.2] [--workspace-gib 16] [--rounds 2] [--modes shoal,torch,torch-expandable]
        [--json FILE] [--verbose]

Each model is a server in a process of its own that serves batches while it holds the GPU
and then hands it to the other. A server's memory is its model's weights (copied in from
pinned host memory at each turn) and a workspace (``--workspace-gib``: a KV cache or
activation arena, as serving systems reserve) with room for the batches' activations.

* shoal: a lender in this process, its capacity one server's memory, preempting after
  ``--turn-seconds``. A server borrows its memory with a wait (in line behind the holder),
  puts its model's tensors into it through ``shoal.torch.RegionPool``, and serves until
  its ``Borrower.watch_revocations`` callback says the lender wants the region for the
  other: it drops its tensors, closes the pool and the region goes back; then it asks
  again.
* torch: the same servers on PyTorch's allocator; this process hands the GPU over as the
  lender would: once the holder has served ``--turn-seconds`` and the other asks, it tells
  the holder to give up; the holder drops its tensors and calls
  ``torch.cuda.empty_cache()`` (the memory must go back to the driver for the other
  process), says so, and the other is told to go.
* torch-expandable, torch-async: the same with PyTorch's expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), or its ``cudaMallocAsync`` backend.

A hand-over is timed from the moment the holder's serving loop sees it must give up
(between two batches, in every mode) to the next server's first batch done, on the
system-wide monotonic clock, in parts: *memory* (the holder dropping its tensors, its
allocator's release — the pool's close, or ``empty_cache`` — and the next one getting the
memory, through the region's give back with shoal, and its workspace allocated), *weights* (allocated and copied in) and
*first batch* (its activations allocated, the batch run). The first two hand-overs of each
mode (the first time each server maps or allocates) are reported apart. Prints a table, last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

GIB = 1 << 30
MIB = 1 << 20
ACTIVATION_ROOM = 2 * GIB  # beside the weights and the workspace: a batch's activations, cuDNN's workspace


def now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine


def log(args, *what: object) -> None:
    if args.verbose:
        print(f"{now():.4f} [{os.getpid()}]", *what, file=sys.stderr, flush=True)


def watchdog(args) -> None:
    """With --verbose, the stacks of every thread go to stderr if the run stalls."""
    if args.verbose:
        import faulthandler

        faulthandler.dump_traceback_later(30, repeat=True)


def tensors_of(module) -> dict:
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


class Model:
    """A model whose weights wait in pinned host memory and whose GPU tensors exist only while
    its server holds the GPU (a skeleton on the meta device between turns)."""

    def __init__(self, name: str) -> None:
        import torch

        torch.manual_seed(0)
        if name == "resnet50":
            import torchvision

            module = torchvision.models.resnet50()
            self.make_input = lambda: torch.randn(32, 3, 224, 224, device="cuda")
        elif name == "gpt2-medium":
            import transformers

            module = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16))
            self.make_input = lambda: torch.randint(0, 50257, (8, 256), device="cuda")
        else:
            raise SystemExit(f"unknown model {name!r}")
        module.eval()
        # Every name, tied weights included (the meta round trip may untie them): each is
        # copied in at each turn; one pinned copy of each tensor.
        pinned_of: dict[int, object] = {}
        self.pinned = {k: pinned_of.setdefault(id(v), v.detach().pin_memory()) for k, v in tensors_of(module).items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.pinned.values())
        self.module = module.to("meta")

    def load(self) -> None:
        import torch

        self.module.to_empty(device="cuda")
        with torch.no_grad():
            for k, t in tensors_of(self.module).items():
                t.copy_(self.pinned[k], non_blocking=True)

    def unload(self) -> None:
        self.module.to_empty(device="meta")

    def serve(self, x):
        import torch

        with torch.inference_mode():
            out = self.module(x)
        return out


def serve_turn(model: Model, workspace_bytes: int, give_up: threading.Event, finish: threading.Event,
               times: dict) -> int:
    """Loads the model, serves until `give_up` or `finish` is set, unloads; returns the batches served."""
    import torch

    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
    times["memory_ready"] = now()
    model.load()
    torch.cuda.synchronize()
    times["loaded"] = now()
    x = model.make_input()
    out = model.serve(x)
    torch.cuda.synchronize()
    times["first_batch"] = now()
    batches = 1
    while not give_up.is_set() and not finish.is_set():
        out = model.serve(x)
        torch.cuda.synchronize()
        batches += 1
    times["noticed"] = now()
    del out, x, workspace
    model.unload()
    times["unloaded"] = now()
    return batches


def finish_when_told(conn, finish: threading.Event) -> threading.Event:
    """Sets `finish` when this process is told the other server took all its turns (its last
    turn would wait for a hand-over that never comes)."""

    def listen() -> None:
        if conn.recv() == "finish":
            finish.set()

    threading.Thread(target=listen, daemon=True).start()
    return finish


def shoal_server(name: str, args, address: str, region_bytes: int, conn) -> None:
    import torch

    import shoal.lending
    import shoal.torch

    watchdog(args)
    torch.cuda.init()
    model = Model(args.model)
    give_up = threading.Event()
    revoked_at: list[float] = []

    def on_revoke(region: int, seconds_left: float) -> None:
        revoked_at.append(now())
        give_up.set()
        log(args, name, "revoked", region, f"{seconds_left:.2f} s left")

    records = []
    with shoal.lending.Borrower(address, timeout=30.0) as borrower, borrower.watch_revocations(on_revoke):
        conn.send("ready")
        assert conn.recv() == "start"
        finish = finish_when_told(conn, threading.Event())
        for _ in range(args.turns):
            if finish.is_set():
                break
            times = {"asked": now()}
            give_up.clear()  # before the borrow: a revoke may come as soon as the region is lent
            revoked_at.clear()
            log(args, name, "asks")
            region = borrower.borrow(region_bytes, name, wait=300.0)
            times["memory"] = now()
            log(args, name, "lent", shoal.lending.Borrower.region_id(region))
            pool = shoal.torch.RegionPool(region)
            with pool.use():
                times["batches"] = serve_turn(model, args.workspace_gib * GIB, give_up, finish, times)
            log(args, name, "served", times["batches"], "batches")
            pool.close()
            log(args, name, "pool closed", pool.stats())
            # Stamped before the region goes (its give back): the next server's memory
            # cannot come before this stamp, so "the next one's memory" is never negative.
            times["released"] = now()
            del pool, region
            log(args, name, "released")
            times["revoked"] = revoked_at[0] if revoked_at else None
            records.append(times)
    conn.send(records)


def torch_server(name: str, args, conn) -> None:
    import torch

    watchdog(args)
    torch.cuda.init()
    model = Model(args.model)
    give_up = threading.Event()
    finish = threading.Event()
    give_up_at: list[float] = []

    def listen() -> None:  # the coordinator's "give up", seen between batches as the watcher's
        while True:
            message = conn.recv()
            if message == "give up":
                give_up_at.append(now())
                give_up.set()
            elif message == "finish":
                finish.set()
            else:
                inbox.append(message)
                arrived.set()

    inbox: list = []
    arrived = threading.Event()
    conn.send("ready")
    threading.Thread(target=listen, daemon=True).start()

    def next_message():
        arrived.wait()
        arrived.clear()
        return inbox.pop(0)

    assert next_message() == "start"
    records = []
    for _ in range(args.turns):
        if finish.is_set():
            break
        give_up.clear()
        give_up_at.clear()
        times = {"asked": now()}
        conn.send("want")
        assert next_message() == "go"
        times["memory"] = now()
        times["batches"] = serve_turn(model, args.workspace_gib * GIB, give_up, finish, times)
        torch.cuda.empty_cache()
        times["released"] = now()
        times["revoked"] = give_up_at[0] if give_up_at else None
        conn.send("released")
        records.append(times)
    conn.send(records)


def hand_overs(per_server: list[list[dict]]) -> list[dict]:
    """Pairs each turn's start with the end of the turn before it (the other server's)."""
    turns = sorted((t for records in per_server for t in records), key=lambda t: t["memory"])
    out = []
    for before, after in zip(turns, turns[1:]):
        out.append({
            "total": after["first_batch"] - before["noticed"],
            "memory": after["memory_ready"] - before["noticed"],
            "unload": before["unloaded"] - before["noticed"],
            "release": before["released"] - before["unloaded"],
            "lent": after["memory_ready"] - before["released"],
            "weights": after["loaded"] - after["memory_ready"],
            "first_batch": after["first_batch"] - after["loaded"],
            "revoke_seen": (before["noticed"] - before["revoked"]) if before["revoked"] else None,
        })
    return out


class Servers:
    """The two server processes and this end of their pipes: started, greeted, and watched
    (a server that dies ends the run with its exit code instead of leaving it waiting)."""

    def __init__(self, target, args_of) -> None:
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(2)]
        self.processes = [context.Process(target=target, args=(*args_of(i), pipes[i][1])) for i in range(2)]
        self.conns = [parent for parent, _ in pipes]
        self.records: dict[int, list] = {}
        for p in self.processes:
            p.start()
        for conn in self.conns:
            assert self.wait_on([conn], None) and conn.recv() == "ready"
        for conn in self.conns:
            conn.send("start")

    def wait_on(self, conns: list, timeout):
        """The connections of `conns` with a message, after `timeout` at most."""
        import multiprocessing.connection as mpc

        running = [p.sentinel for p in self.processes if p.exitcode is None]  # an ended one's is ready for good
        ready = mpc.wait(conns + running, timeout=timeout)
        for p in self.processes:
            if p.sentinel in ready:
                p.join(timeout=5)  # reaped: its exit code known
                if p.exitcode != 0:
                    raise SystemExit(f"a server ended with exit code {p.exitcode}")
        return [c for c in ready if c in conns]

    def waiting_on(self) -> list:
        """The connections of the servers that have not sent their records yet."""
        return [c for i, c in enumerate(self.conns) if i not in self.records]

    def took_records(self, conn, records: list) -> None:
        """`conn`'s server took all its turns: the other's last turn ends now."""
        self.records[self.conns.index(conn)] = records
        for other in self.waiting_on():
            other.send("finish")

    def join(self) -> list[list[dict]]:
        for p in self.processes:
            p.join(timeout=60)
        return [self.records[0], self.records[1]]


def run_shoal(args, region_bytes: int) -> list[list[dict]]:
    import shoal.lending

    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        address = str(pathlib.Path(directory) / "lender.sock")
        with shoal.lending.Lender(address, capacity_bytes=region_bytes, quota_bytes=region_bytes,
                                  preempt_after=args.turn_seconds, preempt_deadline=30.0, max_wait=600.0,
                                  peer_timeout=10.0) as lender:
            servers = Servers(shoal_server, lambda i: (f"model {i}", args, address, region_bytes))
            while servers.waiting_on():
                ready = servers.wait_on(servers.waiting_on(), timeout=5.0)
                if not ready:
                    status = lender.status()
                    log(args, "lender: regions", [(r["id"], r["purpose"], r["state"]) for r in status["regions"]],
                        "waiting", [(w["purpose"], round(w["waited_seconds"], 1)) for w in status["waiting"]])
                for conn in ready:
                    servers.took_records(conn, conn.recv())
            records = servers.join()
            status = lender.status()
            print(f"  lender: preemptions {status['preemptions']}, revocations missed "
                  f"{status['revocations_missed']}, waits {status['waits']}", file=sys.stderr)
    return records


def run_torch(args) -> list[list[dict]]:
    servers = Servers(torch_server, lambda i: (f"model {i}", args))
    raw = servers.conns
    # Hands the GPU over as the lender does: the first to ask gets it; once the holder has
    # had it --turn-seconds and the other asks, the holder gives up, then the next one goes.
    waiting: list[int] = []
    holder, since, asked_to_give_up = None, 0.0, False
    while servers.waiting_on():
        timeout = None
        if holder is not None and waiting and not asked_to_give_up:
            timeout = max(0.0, since + args.turn_seconds - now())
        for conn in servers.wait_on(servers.waiting_on(), timeout):
            message = conn.recv()
            if message == "want":
                waiting.append(raw.index(conn))
            elif message == "released":
                holder, asked_to_give_up = None, False
            else:
                servers.took_records(conn, message)
        if holder is None and waiting:
            holder, since = waiting.pop(0), now()
            raw[holder].send("go")
        elif holder is not None and waiting and not asked_to_give_up and now() >= since + args.turn_seconds:
            raw[holder].send("give up")
            asked_to_give_up = True
    return servers.join()


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):.2f} ({ms[0]:.2f}-{ms[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "gpt2-medium"])
    parser.add_argument("--turns", type=int, default=20, help="turns each server takes")
    parser.add_argument("--turn-seconds", type=float, default=0.2, help="the least turn (the lender's preempt_after)")
    parser.add_argument("--workspace-gib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="every mode in turn, this many times")
    parser.add_argument("--modes", default="shoal,torch,torch-expandable,torch-async",
                        help="shoal, torch (PyTorch's defaults), torch-expandable (its expandable segments), "
                             "torch-async (its cudaMallocAsync backend)")
    parser.add_argument("--json", help="write every hand-over here")
    parser.add_argument("--verbose", action="store_true", help="log each turn's steps (and stalled threads' stacks)")
    args = parser.parse_args()

    import torch

    probe = Model(args.model)
    region_bytes = probe.nbytes + args.workspace_gib * GIB + ACTIVATION_ROOM
    region_bytes = (region_bytes + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
    print(f"{args.model}: weights {probe.nbytes / MIB:.1f} MiB, workspace {args.workspace_gib} GiB, "
          f"each server's memory {region_bytes / GIB:.2f} GiB; {torch.cuda.get_device_name()}", file=sys.stderr)
    del probe

    modes = args.modes.split(",")
    everything: dict[str, list] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            start = now()
            if mode == "shoal":
                records = run_shoal(args, region_bytes)
            else:  # spawned servers take this process's environment as it is when they start
                settings = {"torch-expandable": "expandable_segments:True", "torch-async": "backend:cudaMallocAsync"}
                if mode in settings:
                    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings[mode]
                records = run_torch(args)
                os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            overs = hand_overs(records)
            everything[mode].append(overs)
            print(f"  round {round_ + 1} {mode}: {len(overs)} hand-overs in {now() - start:.1f} s", file=sys.stderr)

    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(everything, indent=1))

    print(f"\nhand-over of {args.model} with a {args.workspace_gib} GiB workspace, ms: median (min-max) "
          f"over the later hand-overs of each round; first two apart")
    print("| round | mode | total | memory | of it: tensors dropped / release / the next one's memory "
          "| weights | first batch | first two, total |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    medians: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            overs = everything[mode][round_]
            later, first = overs[2:], overs[:2]
            medians[mode].append(statistics.median(o["total"] for o in later) if later else float("nan"))
            print(f"| {round_ + 1} | {mode} | {summary([o['total'] for o in later])} | "
                  f"{summary([o['memory'] for o in later])} | {summary([o['unload'] for o in later])} / "
                  f"{summary([o['release'] for o in later])} / {summary([o['lent'] for o in later])} | "
                  f"{summary([o['weights'] for o in later])} | {summary([o['first_batch'] for o in later])} | "
                  f"{summary([o['total'] for o in first])} |")
    for mode in modes:
        seen = [o["revoke_seen"] for overs in everything[mode] for o in overs[2:] if o["revoke_seen"] is not None]
        print(f"{mode}: asked to give up (the watcher's callback, the coordinator's message) -> seen by the "
              f"serving loop {summary(seen)}")
    if "shoal" not in modes:
        return
    for round_ in range(args.rounds):
        s = medians["shoal"][round_]
        for mode in modes:
            if mode != "shoal":
                t = medians[mode][round_]
                print(f"round {round_ + 1}: {mode} / shoal total {t / s:.2f}x ({t * 1000:.2f} / {s * 1000:.2f} ms)")


if __name__ == "__main__":
    main()
