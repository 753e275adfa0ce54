"""shoal.loading.ModuleLoader on the GPU machine: a torch module loaded group by group
while it runs gives the outputs of the module loaded whole, even with the copies held back;
without the waits it does not (the control)."""

from __future__ import annotations

import copy

import pytest

import shoal
import shoal.loading

pytestmark = [pytest.mark.python, pytest.mark.torch]


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or shoal.default_device().kind != "cuda":
        pytest.skip("ModuleLoader loads onto a CUDA device")
    return torch


def make_model(torch, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 16)).eval()
    return model


def run_after_held_copies(torch, loader, plan, wait=True, x=None):
    if isinstance(plan, str):
        plan = loader.plan(grouping=plan)  # before holding the stream: planning measures the link on it
    with torch.cuda.stream(loader.copy_stream):
        torch.cuda._sleep(50_000_000)  # holds the copy stream back: about 30 ms
    loading = loader.load(plan, wait=wait)
    x = torch.ones(4, 1024, device="cuda") if x is None else x
    with torch.no_grad():
        out = loader.module(x)
    return out, loading


@pytest.mark.parametrize("grouping", ["per_layer", "optimal", "whole"])
def test_a_module_loaded_in_groups_computes_what_the_whole_module_computes(torch, grouping):
    model = make_model(torch)
    reference = copy.deepcopy(model).cuda()
    with torch.no_grad():
        expected = reference(torch.ones(4, 1024, device="cuda"))
    loader = shoal.loading.ModuleLoader(model)
    out, loading = run_after_held_copies(torch, loader, grouping)
    assert not loading.done(), "the copies ran before the forward was enqueued: nothing was overlapped"
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert loading.done()
    assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
    loader.unload()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())


def test_control_without_the_waits_the_module_reads_parameters_not_yet_copied(torch):
    # A seed of its own: memory that other tests' loads left in torch's cache holds their
    # weights, which must not be these.
    model = make_model(torch, seed=123)
    reference = copy.deepcopy(model).cuda()
    with torch.no_grad():
        expected = reference(torch.ones(4, 1024, device="cuda"))
    loader = shoal.loading.ModuleLoader(model)
    out, _ = run_after_held_copies(torch, loader, "per_layer", wait=False)
    loader.unload()
    assert not torch.equal(out, expected), "the race did not show: the safe test would prove nothing"


def test_the_profile_orders_layers_as_they_run_and_the_plan_beats_neither_extreme_less(torch):
    model = make_model(torch)
    loader = shoal.loading.ModuleLoader(model)
    profile = loader.profile(torch.ones(4, 1024, device="cuda"), rounds=2)
    assert [layer.name for layer in profile] == [name for name, _ in loader.layer_bytes()]
    assert len(profile) == 17  # 8 Linear + 8 BatchNorm + the head; ReLU holds no tensors
    assert all(layer.compute_seconds > 0 for layer in profile)
    assert sum(layer.bytes for layer in profile) == sum(
        t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
    )
    best = loader.plan()
    for other in ("per_layer", "whole"):
        assert best.last_layer_end <= loader.plan(grouping=other).last_layer_end + 1e-12
    assert all(p.device.type == "cpu" for p in model.parameters()), "profile() leaves the module unloaded"


def test_tied_parameters_load_once_and_optimizers_keep_their_parameters(torch):
    torch.manual_seed(1)
    embed = torch.nn.Embedding(100, 64)
    head = torch.nn.Linear(64, 100, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, torch.nn.Linear(64, 64), head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model).cuda()
    tokens = torch.arange(10, device="cuda")
    loader = shoal.loading.ModuleLoader(model)
    assert sum(b for _, b in loader.layer_bytes()) == (100 * 64 + 64 * 64 + 64) * 4
    out, _ = run_after_held_copies(torch, loader, "per_layer", x=tokens)
    with torch.no_grad():
        assert torch.equal(out, reference(tokens))
    assert model[0].weight is model[2].weight and model[0].weight.is_cuda
    assert optimizer.param_groups[0]["params"][0] is model[0].weight
    loader.unload()


def test_loading_twice_is_refused_and_a_cpu_module_is_required(torch):
    model = make_model(torch)
    loader = shoal.loading.ModuleLoader(model)
    loader.load("whole")
    with pytest.raises(RuntimeError, match="loaded already"):
        loader.load("whole")
    loader.unload()
    with pytest.raises(ValueError, match="CUDA device"):
        shoal.loading.ModuleLoader(make_model(torch), device="cpu")
    with pytest.raises(ValueError, match="start on the CPU"):
        shoal.loading.ModuleLoader(make_model(torch).cuda())


def test_the_profile_reorders_layers_registered_out_of_execution_order(torch):
    class Backwards(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.last = torch.nn.Linear(256, 8)
            self.first = torch.nn.Linear(256, 256)

        def forward(self, x):
            return self.last(torch.relu(self.first(x)))

    torch.manual_seed(2)
    model = Backwards()
    reference = copy.deepcopy(model).cuda()
    x = torch.randn(3, 256, device="cuda")
    loader = shoal.loading.ModuleLoader(model)
    assert [name for name, _ in loader.layer_bytes()] == ["last", "first"]
    assert [layer.name for layer in loader.profile(x, rounds=1)] == ["first", "last"]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    out, _ = run_after_held_copies(torch, loader, "per_layer", x=x)
    with torch.no_grad():
        assert torch.equal(out, reference(x))
    loader.unload()


def test_a_module_without_tensors_is_refused(torch):
    with pytest.raises(ValueError, match="no parameters or buffers"):
        shoal.loading.ModuleLoader(torch.nn.ReLU())


def test_a_module_whose_tensors_are_all_empty_loads_with_nothing_to_copy(torch):
    model = torch.nn.Sequential(torch.nn.Linear(0, 0), torch.nn.Linear(0, 0))
    loader = shoal.loading.ModuleLoader(model)
    loading = loader.load("per_layer")
    out = model(torch.ones(3, 0, device="cuda"))
    loading.synchronize()
    assert loading.done() and out.shape == (3, 0)
    assert all(p.is_cuda and p.numel() == 0 for p in model.parameters())
    loader.unload()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_layer_that_reads_a_child_it_never_calls_waits_for_the_childs_group(torch):
    # nn.MultiheadAttention reads out_proj's weight itself and never calls out_proj.
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
    ).eval()
    reference = copy.deepcopy(model).cuda()
    x = torch.randn(2, 16, 256, device="cuda")
    loader = shoal.loading.ModuleLoader(model)
    loader.profile(x, rounds=1)
    out, _ = run_after_held_copies(torch, loader, "per_layer", x=x)
    with torch.no_grad():
        assert torch.allclose(out, reference(x), rtol=0, atol=0)
    loader.unload()


def test_waiting_by_hand_defaults_to_torchs_current_stream_and_unload_frees_the_device_memory(torch):
    model = make_model(torch, seed=5)
    reference = copy.deepcopy(model).cuda()
    x = torch.ones(4, 1024, device="cuda")
    with torch.no_grad():
        expected = reference(x)
    loader = shoal.loading.ModuleLoader(model)
    plan = loader.plan(grouping="per_layer")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.no_grad():
        reference(x)  # the first matmul on a stream takes cuBLAS's workspace for it: before counting
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(loader.copy_stream):
        torch.cuda._sleep(50_000_000)
    loading = loader.load(plan, wait=False)
    with torch.cuda.stream(side), torch.no_grad():
        side.wait_stream(torch.cuda.current_stream())
        x_side = x.clone()
        loading.wait()  # torch's current stream: side
        out = model(x_side)
    side.synchronize()
    assert torch.equal(out, expected)
    del out, x_side
    loader.unload()
    torch.cuda.empty_cache()  # frees blocks whose recorded streams have passed
    assert torch.cuda.memory_allocated() <= before, "the device buffer outlived unload() while the Loading lived"
    assert loading.groups > 1


def test_an_unload_whose_wait_fails_changes_nothing_and_a_later_one_completes(torch, monkeypatch):
    # A wait that raises (a kernel fault, here torch.cuda.synchronize made to fail once) left the
    # loader thinking it had unloaded, with the module still on device views and its hooks off.
    model = make_model(torch, seed=6)
    loader = shoal.loading.ModuleLoader(model)
    loader.load()
    real_synchronize = torch.cuda.synchronize

    def failing_synchronize(*args, **kwargs):
        monkeypatch.setattr(torch.cuda, "synchronize", real_synchronize)
        raise RuntimeError("CUDA error: device-side assert triggered (made up)")

    monkeypatch.setattr(torch.cuda, "synchronize", failing_synchronize)
    with pytest.raises(RuntimeError, match="made up"):
        loader.unload()
    assert next(model.parameters()).is_cuda, "the failed unload moved the module off the device"
    loader.unload()
    assert not next(model.parameters()).is_cuda, "the second unload did nothing: the first had forgotten the loading"


def test_without_a_profile_the_default_plan_still_overlaps(torch):
    loader = shoal.loading.ModuleLoader(make_model(torch))
    loading = loader.load()
    assert loading.groups == len(loader.layer_bytes()), "without a profile the default is one group per layer"
    loader.unload()
