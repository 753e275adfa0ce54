"""The segment sources behind shoal.torch.RegionPool, called through ctypes as PyTorch's
custom allocator calls them (host backend: a region borrowed in this process). The
torch.cuda.MemPool route itself runs on the GPU machine (test_torch.py)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref

import pytest

import shoal
import shoal.lending
import shoal.torch
from shoal import _shoal
from conftest import ctrl_c_reaches_the_caller_of, ticks_during
from test_lending import eventually  # the lending tests' wait for the lender's books

pytestmark = pytest.mark.python

MIB = 1 << 20
ALLOCATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


@pytest.fixture
def lent():
    if shoal.default_device().kind == "cuda":
        pytest.skip("CUDA refuses to import memory in the process that exported it")
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        address = str(pathlib.Path(directory) / "lender.sock")
        with shoal.lending.Lender(address) as lender, shoal.lending.Borrower(address) as borrower:
            yield lender, borrower


def functions(slot: int):
    allocate, free = _shoal._segment_source_functions(slot)
    return ALLOCATE(allocate), FREE(free)


def test_segments_are_carved_from_the_region_until_it_is_full(lent):
    lender, borrower = lent
    region = borrower.borrow(8 * MIB, "model A")
    slot = _shoal._segment_source_open(region)
    try:
        allocate, free = functions(slot)
        start = _shoal._segment_source_stats(slot)["base"]
        first = allocate(2 * MIB, 0, None)
        second = allocate(4 * MIB, 0, None)
        assert first is not None and second is not None
        for p, n in ((first, 2 * MIB), (second, 4 * MIB)):
            assert start <= p and p + n <= start + 8 * MIB, "a segment outside the region"
        assert abs(first - second) >= 2 * MIB, "segments overlap"
        assert allocate(4 * MIB, 0, None) is None, "the region is full: PyTorch must see out of memory"
        stats = _shoal._segment_source_stats(slot)
        assert (stats["segments"], stats["segment_bytes"]) == (2, 6 * MIB)
        ctypes.memset(first, 0x5A, 2 * MIB)  # the memory is the region's, mapped here
        assert bytes(region.read(first - start, 16)) == b"\x5a" * 16
        free(first, 2 * MIB, 0, None)
        again = allocate(2 * MIB, 0, None)
        assert again == first, "a segment given back is carved again"
        free(again, 2 * MIB, 0, None)
        free(second, 4 * MIB, 0, None)
        assert _shoal._segment_source_stats(slot)["segments"] == 0
    finally:
        _shoal._segment_source_close(slot)
        _shoal._segment_source_mem_pool_gone(slot)
    assert not _shoal._segment_source_stats(slot)["bound"]


def test_the_region_is_held_until_the_pool_is_closed_and_every_segment_is_back(lent):
    lender, borrower = lent
    region = borrower.borrow(4 * MIB, "model B")
    slot = _shoal._segment_source_open(region)
    allocate, free = functions(slot)
    segment = allocate(2 * MIB, 0, None)
    del region
    gc.collect()
    _shoal._segment_source_close(slot)
    _shoal._segment_source_mem_pool_gone(slot)
    assert allocate(2 * MIB, 0, None) is None, "a closed pool carves nothing more"
    stats = _shoal._segment_source_stats(slot)
    assert stats["bound"] and not stats["open"], "unbound while PyTorch still holds a segment"
    time.sleep(0.05)
    assert lender.status()["lent_bytes"] > 0, "the region went back under a live segment"
    free(segment, 2 * MIB, 0, None)
    assert not _shoal._segment_source_stats(slot)["bound"]
    assert eventually(lambda: lender.status()["lent_bytes"] == 0), "the region was not given back"


def test_a_closed_slot_goes_to_no_other_pool_while_its_mem_pool_lives(lent):
    lender, borrower = lent
    first, second = borrower.borrow(2 * MIB, "model D"), borrower.borrow(2 * MIB, "model E")
    slot = _shoal._segment_source_open(first)
    _shoal._segment_source_close(slot)  # closed, but PyTorch's MemPool object would still call it
    assert _shoal._segment_source_stats(slot)["bound"]
    other = _shoal._segment_source_open(second)
    assert other != slot, "a slot a live MemPool still calls was given to another region"
    allocate, _ = functions(slot)
    assert allocate(MIB, 0, None) is None, "a closed pool's functions carve nothing"
    _shoal._segment_source_mem_pool_gone(slot)
    assert not _shoal._segment_source_stats(slot)["bound"]
    _shoal._segment_source_close(other)
    _shoal._segment_source_mem_pool_gone(other)


def test_slots_are_bounded_and_reused(lent):
    lender, borrower = lent
    regions = [borrower.borrow(2 * MIB, f"model C{i}") for i in range(17)]
    opened = []
    with pytest.raises(shoal.InvalidArgumentError, match="region pools are open"):
        for region in regions:
            opened.append(_shoal._segment_source_open(region))
    assert len(opened) == 16
    addresses = {_shoal._segment_source_functions(s) for s in opened}
    assert len(addresses) == 16, "two slots share functions: PyTorch could not tell their pools apart"
    for s in opened:
        _shoal._segment_source_close(s)
        _shoal._segment_source_mem_pool_gone(s)
    slot = _shoal._segment_source_open(regions[16])
    _shoal._segment_source_close(slot)
    _shoal._segment_source_mem_pool_gone(slot)
    with pytest.raises(shoal.InvalidArgumentError):
        _shoal._segment_source_functions(16)


def test_memory_one_pool_carves_is_refused_to_another_until_that_pool_has_let_it_go(lent):
    # Each pool's allocator knows only its own segments: two over the same bytes would hand
    # out the same memory (a model rebuilt in its region while a tensor of the old one lives).
    lender, borrower = lent
    region = borrower.borrow(4 * MIB, "model F")
    slot = _shoal._segment_source_open(region)
    with pytest.raises(shoal.InvalidArgumentError, match="carved already by another RegionPool.*, open"):
        _shoal._segment_source_open(region)
    allocate, free = functions(slot)
    segment = allocate(2 * MIB, 0, None)
    _shoal._segment_source_close(slot)
    _shoal._segment_source_mem_pool_gone(slot)  # closed, its MemPool gone: the live segment still holds it
    with pytest.raises(shoal.InvalidArgumentError, match="closed but its tensors or MemPool still live"):
        _shoal._segment_source_open(region)
    free(segment, 2 * MIB, 0, None)
    again = _shoal._segment_source_open(region)
    allocate, free = functions(again)
    whole = allocate(4 * MIB, 0, None)
    assert whole is not None, "the whole region is the new pool's"
    _shoal._segment_source_close(again)
    _shoal._segment_source_mem_pool_gone(again)
    free(whole, 4 * MIB, 0, None)
    assert not _shoal._segment_source_stats(again)["bound"]


class _StandInMemPool:
    """What RegionPool needs of torch.cuda.MemPool: an object that holds the allocator, and
    the device that was current as it was made (a real MemPool belongs to that device)."""

    made_on: list = []

    def __init__(self, allocator: object) -> None:
        self.allocator = allocator
        self.device = _StandInMemPool.made_on[-1]


def _stand_in_torch(current_device: int = 0) -> types.ModuleType:
    """torch as far as RegionPool uses it (no PyTorch on the host CI), with `current_device`
    current: ``torch.cuda.device(i)`` makes i current inside it, and ``use_mem_pool`` records
    the device it routes (the current one when none is given, as PyTorch's does)."""
    torch = types.ModuleType("torch")
    make_allocator = lambda allocate, free: (allocate, free)  # noqa: E731 - what the pool keeps of it
    torch._C = types.SimpleNamespace(_cuda_customAllocator=make_allocator)  # type: ignore[attr-defined]
    _StandInMemPool.made_on = [current_device]
    routed: list = []

    @contextlib.contextmanager
    def device(index: int):
        _StandInMemPool.made_on.append(index)
        try:
            yield
        finally:
            _StandInMemPool.made_on.pop()

    @contextlib.contextmanager
    def use_mem_pool(pool: _StandInMemPool, device: object = None):
        routed.append((pool, _StandInMemPool.made_on[-1] if device is None else device))
        yield

    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        MemPool=_StandInMemPool, empty_cache=lambda: None, device=device, use_mem_pool=use_mem_pool, routed=routed)
    return torch


def test_a_closed_pool_reports_the_segments_it_still_holds(lent, monkeypatch):
    """stats() after close(): still bound, with PyTorch's segments, until the last comes back."""
    if shoal.torch.is_enabled():
        pytest.skip("shoal is PyTorch's allocator in this process")
    monkeypatch.setitem(sys.modules, "torch", _stand_in_torch())
    lender, borrower = lent
    region = borrower.borrow(8 * MIB, "model F")
    pool = shoal.torch.RegionPool(region)
    allocate_address, free_address = pool.mem_pool.allocator
    allocate, free = ALLOCATE(allocate_address), FREE(free_address)
    segment = allocate(2 * MIB, 0, None)
    assert segment is not None
    pool.close()
    gc.collect()  # the MemPool object is gone: only the segment keeps the storage
    stats = pool.stats()
    assert not stats["open"] and stats["bound"], f"a closed pool with a segment out reads {stats}"
    assert (stats["segments"], stats["segment_bytes"]) == (1, 2 * MIB)
    assert "segments=1" in repr(pool)
    free(segment, 2 * MIB, 0, None)
    assert not pool.stats()["bound"], "the storage is let go once the last segment is back"
    assert pool.stats()["segments"] == 0
    # The slot now serves another pool over the same storage, closed with a segment out:
    # its figures are not the first pool's.
    second = shoal.torch.RegionPool(region)
    allocate_address, free_address = second.mem_pool.allocator
    other = ALLOCATE(allocate_address)(4 * MIB, 0, None)
    second.close()
    gc.collect()
    assert second.stats()["segments"] == 1
    assert not pool.stats()["bound"] and pool.stats()["segments"] == 0, f"another pool's figures: {pool.stats()}"
    FREE(free_address)(other, 4 * MIB, 0, None)


def test_a_close_whose_empty_cache_fails_still_closes_the_pool(lent, monkeypatch):
    """A CUDA error in close()'s own clean-up (a sticky one, after a kernel fault) is raised,
    and the pool is closed all the same: no later close() would close it."""
    if shoal.torch.is_enabled():
        pytest.skip("shoal is PyTorch's allocator in this process")
    torch = _stand_in_torch()

    def empty_cache():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    torch.cuda.empty_cache = empty_cache
    monkeypatch.setitem(sys.modules, "torch", torch)
    lender, borrower = lent
    pool = shoal.torch.RegionPool(borrower.borrow(4 * MIB, "model G"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pool.close()
    gc.collect()
    assert not pool.stats()["open"] and not pool.stats()["bound"], pool.stats()
    assert eventually(lambda: lender.status()["lent_bytes"] == 0), "the region stayed held"


def test_a_segment_of_another_cuda_device_is_refused():
    device = shoal.default_device()
    if device.kind != "cuda":
        pytest.skip("the host backend has one device: PyTorch's device argument is not checked there")
    memory = shoal.Allocator(device).allocate(4 * MIB)
    slot = _shoal._segment_source_open(memory)
    try:
        allocate, free = functions(slot)
        assert allocate(2 * MIB, device.ordinal + 1, None) is None, "carved for another device's tensors"
        assert _shoal._segment_source_stats(slot)["segments"] == 0
        segment = allocate(2 * MIB, device.ordinal, None)
        assert segment is not None, "its own device's request refused"
        free(segment, 2 * MIB, device.ordinal, None)
    finally:
        _shoal._segment_source_close(slot)
        _shoal._segment_source_mem_pool_gone(slot)


def test_a_pool_is_made_and_routes_on_its_storages_device_whatever_device_is_current(monkeypatch):
    """PyTorch's pools are per device: a region on device 0, with device 1 current, gets a
    MemPool of device 0, and use() routes device 0's allocations (not device 1's) to it."""
    if shoal.torch.is_enabled():
        pytest.skip("shoal is PyTorch's allocator in this process")
    torch = _stand_in_torch(current_device=1)
    monkeypatch.setitem(sys.modules, "torch", torch)
    region = shoal.Allocator(shoal.host_device()).allocate(4 * MIB)  # a host storage: device ordinal 0
    pool = shoal.torch.RegionPool(region)
    try:
        assert pool.device == region.device.ordinal == 0
        assert pool.mem_pool.device == 0, "the MemPool was made on the current device, not the storage's"
        with pool.use():
            pass
        assert torch.cuda.routed == [(pool.mem_pool, 0)], "use() routed another device than the storage's"
    finally:
        pool.close()


def test_a_region_pool_of_anything_but_a_storage_is_a_type_error_naming_the_argument():
    memory = shoal.Allocator(shoal.host_device()).allocate(MIB)
    with pytest.raises(TypeError, match=r"RegionPool: storage must be a shoal.Storage, not ArrayView "
                                        r"\(an ArrayView's is its .storage\)"):
        shoal.torch.RegionPool(memory.view("uint8"))
    with pytest.raises(TypeError, match="RegionPool: storage must be a shoal.Storage, not int"):
        shoal.torch.RegionPool(1 << 30)


def test_a_slots_stats_wait_for_an_allocation_in_flight_without_the_gil():
    # PyTorch allocates from a slot on any thread; the allocation holds the slot's lock while
    # it waits for a pending free (here: the only segment, freed on a stream kept busy). A
    # stats() call meanwhile waits for that lock with the GIL let go, so other Python threads
    # run on.
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    slot = _shoal._segment_source_open(allocator.allocate(4 * MIB))
    try:
        allocate, free = functions(slot)
        capacity = _shoal._segment_source_stats(slot)["capacity_bytes"]
        busy = shoal.Stream(shoal.host_device())
        segment = allocate(capacity, 0, None)
        assert segment is not None
        busy.delay(2.0)
        free(segment, capacity, 0, busy.handle)  # given back once `busy` has run its delay
        again: list = []
        allocating = threading.Thread(target=lambda: again.append(allocate(capacity, 0, None)))  # ctypes: no GIL
        allocating.start()
        time.sleep(0.3)  # it waits for the free, the slot's lock held
        took, ticks = ticks_during(lambda: _shoal._segment_source_stats(slot))
        allocating.join(10)
        assert again == [segment], "the allocation did not get the segment freed"
        free(segment, capacity, 0, None)
        assert took >= 0.2, "stats() did not wait for the allocation (the test's premise)"
        assert ticks >= 10, f"another Python thread ran {ticks} times in {took:.2f} s of stats()"
    finally:
        _shoal._segment_source_close(slot)
        _shoal._segment_source_mem_pool_gone(slot)


def test_a_weak_references_callback_ends_only_its_binding_and_a_ctrl_c_as_it_runs_reaches_the_caller():
    # RegionPool ends a slot's binding through weak references whose callbacks are partials of
    # the bindings (C calls): a Ctrl-C that comes as the MemPool goes reaches the code that
    # dropped it, and the slot is let go all the same. A callback that comes after the slot
    # serves another opening ends nothing.
    class Referent:
        pass

    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    slot = _shoal._segment_source_open(allocator.allocate(2 * MIB))
    try:
        binding = _shoal._segment_source_stats(slot)["binding"]
        pool = [Referent()]
        watch = weakref.ref(pool[0], functools.partial(_shoal._segment_source_mem_pool_gone, slot, binding))
        _shoal._segment_source_close(slot, binding + 1)  # another opening's: not this one's to end
        assert _shoal._segment_source_stats(slot)["open"], "a callback of another binding closed the slot"
        _shoal._segment_source_close(slot, binding)
        ctrl_c_reaches_the_caller_of(pool.clear)
        assert watch() is None
        assert not _shoal._segment_source_stats(slot)["bound"], "the MemPool's end was lost to the Ctrl-C"
    finally:
        _shoal._segment_source_close(slot)
        _shoal._segment_source_mem_pool_gone(slot)


def test_a_region_pool_dropped_with_a_ctrl_c_pending_lets_its_slot_go_and_the_ctrl_c_reaches_the_caller(
        monkeypatch):
    # The pool and its MemPool end their binding of the slot through weak references whose
    # callbacks are C calls: a Ctrl-C pending as the last reference goes reaches the code that
    # dropped it, and the slot is let go (finalizers, Python code, printed it as unraisable
    # and left the slot bound for good).
    if shoal.torch.is_enabled():
        pytest.skip("shoal is PyTorch's allocator in this process")
    monkeypatch.setitem(sys.modules, "torch", _stand_in_torch())
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    pools = [shoal.torch.RegionPool(allocator.allocate(2 * MIB))]
    slot = pools[0]._index
    references = sys.getrefcount(pools[0])  # (outside the assert: pytest's rewriting would hold one)
    assert references == 2, "something else holds the pool: its end would not come here"
    ctrl_c_reaches_the_caller_of(pools.clear)
    assert not unraisable, f"the Ctrl-C was raised where Python only prints it: {unraisable!r}"
    assert not _shoal._segment_source_stats(slot)["bound"], "the slot stays bound: its pool's end was lost"


def test_a_ctrl_c_as_a_region_pool_opens_its_slot_lets_the_slot_go(monkeypatch):
    # A Ctrl-C that comes as _segment_source_open returns is raised before its result is
    # stored: the pool never learns its slot. It ends its opening by the binding it drew first.
    if shoal.torch.is_enabled():
        pytest.skip("shoal is PyTorch's allocator in this process")
    monkeypatch.setitem(sys.modules, "torch", _stand_in_torch())
    opened: list[int] = []
    real_open = _shoal._segment_source_open

    def opened_then_interrupted(storage, binding=None):
        opened.append(real_open(storage, binding))
        raise KeyboardInterrupt  # as Python's check for signals right after the call would

    monkeypatch.setattr(_shoal, "_segment_source_open", opened_then_interrupted)
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    with pytest.raises(KeyboardInterrupt):
        shoal.torch.RegionPool(allocator.allocate(2 * MIB))
    assert len(opened) == 1
    assert not _shoal._segment_source_stats(opened[0])["bound"], "the slot stays bound for good"


def test_an_opening_under_a_binding_never_handed_out_or_used_already_is_refused():
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    storage = allocator.allocate(2 * MIB)
    unknown = _shoal._segment_source_new_binding() + 1000
    for binding in (0, unknown):
        with pytest.raises(shoal.InvalidArgumentError, match="not handed out"):
            _shoal._segment_source_open(storage, binding)
    _shoal._segment_source_abandon(unknown)  # ends nothing, refuses nothing
    binding = _shoal._segment_source_new_binding()
    slot = _shoal._segment_source_open(storage, binding)
    try:
        with pytest.raises(shoal.InvalidArgumentError, match="opened a slot already"):
            _shoal._segment_source_open(storage, binding)  # two slots under one binding: abandon would end both
    finally:
        _shoal._segment_source_abandon(binding)
    assert not _shoal._segment_source_stats(slot)["bound"]


DROP_UNDER_A_LOCK = """
import ctypes, faulthandler, sys, threading
import shoal
from shoal import _shoal
faulthandler.dump_traceback_later(20, exit=True)  # a deadlock: the stacks, and a failure
# PyTorch's allocator takes its mutex on a thread that may hold the GIL (a tensor's dealloc) and
# holds it across a RegionPool slot's free function. PyDLL / PYFUNCTYPE calls keep the GIL, as
# PyTorch's do.
libc = ctypes.PyDLL(None)
mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER: zeros
ALLOCATE = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
storage = allocator.allocate(4 << 20)
busy = shoal.Stream(shoal.host_device())
storage.record_stream(busy)
busy.delay(0.5)  # the storage's free waits for it: the allocator's end waits for that
slot = _shoal._segment_source_open(storage)
allocate, free = (kind(address) for kind, address in zip((ALLOCATE, FREE), _shoal._segment_source_functions(slot)))
segment = allocate(1 << 20, 0, None)
_shoal._segment_source_close(slot)
_shoal._segment_source_mem_pool_gone(slot)
del storage, allocator  # the slot's source holds the last references
go = threading.Event()

def freeing_elsewhere():  # another thread frees a tensor: the mutex, with the GIL
    go.wait()
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_unlock(mutex)

other = threading.Thread(target=freeing_elsewhere, daemon=True)
other.start()
sys.setswitchinterval(1000)  # this thread lets the GIL go only where shoal does
go.set()
libc.pthread_mutex_lock(mutex)
free(segment, 1 << 20, 0, None)  # the last segment: the source, its storage and allocator go
libc.pthread_mutex_unlock(mutex)
other.join()
print("no deadlock", flush=True)
"""


def test_a_slot_freed_under_another_librarys_lock_keeps_the_gil_through_the_waits_it_causes():
    # The slot's free function may end the region's storage and its allocator, whose ends wait
    # (pending frees): with the GIL let go there, a Python thread waiting for PyTorch's mutex
    # with the GIL would hold it for good, and the free could never take it back.
    done = subprocess.run([sys.executable, "-c", DROP_UNDER_A_LOCK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "no deadlock" in done.stdout, done.stderr
