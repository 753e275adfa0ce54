"""Grouped model loading, timed on the GPU: a torchvision ResNet-152 and a transformers
BERT-base (random weights, eval, no_grad) whose parameters sit in pinned host memory are
loaded onto the GPU and run once on a batch.

    python bench/python/grouped_loading.py [--rounds R]

Rows per model, each a median with (min-max) over the rounds, on the GPU's timeline from
the start of loading (an event on the compute stream right before the first copy is
enqueued):
  - anchor "copy all, then run": every tensor copied with .to(non_blocking=True) on the
    compute stream, then the forward;
  - shoal.loading with one group for the whole model, one group per layer, and the planned
    grouping (plan_groups on the profile measured first and the copy cost measured on the
    device): time to the first layer's start, time to the last layer's completion, and what
    the planner predicted;
  - the forward alone with the model resident (the floor).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import shoal
import shoal.loading


def resnet152() -> tuple[torch.nn.Module, tuple]:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet152(weights=None).eval(), (torch.randn(8, 3, 224, 224, device="cuda"),)


def bert_base() -> tuple[torch.nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    return model, (torch.randint(0, 30522, (8, 128), device="cuda"),)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"


def mark_first_layer(model: torch.nn.Module, first_name: str, marks: dict):
    """A pre-forward hook on the first layer to run, registered after the loader's own (so
    it fires after the wait): records when the layer starts on the GPU."""
    layer = dict(model.named_modules())[first_name]

    def mark(module, inputs):
        if "first" not in marks:
            marks["first"] = torch.cuda.Event(enable_timing=True)
            marks["first"].record()

    return layer.register_forward_pre_hook(mark)


def timed(run) -> tuple[float, float, float]:
    """(first layer start, last layer end, host time of the load call) in seconds of one
    call of run(marks)."""
    torch.cuda.synchronize()
    marks: dict = {"start": torch.cuda.Event(enable_timing=True), "end": torch.cuda.Event(enable_timing=True)}
    marks["start"].record()
    run(marks)
    marks["end"].record()
    torch.cuda.synchronize()
    first = marks["start"].elapsed_time(marks["first"]) / 1e3 if "first" in marks else 0.0
    return first, marks["start"].elapsed_time(marks["end"]) / 1e3, marks.get("load_host", 0.0)


def bench_model(name: str, make, rounds: int) -> None:
    model, inputs = make()
    loader = shoal.loading.ModuleLoader(model)
    profile = loader.profile(*inputs, rounds=3)
    cost = shoal.loading.measure_copy_cost()
    first_name = profile[0].name
    total_bytes = sum(layer.bytes for layer in profile)
    plans = {g: loader.plan(profile, g, cost) for g in ("whole", "per_layer", "optimal")}

    def with_loader(plan):
        def run(marks):
            begin = time.perf_counter()
            loader.load(plan)
            marks["load_host"] = time.perf_counter() - begin
            hook = mark_first_layer(model, first_name, marks)
            with torch.no_grad():
                model(*inputs)
            hook.remove()

        return run

    params = list(model.parameters())
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]

    def copy_all_then_run(marks):
        for p in params:
            p.data = p.data.to("cuda", non_blocking=True)
        for m, n, b in buffers:
            m._buffers[n] = b.to("cuda", non_blocking=True)
        hook = mark_first_layer(model, first_name, marks)
        with torch.no_grad():
            model(*inputs)
        hook.remove()

    rows: dict[str, tuple[list, list]] = {}
    for _ in range(rounds + 1):  # the first round warms torch's caching allocator
        host = [p.data for p in params]
        host_buffers = [b for _, _, b in buffers]
        result = timed(copy_all_then_run)
        for p, h in zip(params, host):
            p.data = h
        for (m, n, _), h in zip(buffers, host_buffers):
            m._buffers[n] = h
        rows.setdefault("anchor: copy all, then run", ([], [], []))
        for column, value in zip(rows["anchor: copy all, then run"], result):
            column.append(value)
        for grouping, plan in plans.items():
            result = timed(with_loader(plan))
            loader.unload()
            label = f"shoal.loading, {grouping} ({plan.groups} groups)"
            rows.setdefault(label, ([], [], []))
            for column, value in zip(rows[label], result):
                column.append(value)
    for label in rows:  # drop the warm-up round
        rows[label] = tuple(column[1:] for column in rows[label])
    loader.load("whole").synchronize()
    def forward_only(marks):
        with torch.no_grad():
            model(*inputs)

    resident = [timed(forward_only)[1] for _ in range(rounds)]
    loader.unload()

    anchor_end = statistics.median(rows["anchor: copy all, then run"][1])
    print(f"\n### {name}: {len(profile)} layers, {total_bytes / 2**20:.1f} MiB of parameters and buffers")
    print(f"copy cost measured: {cost.per_group_seconds * 1e6:.2f} us per group, {cost.bytes_per_second / 1e9:.1f} GB/s")
    print("| row | first layer starts, ms | last layer done, ms | predicted (first, last), ms | last vs anchor | load() host ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, (first, last, host) in rows.items():
        grouping = label.split(", ")[-1].split(" ")[0] if label.startswith("shoal") else None
        predicted = (
            f"{plans[grouping].first_layer_start * 1e3:.2f}, {plans[grouping].last_layer_end * 1e3:.2f}"
            if grouping
            else "-"
        )
        host_ms = spread(host) if label.startswith("shoal") else "-"
        print(
            f"| {label} | {spread(first)} | {spread(last)} | {predicted} | "
            f"{statistics.median(last) / anchor_end:.2f} | {host_ms} |"
        )
    compute = sum(layer.compute_seconds for layer in profile) * 1e3
    print(
        f"| forward alone, model resident | - | {spread(resident)} | {compute:.2f} (profile) | "
        f"{statistics.median(resident) / anchor_end:.2f} | - |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, make in (("ResNet-152, batch 8, 224x224", resnet152), ("BERT-base, batch 8, 128 tokens", bert_base)):
        bench_model(name, make, args.rounds)


if __name__ == "__main__":
    main()
