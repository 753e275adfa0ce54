"""Real models with random weights (nothing downloaded) on PyTorch's
allocator or on shoal: ResNet-50 training steps, BERT-base forward passes
with mixed batch sizes and sequence lengths, GPT-2 small greedy generation.
Deterministic algorithms and a fixed seed, so both allocators must give the
same digest. Prints one JSON line: digest, step times, peak memory."""

import argparse
import hashlib
import json
import os
import statistics
import time

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=["shoal", "torch"], required=True)
parser.add_argument("--model", choices=["resnet", "bert", "gpt2"], required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--warmup", type=int, default=1)
parser.add_argument("--shoal-conf", default="", help="shoal's settings, e.g. expandable_segments:true")
args = parser.parse_args()

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if args.allocator == "shoal":
    import shoal.torch

    shoal.torch.enable(conf=args.shoal_conf, use_environment=False)
import torch

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
device = torch.device("cuda", 0)
digest = hashlib.sha256()


def note(t: torch.Tensor) -> None:
    digest.update(t.detach().double().cpu().numpy().tobytes())


def resnet_steps():
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator(device=device).manual_seed(1)

    def step(i):
        images = torch.randn(32, 3, 224, 224, device=device, generator=g)
        labels = torch.randint(0, 1000, (32,), device=device, generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss

    return step


def bert_steps():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig()).to(device).eval()
    shapes = [(8, 128), (4, 384), (16, 64), (2, 512), (32, 32)]
    g = torch.Generator(device=device).manual_seed(1)

    def step(i):
        batch, length = shapes[i % len(shapes)]
        ids = torch.randint(0, 30522, (batch, length), device=device, generator=g)
        with torch.no_grad():
            out = model(input_ids=ids).last_hidden_state
        return out.float().sum()

    return step


def gpt2_steps():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).to(device).eval()
    g = torch.Generator(device=device).manual_seed(1)

    def step(i):
        prompt = torch.randint(0, 50257, (4, 16), device=device, generator=g)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(prompt))
        return out

    return step


step = {"resnet": resnet_steps, "bert": bert_steps, "gpt2": gpt2_steps}[args.model]()
times = []
device_calls_before = (0, 0)
vmm_before = 0


def vmm_calls() -> int:
    """shoal's growable segments' driver calls so far (0 on PyTorch's allocator)."""
    if args.allocator != "shoal":
        return 0
    return sum(shoal.torch.allocator().stats()["vmm_calls"].values())


for i in range(args.warmup + args.steps):
    if i == args.warmup:  # the device calls of the timed steps alone: a steady state makes none
        stats = torch.cuda.memory_stats()
        device_calls_before = (stats.get("num_device_alloc", 0), stats.get("num_device_free", 0))
        vmm_before = vmm_calls()
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = step(i)
    torch.cuda.synchronize()
    if i >= args.warmup:
        times.append((time.perf_counter() - start) * 1e3)
    note(result)
final = torch.cuda.memory_stats()
print(
    json.dumps(
        {
            "allocator": args.allocator,
            "model": args.model,
            "digest": digest.hexdigest(),
            "step_ms_median": statistics.median(times),
            "step_ms": times,
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "allocated_at_end": torch.cuda.memory_allocated(),
            "requested_at_end": torch.cuda.memory_stats()["requested_bytes.all.current"],
            "blocks_at_end": torch.cuda.memory_stats()["allocation.all.current"],
            # How much allocation work a step does, on either allocator.
            "allocations_per_step": torch.cuda.memory_stats()["allocation.all.allocated"] / (args.warmup + args.steps),
            "device_allocations": final.get("num_device_alloc", -1),
            "device_frees": final.get("num_device_free", -1),
            "timed_device_allocations": final.get("num_device_alloc", 0) - device_calls_before[0],
            "timed_device_frees": final.get("num_device_free", 0) - device_calls_before[1],
            "timed_vmm_calls": vmm_calls() - vmm_before,
        }
    )
)
