"""Sharing between processes: shoal.sharing's Producer and Consumer over the
checked channel, with multiprocessing spawn and forkserver children, crash
reclaim, hostile producers and deadlines. Every wait has a deadline."""

import gc
import contextlib
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy
import pytest

import shoal
import shoal.sharing as sharing
from conftest import SO_PASSRIGHTS, kernel_has_so_passrights

WAIT = 30  # seconds: no wait in these tests may take longer

# CUDA refuses to import memory into the process that exported it: the tests
# whose producer and consumer are this one process share host memory, on
# every machine.
HOST = shoal.Allocator(shoal.host_device())


def pattern(tag: int, nbytes: int) -> bytes:
    return bytes((tag * 31 + i) % 251 for i in range(nbytes))


def make_batch(tag: int) -> dict:
    """A nested batch whose bytes depend on `tag`: a C-order float32 array,
    a strided int64 view at an offset, and a whole storage."""
    a = shoal.allocate(4 * 5 * 4)
    a.write(pattern(tag, 80))
    b = shoal.allocate(256)
    b.write(pattern(tag + 1, 256))
    c = shoal.allocate(33)
    c.fill(tag)  # enqueued: the consumer's stream must wait for it
    return {
        "x": a.view("float32", (4, 5)),
        "y": [b.view("int64", (3, 2), (4, 1), 64), (c,)],
    }


def producer_main(address: str, tag: int, batches: int, linger: float = 0.0, release=None) -> None:
    """Sends `batches` batches, then stays connected `linger` seconds, and
    until `release` (a multiprocessing Event) is set when one is given."""
    with sharing.Producer(address) as producer:
        for i in range(batches):
            producer.put(make_batch(tag + i))
        time.sleep(linger)
        if release is not None:
            release.wait(WAIT)


def busy_producer_main(address: str, tag: int) -> None:
    """Sends one storage whose bytes its stream writes half a second later,
    then ends at once."""
    with sharing.Producer(address) as producer:
        c = shoal.allocate(33)
        shoal.current_stream().delay(0.5)
        c.fill(tag)  # still queued when put returns
        producer.put({"c": c})


def check_batch(batch: dict, tag: int) -> None:
    x = batch["x"]
    assert (x.dtype, x.shape, x.strides, x.offset) == ("float32", (4, 5), (5, 1), 0)
    assert x.storage.read() == pattern(tag, 80)
    y, (c,) = batch["y"]
    assert (y.dtype, y.shape, y.strides, y.offset) == ("int64", (3, 2), (4, 1), 64)
    assert y.storage.read() == pattern(tag + 1, 256)
    assert (c.dtype, c.shape) == ("uint8", (33,))
    assert c.storage.read() == bytes([tag % 256]) * 33


def shm_entries() -> set:
    """/dev/shm entries, less the CUDA driver's own per-process files and PyTorch's
    files of other processes.

    The driver names them cuda.shm.<device>.<pid>; a multiprocessing child ends with
    os._exit, and the driver may remove its file after join returns. PyTorch names its
    torch_<pid>_...: another test file's processes make them when the suite runs in
    parallel (SHOAL_PYTEST_JOBS). shoal itself uses memfd only, so any other new entry
    is a leak."""
    if not os.path.isdir("/dev/shm"):
        return set()
    ours = f"torch_{os.getpid()}_"
    return {name for name in os.listdir("/dev/shm")
            if not name.startswith("cuda.shm.") and (not name.startswith("torch_") or name.startswith(ours))}


@pytest.fixture
def clean_process():
    """Allocator stats back to zero and no /dev/shm entry left behind."""
    shm_before = shm_entries()
    yield
    gc.collect()
    allocator = shoal.default_allocator()
    assert allocator.stats()["allocations"]["all"]["current"] == 0, "storages leaked"
    assert shm_entries() <= shm_before, f"left in /dev/shm: {shm_entries() - shm_before}"


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_producers_started_by_multiprocessing_send_whole_batches(method, clean_process):
    ctx = multiprocessing.get_context(method)
    with sharing.Consumer() as consumer:
        producers = [ctx.Process(target=producer_main, args=(consumer.address, tag, 3)) for tag in (10, 50)]
        for p in producers:
            p.start()
        seen = []
        for _ in range(6):
            batch = consumer.get(timeout=WAIT)
            tag = batch["y"][1][0].storage.read(0, 1)[0]  # each batch's third array is filled with its tag
            check_batch(batch, tag)
            seen.append(tag)
        for p in producers:
            p.join(WAIT)
            assert p.exitcode == 0
        assert sorted(seen) == [10, 11, 12, 50, 51, 52]
        assert consumer.errors == []
        del batch


def test_a_producers_data_outlives_the_producer(clean_process):
    ctx = multiprocessing.get_context("spawn")
    with sharing.Consumer() as consumer:
        p = ctx.Process(target=producer_main, args=(consumer.address, 7, 1))
        p.start()
        batch = consumer.get(timeout=WAIT)
        p.join(WAIT)
        assert p.exitcode == 0
        check_batch(batch, 7)  # read after the producer has exited
        del batch


def consumer_main(address_queue, held) -> None:
    with sharing.Consumer() as consumer:
        address_queue.put(consumer.address)
        batch = consumer.get(timeout=WAIT)
        held.set()
        time.sleep(WAIT)  # holds the batch until killed
        del batch


def test_a_consumer_killed_while_holding_batches_gives_the_memory_back(clean_process):
    ctx = multiprocessing.get_context("spawn")
    addresses, held = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=consumer_main, args=(addresses, held))
    child.start()
    allocator = shoal.default_allocator()
    before = allocator.stats()["allocations"]["all"]["current"]
    with sharing.Producer(addresses.get(timeout=WAIT), collect_interval_ms=20) as producer:
        producer.put(make_batch(3))
        assert held.wait(WAIT)
        gc.collect()
        # The producer dropped its handles: the three blocks wait in the limbo for the consumer.
        assert producer.context.stats()["limbo_blocks"] == 3
        holders = {h["pid"]: h for h in producer.context.holders()}
        assert holders[child.pid]["references"] == 3
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT)
        deadline = time.monotonic() + WAIT
        while producer.context.stats()["limbo_blocks"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = producer.context.stats()
        assert stats["limbo_blocks"] == 0 and stats["slots_reclaimed"] == 3
    assert allocator.stats()["allocations"]["all"]["current"] == before


def hostile_main(address: str, case: str) -> None:
    """Sends one malformed batch (through the raw Peer), then waits to be cut off."""
    context = shoal.SharingContext(shoal.default_allocator())
    with shoal.Peer(context, shoal.connect(address)) as peer:
        s = shoal.allocate(64)
        header = {"v": 1, "dtype": "float32", "shape": [4], "strides": [1], "offset": 0, "readonly": False}
        note = {"v": 1, "arrays": 1, "batch": {"a": 0}}
        if case == "out_of_bounds":
            header["shape"] = [1000]
        elif case == "negative_dimension":
            header["shape"] = [-4]
        elif case == "unknown_dtype":
            header["dtype"] = "float128x"
        elif case == "deep_nesting":
            deep = {"a": 0}
            for _ in range(200):
                deep = {"l": [deep]}
            note["batch"] = deep
        elif case == "array_twice":
            note["batch"] = {"t": [{"a": 0}, {"a": 0}]}
        elif case == "count_mismatch":
            note["arrays"] = 2
        elif case == "huge_stride":
            header["strides"] = [1 << 62]
        elif case == "huge_extent":  # within each bound, far past the storage once multiplied
            header["shape"], header["strides"] = [1 << 48, 1 << 48], [1 << 48, 1 << 48]
        encoded = b"\xff{" if case == "not_json" else json.dumps(header).encode()
        try:
            peer.send(s, encoded, None)
            peer.send_note(json.dumps(note).encode())
            peer.receive(timeout=WAIT)  # returns when the consumer cuts the connection
        except shoal.ConnectionClosedError:
            pass


@pytest.mark.parametrize(
    "case",
    ["out_of_bounds", "negative_dimension", "unknown_dtype", "not_json", "deep_nesting", "array_twice",
     "count_mismatch", "huge_stride", "huge_extent"],
)
def test_a_malformed_batch_disconnects_its_producer_and_others_go_on(case, clean_process):
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer() as consumer:
        bad = ctx.Process(target=hostile_main, args=(consumer.address, case))
        bad.start()
        with pytest.raises(shoal.PeerTimeoutError):
            consumer.get(timeout=3)
        assert len(consumer.errors) == 1 and isinstance(consumer.errors[0], shoal.ProtocolError)
        assert f"pid {bad.pid} was cut off: " in str(consumer.errors[0]), "the error names the producer"
        assert consumer.producers == 0
        bad.join(WAIT)
        assert bad.exitcode == 0
        good = ctx.Process(target=producer_main, args=(consumer.address, 90, 1))
        good.start()
        check_batch(consumer.get(timeout=WAIT), 90)
        good.join(WAIT)


def test_a_producer_that_ends_right_after_its_put_leaves_its_batch_whole(clean_process):
    # Its close waits for the work the batch waits on: without that, the
    # process ends with the write still queued and the read fails.
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer() as consumer:
        child = ctx.Process(target=busy_producer_main, args=(consumer.address, 40))
        child.start()
        batch = consumer.get(timeout=WAIT)
        child.join(WAIT)
        assert child.exitcode == 0
        assert batch["c"].storage.read() == bytes([40]) * 33
        del batch


def announcing_producer_main(address: str, tag: int, put_done) -> None:
    """Puts one batch, says so, and ends as soon as leaving the with block lets it."""
    with sharing.Producer(address) as producer:
        producer.put(make_batch(tag))
        put_done.set()


def test_a_producer_stays_until_a_late_consumer_has_taken_its_batch(clean_process):
    # Without the wait in close() the producer would be gone before the
    # consumer accepts it: a process that is gone cannot be identified, its
    # connection is refused and its batch lost.
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer() as consumer:
        put_done = ctx.Event()
        p = ctx.Process(target=announcing_producer_main, args=(consumer.address, 60, put_done))
        p.start()
        assert put_done.wait(WAIT)
        time.sleep(0.5)  # the consumer is busy elsewhere
        assert p.is_alive(), "the producer ended before its batch was taken"
        check_batch(consumer.get(timeout=WAIT), 60)
        p.join(WAIT)
        assert p.exitcode == 0
        assert consumer.errors == []


def test_close_gives_up_at_its_timeout_when_the_consumer_takes_nothing():
    with sharing.Consumer(allocator=HOST) as consumer:
        producer = sharing.Producer(consumer.address, allocator=HOST)
        producer.put({"x": HOST.allocate(64).view("uint8")})
        started = time.monotonic()
        with pytest.raises(shoal.PeerTimeoutError, match="had not taken every batch sent within 0.2 s"):
            producer.close(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 5
        assert producer.peer.closed


def test_a_close_or_put_with_a_timeout_that_is_no_wait_is_refused_first_and_changes_nothing():
    with sharing.Consumer(allocator=HOST) as consumer:
        producer = sharing.Producer(consumer.address, allocator=HOST)
        producer.put({"x": HOST.allocate(64).view("uint8")})
        for wrong, error in ((-1, shoal.InvalidArgumentError), (math.inf, shoal.InvalidArgumentError),
                             ("x", TypeError)):
            with pytest.raises(error, match="^shoal.sharing.Producer.close: timeout must be"):
                producer.close(timeout=wrong)
            with pytest.raises(error, match="^shoal.sharing.Producer.put: timeout must be"):
                producer.put({"x": HOST.allocate(64).view("uint8")}, timeout=wrong)
        with pytest.raises(TypeError, match="^shoal.sharing.Producer.put: stream must be a shoal.Stream"):
            producer.put({"x": HOST.allocate(64).view("uint8")}, stream=5)
        assert not producer.closed and not producer.peer.closed, "a refused close closed the connection"
        batch = consumer.get(timeout=WAIT)
        assert batch["x"].nbytes == 64
        producer.close(timeout=numpy.float64(WAIT))  # waits for the batch taken: returns at once


def test_numpy_numbers_are_taken_wherever_a_number_is():
    with sharing.Consumer(allocator=HOST, max_producers=numpy.int64(2), batch_timeout=numpy.float32(5)) as consumer:
        with sharing.Producer(consumer.address, allocator=HOST, max_ahead=numpy.int64(2)) as producer:
            producer.put({"x": HOST.allocate(64).view("uint8")}, timeout=numpy.int64(5))
            assert next(iter(consumer.batches(producers=numpy.int64(1), timeout=numpy.int64(WAIT))))["x"].nbytes == 64
    with pytest.raises(TypeError, match="^shoal.sharing.Consumer: max_producers must be a whole"):
        sharing.Consumer(allocator=HOST, max_producers=1.5)
    with pytest.raises(TypeError, match="^shoal.sharing.Consumer: batch_timeout must be a number"):
        sharing.Consumer(allocator=HOST, batch_timeout="x")


def test_get_takes_any_timeout_a_finite_number_of_seconds_long():
    # Past epoll's int milliseconds (some 24.8 days): the wait is made in parts.
    with sharing.Consumer(allocator=HOST) as consumer:
        with sharing.Producer(consumer.address, allocator=HOST) as producer:
            producer.put({"x": HOST.allocate(64).view("uint8")})
            assert consumer.get(timeout=30 * 86400)["x"].nbytes == 64
            producer.put({"x": HOST.allocate(64).view("uint8")})
            assert next(iter(consumer.batches(producers=1, timeout=1e9)))["x"].nbytes == 64
        with pytest.raises(shoal.InvalidArgumentError, match="^shoal.sharing.Consumer.get: timeout must be a finite"):
            consumer.get(timeout=math.inf)
        with pytest.raises(TypeError, match="^shoal.sharing.Consumer.get: timeout must be a number"):
            consumer.get(timeout="x")


def test_close_returns_once_the_consumer_took_the_batch_or_went_away():
    with sharing.Consumer(allocator=HOST) as consumer:
        with sharing.Producer(consumer.address, allocator=HOST) as producer:
            producer.put({"x": HOST.allocate(64).view("uint8")})
            batch = consumer.get(timeout=WAIT)
            started = time.monotonic()
        assert time.monotonic() - started < 5 and producer.peer.closed and producer.closed
        del batch
    consumer = sharing.Consumer(allocator=HOST)
    producer = sharing.Producer(consumer.address, allocator=HOST)
    assert not producer.closed
    producer.put({"x": HOST.allocate(64).view("uint8")})
    consumer.close()  # never accepted it: the connection is reset
    started = time.monotonic()
    producer.close(timeout=WAIT)
    assert time.monotonic() - started < 5


def test_an_error_leaving_the_with_block_propagates_at_once_and_closes():
    with sharing.Consumer(allocator=HOST) as consumer:
        started = time.monotonic()
        with pytest.raises(ValueError, match="the real bug") as raised:
            with sharing.Producer(consumer.address, allocator=HOST) as producer:
                producer.put({"x": HOST.allocate(64).view("uint8")})  # never taken
                raise ValueError("the real bug")
        assert time.monotonic() - started < 5, "it waited for the consumer"
        assert raised.value.__context__ is None, "another error was raised over it"
        assert producer.peer.closed


def test_a_producer_keeps_at_most_max_ahead_batches_untaken():
    def batch(tag: int) -> dict:
        a, b = HOST.allocate(16), HOST.allocate(16)
        a.fill(tag)
        return {"a": a.view("uint8"), "b": [b.view("uint8")]}

    with sharing.Consumer(allocator=HOST) as consumer:
        with sharing.Producer(consumer.address, allocator=HOST, max_ahead=2) as producer:
            producer.put(batch(1))
            producer.put({})  # no arrays: nothing to take, never counted
            producer.put(batch(2))
            assert producer.peer.untaken() == 4
            with pytest.raises(shoal.PeerTimeoutError, match="nothing of this batch was sent"):
                producer.put(batch(3), timeout=0.2)
            assert consumer.get(timeout=WAIT)["a"].storage.read() == bytes([1]) * 16
            assert producer.peer.untaken() == 2
            producer.put(batch(4), timeout=0)  # one batch ahead now: room for another
            assert consumer.get(timeout=WAIT) == {}
            assert consumer.get(timeout=WAIT)["a"].storage.read() == bytes([2]) * 16
            assert consumer.get(timeout=WAIT)["a"].storage.read() == bytes([4]) * 16  # 3 was never sent
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=0.1)
    with pytest.raises(ValueError, match="max_ahead"):
        sharing.Producer("unused", max_ahead=0)


def test_a_put_whose_note_is_too_large_takes_its_arrays_back():
    with sharing.Consumer(allocator=HOST) as consumer:
        with sharing.Producer(consumer.address, allocator=HOST) as producer:
            with pytest.raises(shoal.InvalidArgumentError, match="metadata"):
                producer.put({"k" * 70_000: HOST.allocate(16).view("uint8")})  # the note is over 64 KiB
            b = HOST.allocate(16)
            b.fill(7)
            producer.put({"b": b.view("uint8")})
            batch = consumer.get(timeout=WAIT)
            assert list(batch) == ["b"] and batch["b"].storage.read() == bytes([7]) * 16
            assert consumer.errors == []
            del batch


def test_arrays_of_a_put_taken_back_hold_no_room_ahead_and_close_does_not_wait_for_them():
    other = shoal.Allocator(shoal.host_device())  # its arrays cannot be sent: the put fails part-way

    def one(tag: int) -> dict:
        a = HOST.allocate(16)
        a.fill(tag)
        return {"a": a.view("uint8")}

    def failing() -> list:
        return [HOST.allocate(16).view("uint8"), other.allocate(16).view("uint8")]

    with sharing.Consumer(allocator=HOST) as consumer:
        with sharing.Producer(consumer.address, allocator=HOST, max_ahead=2) as producer:
            producer.put(one(1))
            with pytest.raises(shoal.InvalidArgumentError):
                producer.put(failing())  # its first array went, then was taken back
            producer.put(one(2))
            assert consumer.get(timeout=WAIT)["a"].storage.read() == bytes([1]) * 16
            producer.put(one(3), timeout=0)  # one batch ahead (2): room, whatever the taken-back array
            assert consumer.get(timeout=WAIT)["a"].storage.read() == bytes([2]) * 16
            assert consumer.get(timeout=WAIT)["a"].storage.read() == bytes([3]) * 16
            with pytest.raises(shoal.InvalidArgumentError):
                producer.put(failing())  # taken back after the last batch: never read
            producer.close(timeout=0.5)  # every batch was taken: no PeerTimeoutError
        assert consumer.errors == []


def test_an_error_leaving_the_with_block_waits_for_no_queued_work():
    with sharing.Consumer(allocator=HOST) as consumer:
        stream = shoal.Stream(HOST.device)
        started = time.monotonic()
        with pytest.raises(ValueError, match="the real bug"):
            with sharing.Producer(consumer.address, allocator=HOST) as producer:
                a = HOST.allocate(16)
                stream.delay(3.0)  # work the batch waits on, queued for seconds
                producer.put({"a": a.view("uint8")}, stream=stream)
                raise ValueError("the real bug")
        assert time.monotonic() - started < 2, "it waited for the stream"
        stream.synchronize()


def test_a_batch_holds_only_shoal_memory():
    with sharing.Consumer() as consumer, sharing.Producer(consumer.address) as producer:
        with pytest.raises(TypeError, match="ArrayViews or Storages"):
            producer.put({"x": b"bytes are not shoal memory"})
        with pytest.raises(TypeError, match="keys must be str"):
            producer.put({1: shoal.allocate(8).view()})


def test_get_gives_up_at_its_deadline():
    with sharing.Consumer() as consumer:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            consumer.get(timeout=0.2)
        assert time.monotonic() - start < 5
        with pytest.raises(shoal.InvalidArgumentError, match="timeout must be"):
            consumer.get(timeout=-1)


def test_a_closed_peer_raises_connection_closed():
    context = shoal.SharingContext(shoal.default_allocator())
    with shoal.Listener(shoal.runtime_dir_address(f"closed-{os.getpid()}.sock")) as listener:
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=producer_main, args=(listener.address, 1, 0))
        child.start()
        connection = listener.accept(timeout=WAIT)
        assert connection is not None
        with shoal.Peer(context, connection) as peer:
            child.join(WAIT)
            assert peer.receive(timeout=WAIT) == (None, b'{"v":1,"end":true}'), "a Producer's close() says it ended"
            with pytest.raises(shoal.ConnectionClosedError) as closed:
                peer.receive(timeout=WAIT)
            assert not closed.value.no_listener
            assert "connection::" not in str(closed.value), "no C++ name in the middle of the message"
            with pytest.raises(shoal.InvalidArgumentError, match="Peer.send: expected a Storage or an ArrayView, "
                                                                 "not NoneType"):
                peer.send(None)
        with pytest.raises(ValueError, match="given to a Peer"):
            shoal.Peer(context, connection)


def slow_answer_main(address: str) -> None:
    """Says b"ready", then answers each storage received with a note b"ok" 0.3 s later; ends at a note."""
    context = shoal.SharingContext(shoal.default_allocator())
    with shoal.Peer(context, shoal.connect(address)) as peer:
        peer.send_note(b"ready")
        while True:
            storage, _ = peer.receive(timeout=WAIT)
            if storage is None:
                return
            del storage
            time.sleep(0.3)
            peer.send_note(b"ok")


@pytest.mark.parametrize("import_answer_spin_us", [1_000_000, 0])
def test_the_answer_to_a_new_segment_is_polled_for_even_with_no_receive_spin(import_answer_spin_us):
    resource = pytest.importorskip("resource")
    context = shoal.SharingContext(
        shoal.default_allocator(), receive_spin_us=0, import_answer_spin_us=import_answer_spin_us)
    address = shoal.runtime_dir_address(f"slow-{os.getpid()}-{import_answer_spin_us}.sock")
    with shoal.Listener(address) as listener:
        child = multiprocessing.get_context("spawn").Process(target=slow_answer_main, args=(listener.address,))
        child.start()
        try:
            connection = listener.accept(timeout=WAIT)
            assert connection is not None
            with shoal.Peer(context, connection) as peer:
                # The spin polls the child's ring, which comes with its first message.
                assert peer.receive(timeout=WAIT) == (None, b"ready")

                def sleeps_until_answered(storage) -> int:
                    """Times this thread slept (gave up its CPU) waiting for the answer."""
                    peer.send(storage)
                    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
                    assert peer.receive(timeout=WAIT) == (None, b"ok")
                    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before

                first, second = shoal.allocate(64), shoal.allocate(64)  # one segment: only the first is new there
                first_sleeps = sleeps_until_answered(first)
                second_sleeps = sleeps_until_answered(second)
                peer.send_note(b"")
        finally:
            child.join(WAIT)
    assert child.exitcode == 0
    assert second_sleeps >= 1, "an answer to memory the child has mapped already is slept on"
    if import_answer_spin_us:
        assert first_sleeps == 0, "the answer to a new segment, 0.3 s after it, is polled for"
    else:
        assert first_sleeps >= 1, "without import_answer_spin_us the first answer is slept on too"


def test_a_connection_not_given_to_a_peer_closes_with_its_block_and_the_listener_sees_it_go():
    address = f"@shoal-connection-close-{os.getpid()}"
    with shoal.Listener(address) as listener:
        with shoal.connect(address, timeout=WAIT) as connection:
            accepted = listener.accept(timeout=WAIT)
            assert accepted is not None and not connection.closed
        assert connection.closed and repr(connection) == "shoal.Connection(closed)"
        connection.close()  # twice: harmless
        with pytest.raises(ValueError, match="closed"):
            connection.peer_pid
        with pytest.raises(ValueError, match="closed"):
            shoal.Peer(shoal.SharingContext(shoal.default_allocator()), connection)
        with shoal.Peer(shoal.SharingContext(shoal.default_allocator()), accepted) as peer:
            with pytest.raises(shoal.ConnectionClosedError):  # the other end is gone
                peer.receive(timeout=WAIT)
        accepted.close()  # the Peer's: closing it changes nothing
        assert not accepted.closed and repr(accepted) == "shoal.Connection(given to a Peer)"


def test_connecting_where_no_one_listens_says_so_by_type(tmp_path):
    with pytest.raises(shoal.ConnectionClosedError) as nobody:
        shoal.connect(str(tmp_path / "nobody.sock"), timeout=WAIT)
    assert nobody.value.no_listener, str(nobody.value)
    assert shoal.ConnectionClosedError("raised in Python").no_listener is False


def test_connect_to_a_listener_that_takes_no_one_times_out(tmp_path):
    import socket

    path = str(tmp_path / "stuck.sock")
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as filler:
        server.bind(path)
        server.listen(0)
        filler.connect(path)  # the backlog is full: a server that stopped accepting
        start = time.monotonic()
        with pytest.raises(shoal.PeerTimeoutError, match="took no connection"):
            shoal.connect(path, timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 5
        with pytest.raises(ValueError, match="timeout"):
            shoal.connect(path, timeout=-1)


@pytest.mark.parametrize("ring_bytes", [65536, 0])
def test_try_receive_takes_every_message_that_came_then_returns_none(ring_bytes):
    import select

    producer = shoal.SharingContext(shoal.default_allocator(), collect_interval_ms=0, ring_bytes=ring_bytes)
    consumer = shoal.SharingContext(shoal.default_allocator(), collect_interval_ms=0, ring_bytes=ring_bytes)
    with shoal.Listener(shoal.runtime_dir_address(f"try-{os.getpid()}-{ring_bytes}.sock")) as listener:
        sender = shoal.Peer(producer, shoal.connect(listener.address))
        receiver = shoal.Peer(consumer, listener.accept(timeout=WAIT))
        with sender, receiver:
            assert receiver.try_receive() is None
            for i in range(5):
                sender.send_note(b"note %d" % i)
            assert select.select([receiver.fileno()], [], [], WAIT)[0]
            got = []
            while (message := receiver.try_receive()) is not None:
                got.append(message[1])
            assert got == [b"note %d" % i for i in range(5)]
            assert not select.select([receiver.fileno()], [], [], 0)[0], "nothing left to read"


def test_a_producer_that_always_has_a_batch_ready_does_not_starve_another():
    with sharing.Consumer(allocator=HOST) as consumer:
        a = sharing.Producer(consumer.address, allocator=HOST)
        b = sharing.Producer(consumer.address, allocator=HOST)
        with a, b:
            for _ in range(6):
                a.put({"who": HOST.allocate(8)})
            b.put({"who": HOST.allocate(16)})
            sources = [consumer.get(timeout=WAIT)["who"].shape[0] for _ in range(3)]
            assert 16 in sources, f"b's batch waited behind a's: {sources}"
            assert sorted(consumer.get(timeout=WAIT)["who"].shape[0] for _ in range(4)) == [8] * 4


def host_producer(consumer: sharing.Consumer) -> sharing.Producer:
    return sharing.Producer(consumer.address, allocator=HOST)


def send_unfinished_batch(producer: sharing.Producer) -> None:
    """One array of a batch, and no note: the batch stays unfinished."""
    view = HOST.allocate(64).view("float32", (16,))
    producer.peer.send(view, sharing._leaf_header(view), None)


def finish_batch(producer: sharing.Producer) -> None:
    producer.peer.send_note(json.dumps({"v": 1, "arrays": 1, "batch": {"a": 0}}).encode())


def test_a_producer_that_leaves_a_batch_unfinished_is_cut_off_after_batch_timeout_of_waiting(clean_process):
    with sharing.Consumer(batch_timeout=0.3, allocator=HOST) as consumer, host_producer(consumer) as producer:
        send_unfinished_batch(producer)
        with pytest.raises(shoal.PeerTimeoutError):
            consumer.get(timeout=1.5)  # its wait ends at the producer's 0.3 s, then at its own deadline
        assert consumer.producers == 0, "the stalled producer still holds its connection and its arrays"
        assert len(consumer.errors) == 1 and isinstance(consumer.errors[0], shoal.PeerTimeoutError)
        assert "unfinished" in str(consumer.errors[0])
        with pytest.raises(shoal.ConnectionClosedError):
            producer.peer.receive(timeout=WAIT)


def test_arrays_that_keep_coming_without_a_note_do_not_stretch_batch_timeout(clean_process):
    with sharing.Consumer(batch_timeout=0.6, allocator=HOST) as consumer, host_producer(consumer) as producer:
        for _ in range(10):  # 0.2 s of waiting a round, an array every round
            send_unfinished_batch(producer)
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=0.2)
            if consumer.producers == 0:
                break
        assert consumer.producers == 0, "a producer sending an array now and then kept its batch open"
        assert isinstance(consumer.errors[0], shoal.PeerTimeoutError)


def test_only_time_spent_waiting_in_get_counts_toward_batch_timeout(clean_process):
    with sharing.Consumer(batch_timeout=1.0, allocator=HOST) as consumer, host_producer(consumer) as producer:
        send_unfinished_batch(producer)
        for _ in range(2):  # 0.2 s of waiting in get(), 1.2 s busy elsewhere after each
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=0.1)
            time.sleep(1.2)
        assert consumer.producers == 1, "time outside get() was counted as the producer's stall"
        finish_batch(producer)
        batch = consumer.get(timeout=WAIT)
        assert batch.shape == (16,)  # {"a": 0}: the batch is array 0 itself
        assert consumer.errors == [] and consumer.producers == 1
        del batch


def test_a_batch_timeout_of_years_still_lets_get_wait_without_a_timeout():
    # select() refuses a wait that long; each of get()'s waits is at most an hour.
    import threading

    with sharing.Consumer(batch_timeout=1e9, allocator=HOST) as consumer, host_producer(consumer) as producer:
        send_unfinished_batch(producer)
        with pytest.raises(shoal.PeerTimeoutError):
            consumer.get(timeout=0.1)  # takes the array: the batch is unfinished now
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(consumer.get()))
        waiter.start()
        time.sleep(0.3)
        finish_batch(producer)
        waiter.join(WAIT)
        assert not waiter.is_alive() and len(got) == 1 and got[0].shape == (16,)
        del got


def test_batch_timeout_none_never_cuts_a_producer_off(clean_process):
    with sharing.Consumer(batch_timeout=None, allocator=HOST) as consumer, host_producer(consumer) as producer:
        send_unfinished_batch(producer)
        with pytest.raises(shoal.PeerTimeoutError):
            consumer.get(timeout=0.3)
        assert consumer.producers == 1 and consumer.errors == []
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="batch_timeout"):
            sharing.Consumer(batch_timeout=bad)


def test_a_put_that_fails_part_way_takes_its_arrays_back_and_the_next_put_arrives_whole():
    other = shoal.Allocator(shoal.host_device())
    with sharing.Consumer(allocator=HOST) as consumer, host_producer(consumer) as producer:
        foreign = other.allocate(16)  # not the producer's allocator's: cannot be sent
        with pytest.raises(shoal.InvalidArgumentError, match="another allocator"):
            producer.put({"a": HOST.allocate(16), "b": foreign})
        producer.put({"c": HOST.allocate(32)})
        batch = consumer.get(timeout=WAIT)
        assert list(batch) == ["c"] and batch["c"].shape == (32,), "the failed put's array came with the next batch"
        assert consumer.errors == [] and consumer.producers == 1
        del batch


def test_the_socket_file_goes_with_the_consumer():
    consumer = sharing.Consumer()
    path = consumer.address
    assert os.path.exists(path) and not consumer.closed
    consumer.close()
    assert not os.path.exists(path) and consumer.closed
    consumer.close()  # twice: nothing more
    with pytest.raises(shoal.InvalidArgumentError, match="closed"):
        consumer.get(timeout=0)


def test_a_producer_past_the_limit_is_refused_and_the_others_go_on(clean_process):
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer(max_producers=1) as consumer:
        release = ctx.Event()
        first = ctx.Process(target=producer_main, args=(consumer.address, 20, 1, 0.0, release))  # stays connected
        first.start()
        check_batch(consumer.get(timeout=WAIT), 20)
        second = ctx.Process(target=producer_main, args=(consumer.address, 30, 1))
        second.start()
        # However late the second process connects, it is refused while the
        # first is there, and its batch (which may have gone out before the
        # refusal) is never delivered.
        deadline = time.monotonic() + WAIT
        while not any(isinstance(e, shoal.PeerRefusedError) for e in consumer.errors):
            assert time.monotonic() < deadline, "the producer past the limit was not refused"
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=0.5)
        second.join(WAIT)
        release.set()
        first.join(WAIT)
        assert first.exitcode == 0


def killed_producer_main(address: str, tag: int, taken) -> None:
    """Sends one batch, then, once the consumer has it (`taken` set), dies as
    by SIGKILL (no close)."""
    producer = sharing.Producer(address)
    producer.put(make_batch(tag))
    taken.wait(WAIT)
    os.kill(os.getpid(), signal.SIGKILL)


def test_batches_yields_every_batch_of_the_producers_then_ends(clean_process):
    # Each producer puts its batches and ends at once: its last batches and
    # its end reach the consumer together, and the loop must yield them all.
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer() as consumer:
        producers = [ctx.Process(target=producer_main, args=(consumer.address, tag, 4)) for tag in (10, 50, 90)]
        for p in producers:
            p.start()
        seen = []
        for batch in consumer.batches(producers=3, timeout=WAIT):
            tag = batch["y"][1][0].storage.read(0, 1)[0]
            check_batch(batch, tag)
            seen.append(tag)
        assert sorted(seen) == [10, 11, 12, 13, 50, 51, 52, 53, 90, 91, 92, 93]
        assert consumer.producers_ended == 3 and consumer.producers == 0
        for p in producers:
            p.join(WAIT)
            assert p.exitcode == 0
        assert consumer.errors == []
        del batch


def test_a_producer_that_dies_ends_the_loop_as_one_that_closes(clean_process):
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer() as consumer:
        taken = ctx.Event()
        survivor = ctx.Process(target=producer_main, args=(consumer.address, 10, 2))
        killed = ctx.Process(target=killed_producer_main, args=(consumer.address, 70, taken))
        survivor.start()
        killed.start()
        tags = []
        for batch in consumer.batches(producers=2, timeout=WAIT):
            tags.append(batch["y"][1][0].storage.read(0, 1)[0])
            if tags[-1] == 70:
                taken.set()
        assert sorted(tags) == [10, 11, 70]
        assert consumer.producers_ended == 2
        killed.join(WAIT)
        survivor.join(WAIT)
        assert killed.exitcode == -signal.SIGKILL and survivor.exitcode == 0


def test_a_producer_refused_past_the_limit_is_not_counted_and_is_named_in_errors():
    with sharing.Consumer(allocator=HOST, max_producers=1) as consumer:
        first = sharing.Producer(consumer.address, allocator=HOST)
        first.put({"x": HOST.allocate(64).view("uint8")})
        second = sharing.Producer(consumer.address, allocator=HOST)
        batch = consumer.get(timeout=WAIT)
        first.close(timeout=WAIT)
        batches = consumer.batches(producers=2, timeout=0.5)
        with pytest.raises(shoal.PeerTimeoutError):
            next(batches)  # its batches never come: the loop must not end as if they had
        assert consumer.producers_ended == 1 and batches.producers_left == 1
        assert any(isinstance(e, shoal.PeerRefusedError) for e in consumer.errors)
        with pytest.raises(shoal.ConnectionClosedError):
            second.put({"x": HOST.allocate(64).view("uint8")})
        del batch


def test_connections_that_send_nothing_are_not_counted_and_a_producer_that_put_nothing_is():
    with sharing.Consumer(allocator=HOST) as consumer:
        batches = consumer.batches(producers=1, timeout=0.5)
        with socket.socket(socket.AF_UNIX) as probe:  # connects and hangs up
            probe.connect(consumer.address)
        with pytest.raises(shoal.SystemCallError, match="already in use"):
            sharing.Consumer(consumer.address, allocator=HOST)  # probes the address: in use
        with pytest.raises(shoal.PeerTimeoutError):
            next(batches)
        assert consumer.producers_ended == 0
        with sharing.Producer(consumer.address, allocator=HOST):
            pass  # puts nothing: its close() says it ended
        assert list(batches) == [] and consumer.producers_ended == 1


def test_the_count_starts_at_each_call_so_a_loop_per_epoch_works():
    with sharing.Consumer(allocator=HOST) as consumer:
        for epoch in range(3):
            producers = [sharing.Producer(consumer.address, allocator=HOST) for _ in range(2)]
            for i, producer in enumerate(producers):
                producer.put({"x": HOST.allocate(8).view("uint8"), "tag": [HOST.allocate(epoch * 2 + i + 1)]})
            taken = consumer.batches(producers=2, timeout=WAIT)
            got = [next(taken), next(taken)]  # both batches taken: the closes below need not wait
            for producer in producers:
                producer.close(timeout=WAIT)
            got += list(taken)
            assert sorted(b["tag"][0].storage.nbytes for b in got) == [epoch * 2 + 1, epoch * 2 + 2]
        assert consumer.producers_ended == 6


def test_a_timeout_leaves_the_iterator_usable():
    with sharing.Consumer(allocator=HOST) as consumer:
        batches = consumer.batches(producers=1, timeout=0.2)
        with pytest.raises(shoal.PeerTimeoutError):
            next(batches)
        producer = sharing.Producer(consumer.address, allocator=HOST)
        producer.put({"x": HOST.allocate(8).view("uint8")})
        got = next(batches)
        producer.close(timeout=WAIT)
        assert list(batches) == [] and batches.producers_left == 0
        del got


def flooding_producer_main(address: str, stop) -> None:
    """Sends notes that take nothing back, as fast as it can, until `stop`
    is set or the consumer hangs up."""
    note = json.dumps({"v": 1, "abort": True}).encode()
    producer = sharing.Producer(address)
    with contextlib.suppress(shoal.ShoalError):
        while not stop.is_set():
            producer.peer.send_note(note)
    os._exit(0)


def test_a_peer_that_never_stops_sending_cannot_hold_get_past_its_deadline(clean_process):
    ctx = multiprocessing.get_context("forkserver")
    with sharing.Consumer() as consumer:
        stop = ctx.Event()
        flooder = ctx.Process(target=flooding_producer_main, args=(consumer.address, stop))
        flooder.start()
        try:
            # Its start (a forkserver child) may take seconds on a loaded machine: accepted first.
            deadline = time.monotonic() + WAIT
            while consumer.producers == 0 and time.monotonic() < deadline:
                with contextlib.suppress(shoal.PeerTimeoutError):
                    consumer.get(timeout=0.2)
            assert consumer.producers == 1
            for _ in range(5):
                started = time.monotonic()
                with pytest.raises(shoal.PeerTimeoutError):
                    consumer.get(timeout=0.2)
                # Held by a turn without end it would not return at all: the bound leaves a loaded machine room.
                assert time.monotonic() - started < 3.0, "a turn without end held get() past its deadline"
        finally:
            stop.set()
            consumer.close()  # a send waiting for room ends at once
            flooder.join(WAIT)


def test_many_producers_turns_cannot_hold_get_past_its_deadline(monkeypatch):
    """Each producer's turn reads up to 256 messages; the deadline is checked
    between turns, not only after every ready producer had one, and those
    left out go first at the next call."""
    abort = json.dumps({"v": 1, "abort": True}).encode()
    with sharing.Consumer(allocator=HOST) as consumer:
        producers = [sharing.Producer(consumer.address, allocator=HOST) for _ in range(12)]
        try:
            deadline = time.monotonic() + WAIT
            while consumer.producers < len(producers) and time.monotonic() < deadline:
                with contextlib.suppress(shoal.PeerTimeoutError):
                    consumer.get(timeout=0.05)
            assert consumer.producers == len(producers)
            for producer in producers:
                producer.peer.send_note(abort)  # every socket readable, no batch to return
            served = []
            slow_turn = consumer._receive_from

            def turn_of_50_ms(incoming, stream):
                served.append(incoming.fd)
                time.sleep(0.05)
                return slow_turn(incoming, stream)

            monkeypatch.setattr(consumer, "_receive_from", turn_of_50_ms)
            started = time.monotonic()
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=0.1)
            took = time.monotonic() - started
            # Without the check between turns: all 12 turns, 0.6 s (counted, not timed: a loaded machine's
            # sleeps overshoot).
            assert len(served) <= 4, f"{len(served)} turns in {took:.2f} s past a 0.1 s deadline"
            first_call = set(served)
            while len(set(served)) < len(producers):
                with pytest.raises(shoal.PeerTimeoutError):
                    consumer.get(timeout=0.1)
            assert sorted(served) == sorted(set(served)), "a producer served twice before each had its turn"
            assert first_call <= set(served)
        finally:
            for producer in producers:
                producer.close(timeout=WAIT)


def test_a_close_from_a_signal_handler_ends_a_waiting_get_with_the_closed_error():
    # Python resumes a select that a signal interrupted: without a wake-up, get() slept
    # on in a closed consumer's select and then failed with a bare OSError.
    with sharing.Consumer(allocator=HOST) as consumer:
        previous = signal.signal(signal.SIGALRM, lambda *_: consumer.close())
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            started = time.monotonic()
            with pytest.raises(shoal.InvalidArgumentError, match="Consumer.get: the consumer is closed"):
                consumer.get(timeout=5)
            assert time.monotonic() - started < 2
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert consumer.closed
        with pytest.raises(shoal.ConnectionClosedError, match="no one listens"):
            shoal.connect(consumer.address)  # torn down as the get() ended


@pytest.mark.parametrize("wait", [None, 5.0])
def test_a_close_from_another_thread_ends_a_waiting_get_with_the_closed_error(wait):
    # Without a wake-up, a get() without a timeout waited on in a select no one would end.
    with sharing.Consumer(allocator=HOST) as consumer:
        closer = threading.Timer(0.2, consumer.close)
        closer.start()
        started = time.monotonic()
        with pytest.raises(shoal.InvalidArgumentError, match="Consumer.batches: the consumer is closed"):
            next(consumer.batches(producers=1, timeout=wait))
        assert time.monotonic() - started < 2
        closer.join(WAIT)
        assert consumer.closed


def test_batches_checks_its_arguments_when_called():
    with sharing.Consumer(allocator=HOST) as consumer:
        assert list(consumer.batches(producers=0)) == []
        for wrong, error in ((-1, shoal.InvalidArgumentError), (1.5, TypeError), (None, TypeError),
                             (True, TypeError)):
            with pytest.raises(error, match="producers must be a whole number"):
                consumer.batches(producers=wrong)
        with pytest.raises(shoal.InvalidArgumentError, match="timeout must be"):
            consumer.batches(producers=1, timeout=-1)
    with pytest.raises(shoal.InvalidArgumentError, match="closed"):
        consumer.batches(producers=1)


def test_a_batch_outlives_its_consumer(clean_process):
    ctx = multiprocessing.get_context("spawn")
    consumer = sharing.Consumer()
    p = ctx.Process(target=producer_main, args=(consumer.address, 60, 1, 1.0))
    p.start()
    batch = consumer.get(timeout=WAIT)
    consumer.close()
    del consumer  # the received storages keep its context and allocator alive
    gc.collect()
    check_batch(batch, 60)
    p.join(WAIT)
    del batch


@pytest.mark.parametrize("value", [-1, 1.5, None, "x", True])
def test_a_sharing_option_of_the_wrong_kind_is_refused_by_name(value):
    with pytest.raises(shoal.InvalidArgumentError, match="ring_bytes takes a whole number"):
        shoal.SharingContext(shoal.default_allocator(), ring_bytes=value)
    with pytest.raises(shoal.InvalidArgumentError, match="ring_bytes takes a whole number"):
        sharing.Consumer(ring_bytes=value)


def test_the_spin_for_an_answer_after_an_import_is_an_option_in_microseconds():
    shoal.SharingContext(shoal.default_allocator(), import_answer_spin_us=0)
    shoal.SharingContext(shoal.default_allocator(), import_answer_spin_us=500)
    with pytest.raises(shoal.InvalidArgumentError, match="import_answer_spin_us takes a whole number"):
        shoal.SharingContext(shoal.default_allocator(), import_answer_spin_us=-1)
    with pytest.raises(shoal.InvalidArgumentError, match="import_answer_spin_us"):
        shoal.SharingContext(shoal.default_allocator(), import_answer_spin=200)  # unknown: the list names it


def test_a_misspelt_keyword_is_refused_naming_the_nearest_one_of_the_class_or_its_context():
    # It reached SharingContext, whose error named that class and listed its options alone.
    with pytest.raises(shoal.InvalidArgumentError,
                       match=r"shoal.sharing.Consumer: unknown keyword max_producer; did you mean max_producers\?"):
        sharing.Consumer(allocator=HOST, max_producer=3)
    with pytest.raises(shoal.InvalidArgumentError, match=r"unknown keyword ring_byte; did you mean ring_bytes\?"):
        sharing.Consumer(allocator=HOST, ring_byte=4096)
    with sharing.Consumer(allocator=HOST) as consumer:
        with pytest.raises(shoal.InvalidArgumentError, match=r"Producer: unknown keyword maxahead; did you mean max_ahead"):
            sharing.Producer(consumer.address, maxahead=2)


def test_a_producers_options_are_checked_when_it_is_made_not_at_its_first_put():
    # Its context is made at the first put (which fixes its device): a misspelt
    # option must not wait until then to show.
    with sharing.Consumer(allocator=HOST) as consumer:
        with pytest.raises(shoal.InvalidArgumentError, match="Producer: unknown keyword bogus .its own: allocator"):
            sharing.Producer(consumer.address, bogus=1)
        with pytest.raises(shoal.InvalidArgumentError, match="ring_bytes takes a whole number"):
            sharing.Producer(consumer.address, ring_bytes=-1)
        with sharing.Producer(consumer.address, allocator=HOST, receive_spin_us=0) as producer:
            producer.put(HOST.allocate(8))
            assert consumer.get(timeout=WAIT).nbytes == 8


def test_numpys_integers_are_taken_as_sharing_options_and_its_bools_are_not():
    np = pytest.importorskip("numpy")
    with sharing.Consumer(ring_bytes=np.int64(65536), allocator=HOST) as consumer:
        assert consumer.address
    shoal.SharingContext(shoal.default_allocator(), slots_per_file=np.uint32(64), receive_spin_us=np.int16(0))
    with pytest.raises(shoal.InvalidArgumentError, match="ring_bytes takes a whole number"):
        shoal.SharingContext(shoal.default_allocator(), ring_bytes=np.bool_(True))
    with pytest.raises(shoal.InvalidArgumentError, match="slots_per_file takes a whole number"):
        shoal.SharingContext(shoal.default_allocator(), slots_per_file=np.int64(2**40))


def test_producers_and_consumers_print_what_they_are():
    with sharing.Consumer(allocator=HOST) as consumer, host_producer(consumer) as producer:
        assert repr(consumer) == f"shoal.sharing.Consumer({consumer.address!r}, 0 producers, 0 errors)"
        assert repr(producer) == f"shoal.sharing.Producer(to pid {os.getpid()})"
    assert repr(consumer).endswith("closed, 0 errors)") and repr(producer) == "shoal.sharing.Producer(closed)"



def test_a_pathlike_address_is_taken_and_a_bytes_path_is_not(tmp_path):
    import pathlib
    path = pathlib.Path(tmp_path) / "pathlike.sock"
    with shoal.Listener(path) as listener:
        assert listener.address == str(path)
        with shoal.connect(path):
            assert listener.accept(timeout=WAIT) is not None
    with pytest.raises(TypeError, match="address: str \\| os.PathLike\\[str\\]"):
        shoal.Listener(os.fsencode(path))


@pytest.mark.parametrize("name", [".", "..", "", "a/b"])
def test_a_runtime_dir_name_that_is_no_file_name_is_refused(name):
    with pytest.raises(shoal.InvalidArgumentError, match=f'runtime_dir_address: "{re.escape(name)}" is not a file name'):
        shoal.runtime_dir_address(name)


def test_a_new_consumer_removes_socket_files_killed_consumers_left():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    folder = os.path.dirname(shoal.runtime_dir_address("x"))
    os.makedirs(folder, mode=0o700, exist_ok=True)

    def left_behind(pid: int) -> str:  # a socket file whose listener is gone, made a minute ago
        path = os.path.join(folder, f"shoal-{pid}-0123456789ab.sock")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
        os.utime(path, (time.time() - 60, time.time() - 60))
        return path

    stale, ours = left_behind(dead_pid), left_behind(os.getpid())
    not_a_socket = os.path.join(folder, f"shoal-{dead_pid}-fedcba987654.sock")
    with open(not_a_socket, "w") as f:
        f.write("a file of the user's own that happens to have such a name")
    try:
        with sharing.Consumer():
            pass
        assert not os.path.exists(stale), "the file of a consumer that is gone was left"
        assert os.path.exists(ours), "the file of a process that runs was removed"
        assert os.path.exists(not_a_socket), "a file that is no socket was removed"
    finally:
        for path in (stale, ours, not_a_socket):
            if os.path.exists(path):
                os.unlink(path)


def test_device_and_allocator_arguments_are_checked_by_name():
    for make in (sharing.Consumer, lambda **kw: sharing.Producer("unused", **kw)):
        with pytest.raises(TypeError, match="device must be a shoal.Device"):
            make(device=object())
        with pytest.raises(shoal.InvalidArgumentError, match="device must be 'cuda:N', 'cuda', 'host' or 'cpu'"):
            make(device="gpu:1")
        with pytest.raises(shoal.InvalidArgumentError, match="device must be a CUDA ordinal >= 0"):
            make(device=-1)
        with pytest.raises(TypeError, match="allocator must be a shoal.Allocator"):
            make(allocator="cuda:0")
    with sharing.Consumer(device="host") as consumer:
        assert consumer.allocator.device == shoal.host_device()
    with sharing.Consumer(allocator=HOST, device=shoal.host_device()) as consumer:
        assert consumer.allocator is HOST
    if shoal.cuda_device_count() > 0:
        with pytest.raises(shoal.InvalidArgumentError, match="allocator= is on host but device= names cuda:0"):
            sharing.Consumer(allocator=HOST, device="cuda:0")


class TorchDevice:
    """What device= reads of a torch.device: its module, its type, its text."""

    def __init__(self, text: str) -> None:
        self.type = text.partition(":")[0]
        self.text = text

    def __str__(self) -> str:
        return self.text


TorchDevice.__module__ = "torch"


def test_cpu_names_the_host_device_as_a_str_and_as_a_torch_device():
    for cpu in ("cpu", TorchDevice("cpu")):
        with sharing.Consumer(device=cpu) as consumer:
            assert consumer.allocator.device == shoal.host_device(), f"device={cpu} did not name the host"
        with sharing.Consumer() as consumer, sharing.Producer(consumer.address, device=cpu) as producer:
            assert producer.allocator.device == shoal.host_device(), f"device={cpu} did not name the host"
    # The one host device is ordinal 0: "cpu:0" is what str(torch.device("cpu", 0)) gives.
    for cpu in ("cpu:0", "host:0", TorchDevice("cpu:0")):
        with sharing.Consumer(device=cpu) as consumer:
            assert consumer.allocator.device == shoal.host_device(), f"device={cpu} did not name the host"
    for other in ("cpu:1", "host:1", TorchDevice("cpu:1")):
        with pytest.raises(shoal.InvalidArgumentError, match=f"not '{other}'"):
            sharing.Consumer(device=other)


@pytest.fixture
def rank_on_gpu_1(monkeypatch):
    """This process as shoal's defaults see a DDP rank on cuda:1: torch imported, CUDA
    initialised in it, device 1 current, two CUDA devices. Making shoal's CUDA device 0
    (shoal.default_allocator() or shoal.default_device(), which create GPU 0's context) fails
    the test. The "cuda:1" made is the host device (this machine may have no GPU); the
    ordinals asked for are returned."""
    from shoal import _device_defaults

    def no_device_0(*args, **kwargs):
        raise AssertionError("shoal's default device was made: a context on GPU 0 in a rank on cuda:1")

    asked: list = []
    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delenv("SHOAL_BACKEND", raising=False)
    monkeypatch.setattr(shoal._shoal, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(shoal._shoal, "cuda_device", lambda ordinal=0: asked.append(ordinal) or shoal.host_device())
    monkeypatch.setattr(shoal._shoal, "default_device", no_device_0)
    monkeypatch.setattr(shoal, "default_allocator", no_device_0)
    monkeypatch.setattr(shoal, "_default_allocator", None)  # not made yet, as in a fresh rank
    monkeypatch.setattr(_device_defaults, "_allocators", {})
    return asked


def test_a_rank_on_another_gpu_makes_nothing_on_gpu_0_by_default(rank_on_gpu_1):
    import shoal.transfer

    with sharing.Consumer() as consumer, sharing.Producer(consumer.address) as producer:
        assert consumer.allocator.device == producer.allocator.device == shoal.host_device()
    shoal.transfer._default_engine_allocator()  # what Engine() with no allocator takes
    assert rank_on_gpu_1 and set(rank_on_gpu_1) == {1}, f"devices made: {rank_on_gpu_1}, not torch's current one"


def test_a_default_producer_takes_the_device_of_the_thread_of_its_first_put(rank_on_gpu_1):
    # PyTorch's current device is per thread: a thread that set none is on device 0. A
    # Producer made in such a thread and used in the rank's thread on cuda:1 makes nothing
    # on device 0.
    rank_thread = threading.local()
    sys.modules["torch"].cuda.current_device = lambda: getattr(rank_thread, "device", 0)
    with sharing.Consumer(allocator=HOST) as consumer:
        producer = sharing.Producer(consumer.address)
        failed: list = []

        def rank() -> None:
            rank_thread.device = 1  # torch.cuda.set_device(1) in this thread
            try:
                producer.put({})
            except BaseException as e:  # noqa: BLE001 - reported below
                failed.append(e)

        worker = threading.Thread(target=rank)
        worker.start()
        worker.join(WAIT)
        assert not failed, failed
        producer.close()
        assert consumer.get(timeout=WAIT) == {}
    assert rank_on_gpu_1 == [1], f"devices made: {rank_on_gpu_1}, not the putting thread's current one"


def test_drops_its_allocators_at_exit_as_the_package_drops_its_default_one():
    # An atexit handler registered before shoal's runs after it (last in, first out).
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('left', len(sys.modules['shoal._device_defaults']._allocators)))\n"
        "import shoal\n"
        "from shoal import _device_defaults\n"
        "_device_defaults._allocators[('host', 0)] = shoal.Allocator(shoal.host_device())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "left 0", done.stdout


def test_sharing_and_transfer_keep_one_allocator_per_device(rank_on_gpu_1):
    import shoal.transfer

    with sharing.Consumer() as consumer, sharing.Producer(consumer.address) as producer:
        assert producer.allocator is consumer.allocator, "a Producer and a Consumer on one device: two caches"
        assert shoal.transfer._default_engine_allocator() is consumer.allocator, (
            "an Engine on the device sharing uses: a second cache of that device's memory")
        with sharing.Consumer(device="cuda:1") as named:
            assert named.allocator is consumer.allocator, "device= named the same device: another allocator"


def test_a_torch_whose_current_device_fails_leaves_shoals_default_device(monkeypatch):
    def torn_down():
        raise RuntimeError("CUDA driver shutting down")

    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=torn_down)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    with sharing.Consumer() as consumer:
        assert consumer.allocator.device == shoal.default_device()


class RewordedPeer:
    """A Peer whose send refuses every array in other words than the binding's today (as a
    reworded C++ message would): put must tell memory of another allocator by itself."""

    def __init__(self, peer: shoal.Peer) -> None:
        self._peer = peer

    def send(self, *args, **kwargs):
        raise shoal.InvalidArgumentError("peer::send: refused")

    def __getattr__(self, name: str):
        return getattr(self._peer, name)


class InterruptedAfterSendPeer:
    """A Peer whose first send goes, then raises KeyboardInterrupt, as a Ctrl-C arriving during
    the native call is raised as it returns."""

    def __init__(self, peer: shoal.Peer) -> None:
        self._peer = peer
        self.interrupted = False

    def send(self, *args, **kwargs):
        self._peer.send(*args, **kwargs)
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt

    def __getattr__(self, name: str):
        return getattr(self._peer, name)


def test_a_put_interrupted_as_its_first_array_went_takes_it_back():
    # Counted as not sent, the array stayed at the consumer, which counted it into the next
    # batch and cut the producer off for a note that did not match.
    with sharing.Consumer(allocator=HOST) as consumer, host_producer(consumer) as producer:
        producer._link = InterruptedAfterSendPeer(producer.peer)
        with pytest.raises(KeyboardInterrupt):
            producer.put({"a": HOST.allocate(16)})
        second = HOST.allocate(16)
        second.fill(5)
        producer.put({"b": second.view("uint8")})
        got = consumer.get(timeout=WAIT)
        assert list(got) == ["b"] and got["b"].storage.read() == bytes([5]) * 16
        assert consumer.errors == []


class InterruptedAfterReceivePeer:
    """A Peer whose first receive of an array takes it, then raises KeyboardInterrupt, as a
    Ctrl-C arriving during the native call is raised as it returns."""

    def __init__(self, peer: shoal.Peer) -> None:
        self._peer = peer
        self.interrupted = False

    def try_receive(self, *args, **kwargs):
        message = self._peer.try_receive(*args, **kwargs)
        if message is not None and message[0] is not None and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return message

    def __getattr__(self, name: str):
        return getattr(self._peer, name)


def test_a_read_interrupted_as_an_array_came_closes_that_connection_and_says_why(monkeypatch):
    # The array taken was lost: counted on, the batch's note would not match and the producer
    # would be cut off later for a mismatch it did not make.
    real_incoming = sharing._Incoming
    monkeypatch.setattr(sharing, "_Incoming", lambda peer: real_incoming(InterruptedAfterReceivePeer(peer)))
    with sharing.Consumer(allocator=HOST) as consumer, host_producer(consumer) as producer:
        producer.put({"a": HOST.allocate(16)})
        with pytest.raises(KeyboardInterrupt):
            consumer.get(timeout=WAIT)
        assert consumer.producers == 0
        assert len(consumer.errors) == 1, consumer.errors
        assert isinstance(consumer.errors[0], shoal.ConnectionClosedError)
        assert "interrupted (KeyboardInterrupt)" in str(consumer.errors[0])


def test_memory_of_another_allocator_is_told_by_its_allocator_not_by_the_bindings_words():
    other = shoal.Allocator(shoal.host_device())
    with sharing.Consumer(allocator=HOST) as consumer, host_producer(consumer) as producer:
        producer._link = RewordedPeer(producer.peer)
        with pytest.raises(shoal.InvalidArgumentError) as refused:
            producer.put({"a": other.allocate(16)})
        message = str(refused.value)
        assert "batch['a'] is shoal memory on host from another allocator" in message, message
        # Its own memory, refused for another reason: the binding's words, not a wrong guess.
        with pytest.raises(shoal.InvalidArgumentError, match=r"^peer::send: refused$"):
            producer.put({"b": HOST.allocate(16)})


def test_memory_the_producers_allocator_adopted_keeps_the_bindings_advice_to_copy_it():
    # A relay: what a Consumer received is adopted by its allocator, not allocated by it; sent
    # on through a Producer of that same allocator, it is refused with the binding's words
    # (copy it), not told to make the Producer with allocator= (it has that allocator).
    imported = shoal.from_dlpack(numpy.arange(4, dtype="int32"), HOST)
    with sharing.Consumer(allocator=HOST) as first, host_producer(first) as source:
        source.put({"x": HOST.allocate(16)})
        received = first.get(timeout=WAIT)
        assert received["x"].storage.same_allocator(HOST), "a received storage is not its consumer allocator's"
        with sharing.Consumer(allocator=HOST) as second, host_producer(second) as relay:
            for name, array in (("received", received["x"]), ("imported", imported)):
                with pytest.raises(shoal.InvalidArgumentError) as refused:
                    relay.put({name: array})
                message = str(refused.value)
                assert "belongs to another owner" in message and "copy it" in message, message
                assert "allocator=" not in message, message
        del received


def test_memory_of_another_allocator_is_refused_in_python_terms_naming_the_argument_to_pass():
    other = shoal.Allocator(shoal.host_device())
    with sharing.Consumer(allocator=HOST) as consumer, host_producer(consumer) as producer:
        with pytest.raises(shoal.InvalidArgumentError) as refused:
            producer.put({"a": HOST.allocate(16), "b": [other.allocate(16)]})
        message = str(refused.value)
        assert "batch['b'][0] is shoal memory on host from another allocator" in message, message
        assert "allocator= the shoal.Allocator it came from" in message, message
        assert "peer::send" not in message and "sharing context" not in message, message


class FakeTensor:
    """What Producer.put reads of a CUDA tensor (shoal.torch.share is replaced): its device."""

    def __init__(self, ordinal: int, view) -> None:
        self.device = type("device", (), {"index": ordinal, "type": "cuda"})()
        self.view = view


FakeTensor.__module__ = "torch"  # put takes it for a tensor


@pytest.fixture
def torch_stand_in(monkeypatch):
    """shoal.torch enabled as far as sharing sees it, on a host "GPU" per ordinal: its
    allocators, PyTorch's current stream per device (a host stream), share()."""
    import shoal.torch as shoal_torch

    allocators = {ordinal: shoal.Allocator(shoal.host_device()) for ordinal in (0, 2, 3)}
    streams = {ordinal: shoal.Stream(shoal.host_device()) for ordinal in (2, 3)}
    asked: list = []
    monkeypatch.setattr(shoal_torch, "is_enabled", lambda: True)
    monkeypatch.setattr(shoal_torch, "allocator", lambda ordinal: allocators[ordinal])
    monkeypatch.setattr(shoal_torch, "share", lambda tensor: tensor.view)
    monkeypatch.setattr(shoal._shoal, "cuda_device", lambda ordinal: types.SimpleNamespace(kind="cuda", ordinal=ordinal))
    monkeypatch.setattr(sharing, "_torch_stream", lambda ordinal: asked.append(ordinal) or streams[ordinal])
    return allocators, streams, asked


def test_a_producer_made_without_allocator_takes_its_first_tensors_device_and_waits_on_torchs_stream(
    torch_stand_in,
):
    allocators, streams, asked = torch_stand_in
    memory = allocators[3].allocate(4096, streams[3])
    streams[3].delay(0.5)  # the tensor's writes, enqueued on PyTorch's current stream of its device
    memory.fill(1, streams[3])
    with sharing.Consumer(allocator=HOST) as consumer, sharing.Producer(consumer.address) as producer:
        producer.put({"x": FakeTensor(3, memory.view("uint8"))})
        assert producer.allocator is allocators[3], "the producer did not take its first tensor's device"
        assert asked == [3], "put did not order after PyTorch's current stream of the tensor's device"
        batch = consumer.get(timeout=WAIT)
        assert batch["x"].storage.read() == b"\x01" * 4096, "the consumer read before the tensor's writes ran"
        # Its device is chosen now: a tensor of another device's allocator is refused by name.
        with pytest.raises(shoal.InvalidArgumentError) as refused:
            producer.put({"y": FakeTensor(2, allocators[2].allocate(64).view("uint8"))})
        message = str(refused.value)
        assert "batch['y'] is a tensor on host from another allocator" in message, message
        assert "allocator=shoal.torch.allocator(2) (or device='cuda:2')" in message, message
        del batch
    streams[3].synchronize()


def test_a_first_put_without_tensors_fixes_a_default_producers_allocator(torch_stand_in):
    allocators, streams, asked = torch_stand_in
    with sharing.Consumer(allocator=HOST) as consumer, sharing.Producer(consumer.address) as producer:
        chosen = producer.allocator
        producer.put({})  # a note alone: it makes the connection's Peer, which binds the allocator
        with pytest.raises(shoal.InvalidArgumentError) as refused:
            producer.put({"x": FakeTensor(3, allocators[3].allocate(64).view("uint8"))})
        assert producer.allocator is chosen, "a later put's tensors moved the allocator"
        message = str(refused.value)
        assert "batch['x'] is a tensor on host from another allocator" in message, message
        assert consumer.get(timeout=WAIT) == {}


def test_a_peer_ring_over_max_peer_ring_bytes_is_refused_naming_the_option_to_raise():
    producer = shoal.SharingContext(shoal.default_allocator(), collect_interval_ms=0, ring_bytes=1 << 20)
    consumer = shoal.SharingContext(shoal.default_allocator(), collect_interval_ms=0, max_peer_ring_bytes=65536)
    with shoal.Listener(shoal.runtime_dir_address(f"ring-bound-{os.getpid()}.sock")) as listener:
        sender = shoal.Peer(producer, shoal.connect(listener.address))
        receiver = shoal.Peer(consumer, listener.accept(timeout=WAIT))
        with sender, receiver:
            sender.send_note(b"through the ring")
            with pytest.raises(shoal.ProtocolError, match=r"a ring of 1048576 bytes, over the 65536 this side takes \(allow_peer_ring; for a sharing peer, max_peer_ring_bytes\)"):
                receiver.receive(timeout=WAIT)
    with pytest.raises(shoal.InvalidArgumentError, match="SharingContext's max_peer_ring_bytes is 4095"):
        shoal.SharingContext(shoal.default_allocator(), max_peer_ring_bytes=4095)
    with sharing.Consumer(max_peer_ring_bytes=1 << 20, allocator=HOST) as bounded:
        with sharing.Producer(bounded.address, allocator=HOST, ring_bytes=1 << 20) as big_ring:
            big_ring.put({"x": HOST.allocate(8)})
            assert bounded.get(timeout=WAIT)["x"].shape[0] == 8


@pytest.mark.parametrize("option, limit", [("max_peer_mapped_bytes", 1 << 20), ("max_mapped_bytes", 1 << 20),
                                           ("max_producer_resources", 2)])
def test_a_producer_past_the_sharing_bounds_is_refused_naming_the_option_to_raise(option, limit):
    # One producer's bytes mapped, and all producers' together: a segment of 2 MiB past 1 MiB. All
    # producers' descriptors and mappings: a counter file and a segment announced, the segment's
    # mapping one past 2.
    producer = shoal.SharingContext(HOST, collect_interval_ms=0)
    consumer = shoal.SharingContext(HOST, collect_interval_ms=0, **{option: limit})
    with shoal.Listener(shoal.runtime_dir_address(f"{option}-{os.getpid()}.sock")) as listener:
        sender = shoal.Peer(producer, shoal.connect(listener.address))
        receiver = shoal.Peer(consumer, listener.accept(timeout=WAIT))
        with sender, receiver:
            sender.send(HOST.allocate(64))  # in a segment of 2 MiB
            with pytest.raises(shoal.ProtocolError, match=option):
                receiver.receive(timeout=WAIT)
    with pytest.raises(shoal.InvalidArgumentError, match=f"SharingContext's {option} is 0"):
        shoal.SharingContext(HOST, **{option: 0})


def test_a_contexts_stats_show_what_it_holds_for_producers_until_they_go():
    producer = shoal.SharingContext(HOST, collect_interval_ms=0)
    consumer = shoal.SharingContext(HOST, collect_interval_ms=0)
    assert consumer.stats()["producer_resources"] == 0 and consumer.stats()["producers_mapped_bytes"] == 0
    with shoal.Listener(shoal.runtime_dir_address(f"held-stats-{os.getpid()}.sock")) as listener:
        sender = shoal.Peer(producer, shoal.connect(listener.address))
        receiver = shoal.Peer(consumer, listener.accept(timeout=WAIT))
        with sender, receiver:
            sender.send(HOST.allocate(64))  # in a segment of 2 MiB
            got = receiver.receive(timeout=WAIT)
            held = consumer.stats()
            assert held["producer_resources"] == 3  # the counter file, the segment, its mapping
            assert held["producers_mapped_bytes"] >= 64
            del got
    deadline = time.monotonic() + WAIT
    while consumer.stats()["producer_resources"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert consumer.stats()["producer_resources"] == 0 and consumer.stats()["producers_mapped_bytes"] == 0


def test_a_producer_left_by_an_exception_before_any_put_closes_its_connection_alone(monkeypatch):
    # Nothing put: no allocator fixed, no context or Peer made just to close (a failure
    # there would replace the block's own error).
    made = []
    real_context = sharing._producer_context
    monkeypatch.setattr(sharing, "_producer_context", lambda *args: made.append(args) or real_context(*args))
    with sharing.Consumer(allocator=HOST) as consumer:
        producer = sharing.Producer(consumer.address)
        with pytest.raises(ValueError, match="the block's own") as raised:
            with producer:
                raise ValueError("the block's own")
        assert raised.value.__context__ is None
        assert producer.closed and made == []


def test_a_storage_one_producer_sent_another_producer_of_its_allocator_sends_too():
    # One process sending the same weights to two consumers, each through a Producer of its
    # own, and again to a consumer that restarted after the first Producer closed.
    weights = HOST.allocate(16)
    weights.fill(9)
    with sharing.Consumer(allocator=HOST) as first, sharing.Consumer(allocator=HOST) as second:
        with host_producer(first) as to_first, host_producer(second) as to_second:
            to_first.put({"w": weights.view("uint8")})
            to_second.put({"w": weights.view("uint8")})
            assert to_first.context is to_second.context
            for consumer in (first, second):
                assert consumer.get(timeout=WAIT)["w"].storage.read() == bytes([9]) * 16
    del to_first, to_second  # every Producer before it gone, as in a reconnect loop
    gc.collect()
    with sharing.Consumer(allocator=HOST) as restarted, host_producer(restarted) as again:
        again.put({"w": weights.view("uint8")})
        assert restarted.get(timeout=WAIT)["w"].storage.read() == bytes([9]) * 16


def test_producers_of_other_options_or_allocators_have_contexts_of_their_own_and_a_second_context_says_why_it_refuses():
    other = shoal.Allocator(shoal.host_device())
    with sharing.Consumer(allocator=HOST) as consumer:
        with host_producer(consumer) as plain, \
                sharing.Producer(consumer.address, allocator=HOST, ring_bytes=0) as no_ring, \
                sharing.Producer(consumer.address, allocator=other) as elsewhere:
            assert plain.context is not no_ring.context
            assert plain.context is not elsewhere.context
            storage = HOST.allocate(16)
            plain.put({"x": storage.view("uint8")})
            with pytest.raises(shoal.InvalidArgumentError, match="another sharing context first") as refused:
                no_ring.put({"x": storage.view("uint8")})
            assert "another Producer or SharingContext" in str(refused.value)
            assert consumer.get(timeout=WAIT)["x"].storage.read() == storage.read()


def test_two_objects_of_one_allocator_are_equal_and_hash_alike():
    context = shoal.SharingContext(HOST)
    assert context.allocator == HOST and hash(context.allocator) == hash(HOST)
    assert context.allocator is not HOST
    assert shoal.Allocator(shoal.host_device()) != HOST
    assert HOST != "an allocator"


def test_arguments_are_refused_in_the_words_of_the_call_that_took_them():
    with pytest.raises(shoal.InvalidArgumentError, match=r"^shoal\.sharing\.Producer: the address 'rel\.sock' is a relative"):
        sharing.Producer("rel.sock")
    with pytest.raises(shoal.InvalidArgumentError, match=r"^shoal\.sharing\.Consumer: allowed_uids"):
        sharing.Consumer(allowed_uids=[-1])
    with pytest.raises(TypeError, match=r"^shoal\.sharing\.Consumer: allowed_uids must be a sequence of uids"):
        sharing.Consumer(allowed_uids=1000)  # type: ignore[arg-type]
    with sharing.Consumer(allocator=HOST) as consumer:
        producer = sharing.Producer(consumer.address, allocator=HOST)
        producer.close()
        with pytest.raises(shoal.ConnectionClosedError, match=r"^shoal\.sharing\.Producer\.put: this Producer is closed"):
            producer.put(HOST.allocate(8))


@pytest.mark.skipif(not kernel_has_so_passrights(), reason="this kernel has no SO_PASSRIGHTS (Linux 6.16 on)")
def test_a_connection_that_takes_no_descriptors_is_noted_in_errors_not_raised_from_get():
    # A connection with SO_PASSRIGHTS off (a lender's client pointed at the wrong address, or a
    # hostile one) cannot take the ring's descriptors: its Peer fails at the accept. That is one
    # bad producer, noted with its pid; get() goes on (it raised from get(), found in review).
    with sharing.Consumer(allocator=HOST) as consumer:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hostile:
            hostile.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
            hostile.connect(consumer.address)
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=0.5)
            assert len(consumer.errors) == 1, consumer.errors
            assert isinstance(consumer.errors[0], shoal.ProtocolError)
            assert f"pid {os.getpid()} was refused" in str(consumer.errors[0]), consumer.errors[0]
        with sharing.Producer(consumer.address, allocator=HOST) as producer:
            producer.put({"x": HOST.allocate(8)})
            assert consumer.get(timeout=WAIT)["x"].shape[0] == 8


def test_a_batch_structure_naming_one_dict_key_twice_is_refused_not_an_array_dropped():
    # A Producer's dict has each key once; a note naming one twice would keep the second array
    # and drop the first without a word (each counts as used). Refused (found in review).
    with sharing.Consumer(allocator=HOST) as consumer:
        context = shoal.SharingContext(HOST)
        with shoal.Peer(context, shoal.connect(consumer.address)) as peer:
            for nbytes in (8, 16):
                view = HOST.allocate(nbytes).view("uint8")
                peer.send(view, sharing._leaf_header(view), None)
            note = {"v": 1, "arrays": 2, "batch": {"d": [["x", {"a": 0}], ["x", {"a": 1}]]}}
            peer.send_note(json.dumps(note).encode())
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=2)
            assert len(consumer.errors) == 1, consumer.errors
            assert "a dict entry named twice in a batch ('x')" in str(consumer.errors[0]), consumer.errors[0]


def test_a_batch_note_whose_version_or_count_is_not_a_number_is_refused():
    # JSON true equals 1 in Python: a note saying "v": true, "arrays": true is not what a
    # Producer sends, and is refused as one that does not match.
    with sharing.Consumer(allocator=HOST) as consumer:
        context = shoal.SharingContext(HOST)
        with shoal.Peer(context, shoal.connect(consumer.address)) as peer:
            view = HOST.allocate(8).view("uint8")
            peer.send(view, sharing._leaf_header(view), None)
            peer.send_note(json.dumps({"v": True, "arrays": True, "batch": {"a": 0}}).encode())
            with pytest.raises(shoal.PeerTimeoutError):
                consumer.get(timeout=2)
            assert len(consumer.errors) == 1, consumer.errors
            assert "a batch note that does not match the arrays sent" in str(consumer.errors[0]), consumer.errors[0]
