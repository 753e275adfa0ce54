"""Typed views of storages and their zero-copy DLPack export, consumed by numpy (host backend)."""

import ctypes
import gc
import sys
import warnings
import weakref

import numpy
import pytest

import shoal
from conftest import ticks_during

pytestmark = pytest.mark.skipif(shoal.default_device().kind != "host", reason="numpy consumes host memory only")


def test_numpy_sees_shoal_memory_without_a_copy_both_ways(allocator):
    s = allocator.allocate(4 * 12)
    s.write(numpy.arange(12, dtype=numpy.float32).tobytes())
    a = numpy.from_dlpack(s.view("float32", (3, 4)))
    assert a.shape == (3, 4) and a.dtype == numpy.float32
    assert a.ctypes.data == s.ptr
    assert a[2, 3] == 11
    a[0, 0] = 42.0  # numpy writes, shoal reads
    assert numpy.frombuffer(s.read(0, 4), numpy.float32)[0] == 42.0
    s.write(numpy.float32(-1).tobytes(), offset=4)  # shoal writes, numpy reads
    assert a[0, 1] == -1.0
    del a, s


def test_shape_strides_and_offset_reach_numpy(allocator):
    s = allocator.allocate(8 * 20)
    s.write(numpy.arange(20, dtype=numpy.int64).tobytes())
    v = s.view(numpy.int64, shape=(3, 2), strides=(4, 2), offset=8)
    assert (v.shape, v.strides, v.offset, v.dtype, v.itemsize) == ((3, 2), (4, 2), 8, "int64", 8)
    a = numpy.from_dlpack(v)
    assert a.tolist() == [[1, 3], [5, 7], [9, 11]]
    assert a.strides == (32, 16)
    reversed_view = numpy.from_dlpack(s.view("int64", shape=(5,), strides=(-1,), offset=8 * 4))
    assert reversed_view.tolist() == [4, 3, 2, 1, 0]
    del a, reversed_view, v, s


def test_the_default_view_is_bytes_to_the_end(allocator):
    s = allocator.allocate(10)
    s.fill(7)
    a = numpy.from_dlpack(s.view(offset=3))
    assert a.dtype == numpy.uint8 and a.shape == (7,) and (a == 7).all()
    del a, s


def test_versioned_capsules_when_the_consumer_asks():
    s = shoal.allocate(64)
    v = s.view("float64")
    assert "dltensor_versioned" in repr(v.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(v.__dlpack__())
    assert '"dltensor"' in repr(v.__dlpack__(max_version=(0, 8)))
    assert v.__dlpack_device__() == (1, 0)


def test_every_dtype_the_package_lists_makes_a_view(allocator):
    s = allocator.allocate(16)
    assert "float32" in shoal.view_dtypes()
    for name in shoal.view_dtypes():
        assert s.view(name, (1,)).dtype == name
    del s


@pytest.mark.parametrize("dtype", ["float8", "object", 3.5])
def test_an_unknown_dtype_is_refused(allocator, dtype):
    s = allocator.allocate(16)
    with pytest.raises(TypeError, match="dtype"):
        s.view(dtype)
    del s


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shape": (5,), "dtype": "float32"}, "reaches outside"),
        ({"shape": (2,), "dtype": "float32", "offset": 12}, "reaches outside"),
        ({"shape": (2,), "dtype": "float32", "offset": 2}, "not a multiple"),
        ({"shape": (-1,)}, "negative extent"),
        ({"shape": (2, 2), "strides": (1,)}, "strides for 2 dimensions"),
        ({"shape": (2,), "strides": (-1,)}, "reaches outside"),
        ({"offset": 17}, "outside"),
        # Byte counts past 64 bits, which once wrapped into a view accepted.
        ({"dtype": "float64", "shape": (2**62,), "strides": (2**63 - 1,)}, r"2\*\*63 - 1"),
        ({"shape": (2, 2), "strides": (2**62, 2**62)}, r"2\*\*63 - 1"),
        ({"dtype": "float64", "shape": (2**62,), "strides": (0,)}, r"2\*\*63 - 1"),
        ({"shape": (0, 2**62, 2**62)}, r"C-order strides .* 2\*\*63 - 1"),
    ],
)
def test_a_view_outside_the_storage_is_refused(allocator, kwargs, message):
    s = allocator.allocate(16)
    with pytest.raises(ValueError, match=message):
        s.view(**kwargs)
    del s


@pytest.mark.parametrize("kwargs, named", [
    ({"stream": 2**70}, "stream must be an int of 64 bits"),
    ({"max_version": "x"}, "max_version must be"),
    ({"max_version": (1,)}, "max_version must be"),
    ({"dl_device": "cpu"}, "dl_device must be"),
    ({"copy": "no"}, "copy must be"),
])
def test_arguments_of_the_wrong_type_are_a_type_error_naming_them(kwargs, named):
    v = shoal.allocate(16).view()
    with pytest.raises(TypeError, match=named):
        v.__dlpack__(**kwargs)


def test_stream_zero_and_bad_stream_values_are_refused():
    s = shoal.allocate(16)
    v = s.view()
    with pytest.raises(ValueError, match="stream=0"):
        v.__dlpack__(stream=0)
    with pytest.raises(ValueError):
        v.__dlpack__(stream=-5)
    with pytest.raises(TypeError):
        v.__dlpack__(stream="default")
    with pytest.raises(ValueError, match="not a (live )?stream"):
        v.__dlpack__(stream=0x1234560)  # no stream of this device
    assert not s.shared_outside_process  # refused before anything was exported
    with pytest.raises(BufferError):
        v.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        v.__dlpack__(dl_device=(2, 0))


def delayed_write(s, value, stream, seconds=0.3):
    """Enqueues a write of `value` on `stream` that runs only after `seconds`."""
    stream.delay(seconds)
    s.fill(value, stream=stream)
    s.record_stream(stream)  # its free waits for the write, whatever the test finds


def test_stream_none_makes_the_host_wait_for_the_producer(allocator):
    s = allocator.allocate(64)
    s.fill(0)
    producer = shoal.Stream()
    delayed_write(s, 9, producer)
    with shoal.stream(producer):
        a = numpy.from_dlpack(s.view())
    assert (a == 9).all()
    del a, s


def test_a_consumer_stream_waits_for_the_producer_stream(allocator):
    s = allocator.allocate(64)
    s.fill(0)
    producer, consumer = shoal.Stream(), shoal.Stream()
    delayed_write(s, 5, producer)
    with shoal.stream(producer):
        capsule = s.view().__dlpack__(stream=consumer.handle)
    # Work on the consumer stream runs after the producer's write.
    assert s.read(stream=consumer) == b"\x05" * 64
    del capsule, s


@pytest.mark.parametrize("legacy_value", [1, 2])
def test_stream_one_and_two_name_the_default_stream(allocator, legacy_value):
    s = allocator.allocate(64)
    s.fill(0)
    producer = shoal.Stream()
    delayed_write(s, 3, producer)
    with shoal.stream(producer):
        capsule = s.view().__dlpack__(stream=legacy_value)
    assert s.read(stream=shoal.Stream.default()) == b"\x03" * 64
    del capsule, s


def test_stream_minus_one_does_not_synchronize(allocator):
    s = allocator.allocate(64)
    s.fill(0)
    producer = shoal.Stream()
    delayed_write(s, 4, producer, seconds=1.0)
    with shoal.stream(producer):
        capsule = s.view().__dlpack__(stream=-1)
    assert not producer.query()
    producer.synchronize()
    del capsule, s


def test_the_consumer_stream_holds_the_free(allocator):
    consumer = shoal.Stream()
    s = allocator.allocate(4096)
    ptr = s.ptr
    capsule = s.view().__dlpack__(stream=consumer.handle)
    consumer.delay(0.5)  # the consumer still uses the memory
    del capsule, s
    gc.collect()
    states = [b["state"] for seg in allocator.snapshot()["segments"] for b in seg["blocks"] if b["address"] == ptr]
    assert states == ["pending_free"]
    consumer.synchronize()


def test_an_exported_storage_is_never_lazily_shared_again(allocator):
    s = allocator.allocate(16)
    s.fill(1)
    a = numpy.from_dlpack(s.view())
    assert s.shared_outside_process
    clone = s.lazy_clone()
    assert not clone.is_lazy  # an eager copy: numpy may write `s` at any time
    shoal.synchronize()  # the copy runs in stream order; the host writes after it
    a[:] = 2
    assert clone.read() == b"\x01" * 16
    del a, s, clone


def test_a_writable_export_of_a_lazy_clone_materializes_it(allocator):
    source = allocator.allocate(16)
    source.fill(1)
    clone = source.lazy_clone()
    a = numpy.from_dlpack(clone.view())
    assert not clone.is_lazy
    a[:] = 8
    assert source.read() == b"\x01" * 16
    assert clone.read() == b"\x08" * 16
    del a, source, clone


def test_a_readonly_export_of_a_lazy_clone_does_not_materialize_it(allocator):
    source = allocator.allocate(16)
    source.fill(1)
    clone = source.lazy_clone()
    a = numpy.from_dlpack(clone.view(readonly=True))
    assert clone.is_lazy
    assert not a.flags.writeable
    assert (a == 1).all()
    source.fill(6)  # the source materializes; the clone's data stays
    source_now = source.read()
    assert source_now == b"\x06" * 16
    assert (a == 1).all()
    with pytest.raises(BufferError, match="read-only"):
        clone.view(readonly=True).__dlpack__()  # a legacy capsule cannot say read-only
    del a, source, clone


def test_a_capsule_never_consumed_gives_its_storage_back(allocator):
    s = allocator.allocate(128)
    capsules = [s.view().__dlpack__(), s.view().__dlpack__(max_version=(1, 0))]
    del s
    gc.collect()
    assert allocator.stats()["allocations"]["all"]["current"] == 1
    del capsules
    gc.collect()
    assert allocator.stats()["allocations"]["all"]["current"] == 0


def test_from_dlpack_sees_numpy_memory_without_a_copy_both_ways(allocator):
    a = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)
    view = shoal.from_dlpack(a, allocator)
    assert (view.shape, view.strides, view.dtype, view.offset) == ((3, 4), (4, 1), "float32", 0)
    assert view.storage.ptr == a.ctypes.data
    assert not view.storage.is_lazy and view.storage.shared_outside_process
    view.storage.write(numpy.float32(-2).tobytes(), offset=4)  # shoal writes, numpy reads
    assert a[0, 1] == -2
    a[2, 3] = 99  # numpy writes, shoal reads
    assert numpy.frombuffer(view.storage.read(44, 4), numpy.float32)[0] == 99
    back = numpy.from_dlpack(view)  # and out again: the same memory
    assert back.ctypes.data == a.ctypes.data
    del view, back


def test_from_dlpack_keeps_strides_offsets_and_negative_steps(allocator):
    base = numpy.arange(20, dtype=numpy.int64)
    picked = base[17:2:-3]  # [17, 14, 11, 8, 5]
    view = shoal.from_dlpack(picked, allocator)
    assert view.strides == (-3,)
    assert numpy.from_dlpack(view).tolist() == [17, 14, 11, 8, 5]
    assert view.storage.nbytes == (17 - 5 + 1) * 8
    del view


def test_from_dlpack_releases_the_array_after_the_last_use(allocator):
    a = numpy.ones(1000, dtype=numpy.uint8)
    alive = weakref.ref(a)
    view = shoal.from_dlpack(a, allocator)
    del a
    gc.collect()
    assert alive() is not None  # shoal still uses it
    del view
    gc.collect()
    assert alive() is None


def test_a_read_only_array_is_imported_read_only(allocator):
    a = numpy.arange(4, dtype=numpy.int32)
    a.flags.writeable = False
    view = shoal.from_dlpack(a, allocator)
    assert view.readonly
    assert not numpy.from_dlpack(view).flags.writeable
    del view


def test_the_storage_of_a_read_only_import_refuses_every_write(allocator):
    a = numpy.arange(16, dtype=numpy.uint8)
    a.flags.writeable = False
    storage = shoal.from_dlpack(a, allocator).storage
    writes = {
        "write": lambda: storage.write(b"x"),
        "fill": lambda: storage.fill(1),
        "mutable_ptr": lambda: storage.mutable_ptr(),
        "view(readonly=False)": lambda: storage.view(readonly=False),
    }
    for name, write in writes.items():
        with pytest.raises(shoal.InvalidArgumentError, match="read-only"):
            write()
    assert storage.view().readonly, "a view of read-only memory is read-only unless asked otherwise"
    assert "read-only" in repr(storage)
    copy = storage.lazy_clone()  # memory of its own: writable
    copy.fill(7)
    assert copy.read(nbytes=2) == b"\x07\x07" and (a == numpy.arange(16)).all()


def test_a_dtype_of_the_other_byte_order_is_refused(allocator):
    s = allocator.allocate(64)
    swapped = numpy.dtype(">f4") if sys.byteorder == "little" else numpy.dtype("<f4")
    with pytest.raises(TypeError, match="byte order"):
        s.view(swapped)
    assert s.view(swapped.newbyteorder("=")).dtype == "float32"


def numpy_dtype_spellings():
    """What numpy takes for a dtype, and near misses: its names, its type codes, kind and size
    codes ('f4'), each also after a byte order ('<', '>', '=', '|')."""
    names = {key for key in numpy.sctypeDict if isinstance(key, str)} | set(numpy.typecodes["All"])
    names |= {kind + str(size) for kind in "biufcV" for size in (1, 2, 3, 4, 8, 16)}
    return sorted(order + name for name in names for order in ("", "<", ">", "=", "|"))


def test_a_view_reads_every_numpy_spelling_of_a_dtype_as_numpy_does(allocator):
    s = allocator.allocate(64)
    supported = set(shoal.view_dtypes())
    taken = 0
    for spelling in numpy_dtype_spellings():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                meant = numpy.dtype(spelling)
        except (TypeError, ValueError):
            meant = None
        if meant is not None and meant.name in supported and meant.isnative:
            assert s.view(spelling, (1,)).dtype == meant.name, spelling
            assert s.view(meant.type, (1,)).dtype == meant.name, meant.type  # numpy.longlong, numpy.intc, ...
            taken += 1
        elif meant is not None and meant.name in supported:
            with pytest.raises(TypeError, match="byte order"):
                s.view(spelling)
        else:
            with pytest.raises(TypeError, match=r"is not supported; views take .*shoal\.view_dtypes\(\)"):
                s.view(spelling)
    assert taken > 100, "the spellings tried are numpy's"


class CapsuleOnce:
    """Hands out one capsule, the same one each time asked."""

    def __init__(self, array):
        self.capsule = array.__dlpack__()

    def __dlpack__(self, stream=None):
        return self.capsule


def test_a_capsule_consumed_twice_is_refused(allocator):
    source = CapsuleOnce(numpy.zeros(8))
    first = shoal.from_dlpack(source, allocator)
    with pytest.raises(BufferError, match="consumed already"):
        shoal.from_dlpack(source, allocator)
    with pytest.raises(BufferError, match="consumed already"):
        shoal.from_dlpack(source.capsule, allocator)
    del first


class HostileCapsule:
    """A legacy DLPack capsule over 64 bytes of host memory, with whatever
    shape and strides (None: C order) a producer may claim."""

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                    ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                    ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
                    ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    def __init__(self, shape, strides, bits):
        self.memory = numpy.zeros(64, dtype=numpy.uint8)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        kDLCPU, kDLUInt = 1, 1
        self.tensor = self.Tensor(self.memory.ctypes.data, kDLCPU, 0, len(shape), kDLUInt, bits, 1, self.shape,
                                  self.strides, 0, None, None)  # no deleter: the memory is this object's
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self.capsule = new(ctypes.addressof(self.tensor), b"dltensor", None)

    def __dlpack__(self, stream=None):
        return self.capsule


@pytest.mark.parametrize("shape, strides, bits", [
    ((2**62,), (2**63 - 1,), 64),  # its bytes wrapped to a small span once
    ((4,), (2**62,), 8),
    ((2**32, 2**32), None, 8),  # C order: a stride past 64 bits
])
def test_from_dlpack_refuses_a_tensor_whose_bytes_pass_64_bits(allocator, shape, strides, bits):
    hostile = HostileCapsule(shape, strides, bits)
    for _ in range(2):  # refused before it is consumed: the same answer again
        with pytest.raises(BufferError, match=r"spans more than 2\*\*63 - 1 bytes"):
            shoal.from_dlpack(hostile, allocator)


def test_from_dlpack_refuses_what_it_cannot_import(allocator):
    with pytest.raises(TypeError, match="no __dlpack__"):
        shoal.from_dlpack([1, 2, 3], allocator)
    with pytest.raises(BufferError, match=r"dtype complex128 \(DLPack code 5, 128 bits\) is not supported; shoal takes "
                                          r"bool, .*complex64$"):
        shoal.from_dlpack(numpy.zeros(4, dtype=numpy.complex128), allocator)
    with pytest.raises(BufferError, match="without elements"):
        shoal.from_dlpack(numpy.zeros((0, 3)), allocator)


def test_an_imported_array_goes_back_only_after_every_recorded_stream_passed(allocator):
    a = numpy.zeros(64, dtype=numpy.uint8)
    view = shoal.from_dlpack(a, allocator)
    user = shoal.Stream()
    user.delay(0.3)
    view.storage.fill(5, stream=user)
    view.storage.record_stream(user)
    del view
    gc.collect()
    assert user.query()  # the release waited for `user`
    assert (a == 5).all()


def test_an_imported_array_can_be_exported_again_to_a_consumer_stream():
    a = numpy.arange(16, dtype=numpy.float32)
    v = shoal.from_dlpack(a)
    s = shoal.Stream()
    capsule = v.__dlpack__(stream=s.handle, max_version=(1, 0))  # the consumer's stream is recorded on the storage

    class Exported:
        def __dlpack__(self, **_):
            return capsule

        def __dlpack_device__(self):
            return v.__dlpack_device__()

    b = numpy.from_dlpack(Exported())
    b[3] = 42.0
    assert a[3] == 42.0, "the same memory all the way"
    del b, capsule, v
    gc.collect()


def test_numpy_asarray_reads_a_host_view_in_place(allocator):
    s = allocator.allocate(4 * 6)
    s.write(numpy.arange(6, dtype=numpy.float32).tobytes())
    view = s.view("float32", (2, 3))
    a = numpy.asarray(view)
    assert a.shape == (2, 3) and a.dtype == numpy.float32 and a.ctypes.data == s.ptr
    assert (numpy.asarray(view, dtype=numpy.float64) == numpy.arange(6).reshape(2, 3)).all()
    assert numpy.array(view, copy=True).ctypes.data != s.ptr
    if numpy.lib.NumpyVersion(numpy.__version__) >= "2.0.0":
        with pytest.raises(ValueError):
            numpy.array(view, dtype=numpy.float64, copy=False)


def test_dropping_an_import_used_on_a_busy_stream_lets_other_python_threads_run():
    # Imported memory goes back to its producer once the streams it was used on have passed
    # their work, waited for on the host as its last view goes: with the GIL let go.
    array = numpy.arange(1024, dtype=numpy.uint8)
    view = shoal.from_dlpack(array)
    busy = shoal.Stream(shoal.host_device())
    busy.delay(0.5)
    view.storage.record_stream(busy)
    views = [view]
    del view
    took, ticks = ticks_during(views.clear)  # the last view goes: the memory goes back to numpy
    assert took >= 0.2, "the release did not wait for the stream (the test's premise)"
    assert ticks >= 10, f"another Python thread ran {ticks} times in {took:.2f} s of the drop"
    assert array[1023] == 255  # numpy's array is whole and its own again


def test_a_views_repr_shows_strides_that_are_not_c_order_and_its_device():
    s = shoal.allocate(64)
    plain = repr(s.view("int32", (4,)))
    assert "strides" not in plain and f"device={s.device.name}" in plain, plain
    assert repr(s.view("int64", shape=(5,), strides=(-1,), offset=32)).startswith(
        "shoal.ArrayView(dtype=int64, shape=(5,), strides=(-1,), offset=32, device="), "a reversed view reads as one"
    assert "strides=(0, 1)" in repr(s.view("uint8", shape=(3, 4), strides=(0, 1)))


@pytest.mark.parametrize("make", [lambda s: s, lambda s: s.view("float32", (4,))], ids=["storage", "view"])
def test_pickling_memory_is_refused_with_the_way_that_works(make):
    # pickle's own refusal ("cannot pickle 'Storage' object") names no way on: a data
    # loader's first try is a multiprocessing queue.
    import copy
    import pickle

    thing = make(shoal.allocate(16))
    with pytest.raises(TypeError, match=r"cannot be pickled: its memory belongs to this process.*shoal\.sharing"):
        pickle.dumps(thing)
    with pytest.raises(TypeError, match="shoal.sharing"):
        copy.copy(thing)


@pytest.mark.skipif(shoal.default_device().kind != "host", reason="numpy reads host memory only")
def test_array_protocol_copy_must_be_none_or_a_bool():
    view = shoal.allocate(16).view("uint8")
    with pytest.raises(TypeError, match="copy must be None, True or False"):
        view.__array__(copy=1)
    assert view.__array__(copy=numpy.True_).shape == (16,), "numpy's own bool is a bool"
