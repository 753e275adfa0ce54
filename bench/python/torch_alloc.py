"""PyTorch on shoal against PyTorch's own allocator, side by side in one run
(each allocator in its own process, since shoal.torch.enable() must precede
CUDA initialisation):

  1. torch.empty + del in a loop from Python, 512 B to 64 MiB;
  2. from C++ through PyTorch's allocator interface: allocate() and the
     DataPtr's deleter (the tensor path), raw_alloc + raw_delete (through the
     pluggable wrapper's pointer map), and shoal's own table alone;
  3. real models (python/tests/torch_programs/models.py): step time and peak
     reserved memory.

Prints a markdown table of medians with the spread (min-max) over rounds.
  python bench/python/torch_alloc.py [--rounds 3] [--models resnet,bert,gpt2]
                                    [--shoal-conf expandable_segments:true] [--cpus 3]
                                    [--control] [--fixed-layout]

--cpus pins every process to those CPUs. Launch-bound model steps (BERT's
forward, GPT-2's generation) run at the speed of the core a process lands
on: BERT's step measured 14.8 to 26.7 ms in different processes of the same
allocator on one H100 machine, constant within each process. --control runs
PyTorch's allocator in both columns: the ratio it prints is what process
noise alone gives, to read the real comparison against.
"""

import argparse
import ctypes
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

SIZES = [512, 4096, 65536, 1 << 20, 16 << 20, 64 << 20]
MODELS_PROGRAM = pathlib.Path(__file__).resolve().parents[2] / "python" / "tests" / "torch_programs" / "models.py"


def measure_in_this_process(allocator: str, iterations: int) -> dict:
    """Runs in a child: per-op figures for one allocator."""
    import shoal.torch

    if allocator == "shoal":
        shoal.torch.enable(use_environment=False)
    import torch

    plugin = ctypes.CDLL(str(shoal.torch._plugin_path()))
    plugin.shoal_torch_bench_raw_pairs.restype = ctypes.c_double
    plugin.shoal_torch_bench_raw_pairs.argtypes = [ctypes.c_size_t, ctypes.c_int]
    plugin.shoal_torch_bench_dataptr_pairs.restype = ctypes.c_double
    plugin.shoal_torch_bench_dataptr_pairs.argtypes = [ctypes.c_size_t, ctypes.c_int]
    plugin.shoal_torch_bench_table_pairs.restype = ctypes.c_double
    plugin.shoal_torch_bench_table_pairs.argtypes = [ctypes.c_size_t, ctypes.c_int]
    torch.empty(1, device="cuda")
    out = {}
    for n in SIZES:
        for _ in range(100):
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
            del x
        start = time.perf_counter_ns()
        for _ in range(iterations):
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
            del x
        out[f"empty_del_{n}"] = (time.perf_counter_ns() - start) / iterations / 1e3
        out[f"dataptr_{n}"] = plugin.shoal_torch_bench_dataptr_pairs(n, iterations) / 1e3
        out[f"raw_{n}"] = plugin.shoal_torch_bench_raw_pairs(n, iterations) / 1e3
        if allocator == "shoal":
            out[f"table_{n}"] = plugin.shoal_torch_bench_table_pairs(n, iterations) / 1e3
    if allocator == "shoal":  # a cached pair should never reach the device or retry
        stats = shoal.torch.memory_stats()
        out["device_allocs"] = stats["num_device_alloc"]
        out["retries"] = stats["num_alloc_retries"]
    return out


def child(allocator: str, iterations: int) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", allocator, "--iterations", str(iterations)],
        capture_output=True, text=True, timeout=600,
    )
    if r.returncode != 0:
        raise SystemExit(f"{allocator} child failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def model_run(allocator: str, model: str, steps: int, warmup: int, shoal_conf: str, fixed_layout: bool) -> dict:
    command = [sys.executable, str(MODELS_PROGRAM), "--allocator", allocator, "--model", model, "--steps", str(steps),
               "--warmup", str(warmup), "--shoal-conf", shoal_conf]
    env = None
    if fixed_layout:
        # Every process gets the same string hashes and address layout, two
        # of the things that make processes of one program run at different
        # speeds (the control run shows how much is left).
        env = dict(os.environ, PYTHONHASHSEED="0")
        command = ["setarch", os.uname().machine, "--addr-no-randomize", *command]
    r = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{model} on {allocator} failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else (f"{n >> 10} KiB" if n >= 1024 else f"{n} B")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=["torch", "shoal"])
    parser.add_argument("--iterations", type=int, default=20000, help="per-op pairs per size; 0 skips them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="resnet,bert,gpt2")
    parser.add_argument("--model-steps", type=int, default=10)
    parser.add_argument("--model-warmup", type=int, default=2, help="untimed steps first (BERT: one per shape is 5)")
    parser.add_argument("--shoal-conf", default="", help="shoal's settings for the models, e.g. expandable_segments:true")
    parser.add_argument("--cpus", default="", help="run every process on these CPUs only, e.g. 3 or 2,3")
    parser.add_argument("--control", action="store_true",
                        help="models only: PyTorch's allocator in both columns (an A/A run), to show how far two "
                             "sets of processes of one allocator differ")
    parser.add_argument("--fixed-layout", action="store_true",
                        help="models only: run each process with PYTHONHASHSEED=0 and without address space "
                             "randomisation (setarch), so processes differ less")
    args = parser.parse_args()
    if args.cpus:  # inherited by the child processes
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.child:
        print(json.dumps(measure_in_this_process(args.child, args.iterations)))
        return
    if args.iterations > 0:
        allocator_pairs(args)
    model_steps(args)


def allocator_pairs(args) -> None:
    runs = {"torch": [], "shoal": []}
    for _ in range(args.rounds):
        for allocator in runs:
            runs[allocator].append(child(allocator, args.iterations))
    print("| size | torch.empty+del, PyTorch (µs) | torch.empty+del, shoal (µs) | PyTorch/shoal | "
          "allocate+DataPtr free, PyTorch (µs) | same, shoal (µs) | PyTorch/shoal | "
          "raw_alloc+raw_delete, PyTorch (µs) | same, shoal through the pluggable map (µs) | "
          "shoal table alone (µs) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in SIZES:
        t = [r[f"empty_del_{n}"] for r in runs["torch"]]
        s = [r[f"empty_del_{n}"] for r in runs["shoal"]]
        dt = [r[f"dataptr_{n}"] for r in runs["torch"]]
        ds = [r[f"dataptr_{n}"] for r in runs["shoal"]]
        rt = [r[f"raw_{n}"] for r in runs["torch"]]
        rs = [r[f"raw_{n}"] for r in runs["shoal"]]
        tb = [r[f"table_{n}"] for r in runs["shoal"]]
        ratio = lambda a, b: f"{statistics.median(a) / statistics.median(b):.2f}×"  # noqa: E731
        print(f"| {size_name(n)} | {spread(t)} | {spread(s)} | {ratio(t, s)} | {spread(dt)} | {spread(ds)} | "
              f"{ratio(dt, ds)} | {spread(rt)} | {spread(rs)} | {spread(tb)} |")
    print(f"shoal device allocations / retries per round: "
          f"{[(r['device_allocs'], r['retries']) for r in runs['shoal']]}")


def model_steps(args) -> None:
    models = [m for m in args.models.split(",") if m]
    if not models:
        return
    print()
    if args.shoal_conf:
        print(f"shoal's settings for the models: {args.shoal_conf}")
    # Steps of every round pooled: the median step, and the fastest step — the
    # generation loops are bound by the host CPU, whose speed drifts by tens of
    # percent between processes on a shared machine; the fastest step is what
    # each allocator allows when the machine is quiet.
    # The second column's allocator: shoal, or PyTorch's again in a control run.
    second = "torch" if args.control else "shoal"
    if args.control:
        print("control run (A/A): PyTorch's allocator in both columns; the column named shoal is PyTorch's too")
    print("| model | step, PyTorch (ms) | step, shoal (ms) | shoal/PyTorch | fastest step, PyTorch / shoal (ms) | "
          "shoal/PyTorch | peak reserved, PyTorch (MiB) | peak reserved, shoal (MiB) | shoal/PyTorch | same outputs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in models:
        res = {"torch": [], "shoal": []}
        for round_index in range(args.rounds):  # interleaved, each first in turn, so drift touches both alike
            order = ["torch", "shoal"] if round_index % 2 == 0 else ["shoal", "torch"]
            for side in order:
                allocator = second if side == "shoal" else side
                res[side].append(model_run(allocator, model, args.model_steps, args.model_warmup, args.shoal_conf,
                                           args.fixed_layout))
        step = {a: [t for r in res[a] for t in r["step_ms"]] for a in res}
        fastest = {a: min(step[a]) for a in res}
        peak = {a: [r["peak_reserved"] / 2**20 for r in res[a]] for a in res}
        same = len({r["digest"] for a in res for r in res[a]}) == 1
        # Mean step per process: BERT's steps cycle through five shapes of
        # different cost, so a median of pooled steps picks one shape.
        means = {a: [statistics.fmean(r["step_ms"]) for r in res[a]] for a in res}
        print(f"| {model} | {spread(step['torch'])} | {spread(step['shoal'])} | "
              f"{statistics.median(step['shoal']) / statistics.median(step['torch']):.3f} | "
              f"{fastest['torch']:.3f} / {fastest['shoal']:.3f} | {fastest['shoal'] / fastest['torch']:.3f} | "
              f"{spread(peak['torch'])} | {spread(peak['shoal'])} | "
              f"{statistics.median(peak['shoal']) / statistics.median(peak['torch']):.3f} | {'yes' if same else 'NO'} |")
        print(f"  {model}: mean step per process (ms), PyTorch {spread(means['torch'])}, shoal {spread(means['shoal'])}, "
              f"shoal/PyTorch {statistics.median(means['shoal']) / statistics.median(means['torch']):.3f} "
              f"(fastest process {min(means['shoal']) / min(means['torch']):.3f})")
        per_step = {a: res[a][0]["allocations_per_step"] for a in res}
        print(f"  {model}: allocations per step {per_step}, shoal device allocations "
              f"{[r['device_allocations'] for r in res['shoal']]}")
        # A steady state takes nothing from the device: calls made during the
        # timed steps (allocs + frees, and shoal's growable-segment driver calls)
        # are time neither the median nor the peak shows by itself.
        for a in res:
            print(f"  {model} on {a}: device allocs + frees during the timed steps "
                  f"{[(r['timed_device_allocations'], r['timed_device_frees']) for r in res[a]]}, "
                  f"VMM calls {[r['timed_vmm_calls'] for r in res[a]]}")


if __name__ == "__main__":
    main()
