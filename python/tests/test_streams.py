"""Devices, streams, events and the `with shoal.stream(s)` scope."""

import copy
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


def test_dropping_a_stream_with_work_queued_lets_other_python_threads_run():
    # A host stream runs the work queued on it before it goes: the dealloc of the last
    # reference (with the GIL) lets the GIL go for that wait.
    s = shoal.Stream(shoal.host_device())
    s.delay(0.5)
    streams = [s]
    del s
    took, ticks = ticks_during(streams.clear)  # the last reference goes
    assert took >= 0.2, "the stream's end did not wait for its work (the test's premise)"
    assert ticks >= 10, f"another Python thread ran {ticks} times in {took:.2f} s of the drop"


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
