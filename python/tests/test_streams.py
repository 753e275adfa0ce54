"""Devices, streams, events and the `with shoal.stream(s)` scope."""

import copy
import gc
import os
import pickle
import threading
import time

import pytest

import shoal
from conftest import ticks_during


def test_the_default_device_follows_shoal_backend():
    expected = "cuda" if shoal.cuda_device_count() > 0 else "host"
    assert shoal.default_device().kind == expected
    assert shoal.host_device().kind == "host"


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), 1e12])
def test_a_delay_that_is_no_time_span_is_refused(seconds):
    with pytest.raises(shoal.InvalidArgumentError, match="seconds must be a number from 0 to 86400"):
        shoal.Stream().delay(seconds)


def test_current_stream_is_the_default_stream_outside_any_scope():
    assert shoal.current_stream() == shoal.Stream.default()
    assert shoal.current_stream().handle == 0


def test_stream_scopes_nest_and_restore():
    outer, inner = shoal.Stream(), shoal.Stream()
    assert outer != inner
    with shoal.stream(outer):
        assert shoal.current_stream() == outer
        with shoal.stream(inner):
            assert shoal.current_stream() == inner
        assert shoal.current_stream() == outer
    assert shoal.current_stream() == shoal.Stream.default()


def test_a_scope_is_left_when_its_block_raises():
    s = shoal.Stream()
    with pytest.raises(KeyError):
        with shoal.stream(s):
            raise KeyError("x")
    assert shoal.current_stream() == shoal.Stream.default()


def test_scopes_are_per_thread():
    s = shoal.Stream()
    seen = []
    with shoal.stream(s):
        worker = threading.Thread(target=lambda: seen.append(shoal.current_stream()))
        worker.start()
        worker.join(timeout=10)
    assert seen == [shoal.Stream.default()]


def test_an_event_completes_when_its_stream_passes_it():
    s = shoal.Stream()
    s.delay(0.2)
    e = shoal.Event()
    assert e.query(), "an event never recorded is complete, as its docstring says"
    e.synchronize()
    e.record(s)
    assert not e.query()
    e.synchronize()
    assert e.query()
    assert s.query()


def test_a_stream_waits_for_an_event_of_another():
    producer, consumer = shoal.Stream(), shoal.Stream()
    producer.delay(0.3)
    e = shoal.Event()
    e.record(producer)
    consumer.wait_event(e)
    assert not consumer.query()
    consumer.synchronize()
    assert e.query()


def test_synchronize_releases_the_gil():
    # While a thread blocks in synchronize on a stream kept busy for 1 s, this
    # thread wakes from a 0.1 s sleep on time: it could take the GIL.
    s = shoal.Stream()
    s.delay(1.0)
    entered, done = threading.Event(), threading.Event()

    def wait():
        entered.set()
        shoal.synchronize(s)
        done.set()

    worker = threading.Thread(target=wait)
    worker.start()
    assert entered.wait(timeout=10)
    start = time.monotonic()
    time.sleep(0.1)
    woke_after = time.monotonic() - start
    still_blocked = not done.is_set()
    worker.join(timeout=10)
    assert still_blocked
    assert woke_after < 0.6, f"the main thread waited {woke_after:.2f} s for the GIL"


def test_dropping_a_stream_with_work_queued_returns_at_once_and_the_work_still_runs():
    # As on CUDA, a stream's end does not wait for its work (a receiver dropping a
    # stream whose wait for another process has not passed must not block on it).
    s = shoal.Stream(shoal.host_device())
    s.delay(2.0)  # long beside the bound below: a loaded machine stays within both
    e = shoal.Event(shoal.host_device())
    e.record(s)
    start = time.monotonic()
    del s
    assert time.monotonic() - start < 1.0, "the stream's end waited for its work"
    assert not e.query()
    e.synchronize()
    assert e.query(), "the work queued before the end ran"


def test_a_device_pickles_as_the_same_device():
    for device in {shoal.host_device(), shoal.default_device()}:
        assert pickle.loads(pickle.dumps(device)) is device
        assert copy.deepcopy(device) is device
    from shoal import _device_defaults  # what unpickling calls: a kind or ordinal no device has is refused

    for kind, ordinal in (("gpu", 0), ("host", 5)):
        with pytest.raises(shoal.InvalidArgumentError, match="no device of kind"):
            _device_defaults.device_named(kind, ordinal)


def test_streams_and_devices_are_unequal_to_other_kinds_of_object():
    s = shoal.Stream()
    assert (s == None) is False and s != "x"  # noqa: E711 (the comparison itself is under test)
    assert s not in [None, 1] and s in [None, s]
    device = shoal.default_device()
    assert device != "host" and (device == None) is False  # noqa: E711
    assert device == shoal.default_device()


def _threads():
    return len(os.listdir("/proc/self/task"))


def _request(allocator, work):
    # A request's work, which it waits for before it answers.
    stream = shoal.Stream()
    with shoal.stream(stream):
        storage = allocator.allocate(1 << 20)
        work(storage, stream)
        del storage
    stream.synchronize()


@pytest.mark.parametrize(
    "work",
    [
        lambda st, s: st.write(b"x" * 4096),
        lambda st, s: st.fill(7),
        lambda st, s: st.lazy_clone().fill(1),
        lambda st, s: st.record_stream(s),
        lambda st, s: st.view("uint8").__dlpack__(stream=None if st.device.kind == "host" else -1, max_version=(1, 0)),
    ],
    ids=["write", "fill", "lazy_clone", "record_stream", "dlpack"],
)
def test_a_stream_per_request_goes_with_its_storages(work):
    # Each request's stream is dropped with its storages: the allocator lets
    # it go and passes its cache to the next request's stream, so neither
    # streams (a thread each on the host backend) nor segments pile up.
    allocator = shoal.Allocator()
    _request(allocator, work)
    threads = _threads()
    for _ in range(40):
        _request(allocator, work)
    allocator.empty_cache()
    stats = allocator.stats()
    assert stats["num_device_alloc"] <= 4, "each request's stream took the cache of one before it"
    deadline = time.monotonic() + 5  # a destroyed stream's thread ends once its work ran
    while _threads() > threads + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() <= threads + 2, "the requests' streams were destroyed"


@pytest.mark.skipif(shoal.default_device().kind != "host", reason="imports numpy arrays; counts host streams' threads")
def test_a_stream_per_request_goes_with_the_arrays_it_imported():
    # An imported array's streams go with its views and the array (they were kept for the
    # allocator's life: a stream per request, each importing an array, piled up).
    import numpy

    def request() -> None:
        stream = shoal.Stream()
        with shoal.stream(stream):
            view = shoal.from_dlpack(numpy.ones(16, "float32"))
            view.storage.fill(1)
            del view
        stream.synchronize()

    _assert_requests_leave_no_thread(request)


def test_a_stream_scope_left_out_of_order_leaves_the_later_scopes_stream_current():
    # A generator's scope closed inside a later scope: the later stream stays current (the
    # generator's guard put back the stream current before it, undoing the later scope).
    a, b = shoal.Stream(), shoal.Stream()
    before = shoal.current_stream()

    def scoped():
        with shoal.stream(a):
            yield

    suspended = scoped()
    next(suspended)
    assert shoal.current_stream() == a
    with shoal.stream(b):
        suspended.close()
        assert shoal.current_stream() == b, "the later scope's stream was undone"
        allocation = shoal.allocate(64)  # goes on the current stream
    assert shoal.current_stream() == before
    del allocation


def test_a_stream_scope_left_on_another_thread_is_refused_and_that_threads_scopes_stay():
    # Tokens are unique in the process: another thread's token matches none of this
    # thread's scopes (per-thread counters made one thread's first scope another's).
    a, b = shoal.Stream(), shoal.Stream()
    tokens = []
    entered, leave = threading.Event(), threading.Event()

    def other_thread() -> None:
        with shoal.stream(b):
            tokens.append(shoal._shoal._push_stream(b))
            entered.set()
            leave.wait(10)
            shoal._shoal._pop_stream(tokens[0])

    helper = threading.Thread(target=other_thread)
    helper.start()
    assert entered.wait(10)
    with shoal.stream(a):
        with pytest.raises(shoal.InvalidArgumentError, match="not open on this thread"):
            shoal._shoal._pop_stream(tokens[0])
        assert shoal.current_stream() == a, "another thread's token left this thread's scope"
    leave.set()
    helper.join(10)


def test_a_stream_used_on_a_storage_lives_as_long_as_the_storage():
    allocator = shoal.Allocator()
    storage = allocator.allocate(1 << 16)
    stream = shoal.Stream()
    storage.write(b"y" * 16, stream=stream)
    storage.record_stream(stream)
    threads = _threads()
    del stream  # the storage's release still waits for it
    assert _threads() >= threads, "the stream is kept while the storage lives"
    clone = storage.lazy_clone()
    del storage
    assert clone.read(0, 16) == b"y" * 16
    del clone
    allocator.empty_cache()
    assert allocator.stats()["allocated_bytes"]["all"]["current"] == 0


def test_an_eager_clone_keeps_only_its_own_stream():
    # Memory exported writable is copied at once by lazy_clone: the copy
    # shares nothing with its source, so the streams the source was used on
    # go with the source while the copy lives.
    allocator = shoal.Allocator(shoal.host_device())  # a host stream is a thread: what is counted
    storage = allocator.allocate(1 << 16)
    writer = shoal.Stream(shoal.host_device())
    storage.fill(5, stream=writer)
    writer.synchronize()
    exported = storage.view("uint8").__dlpack__(max_version=(1, 0))  # writable: later clones copy at once
    clone = storage.lazy_clone()
    assert not clone.aliases(storage)
    del writer
    threads = _threads()
    del exported, storage
    allocator.empty_cache()
    deadline = time.monotonic() + 5  # a destroyed stream's thread ends once its work ran
    while _threads() >= threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() < threads, "the source's stream went with the source"
    assert clone.read(0, 4) == b"\x05" * 4


def _connected_pair(name):
    # A Listener/connect pair in this process: (accepted, dialed).
    with shoal.Listener(f"@{name}-{os.getpid()}") as listener:
        dialed: list = []
        dialer = threading.Thread(target=lambda: dialed.append(shoal.connect(listener.address)))
        dialer.start()
        accepted = listener.accept(timeout=10)
        dialer.join(10)
    return accepted, dialed[0]


def _receive_on(peer, how, stream):
    if how == "receive":
        return peer.receive(timeout=10, stream=stream)
    deadline = time.monotonic() + 10
    while (message := peer.try_receive(stream=stream)) is None:
        assert time.monotonic() < deadline, "the storage sent came"
        time.sleep(0.001)
    return message


@pytest.mark.parametrize("how", ["receive", "try_receive"])
def test_a_stream_per_receive_goes_with_the_received_storage(how):
    # A received storage's handles keep the streams it was received and used
    # on (its release waits for them, then they go): a consumer that receives
    # each request on a new stream leaves neither those streams (a thread each
    # on the host backend) nor the ones it used the storages on behind.
    host = shoal.Allocator(shoal.host_device())  # CUDA refuses memory exported by the same process
    accepted, dialed = _connected_pair(f"streams-received-{how}")
    with shoal.Peer(shoal.SharingContext(host), accepted) as receiver, \
            shoal.Peer(shoal.SharingContext(host), dialed) as sender:

        def request(n):
            storage = host.allocate(1 << 12)
            storage.fill(n)
            sender.send(storage)
            del storage
            stream, other = shoal.Stream(shoal.host_device()), shoal.Stream(shoal.host_device())
            received, _ = _receive_on(receiver, how, stream)
            assert received.read(0, 4, stream=stream) == bytes([n]) * 4
            received.write(b"\x01" * 4, stream=other)
            received.record_stream(other)
            del received
            stream.synchronize()
            other.synchronize()

        request(1)
        threads = _threads()
        for n in range(40):
            request(n)
        deadline = time.monotonic() + 10
        while _threads() > threads + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads() <= threads + 2, "the received storages' streams went with them"
        assert receiver.stats()["held_storages"] == 0


def test_the_streams_of_a_storage_sent_to_another_process_are_kept_by_the_allocator():
    # The other process's release of a sent storage may come after every
    # handle here: the storage's streams, and any used on it later, are kept
    # by the allocator, so its release can still wait for them.
    host = shoal.Allocator(shoal.host_device())  # CUDA refuses memory exported by the same process
    accepted, dialed = _connected_pair("streams-sent")
    with shoal.Peer(shoal.SharingContext(host), accepted) as receiver, \
            shoal.Peer(shoal.SharingContext(host), dialed) as sender:
        storage = host.allocate(1 << 16)
        stream = shoal.Stream(shoal.host_device())
        storage.fill(3, stream=stream)
        sender.send(storage, stream=stream)
        received, _ = receiver.receive(timeout=10)
        threads = _threads()
        del stream, storage
        assert _threads() >= threads, "the sent storage's stream is kept while the other side holds it"
        assert received.read(0, 4) == b"\x03" * 4
        del received
        deadline = time.monotonic() + 10
        while host.stats()["allocated_bytes"]["all"]["current"] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.stats()["allocated_bytes"]["all"]["current"] == 0, "released after the kept stream"


def _assert_requests_leave_no_thread(request, settle=lambda: None) -> None:
    """`settle` runs while the threads are counted down: what frees the requests'
    memory after they returned (a sharing context's collect)."""
    request()
    gc.collect()
    threads = _threads()
    for _ in range(40):
        request()
    gc.collect()
    deadline = time.monotonic() + 5  # a destroyed stream's thread ends once its work ran
    while _threads() > threads + 2 and time.monotonic() < deadline:
        settle()
        time.sleep(0.01)
    assert _threads() <= threads + 2, "each request left its stream's thread"


@pytest.mark.skipif(shoal.default_device().kind != "host", reason="counts host streams' threads")
def test_a_stream_per_request_goes_after_a_transfer_batch_was_waited_on_it():
    # A transfer batch's storages are parts of one block, freed with the last
    # of them: each request's stream must still go once they are gone.
    import numpy
    import shoal.transfer

    with shoal.transfer.Engine() as engine:
        def request() -> None:
            stream = shoal.Stream()
            engine.submit(numpy.ones(16, "float32"))
            with shoal.stream(stream):  # the export orders the read after this stream's work: the copies
                batch = engine.get(timeout=10)
                assert numpy.from_dlpack(batch).sum() == 16
                del batch
            stream.synchronize()

        _assert_requests_leave_no_thread(request)


@pytest.mark.skipif(shoal.default_device().kind != "host", reason="counts host streams' threads")
def test_a_stream_per_request_goes_after_a_storage_sent_on_it_is_released():
    # A storage sent to another process is freed when that process lets go,
    # after every handle here: the stream it was used on must go then.
    allocator = shoal.default_allocator()
    producer = shoal.SharingContext(allocator, collect_interval_ms=0)
    consumer = shoal.SharingContext(allocator, collect_interval_ms=0)
    with shoal.Listener(shoal.runtime_dir_address(f"streams-{os.getpid()}.sock")) as listener:
        sender = shoal.Peer(producer, shoal.connect(listener.address))
        receiver = shoal.Peer(consumer, listener.accept(timeout=10))
        with sender, receiver:
            def request() -> None:
                stream = shoal.Stream()
                with shoal.stream(stream):
                    storage = allocator.allocate(4096)
                    storage.fill(3)
                    sender.send(storage, b"")
                    del storage
                received, _ = receiver.receive(timeout=10)
                del received
                stream.synchronize()
                producer.collect()

            # The consumer's release of a storage may land after the request's
            # collect (its slot is let go on the receive stream): the blocks it
            # left in the limbo are freed at a later collect, as the collector's,
            # and a freed block's streams go when the allocator next looks at
            # its pending frees (its next allocation).
            def settle() -> None:
                producer.collect()
                allocator.allocate(64)  # dropped at once: the allocation looks at the pending frees

            _assert_requests_leave_no_thread(request, settle=settle)
