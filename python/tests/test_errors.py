"""Every C++ error type arrives as its Python exception class, with the same message."""

import copy
import errno
import os
import pickle
import pathlib
import re

import pytest

import shoal
import shoal.transfer

MAPPING = [
    ("error", shoal.ShoalError, RuntimeError),
    ("invalid_argument", shoal.InvalidArgumentError, ValueError),
    ("protocol_error", shoal.ProtocolError, ValueError),
    ("out_of_memory", shoal.OutOfMemoryError, MemoryError),
    ("device_unavailable", shoal.DeviceUnavailableError, RuntimeError),
    ("backend_error", shoal.BackendError, RuntimeError),
    ("os_error", shoal.SystemCallError, OSError),
    ("stream_error", shoal.StreamError, RuntimeError),
    ("ordering_violation", shoal.OrderingViolationError, RuntimeError),
    ("invariant_violation", shoal.InvariantViolationError, RuntimeError),
    ("connection_closed", shoal.ConnectionClosedError, ConnectionError),
    ("peer_refused", shoal.PeerRefusedError, ConnectionRefusedError),
    ("timeout_error", shoal.PeerTimeoutError, TimeoutError),
    ("content_mismatch", shoal.ContentMismatchError, shoal.ShoalError),
]


@pytest.mark.parametrize("kind, python_type, builtin", MAPPING)
def test_each_cpp_error_maps_to_its_class_with_the_same_message(kind, python_type, builtin):
    with pytest.raises(python_type) as raised:
        shoal._shoal._throw_cpp_error(kind, f"what {kind} says")
    assert type(raised.value) is python_type
    assert isinstance(raised.value, shoal.ShoalError)
    assert isinstance(raised.value, builtin)
    assert str(raised.value).endswith(f"what {kind} says")  # backend_error's prefixes the call


def test_errors_carry_their_fields():
    with pytest.raises(shoal.BackendError) as backend:
        shoal._shoal._throw_cpp_error("backend_error", "boom")
    assert (backend.value.call, backend.value.detail) == ("a_call", "boom")
    with pytest.raises(shoal.SystemCallError) as system:
        shoal._shoal._throw_cpp_error("os_error", "taken")
    assert (system.value.call, system.value.detail) == ("a_call", "taken")
    assert system.value.errno == errno.EADDRINUSE
    assert system.value.strerror == "a_call failed: taken"
    assert str(system.value) == f"[Errno {errno.EADDRINUSE}] a_call failed: taken"
    assert isinstance(system.value, shoal.BackendError)
    for copied in (pickle.loads(pickle.dumps(system.value)), copy.copy(system.value), copy.deepcopy(system.value)):
        assert type(copied) is shoal.SystemCallError
        assert (copied.errno, copied.strerror, str(copied)) == (errno.EADDRINUSE, system.value.strerror, str(system.value))
    assert shoal.SystemCallError(errno.ENOENT, "made in Python").errno == errno.ENOENT
    with pytest.raises(shoal.InvariantViolationError) as invariant:
        shoal._shoal._throw_cpp_error("invariant_violation", "broken")
    assert invariant.value.invariant == "an_invariant"
    with pytest.raises(shoal.OutOfMemoryError) as refused:
        shoal._shoal._throw_cpp_error("memory_refused", "no room")
    assert (refused.value.requested_bytes, refused.value.reason) == (4096, "wait_expired")
    with pytest.raises(shoal.OutOfMemoryError) as own:
        shoal._shoal._throw_cpp_error("out_of_memory", "no room")
    assert own.value.reason is None
    assert shoal.OutOfMemoryError("made in Python").reason is None


@pytest.mark.parametrize("said, read", [
    ("caching_allocator::allocate: too much", "Allocator.allocate: too much"),
    ("connection::connect: no one listens at @x", "shoal.connect: no one listens at @x"),
    ("connection::receive from pid 7: recvmsg: closed", "receiving from pid 7: recvmsg: closed"),
    ("lender::revoke: region 9 is not lent", "shoal.lending.Lender.revoke: region 9 is not lent"),
    ("borrower::metrics: the lender did not answer in time",
     "shoal.lending.Borrower.metrics: the lender did not answer in time"),
    ("borrower::revocations: timed out", "shoal.lending.Borrower.revocations: timed out"),
    ("peer::send_note: too long", "Peer.send_note: too long"),
    ("cuda_device::adopt_external_stream: not a stream", "Stream.from_handle: not a stream"),
    ("lender's own words", "lender's own words"),
    ("listeners: not a name", "listeners: not a name"),
    ("borrower::close: x", "borrower::close: x"),  # a method the table does not name: not half-rewritten
    # Qualified names in the middle of a message, as words only.
    ("peer pid 7 (uid 0): connection::receive from pid 7: recvmsg: closed",
     "peer pid 7 (uid 0): receiving from pid 7: recvmsg: closed"),
    ("peer::send: 70000 bytes over the limit of 65536 (sharing_options::max_metadata_bytes)",
     "Peer.send: 70000 bytes over the limit of 65536 (SharingContext's max_metadata_bytes)"),
    ('channel_address::in_runtime_dir: ".." is not a file name', 'runtime_dir_address: ".." is not a file name'),
    ("a peer said xconnection::receive and connection::receive_more", "a peer said xconnection::receive and "
     "connection::receive_more"),
])
def test_messages_name_the_python_api_not_the_cpp_operation(said, read):
    with pytest.raises(shoal.InvalidArgumentError) as raised:
        shoal._shoal._throw_cpp_error("invalid_argument", said)
    assert str(raised.value) == read


def test_a_message_that_is_no_utf8_still_raises_its_error_with_escapes():
    # A message may quote what a peer sent: the error comes, its odd bytes as \xNN.
    with pytest.raises(shoal.ProtocolError) as raised:
        shoal._shoal._throw_cpp_error("protocol_error", b"the peer said \xff\xfe")
    assert str(raised.value) == "the peer said \\xff\\xfe"
    with pytest.raises(shoal.BackendError) as backend:
        shoal._shoal._throw_cpp_error("backend_error", b"lender: \xc3")
    assert backend.value.detail == "lender: \\xc3"


def test_a_peer_greeting_with_a_name_that_is_no_text_is_a_protocol_error(tmp_path):
    import socket
    import struct

    import shoal.sharing

    address = str(tmp_path / "other.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(address)
        server.listen(1)
        allocator = shoal.Allocator(use_environment=False)
        producer = shoal.sharing.Producer(address, allocator=allocator, ring_bytes=0)
        try:
            producer.put({"x": allocator.allocate(64).view()})
            accepted, _ = server.accept()
            name = b"shoal.\xff\x00bad"
            payload = struct.pack("<I", len(name)) + name + struct.pack("<H", 1)
            frame = struct.pack("<HHI", 0xFFFF, 0, len(payload)) + payload
            batch = b"SHOL" + struct.pack("<HH", 2, 1) + struct.pack("<I", max(len(frame), 256 - 12)) + frame
            accepted.sendall(batch + bytes(max(0, 256 - len(batch))))
            accepted.close()
            with pytest.raises(shoal.ProtocolError, match=re.escape(r"'shoal.\xff\x00bad' version 1")):
                producer.close(timeout=5)
        finally:
            producer.close(timeout=0)


def test_a_storage_handed_to_a_region_says_so_in_python_words():
    with pytest.raises(shoal.InvalidArgumentError, match="given to shoal.lending.Borrower.publish belongs to the region"
                       r" now; read it through the SharedRegion publish returned: its entry\(\) views\)$"):
        shoal._shoal._throw_cpp_error("invalid_argument", "storage: this handle is empty (default-constructed)")


def test_a_failed_connect_names_shoal_connect():
    with pytest.raises(shoal.ConnectionClosedError, match=r"^shoal\.connect: "):
        shoal.connect("@shoal-no-one-listens-here-%d" % os.getpid())


def test_an_address_in_use_is_an_os_error_with_its_errno(tmp_path):
    for address in (str(tmp_path / "in-use.sock"), f"@shoal-in-use-{os.getpid()}"):
        with shoal.Listener(address):
            with pytest.raises(OSError, match="already in use") as raised:
                shoal.Listener(address)
        assert isinstance(raised.value, shoal.SystemCallError)
        assert raised.value.errno == errno.EADDRINUSE
        assert str(raised.value).startswith(f"[Errno {errno.EADDRINUSE}] Listener failed: ")


def test_a_socket_path_whose_parent_does_not_exist_is_an_os_error_with_enoent(tmp_path):
    with pytest.raises(OSError, match="parent does not exist") as raised:
        shoal.Listener(str(tmp_path / "missing" / "deeper" / "x.sock"))
    assert isinstance(raised.value, shoal.SystemCallError)
    assert raised.value.errno == errno.ENOENT


def test_numbers_out_of_range_are_refused_by_the_argument_they_were_given_as():
    import numpy
    import shoal.lending

    address = f"@shoal-numbers-{os.getpid()}"
    allocator = shoal.Allocator(use_environment=False)
    listener = shoal.Listener(address)
    client = shoal.connect(address)
    peer = shoal.Peer(shoal.SharingContext(allocator), listener.accept())
    lending_address = f"@shoal-numbers-lender-{os.getpid()}"
    with shoal.lending.Lender(lending_address) as lender, shoal.lending.Borrower(lending_address) as borrower:
        for call, message in (
            (lambda: shoal.Listener(address + "-2", allowed_uids=[-1]), "Listener: allowed_uids must be >= 0, got -1"),
            (lambda: shoal.Listener(address + "-2", allowed_uids=[2**32 - 1]),
             "Listener: allowed_uids must be at most 4294967294, got 4294967295"),
            (lambda: shoal.connect(address, allowed_uids=[2**70]), "connect: allowed_uids must be at most"),
            (lambda: allocator.allocate(2**70), "Allocator.allocate: nbytes must be at most 9223372036854775807"),
            (lambda: allocator.allocate(-5), "Allocator.allocate: nbytes must be positive, got -5"),
            (lambda: shoal.Stream.from_handle(-1), "Stream.from_handle: handle must be >= 0, got -1"),
            (lambda: peer.wait_taken(0.1, at_most=-1), "Peer.wait_taken: at_most must be >= 0, got -1"),
            (lambda: lender.revoke(-1, 1.0), "shoal.lending.Lender.revoke: region must be >= 0, got -1"),
            (lambda: borrower.revoke(-1, 1.0), "shoal.lending.Borrower.revoke: region must be >= 0, got -1"),
        ):
            with pytest.raises(shoal.InvalidArgumentError, match="^" + re.escape(message)):
                call()
    # A value past 64 bits, or of an int subclass, is named without Python printing it.
    class Loud(int):
        def __str__(self) -> str:
            raise RuntimeError("__str__ ran")

        __repr__ = __str__

    for call, message in (
        (lambda: allocator.allocate(10**5000), "nbytes must be at most 9223372036854775807, got a number of more than"),
        (lambda: allocator.allocate(-(10**5000)), "nbytes must be positive, got a negative number of more than 64 bits"),
        (lambda: allocator.allocate(Loud(-5)), "nbytes must be positive, got -5"),
        (lambda: shoal.Stream.from_handle(2**64), "handle must be at most 18446744073709551615, got a number of"),
        (lambda: shoal.lending.Lender(lending_address, allowed_uids=[2**32 - 1]),
         "shoal.lending.Lender: allowed_uids must be a whole number from 0 to 4294967294, not 4294967295"),
        (lambda: shoal.lending.Borrower(lending_address, allowed_uids=[10**5000]), "not a number of 16610 bits"),
    ):
        with pytest.raises(shoal.InvalidArgumentError, match=re.escape(message)):
            call()
    # A handle anywhere in 64 bits is looked at: on the host backend, which has no streams to
    # find (CUDA would read a stream at that address: no handle of a live stream, no call).
    if shoal.default_device().kind != "cuda":
        with pytest.raises(shoal.InvalidArgumentError, match="is not a stream"):
            shoal.Stream.from_handle(2**63)
    # numpy's integers are whole numbers too, as any object with __index__.
    assert allocator.allocate(numpy.int64(64)).nbytes == 64
    with shoal.lending.Lender(lending_address + "-numpy", allowed_uids=[numpy.int64(os.getuid())]) as lender:
        with shoal.lending.Borrower(lending_address + "-numpy", allowed_uids=[numpy.uint32(os.getuid())]) as borrower:
            assert borrower.borrow(numpy.int64(4096), "numpy").nbytes >= 4096  # regions are whole chunks
    with pytest.raises(shoal.InvalidArgumentError, match="at_most must be >= 0, got -2"):
        peer.wait_taken(0.1, at_most=numpy.int32(-2))
    with pytest.raises(TypeError):
        allocator.allocate(64.0)  # not a whole number: nanobind's own TypeError
    peer.close()
    client.close()
    listener.close()


def test_a_storages_offsets_shapes_and_bytes_past_64_bits_are_refused_by_name():
    import numpy
    import shoal.loading

    storage = shoal.allocate(4096)
    load = shoal.loading.load_groups([[(storage, numpy.zeros(4096, "uint8"))]])
    load.synchronize()
    for call, message in (
        (lambda: storage.read(2**64 - 1), "Storage.read: offset must lie from -2^63 to 2^63 - 1, got 18446744073709551615"),
        (lambda: storage.read(0, 2**63), "Storage.read: nbytes must lie from -2^63 to 2^63 - 1, got 9223372036854775808"),
        (lambda: storage.read(-(2**70)), "Storage.read: offset must lie from -2^63 to 2^63 - 1, got a negative number of"),
        (lambda: storage.write(b"x", 2**63), "Storage.write: offset must lie from -2^63 to 2^63 - 1"),
        (lambda: storage.fill(256), "Storage.fill: value (a byte) must be at most 255, got 256"),
        (lambda: storage.fill(2**31), "Storage.fill: value (a byte) must be at most 255, got 2147483648"),
        (lambda: storage.fill(-1), "Storage.fill: value (a byte) must be >= 0, got -1"),
        (lambda: storage.view("uint8", (2**63,)), "Storage.view: shape must lie from -2^63 to 2^63 - 1"),
        (lambda: storage.view("uint8", (4,), (2**64,)), "Storage.view: strides must lie from -2^63 to 2^63 - 1"),
        (lambda: storage.view("uint8", offset=2**64), "Storage.view: offset must lie from -2^63 to 2^63 - 1"),
        (lambda: shoal.cuda_device(2**31), "cuda_device: ordinal must be at most 2147483647, got 2147483648"),
        (lambda: shoal.cuda_device(-1), "cuda_device: ordinal must be >= 0, got -1"),
        (lambda: load.wait(2**63), "shoal.loading.GroupedLoad.wait: group must be at most 9223372036854775807"),
        (lambda: load.is_ready(-1), "shoal.loading.GroupedLoad.is_ready: group must be >= 0, got -1"),
        (lambda: load.synchronize_group(2**64), "shoal.loading.GroupedLoad.synchronize_group: group must be at most"),
    ):
        with pytest.raises(shoal.InvalidArgumentError, match="^" + re.escape(message)):
            call()
    # Within 64 bits, the storage's own range checks answer as before; numpy integers pass.
    with pytest.raises(shoal.InvalidArgumentError, match="do not fit the storage's 4096 bytes"):
        storage.read(2**62)
    with pytest.raises(shoal.InvalidArgumentError, match="negative extent -1"):
        storage.view("uint8", (-1,))
    storage.fill(numpy.uint8(7))
    assert storage.read(numpy.int64(4095)) == b"\x07"
    assert storage.view("uint8", (numpy.int64(2),), (numpy.int32(-1),), offset=numpy.int64(1)).shape == (2,)
    assert load.is_ready(numpy.int64(0))


def test_an_error_made_in_python_has_every_attribute_the_stubs_promise():
    # A test double raised in place of shoal's own error meets the same handler.
    assert shoal.OutOfMemoryError("x").requested_bytes == 0
    assert shoal.OutOfMemoryError("x").reason is None
    assert shoal.BackendError("x").call == "" and shoal.BackendError("x").detail == ""
    made = shoal.SystemCallError(2, "x")
    assert (made.errno, made.call, made.detail) == (2, "", "")
    assert shoal.InvariantViolationError("x").invariant == ""
    assert shoal.ConnectionClosedError("x").no_listener is False

    import numpy
    from shoal import loading

    load = loading.load_groups([[(shoal.allocate(64), numpy.zeros(64, "uint8"))]])
    with pytest.raises(shoal.InvalidArgumentError, match="^shoal\\.loading\\.GroupedLoad: group 2 does not exist"):
        load.wait(2)


def test_a_real_invalid_argument_is_a_value_error():
    with pytest.raises(ValueError, match="unknown_key"):
        shoal.Allocator(use_environment=False, unknown_key=1)


def test_a_real_out_of_memory_is_a_memory_error_with_the_size_asked():
    allocator = shoal.Allocator(use_environment=False, memory_limit_mb=2)
    with pytest.raises(MemoryError) as raised:
        allocator.allocate(4 << 20)
    assert isinstance(raised.value, shoal.OutOfMemoryError)
    assert raised.value.requested_bytes == 4 << 20
    assert raised.value.reason is None


def test_a_missing_cuda_device_is_device_unavailable():
    if shoal.cuda_device_count() > 0:
        pytest.skip("a CUDA device exists here")
    with pytest.raises(shoal.DeviceUnavailableError):
        shoal.cuda_device(0)


def test_a_storage_used_on_a_busy_stream_is_no_ordering_violation_even_with_safety_off():
    # Safety off, debug on: debug mode reports a block handed out while a
    # stream that freed it is still busy. A storage is released after every
    # stream it was used on, wherever it is dropped, so storages never get
    # there: the block stays held and the request gets another one.
    allocator = shoal.Allocator(use_environment=False, debug=True, cross_stream_safety=False)
    side, model = shoal.Stream(), shoal.Stream()
    batch = allocator.allocate(4096, side)
    ptr = batch.ptr
    model.delay(1.0)
    batch.record_stream(model)  # the model still reads the batch
    with shoal.stream(model):
        del batch
    again = allocator.allocate(4096, side)
    assert again.ptr != ptr
    del again
    model.synchronize()


def test_every_error_type_of_the_cpp_header_is_mapped():
    header = pathlib.Path(__file__).parents[2] / "include" / "shoal" / "core" / "error.h"
    if not header.exists():
        pytest.skip("run from the source tree")
    cpp_types = re.findall(r"^class (\w+) : public", header.read_text(), re.MULTILINE)
    assert "out_of_memory" in cpp_types
    mapped = {kind for kind, _, _ in MAPPING}
    assert set(cpp_types) == mapped


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"conf": 1}, r"shoal.torch.enable\(\): conf must be a str \('key:value,...'\) or None, not int"),
        ({"conf": b"expandable_segments:false"}, r"conf must be a str .* not bytes"),
        ({"use_environment": "no"}, r"shoal.torch.enable\(\): use_environment must be a bool, not str"),
        ({"use_environment": 0}, r"use_environment must be a bool, not int"),
    ],
)
def test_enable_names_an_argument_of_the_wrong_type_before_touching_pytorch(arguments, message):
    import shoal.torch

    with pytest.raises(TypeError, match=message) as raised:
        shoal.torch.enable(**arguments)
    assert "_torch_configure" not in str(raised.value)
    assert not shoal.torch.is_enabled()


@pytest.mark.parametrize("call", ["allocator", "memory_stats", "memory_allocated", "reset_peak_memory_stats",
                                  "memory_snapshot", "empty_cache"])
def test_shoal_torch_before_enable_is_a_shoal_error_that_says_to_enable_first(call, monkeypatch):
    # Where PyTorch is missing the calls say so first (test_shoal_torch_without_pytorch_...);
    # a stand-in module lets this run without it too.
    import sys
    import types

    import shoal.torch

    if shoal.torch.is_enabled():
        pytest.skip("shoal.torch is enabled in this process")
    if "torch" not in sys.modules:
        monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    with pytest.raises(shoal.InvalidArgumentError, match=r"call shoal\.torch\.enable\(\) first"):
        getattr(shoal.torch, call)()


def test_the_packages_own_argument_checks_raise_shoal_errors_that_are_value_errors():
    # README: errors arrive as shoal.ShoalError subclasses; a bad value is also a ValueError.
    import shoal.sharing
    import shoal.transfer

    view = shoal.allocate(64).view("uint8", (64,))
    deep: list = [view]
    for _ in range(shoal.sharing.MAX_NESTING + 1):
        deep = [deep]
    def submit_nothing() -> None:
        with shoal.transfer.Engine() as engine:
            engine.submit([])

    for bad in (
        lambda: shoal.sharing.Consumer(max_producers=0),
        lambda: shoal.sharing.Consumer(batch_timeout=-1),
        lambda: view.__dlpack__(stream=0),
        lambda: view.__dlpack__(stream=-5),
        submit_nothing,
    ):
        with pytest.raises(shoal.InvalidArgumentError) as raised:
            bad()
        assert isinstance(raised.value, ValueError)
        assert isinstance(raised.value, shoal.ShoalError)
    with shoal.sharing.Consumer() as consumer, shoal.sharing.Producer(consumer.address) as producer:
        with pytest.raises(shoal.InvalidArgumentError, match="nests deeper"):
            producer.put(deep)


def test_shoal_torch_without_pytorch_says_it_needs_pytorch(monkeypatch):
    # None in sys.modules makes `import torch` fail as a missing PyTorch does, here whether
    # or not this Python has it.
    import sys

    import shoal.loading
    import shoal.torch
    monkeypatch.setitem(sys.modules, "torch", None)
    for where, call in [("shoal.torch.enable()", lambda: shoal.torch.enable()),
                        ("shoal.torch.share()", lambda: shoal.torch.share(object())),
                        ("shoal.torch.allocator()", lambda: shoal.torch.memory_stats()),
                        ("shoal.torch.RegionPool", lambda: shoal.torch.RegionPool(shoal.allocate(64))),
                        ("shoal.loading", lambda: shoal.loading.ModuleLoader(object()))]:
        with pytest.raises(ModuleNotFoundError, match=re.escape(where) + " needs PyTorch") as caught:
            call()
        assert caught.value.name == "torch"
    assert not shoal.torch.is_enabled()


@pytest.mark.parametrize(
    "made_elsewhere, says",
    [
        (shoal.Storage, "shoal.allocate(nbytes)"),
        (shoal.ArrayView, "Storage.view(dtype, shape)"),
        (shoal.Connection, "shoal.connect(address) or Listener.accept()"),
        (shoal.Device, "shoal.default_device()"),
        (shoal._shoal.GroupedLoad, "shoal.loading.load_groups()"),
        (shoal.transfer.TransferredBatch, "shoal.transfer.Engine.next()"),
    ],
)
def test_a_class_whose_objects_other_calls_make_names_those_calls_when_called(made_elsewhere, says):
    # nanobind's own refusal says only "no constructor defined"
    with pytest.raises(TypeError, match="is not made by calling the class") as raised:
        made_elsewhere()
    assert says in str(raised.value)
    with pytest.raises(TypeError, match="is not made by calling the class"):
        made_elsewhere(1, keyword=2)
