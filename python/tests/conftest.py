"""Fixtures shared by the shoal pytest suite (host backend in CI)."""

import _thread
import gc
import operator
import os
import signal
import socket
import threading
import time
from typing import Callable

import pytest

import shoal


SO_PASSRIGHTS = 83  # socket option, Linux 6.16 on: off, the socket takes no descriptors


def kernel_has_so_passrights() -> bool:
    """Whether this kernel has SO_PASSRIGHTS (a lender turns it off, so a peer's send of a
    descriptor fails there instead of reaching it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 1)
        except OSError:
            return False
    return True


def live_allocations(allocator: shoal.Allocator) -> int:
    return allocator.stats()["allocations"]["all"]["current"]


def ticks_during(call: Callable[[], object]) -> tuple[float, int]:
    """Runs call() on this thread while another Python thread ticks every 2 ms; returns how
    long the call took and how many times the other thread ticked meanwhile. A call that
    holds the GIL while it waits stops the ticks until it returns (one may slip in as it
    begins): a call that lets the GIL go gets one tick per 2 ms or so."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.05)
        started = time.monotonic()
        call()
        ended = time.monotonic()
    finally:
        stop.set()
        ticker.join(10)
    return ended - started, sum(started < t < ended for t in ticks)


def may_act_as(*ids: int) -> bool:
    """Whether a test may switch a child to these uids (and gids of the same numbers): root,
    with each mapped in this user namespace (a container that maps only root refuses them)."""
    if os.geteuid() != 0:
        return False

    def mapped(map_file: str, number: int) -> bool:
        try:
            with open(map_file) as ranges:
                rows = [tuple(int(field) for field in line.split()) for line in ranges if line.strip()]
        except FileNotFoundError:
            return True  # no user namespaces here: every id is the system's
        return any(inside <= number < inside + count for inside, _, count in rows)

    return all(mapped("/proc/self/uid_map", n) and mapped("/proc/self/gid_map", n) for n in ids)


def ctrl_c_reaches_the_caller_of(drop: Callable[[], object]) -> None:
    """Runs drop() with a Ctrl-C pending: _thread.interrupt_main trips SIGINT's flag as a
    real Ctrl-C does (Python's own handler raises KeyboardInterrupt at the next check), and
    drop() runs in the C calls right after it, with no Python code of the test between them.
    Fails unless the KeyboardInterrupt reaches this caller (raised in a __del__ or a
    finalizer's Python code, Python prints it and goes on)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            list(map(operator.methodcaller("__call__"), [_thread.interrupt_main, drop]))
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def allocator():
    """A fresh allocator (SHOAL_ALLOC_CONF ignored); the test must give back every block it took."""
    a = shoal.Allocator(use_environment=False, trace_entries=1000)
    yield a
    gc.collect()
    assert live_allocations(a) == 0, "the test leaked storages"
    a.empty_cache()
    assert a.stats()["reserved_bytes"]["all"]["current"] == 0


def pytest_configure(config):
    config.addinivalue_line("markers", "python: the Python package's suite (every test here)")
    config.addinivalue_line("markers", "torch: needs PyTorch with CUDA and a GPU (shoal.torch)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device as shoal's default device")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.python)
