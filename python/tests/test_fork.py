"""A fork() child of a process that used shoal (host backend): what the parent
opened is the parent's. The child is refused its allocations and stream work
with DeviceUnavailableError, and ends without hanging on the parent's
threads, or on a lock another of the parent's threads held at the fork."""

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import time

import pytest

import shoal
import shoal.sharing
import shoal.transfer
from shoal import _device_defaults


def run_in_child(body, timeout: float = 10.0) -> int:
    """Runs body() in a forked child; its return value is the exit code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = body()
        except BaseException:  # noqa: BLE001 - any escape is a failure the parent reports
            code = 98
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def refused(call) -> bool:
    try:
        call()
    except shoal.DeviceUnavailableError as e:
        return "fork()" in str(e)
    return False


def test_a_forked_child_is_refused_the_parents_allocator_and_streams():
    allocator = shoal.Allocator(use_environment=False)
    kept = allocator.allocate(4096)
    kept.fill(3)
    side = shoal.Stream()

    def child() -> int:
        if not refused(lambda: allocator.allocate(64)):
            return 1
        if not refused(lambda: kept.read(0, 4)):
            return 2
        if not refused(lambda: kept.fill(1, stream=side)):
            return 3
        if not refused(shoal.Stream):
            return 4
        return 0

    assert run_in_child(child) == 0, "1: allocated, 2: read, 3: filled, 4: a stream was made"
    assert kept.read(0, 4) == b"\x03" * 4, "the parent's storage is as it was"
    with shoal.stream(side):
        more = allocator.allocate(64)
        more.fill(5)
    side.synchronize()
    del kept, more


def test_a_forked_child_is_refused_memory_of_the_parents_device_through_a_new_allocator():
    shoal.allocate(16)  # the default device is open before the fork

    def child() -> int:
        fresh = shoal.Allocator(use_environment=False)  # made here, over the parent's device
        if not refused(lambda: fresh.allocate(4096)):
            return 1
        if not refused(lambda: shoal.allocate(4096)):
            return 2
        return 0

    assert run_in_child(child) == 0, (
        "1: a new allocator handed out memory no stream here can use, 2: shoal.allocate did")


def test_a_forked_child_ends_with_the_parents_sharing_context_and_transfer_engine_alive():
    context = shoal.SharingContext(shoal.default_allocator())
    engine = shoal.transfer.Engine()
    time.sleep(0.05)  # their threads wait

    def child() -> int:
        nonlocal context, engine
        context = engine = None  # what a child's exit does to what it inherited
        gc.collect()
        return 0

    assert run_in_child(child) == 0
    assert context.collect() == 0
    engine.close()


def test_a_forked_child_is_refused_the_parents_transfer_engine():
    import numpy

    engine = shoal.transfer.Engine()

    def child() -> int:
        # A forking data loader's worker: never a batch accepted that no thread copies.
        if not refused(lambda: engine.submit(numpy.ones(4))):
            return 1
        if not refused(lambda: engine.get(timeout=1)):
            return 2
        return 0

    assert run_in_child(child) == 0, "1: submit, 2: get was not refused"
    engine.submit(numpy.ones(4))
    assert engine.get(timeout=10).nbytes == 32, "the parent's engine goes on"
    engine.close()


def test_a_forked_child_closing_an_inherited_peer_leaves_the_parents_messages():
    # Host memory on every backend: both peers are in this process, and CUDA
    # does not open its own process's IPC handles.
    host = shoal.Allocator(shoal.host_device())
    context = shoal.SharingContext(host)
    address = shoal.runtime_dir_address(f"fork-peer-{os.getpid()}.sock")
    listener = shoal.Listener(address)
    accepted = {}
    taker = threading.Thread(target=lambda: accepted.setdefault("link", listener.accept(timeout=10)))
    taker.start()
    sender = shoal.Peer(context, shoal.connect(address, timeout=10))
    taker.join()
    receiver = shoal.Peer(context, accepted["link"])
    storage = host.allocate(4096)
    storage.fill(7)
    sender.send(storage, b"first")
    sender.send(storage, b"second")
    time.sleep(0.1)  # both on the socket

    def child() -> int:
        receiver.close()  # what the child's exit does to a Peer it inherited
        return 0

    assert run_in_child(child) == 0
    assert [receiver.receive(timeout=5)[1] for _ in range(2)] == [b"first", b"second"]
    receiver.close()
    sender.close()
    listener.close()


def test_a_forked_child_can_close_an_engine_a_parent_thread_was_using():
    engine = shoal.transfer.Engine()
    waiting = threading.Thread(target=lambda: pytest.raises(shoal.ShoalError, engine.get, timeout=30))
    waiting.start()
    time.sleep(0.1)  # the parent's thread waits inside get()

    def child() -> int:
        engine.close()
        return 0

    assert run_in_child(child) == 0
    engine.close()  # ends the parent's wait
    waiting.join(10)
    assert not waiting.is_alive()


def test_a_forked_child_that_lives_on_leaves_no_listening_name_bound():
    address = f"@shoal-fork-linger-{os.getpid()}"
    listener = shoal.Listener(address)
    ready_read, ready_write = os.pipe()
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(hold_write)
        os.write(ready_write, b"r")  # past fork(): the child let go of the parent's sockets
        os.read(hold_read, 1)  # lives until the parent lets it go
        os._exit(0)
    os.close(hold_read)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"r"
        listener.close()
        again = shoal.Listener(address)  # refused while the child kept the name bound
        again.close()
    finally:
        os.close(hold_write)
        os.close(ready_read)
        os.waitpid(pid, 0)


# A parent thread busy in shoal at the fork: a lock it held then is never let
# go in the child, which must neither wait for it nor touch the parent's objects.


@contextlib.contextmanager
def parent_thread_busy(step):
    """Runs step() over and over on a parent thread, the GIL handed over often."""
    stop = threading.Event()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    def steps() -> None:
        while not stop.is_set():
            step()

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    try:
        time.sleep(0.02)
        yield
    finally:
        stop.set()
        sys.setswitchinterval(old)
        thread.join(10)


def first_hung_fork(body, forks: int) -> int:
    """Forks up to `forks` children running body() under a 3 s alarm; the number of the
    first whose child hung (or failed), else 0."""
    for n in range(1, forks + 1):
        pid = os.fork()
        if pid == 0:
            signal.alarm(3)
            code = 98
            try:
                code = body()
            finally:
                os._exit(code)
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            return n
    return 0


@contextlib.contextmanager
def held_by_a_parent_thread(lock):
    """`lock` held by another thread for the block (a thread inside its `with` at the fork)."""
    held, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (lock.acquire(), held.set(), release.wait(30), lock.release()))
    thread.start()
    held.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def test_a_forked_child_is_refused_the_default_allocator_a_parent_thread_was_making():
    # Race seen: a parent thread making the default allocator (reset in a loop) -> 1 hang in 2000 forks.
    shoal.allocate(16)  # the default device is open before the fork
    with held_by_a_parent_thread(shoal._default_allocator_lock):
        assert run_in_child(lambda: 0 if refused(lambda: shoal.allocate(64)) else 1, timeout=5) == 0


def test_a_forked_child_exits_while_a_parent_thread_was_making_a_device_allocator():
    with held_by_a_parent_thread(_device_defaults._allocators_lock):
        assert run_in_child(lambda: (atexit._run_exitfuncs(), 0)[1], timeout=5) == 0  # a plain child's exit


def test_a_forked_child_makes_a_producer_while_a_parent_thread_was_making_one():
    # Race seen: a parent thread making Producers in a loop -> 3 hangs in 2000 forks.
    host = shoal.Allocator(shoal.host_device())
    nobody = shoal.runtime_dir_address(f"fork-nobody-{os.getpid()}.sock")

    def child() -> int:
        try:
            shoal.sharing.Producer(nobody, allocator=host)
        except shoal.ShoalError:
            return 0
        return 1

    with held_by_a_parent_thread(shoal.sharing._producer_contexts_lock):
        assert run_in_child(child, timeout=5) == 0


def test_a_forked_child_closes_a_consumer_a_parent_thread_waits_in():
    consumer = shoal.sharing.Consumer(allocator=shoal.Allocator(shoal.host_device()))
    waiting = threading.Thread(target=lambda: pytest.raises(shoal.ShoalError, consumer.get, timeout=30))
    waiting.start()
    time.sleep(0.1)  # the parent's thread waits inside get(), holding _call_lock
    try:
        assert run_in_child(lambda: (consumer.close(), 0)[1], timeout=5) == 0  # a child's `with` block ending
    finally:
        consumer.close()
        waiting.join(10)


def test_a_forked_child_is_refused_the_parents_consumer():
    consumer = shoal.sharing.Consumer(allocator=shoal.Allocator(shoal.host_device()))

    def child() -> int:
        # Its listener and connections are the parent's: a get() here would take their batches.
        return 0 if refused(lambda: consumer.get(timeout=0.1)) else 1

    try:
        assert run_in_child(child, timeout=5) == 0
    finally:
        consumer.close()


def test_a_forked_child_closing_a_consumer_leaves_the_parents_get_waiting_not_spinning():
    consumer = shoal.sharing.Consumer(allocator=shoal.Allocator(shoal.host_device()))
    assert run_in_child(lambda: (consumer.close(), 0)[1]) == 0
    cpu = time.thread_time()
    with pytest.raises(shoal.PeerTimeoutError):
        consumer.get(timeout=1)
    spent = time.thread_time() - cpu
    consumer.close()
    assert spent < 0.3, f"the parent's get() spun: {spent:.2f} s of CPU in a 1 s wait"


def test_a_forked_child_drops_a_stream_while_a_parent_thread_synchronizes_one():
    side = shoal.Stream()
    doomed = [shoal.Stream()]

    def child() -> int:
        doomed.clear()  # the drop a plain child's exit (or its gc) does: registry_mutex, exclusive
        gc.collect()
        return 0

    with parent_thread_busy(side.synchronize):  # GIL let go, registry_mutex held shared in find()
        assert first_hung_fork(child, 1500) == 0


def test_a_forked_child_queries_a_stream_while_a_parent_thread_makes_and_drops_streams():
    side = shoal.Stream()

    def churn() -> None:
        s = shoal.Stream()
        del s  # the drop lets the GIL go, then takes registry_mutex exclusively

    def child() -> int:
        with contextlib.suppress(shoal.ShoalError):
            side.query()
        return 0

    with parent_thread_busy(churn):
        assert first_hung_fork(child, 1500) == 0
