#!/usr/bin/env python3
"""Record allocation traces from PyTorch running real models on a GPU.

Runs each workload under PyTorch's memory-history recording, converts the
caching allocator's trace (every alloc and free with size and stream) into
shoal's trace format (docs/traces.md), and writes one .trace file per
workload for bench/replay (shoal_replay, shoal_replay_compare).

Workloads (random weights and inputs, no network needed):
  resnet50-train-b32, resnet50-train-b64
      torchvision ResNet-50, fp32, 224x224, 4 training steps each
      (forward, backward, SGD step with momentum).
  transformer-infer-mixed
      a 12-layer encoder (d_model 1024, 16 heads, fp16) under no_grad,
      30 requests with batch in {1,4,8,16} and sequence in
      {128,256,512,1024}, in a fixed random order.
  gpt2-generate
      transformers GPT-2 small, greedy generation of 48 tokens for six
      prompts of mixed batch and length (a KV cache growing per token).
  bert-serve-mixed
      transformers BERT-base, 40 requests of mixed batch and sequence.
  bert-gpt2-serve
      BERT-base and GPT-2 small served in one process (two model
      families), 40 requests of mixed shapes.

Usage, on the GPU machine (PyTorch with CUDA; well under 3 minutes on an H100):
  python3 scripts/record-traces.py [OUT_DIR]   # default: $OUT, else ./traces

The recording and the conversion are shoal.traces' (python/shoal/traces.py, loaded
here by path), which records any program the same way.
"""

import argparse
import datetime
import gc
import importlib.util
import os
import random
import sys

def load_traces_module():
    """shoal.traces (python/shoal/traces.py), loaded by path: it needs no built shoal."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "shoal", "traces.py")
    spec = importlib.util.spec_from_file_location("shoal_traces", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


traces = load_traces_module()


# ---- workloads ---------------------------------------------------------------


def resnet50(torch):
    """ResNet-50 with random weights: torchvision's, or where torchvision
    cannot be imported, the same architecture built here. Returns the model
    and which one it is."""
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None), "torchvision resnet50(weights=None)"
    except Exception as e:  # ImportError, or a torchvision built for another torch
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, inplanes, planes, stride):
            super().__init__()
            width, out = planes, planes * 4
            self.conv1, self.bn1 = nn.Conv2d(inplanes, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or inplanes != out:
                self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                                nn.BatchNorm2d(out))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            return self.relu(self.bn3(self.conv3(y)) + identity)

    layers, inplanes = [], 64
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
            inplanes = planes * 4
    model = nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000),
    )
    return model, f"ResNet-50 built from torch.nn (torchvision unusable: {reason})"


def resnet_training(batch, steps):
    def run(torch):
        torch.manual_seed(0)
        model, which = resnet50(torch)
        model = model.cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        for _ in range(steps):
            images = torch.randn(batch, 3, 224, 224, device="cuda")
            labels = torch.randint(0, 1000, (batch,), device="cuda")
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            loss.item()  # a training loop reads its loss; it also bounds the queue
        return f"model: {which}"

    return run, f"ResNet-50 training, fp32, batch {batch}, 224x224, {steps} steps of forward + backward + SGD(momentum 0.9)"


TRANSFORMER_BATCHES = (1, 4, 8, 16)
TRANSFORMER_SEQUENCES = (128, 256, 512, 1024)


def transformer_inference(requests, seed):
    shapes = [(b, s) for b in TRANSFORMER_BATCHES for s in TRANSFORMER_SEQUENCES]
    order = [random.Random(seed).choice(shapes) for _ in range(requests)]

    def run(torch):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(
            d_model=1024, nhead=16, dim_feedforward=4096, dropout=0.0, batch_first=True
        )
        model = torch.nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
        model = model.cuda().half().eval()
        with torch.no_grad():
            for batch, sequence in order:
                x = torch.randn(batch, sequence, 1024, device="cuda", dtype=torch.half)
                model(x).float().mean().item()  # a server copies its answer out

    shapes_text = " ".join(f"{b}x{s}" for b, s in order)
    return run, (
        f"nn.TransformerEncoder 12 layers, d_model 1024, 16 heads, ffn 4096, fp16, no_grad, "
        f"{requests} requests (batch x sequence): {shapes_text}"
    )


def gpt2(torch):
    import transformers

    config = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12)  # GPT-2 small, random weights
    return transformers.GPT2LMHeadModel(config).cuda().eval()


def bert(torch):
    import transformers

    config = transformers.BertConfig()  # BERT-base, random weights
    return transformers.BertModel(config).cuda().eval()


GENERATION_PROMPTS = ((1, 32), (4, 64), (2, 128), (8, 16), (1, 256), (4, 32))


def gpt2_generation(new_tokens):
    """A decoder generating: the KV cache grows by one position per token in every layer."""

    def run(torch):
        torch.manual_seed(0)
        model = gpt2(torch)
        with torch.no_grad():
            for batch, prompt in GENERATION_PROMPTS:
                ids = torch.randint(0, 50257, (batch, prompt), device="cuda")
                out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=0, attention_mask=torch.ones_like(ids))
                out.cpu()  # a server sends the tokens out

    prompts = " ".join(f"{b}x{p}" for b, p in GENERATION_PROMPTS)
    return run, (f"transformers GPT-2 small (random weights), greedy generate() of {new_tokens} tokens with a "
                 f"growing KV cache, prompts (batch x length): {prompts}")


SERVING_BATCHES = (1, 2, 4, 8, 16, 32)
SERVING_SEQUENCES = (16, 64, 128, 256, 384, 512)


def two_family_serving(requests, seed):
    """BERT-base encoding and GPT-2 small generation served in one process, mixed shapes."""
    rng = random.Random(seed)
    order = [(rng.choice(("bert", "bert", "gpt2")), rng.choice(SERVING_BATCHES), rng.choice(SERVING_SEQUENCES))
             for _ in range(requests)]

    def run(torch):
        torch.manual_seed(0)
        models = {"bert": bert(torch), "gpt2": gpt2(torch)}
        with torch.no_grad():
            for family, batch, sequence in order:
                if family == "bert":
                    ids = torch.randint(0, 30522, (batch, sequence), device="cuda")
                    models["bert"](input_ids=ids).last_hidden_state[:, 0].float().cpu()
                else:
                    ids = torch.randint(0, 50257, (max(1, batch // 4), min(sequence, 128)), device="cuda")
                    models["gpt2"].generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                            pad_token_id=0, attention_mask=torch.ones_like(ids)).cpu()

    text = " ".join(f"{f}:{b}x{s}" for f, b, s in order)
    return run, f"BERT-base and GPT-2 small (random weights) served in one process, {requests} requests: {text}"


def bert_serving(requests, seed):
    rng = random.Random(seed)
    order = [(rng.choice(SERVING_BATCHES), rng.choice(SERVING_SEQUENCES)) for _ in range(requests)]

    def run(torch):
        torch.manual_seed(0)
        model = bert(torch)
        with torch.no_grad():
            for batch, sequence in order:
                ids = torch.randint(0, 30522, (batch, sequence), device="cuda")
                model(input_ids=ids).last_hidden_state[:, 0].float().cpu()

    text = " ".join(f"{b}x{s}" for b, s in order)
    return run, f"transformers BERT-base (random weights), fp32, no_grad, {requests} requests (batch x sequence): {text}"


WORKLOADS = {
    "resnet50-train-b32": lambda: resnet_training(32, 4),
    "resnet50-train-b64": lambda: resnet_training(64, 4),
    "transformer-infer-mixed": lambda: transformer_inference(30, seed=0),
    "gpt2-generate": lambda: gpt2_generation(48),
    "bert-serve-mixed": lambda: bert_serving(40, seed=1),
    "bert-gpt2-serve": lambda: two_family_serving(40, seed=2),
}


# ---- recording ----------------------------------------------------------------


def mib(n):
    return n / (1 << 20)


def record(torch, name, out_dir, max_entries, free_action):
    run, description = WORKLOADS[name]()
    gc.collect()
    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        # so that each trace starts from nothing and records its own workspaces
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    path = os.path.join(out_dir, name + ".trace")
    notes = [f"{name}: recorded by scripts/record-traces.py, {datetime.date.today().isoformat()}",
             f"workload: {description}"]
    with traces.record(path, max_entries=max_entries, free_on=free_action, notes=notes) as recording:
        model_note = run(torch)
        if model_note:
            recording.notes.append(model_note)
    if recording.truncated:
        print(f"warning: {name}: the history reached max_entries; the start of the workload was lost "
              "(raise --max-entries)", file=sys.stderr)
    return {"name": name, "recording": recording}


def print_table(results):
    print("| trace | events | allocs | streams | peak requested MiB (trace) | torch peak requested MiB "
          "| torch peak allocated MiB | torch peak reserved MiB | torch reserved / requested | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        c = r["recording"]
        ratio = c.torch_peak_reserved / c.peak_requested if c.peak_requested else 0.0
        print(f"| {r['name']} | {c.events} | {c.allocs} | {c.streams} | {mib(c.peak_requested):.1f} "
              f"| {mib(c.torch_peak_requested):.1f} | {mib(c.torch_peak_allocated):.1f} "
              f"| {mib(c.torch_peak_reserved):.1f} | {ratio:.3f} | {c.seconds:.1f} |")


def main_record(args):
    import torch

    if not torch.cuda.is_available():
        print("record-traces: PyTorch sees no CUDA device; run this on the GPU machine", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    names = args.only or list(WORKLOADS)
    results = []
    for name in names:
        r = record(torch, name, args.out, args.max_entries, args.free_on)
        print(f"wrote {r['recording']}", flush=True)
        results.append(r)
    print()
    print_table(results)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or "traces",
                        help="directory for the .trace files (default: $OUT, else ./traces)")
    parser.add_argument("--only", nargs="+", choices=list(WORKLOADS), help="record only these workloads")
    parser.add_argument("--max-entries", type=int, default=1_000_000, help="history ring size (default 1,000,000)")
    parser.add_argument("--free-on", choices=("free_requested", "free_completed"), default="free_requested",
                        help="which PyTorch event counts as the free (default free_requested)")
    args = parser.parse_args()
    return main_record(args)


if __name__ == "__main__":
    sys.exit(main())
