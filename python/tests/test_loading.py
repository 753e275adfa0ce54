"""shoal.loading: groups of host arrays copied to the device, a GPU-side wait per group,
the group planner, and (on the GPU machine) a torch module loaded group by group while it runs.
"""

from __future__ import annotations

import gc
import weakref

import numpy
import pytest

import shoal
import shoal.loading
from conftest import ticks_during

pytestmark = pytest.mark.python

GROUPS = 5
MIB = 1 << 20


def host_array(nbytes: int, value: int):
    """A host array of ``nbytes`` bytes, each ``value``: page-locked on CUDA (a pinned torch
    tensor: from pageable memory CUDA copies synchronously, so nothing would race), numpy on
    the host backend."""
    if shoal.default_device().kind == "cuda":
        torch = pytest.importorskip("torch")
        return torch.full((nbytes,), value, dtype=torch.uint8).pin_memory()
    return numpy.full(nbytes, value, dtype="uint8")


def model_memory(groups: int = GROUPS, nbytes: int = 4 * MIB) -> tuple[list, list]:
    """Zeroed device storages and host sources of value g + 1 for each group g (two per group)."""
    targets = [[shoal.allocate(nbytes), shoal.allocate(nbytes)] for _ in range(groups)]
    for pair in targets:
        for storage in pair:
            storage.fill(0)
    shoal.synchronize()
    sources = [[host_array(nbytes, g + 1) for _ in range(2)] for g in range(groups)]
    return targets, sources


def test_dropping_a_load_whose_copies_are_queued_lets_other_python_threads_run():
    # The load's end waits for its copies; with the GIL held there, every other Python
    # thread would stand still until they had run.
    targets, sources = model_memory(groups=1, nbytes=4096)
    copy = shoal.Stream()
    copy.delay(0.5)
    loads = [shoal.loading.load_groups([list(zip(targets[0], sources[0]))], copy)]
    took, ticks = ticks_during(loads.clear)  # the last reference: waits for the copies
    assert took >= 0.2, "the load's end did not wait for its copies (the test's premise)"
    assert ticks >= 10, f"another Python thread ran {ticks} times in {took:.2f} s of the drop"
    assert all(bytes(storage.read(0, 4096)) == bytes([1]) * 4096 for storage in targets[0])


def last_bytes_seen(wait: bool) -> list[int]:
    """Loads on a copy stream held back at first; a compute stream reads the last byte of each
    group's storages, waiting for the group first when ``wait``."""
    targets, sources = model_memory()
    copy, compute = shoal.Stream(), shoal.Stream()
    copy.delay(0.05)
    load = shoal.loading.load_groups(
        [list(zip(targets[g], sources[g])) for g in range(GROUPS)], copy
    )
    assert load.groups == GROUPS
    seen = []
    for g in range(GROUPS):
        if wait:
            load.wait(g, compute)
        for storage in targets[g]:
            seen.append(storage.read(storage.nbytes - 1, 1, stream=compute)[0])
    load.synchronize()
    return seen


def test_a_stream_waiting_for_each_group_reads_its_final_bytes():
    assert last_bytes_seen(wait=True) == [g + 1 for g in range(GROUPS) for _ in range(2)]


def test_control_without_the_waits_the_stream_reads_bytes_not_yet_copied():
    assert last_bytes_seen(wait=False) != [g + 1 for g in range(GROUPS) for _ in range(2)], (
        "the race did not show: the safe test would prove nothing"
    )


def test_array_views_are_destinations_and_sources_live_until_the_load_is_gone():
    storage = shoal.allocate(4096)
    view = storage.view("float32", (2, 512))
    source = numpy.arange(1024, dtype="float32").reshape(2, 512)
    watch = weakref.ref(source)
    load = shoal.loading.load_groups([[(view, source)]])
    del source
    gc.collect()
    assert watch() is not None, "a source was let go of while the load exists"
    load.wait(0)
    load.synchronize_group(0)
    assert repr(load) == "shoal.loading.GroupedLoad(1 groups, 1 copied)"  # named where users find it
    with pytest.raises(shoal.InvalidArgumentError, match="group must be >= 0"):
        load.wait(-1)
    del load
    gc.collect()
    assert watch() is None
    got = numpy.frombuffer(storage.read(), dtype="float32")
    assert numpy.array_equal(got, numpy.arange(1024, dtype="float32"))


def test_bad_groups_are_refused_with_clear_errors():
    storage = shoal.allocate(4096)
    with pytest.raises(ValueError, match="does not fill"):
        shoal.loading.load_groups([[(storage, numpy.zeros(100, "uint8"))]])
    with pytest.raises(TypeError, match="source"):
        shoal.loading.load_groups([[(storage, b"x" * 4096)]])
    with pytest.raises(ValueError, match="C-contiguous"):  # the right type, the wrong layout
        shoal.loading.load_groups([[(storage, numpy.zeros((64, 128), "uint8")[:, ::2])]])
    with pytest.raises(TypeError, match="destination"):
        shoal.loading.load_groups([[(bytearray(4096), numpy.zeros(4096, "uint8"))]])
    with pytest.raises(ValueError, match="writable"):
        shoal.loading.load_groups([[(storage.view(readonly=True), numpy.zeros(4096, "uint8"))]])
    with pytest.raises(shoal.InvalidArgumentError, match="no copies"):
        shoal.loading.load_groups([[(storage, numpy.zeros(4096, "uint8"))], []])
    with pytest.raises(shoal.InvalidArgumentError, match="no groups"):
        shoal.loading.load_groups([])
    load = shoal.loading.load_groups([[(storage, numpy.zeros(4096, "uint8"))]])
    with pytest.raises(shoal.InvalidArgumentError, match="does not exist"):
        load.wait(1)
    for negative in (load.is_ready, load.synchronize_group, load.wait):
        with pytest.raises(shoal.InvalidArgumentError, match="must be >= 0"):
            negative(-1)
    load.synchronize_group(0)
    assert load.is_ready(0)


def test_the_plan_follows_the_copy_and_compute_timeline():
    layers = [(10**9, 0.5), (10**9, 0.5)]
    cost = shoal.loading.CopyCost(0.1, 1e9)
    per_layer = shoal.loading.plan_groups(layers, cost, "per_layer")
    assert per_layer.group_ends == (1, 2)
    assert per_layer.first_layer_start == pytest.approx(1.1)
    assert per_layer.last_layer_end == pytest.approx(2.7)
    whole = shoal.loading.plan_groups(layers, cost, "whole")
    assert (whole.groups, whole.first_layer_start, whole.last_layer_end) == (1, pytest.approx(2.1), pytest.approx(3.1))
    best = shoal.loading.plan_groups([shoal.loading.LayerProfile("a", *layers[0]), layers[1]], cost)
    assert best.last_layer_end <= min(per_layer.last_layer_end, whole.last_layer_end)
    assert shoal.loading.evaluate_grouping(layers, cost, [1, 2]) == per_layer
    with pytest.raises(shoal.InvalidArgumentError):
        shoal.loading.plan_groups(layers, cost, "fastest")
    with pytest.raises(shoal.InvalidArgumentError):
        shoal.loading.evaluate_grouping(layers, cost, [2, 1])
    with pytest.raises(shoal.InvalidArgumentError):  # an end past the layers is never read
        shoal.loading.evaluate_grouping(layers, cost, [2_000_000, 2])
    with pytest.raises(shoal.InvalidArgumentError, match="a layer's bytes"):
        shoal.loading.plan_groups([(-5, 0.1)], cost)


def test_the_measured_copy_cost_is_a_plausible_link():
    cost = shoal.loading.measure_copy_cost()
    assert 0 < cost.per_group_seconds < 1e-2
    assert 1e8 < cost.bytes_per_second < 1e13


def test_a_foreign_stream_handle_is_refused_where_there_are_none():
    if shoal.default_device().kind != "host":
        pytest.skip("the host backend has no foreign streams; CUDA handles are exercised by the torch tests")
    with pytest.raises(shoal.InvalidArgumentError):
        shoal.Stream.from_handle(12345)


@pytest.mark.torch
def test_a_torch_source_with_the_conjugate_or_negative_bit_is_loaded_as_it_reads():
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    # The conjugate bit and the negative bit (as z.conj().imag has, contiguous here): the
    # tensors' bytes hold the values before the bit.
    sources = [z.conj(), torch.tensor([2.0, -4.0])._neg_view()]
    assert sources[0].is_conj() and sources[1].is_neg()
    expected = [bytes(s.resolve_conj().resolve_neg().numpy().tobytes()) for s in sources]
    targets = [shoal.allocate(s.numel() * s.element_size()) for s in sources]
    load = shoal.loading.load_groups([[(targets[0], sources[0])], [(targets[1], sources[1])]])
    load.synchronize()
    assert [t.read() for t in targets] == expected, "the bit was dropped: the raw bytes were copied"
    del load, targets


@pytest.mark.torch
def test_a_torch_destination_with_the_conjugate_bit_is_refused():
    torch = pytest.importorskip("torch")
    if shoal.default_device().kind != "cuda" or not torch.cuda.is_available():
        pytest.skip("torch destinations are CUDA tensors")
    destination = torch.zeros(2, dtype=torch.complex64, device="cuda").conj()
    with pytest.raises(ValueError, match="conjugate or negative bit"):
        shoal.loading.load_groups([[(destination, torch.zeros(2, dtype=torch.complex64))]])
