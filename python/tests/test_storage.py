"""Storages: allocation, reads and writes in stream order, lazy clones, record_stream."""

import gc
import subprocess
import sys
import threading
import time
import unittest.mock

import pytest

import shoal


def test_allocate_gives_a_storage_of_the_size_asked(allocator):
    s = allocator.allocate(3000)
    assert s.nbytes == 3000 and len(s) == 3000
    assert s.ptr % 512 == 0
    assert s.device == allocator.device
    del s


def test_a_storage_keeps_its_allocator_alive():
    allocator = shoal.Allocator(use_environment=False)
    s = allocator.allocate(100)
    s.write(b"x" * 100)
    del allocator
    gc.collect()
    assert s.read() == b"x" * 100
    del s  # frees into the allocator, which goes with it


@pytest.mark.parametrize("nbytes", [0, -1, -(1 << 40)])
def test_a_size_that_is_not_positive_is_refused(allocator, nbytes):
    with pytest.raises(ValueError, match="nbytes must be positive"):
        allocator.allocate(nbytes)


def test_a_read_from_past_the_end_names_the_offset(allocator):
    s = allocator.allocate(64)
    with pytest.raises(shoal.InvalidArgumentError, match=r"Storage.read: 0 bytes at offset 65 do not fit"):
        s.read(offset=65)
    assert s.read(offset=64) == b""


def test_none_means_the_default_dtype_and_data_that_is_no_buffer_is_named(allocator):
    s = allocator.allocate(64)
    assert (s.view(None).dtype, s.view(dtype=None).shape) == ("uint8", (64,))
    with pytest.raises(TypeError, match="Storage.write: data must be a bytes-like object .*, not NoneType"):
        s.write(None)
    with pytest.raises(TypeError, match="Storage.write: data must be a bytes-like object .*, not int"):
        s.write(5)


def test_numpys_bool_is_taken_for_readonly(allocator):
    numpy = pytest.importorskip("numpy")
    s = allocator.allocate(64)
    assert s.view(readonly=numpy.bool_(True)).readonly
    assert not s.view(readonly=numpy.bool_(False)).readonly


def test_write_then_read_round_trips(allocator):
    s = allocator.allocate(64)
    s.write(b"shoal" * 4, offset=8)
    assert s.read(8, 20) == b"shoal" * 4
    s.fill(0xAB)
    assert s.read() == b"\xab" * 64
    del s


def test_reads_and_writes_outside_the_storage_are_refused(allocator):
    s = allocator.allocate(16)
    with pytest.raises(ValueError, match="do not fit"):
        s.write(b"x" * 17)
    with pytest.raises(ValueError, match="do not fit"):
        s.read(10, 7)
    with pytest.raises(ValueError, match=r"Storage.read: offset -1 is negative"):
        s.read(-1, 1)
    with pytest.raises(ValueError, match=r"Storage.read: offset -1 is negative"):
        s.read(-1)
    with pytest.raises(ValueError, match=r"Storage.write: offset -2 is negative"):
        s.write(b"x", offset=-2)
    with pytest.raises(ValueError):
        s.fill(256)
    del s


def test_a_write_is_ordered_after_earlier_work_on_its_stream(allocator):
    s = allocator.allocate(8)
    st = shoal.Stream()
    st.delay(0.2)
    s.fill(1, stream=st)
    s.write(b"\x02" * 4, stream=st)
    assert s.read(stream=st) == b"\x02" * 4 + b"\x01" * 4
    del s


def test_a_lazy_clone_keeps_its_data_when_the_source_is_written(allocator):
    source = allocator.allocate(32)
    source.write(b"a" * 32)
    clone = source.lazy_clone()
    assert clone.is_lazy and source.is_lazy
    assert not clone.aliases(source)
    source.write(b"b" * 32)
    assert clone.read() == b"a" * 32
    assert source.read() == b"b" * 32
    del source, clone


def test_a_lazy_clone_read_on_its_own_stream_sees_the_source_s_writes_on_another_stream(allocator):
    # The source's fill waits behind half a second on `writer`; the clone is made for
    # `reader` and read there at once: the read must wait for the fill, not overtake it.
    source = allocator.allocate(1 << 20)
    source.fill(0)
    shoal.synchronize()
    writer, reader = shoal.Stream(allocator.device), shoal.Stream(allocator.device)
    writer.delay(0.5)
    source.fill(0x5A, stream=writer)
    clone = source.lazy_clone(stream=reader)
    assert clone.is_lazy, "the lazy path, not an eager copy"
    assert clone.read((1 << 20) - 4, 4, stream=reader) == b"\x5a" * 4, "the read overtook the source's fill"
    assert source.read(stream=writer)[:4] == b"\x5a" * 4
    del source, clone


def test_writing_a_lazy_clone_materializes_it_and_leaves_the_source(allocator):
    source = allocator.allocate(32)
    source.write(b"a" * 32)
    clone = source.lazy_clone()
    shared_ptr = clone.ptr
    clone.write(b"c" * 4)
    assert not clone.is_lazy
    assert clone.ptr != shared_ptr or not source.is_lazy
    assert clone.read() == b"c" * 4 + b"a" * 28
    assert source.read() == b"a" * 32
    del source, clone


def test_record_stream_holds_the_free_for_that_stream(allocator):
    user = shoal.Stream()
    s = allocator.allocate(4096)
    ptr = s.ptr
    user.delay(0.5)
    s.record_stream(user)
    del s
    gc.collect()
    states = [b["state"] for seg in allocator.snapshot()["segments"] for b in seg["blocks"] if b["address"] == ptr]
    assert states == ["pending_free"]
    user.synchronize()


def test_a_storage_dropped_inside_a_stream_scope_is_freed_after_that_streams_work(allocator):
    side, model = shoal.Stream(), shoal.Stream()
    with shoal.stream(side):
        batch = allocator.allocate(1 << 20)
        view = allocator.allocate(1 << 20).view()
    ptrs = {batch.ptr, view.storage.ptr}
    model.delay(0.5)  # the model's kernel reading both through their pointers
    with shoal.stream(model):
        del batch, view
        gc.collect()
    states = [b["state"] for seg in allocator.snapshot()["segments"] for b in seg["blocks"] if b["address"] in ptrs]
    assert states == ["pending_free", "pending_free"], "a free in the model's scope did not wait for the model"
    with shoal.stream(side):
        later = [allocator.allocate(1 << 20) for _ in range(2)]
    assert not ptrs & {s.ptr for s in later} or model.query(), "memory handed out again before the model passed"
    model.synchronize()
    del later


def test_a_copy_dropped_in_a_scope_while_the_storage_lives_on_records_nothing(allocator):
    side, model = shoal.Stream(), shoal.Stream()
    s = allocator.allocate(4096, side)
    ptr = s.ptr
    model.delay(0.5)
    with shoal.stream(model):
        view = s.view()  # another handle, dropped here while `s` lives
        del view
    del s  # the last handle, outside any scope: its own stream only
    gc.collect()
    states = [b["state"] for seg in allocator.snapshot()["segments"] for b in seg["blocks"] if b["address"] == ptr]
    assert states == ["free"], "a copy dropped in the model's scope made the free wait for the model"
    model.synchronize()


def test_a_storage_dropped_outside_any_stream_scope_waits_for_its_own_streams_only(allocator):
    side, model = shoal.Stream(), shoal.Stream()
    s = allocator.allocate(4096, side)
    ptr = s.ptr
    model.delay(0.5)
    del s
    gc.collect()
    states = [b["state"] for seg in allocator.snapshot()["segments"] for b in seg["blocks"] if b["address"] == ptr]
    assert states == ["free"]
    model.synchronize()


def test_a_stream_of_another_device_is_refused(allocator):
    if shoal.cuda_device_count() == 0:
        pytest.skip("needs a second device")
    other = shoal.Stream(shoal.cuda_device(0) if allocator.device.kind == "host" else shoal.host_device())
    with pytest.raises(ValueError, match="use a stream of the memory's device"):
        allocator.allocate(16, other)


# A read-only DLPack export is a snapshot that holds its memory. The host
# backend hands a freed block straight to the next allocation of its size on
# the stream, so `overwrite_any_freed_block` writes other bytes into any block
# an export still reads but no longer holds: the read then sees them.
def overwrite_any_freed_block(allocator, nbytes):
    gc.collect()
    reuse = allocator.allocate(nbytes)
    reuse.fill(0xEE)
    shoal.synchronize()
    return reuse


def host_numpy(allocator):
    if allocator.device.kind != "host":
        pytest.skip("numpy reads host memory only")
    return pytest.importorskip("numpy")


def test_a_readonly_export_of_a_clone_keeps_the_shared_data_once_the_clone_wrote_and_the_source_went(allocator):
    numpy = host_numpy(allocator)
    n = 4096
    a = allocator.allocate(n)
    a.fill(1)
    b = a.lazy_clone()
    shown = numpy.from_dlpack(b.view(readonly=True))
    b.fill(2)  # b moves to a copy of its own
    del a  # the last other holder of the shared data
    reuse = overwrite_any_freed_block(allocator, n)
    assert (shown == 1).all(), "the export read memory freed and handed out again"
    assert b.read() == b"\x02" * n
    del shown, b, reuse


def test_a_readonly_export_keeps_its_data_once_the_storage_wrote_and_a_clone_made_after_went(allocator):
    numpy = host_numpy(allocator)
    n = 4096
    a = allocator.allocate(n)
    a.fill(1)
    shown = numpy.from_dlpack(a.view(readonly=True))
    c = a.lazy_clone()
    a.fill(3)  # a moves to a copy; c holds the data the export shows
    del c
    reuse = overwrite_any_freed_block(allocator, n)
    assert (shown == 1).all(), "the export read memory freed and handed out again"
    assert a.read() == b"\x03" * n
    del shown, a, reuse


def test_a_readonly_export_is_a_snapshot_and_its_storage_writes_in_place_once_it_is_gone(allocator):
    numpy = host_numpy(allocator)
    a = allocator.allocate(64)
    a.fill(1)
    shown = numpy.from_dlpack(a.view(readonly=True))
    a.fill(5)  # while the export lives: a copy, the export keeps its bytes
    shoal.synchronize()
    assert (shown == 1).all() and a.read() == b"\x05" * 64
    del shown
    gc.collect()
    b = allocator.allocate(64)
    ptr = b.ptr
    shown = numpy.from_dlpack(b.view(readonly=True))
    del shown
    gc.collect()
    b.fill(7)  # the export went: nothing shares the data, no copy
    assert b.ptr == ptr and not b.is_lazy
    assert b.read() == b"\x07" * 64
    del a, b


@pytest.mark.parametrize("how", ["fill", "write"])
def test_a_readonly_export_made_while_another_thread_writes_stays_a_snapshot(allocator, how):
    # The export's clone once came between a write's taking its pointer and
    # enqueueing the write, which then landed in the snapshot: found within a
    # few hundred exports, so two seconds of them find it again.
    numpy = host_numpy(allocator)
    s = allocator.allocate(4096)
    stream = shoal.Stream()
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i = i % 250 + 1
            if how == "fill":
                s.fill(i, stream=stream)
            else:
                s.write(bytes([i]) * 64, stream=stream)

    thread = threading.Thread(target=writer)
    thread.start()
    changed = None
    try:
        until = time.monotonic() + 2
        while changed is None and time.monotonic() < until:
            shown = numpy.from_dlpack(s.view(readonly=True))
            before = int(shown[0])
            stream.synchronize()  # every write enqueued so far has run
            if int(shown[0]) != before:
                changed = (before, int(shown[0]))
    finally:
        stop.set()
        thread.join()
    stream.synchronize()
    assert changed is None, f"a write after the export landed in it: {changed[0]} became {changed[1]}"
    del shown, s


def test_a_readonly_export_of_memory_never_lazily_shared_shows_the_memory_itself(allocator):
    numpy = host_numpy(allocator)
    s = allocator.allocate(64)
    s.fill(1)
    writable = numpy.from_dlpack(s.view())  # marks it shared outside the process
    shown = numpy.from_dlpack(s.view(readonly=True))
    assert shown.ctypes.data == s.ptr
    s.fill(4)  # written in place: the export, of the same memory, sees it
    shoal.synchronize()
    assert (shown == 4).all() and (writable == 4).all()
    del writable, shown, s


def test_numpy_asarray_of_a_host_storage_is_its_bytes_in_place(allocator):
    numpy = host_numpy(allocator)
    s = allocator.allocate(16)
    s.write(bytes(range(16)))
    a = numpy.asarray(s)
    assert (a.dtype, a.shape, a.ctypes.data) == (numpy.uint8, (16,), s.ptr)
    assert a.tolist() == list(range(16)) and a.flags.writeable
    a[0] = 200  # numpy writes the storage's memory itself
    assert s.read(nbytes=1) == b"\xc8"
    assert numpy.array(s).ctypes.data != s.ptr  # numpy.array copies unless told not to
    assert numpy.asarray(s, dtype=numpy.int16).tolist() == [200] + list(range(1, 16))  # values converted, as numpy does
    if numpy.lib.NumpyVersion(numpy.__version__) >= "2.0.0":
        assert numpy.asarray(s, copy=False).ctypes.data == s.ptr
        assert numpy.asarray(s, copy=True).ctypes.data != s.ptr
        with pytest.raises(ValueError):
            numpy.asarray(s, dtype=numpy.float32, copy=False)  # a conversion copies: refused as numpy expects
    del a, s


def test_numpy_asarray_of_a_lazy_clone_materializes_it_and_marks_it_shared_as_a_view_export_does(allocator):
    numpy = host_numpy(allocator)
    source = allocator.allocate(64)
    source.fill(1)
    clone = source.lazy_clone()
    assert clone.is_lazy and not clone.shared_outside_process
    a = numpy.asarray(clone)
    assert not clone.is_lazy and clone.shared_outside_process  # for good: numpy may write it any time
    assert a.ctypes.data == clone.ptr != source.ptr
    a[:] = 9
    assert source.read(nbytes=2) == b"\x01\x01" and clone.read(nbytes=2) == b"\x09\x09"
    assert not clone.lazy_clone().is_lazy  # an eager copy from now on
    del a, clone, source


def test_numpy_asarray_of_read_only_memory_is_a_read_only_array(allocator):
    numpy = host_numpy(allocator)
    if numpy.lib.NumpyVersion(numpy.__version__) < "2.1.0":
        pytest.skip("a read-only export needs a DLPack 1.x consumer (numpy >= 2.1)")
    imported = numpy.arange(16, dtype=numpy.uint8)
    imported.flags.writeable = False
    storage = shoal.from_dlpack(imported, allocator).storage
    a = numpy.asarray(storage)
    assert not a.flags.writeable and a.tolist() == list(range(16)) and a.ctypes.data == imported.ctypes.data
    del a, storage


@pytest.mark.skipif(shoal.cuda_device_count() == 0, reason="needs a CUDA device")
def test_numpy_asarray_of_device_memory_says_numpy_cannot_read_it_and_how_to_copy_it():
    numpy = pytest.importorskip("numpy")
    s = shoal.Allocator(shoal.cuda_device(0), use_environment=False).allocate(16)
    s.fill(3)
    with pytest.raises(TypeError, match=r"device memory of cuda:0 \(.*\), which numpy cannot read; copy it to the "
                                        r"host with storage\.read\(\)"):
        numpy.asarray(s)
    assert numpy.frombuffer(s.read(), numpy.uint8).tolist() == [3] * 16  # the way it names
    assert not s.shared_outside_process  # refused before anything was exported


@pytest.mark.skipif(shoal.cuda_device_count() == 0, reason="needs a CUDA device")
def test_numpy_asarray_of_a_device_view_names_the_device_and_how_to_copy_it():
    numpy = pytest.importorskip("numpy")
    view = shoal.Allocator(shoal.cuda_device(0), use_environment=False).allocate(16).view("float32")
    with pytest.raises(TypeError, match=r"numpy\.asarray\(view\): the view is device memory of cuda:0 \(.*\), which "
                                        r"numpy cannot read; copy it to the host with view\.storage\.read\(\) .*, or "
                                        r"take it without copying with torch\.from_dlpack\(view\) or "
                                        r"cupy\.from_dlpack\(view\)"):
        numpy.asarray(view)


def test_numpy_asarray_of_pinned_host_memory_says_it_is_pinned_host_memory_and_how_to_copy_it():
    # Of either backend: shoal's DLPack export refuses staging memory, so numpy takes none of it.
    numpy = pytest.importorskip("numpy")
    s = shoal.Allocator(memory="pinned_host", memory_limit_mb=64, use_environment=False).allocate(16)
    s.write(bytes(range(16)))
    where = f"{s.device.kind}:{s.device.ordinal}"
    for asked, what, reader in [(s, "storage", "storage"), (s.view("float32"), "view", "view.storage")]:
        with pytest.raises(TypeError) as refused:
            numpy.asarray(asked)
        said = str(refused.value)
        assert said.startswith(f"numpy.asarray({what}): the {what} is pinned host memory of {where} (an Allocator "
                               "with memory='pinned_host'"), said
        assert f"copy it with {reader}.read()" in said and "device memory" not in said, said
    assert numpy.frombuffer(s.read(), numpy.uint8).tolist() == list(range(16))  # the way it names
    assert not s.shared_outside_process  # refused before anything was exported


@pytest.mark.parametrize("spelling, name", [
    ("f4", "float32"), ("<f4", "float32"), ("=f4", "float32"), ("|f4", "float32"), ("f", "float32"),
    ("i8", "int64"), ("q", "int64"), ("u1", "uint8"), ("|u1", "uint8"), ("B", "uint8"), ("i1", "int8"),
    ("?", "bool"), ("b1", "bool"), ("bool_", "bool"), ("e", "float16"), ("f2", "float16"), ("d", "float64"),
    ("c8", "complex64"), ("F", "complex64"), ("u2", "uint16"), ("i4", "int32"), ("u4", "uint32"),
    ("u8", "uint64"), ("single", "float32"), ("double", "float64"), ("half", "float16"), ("intc", "int32"),
    ("short", "int16"), ("ubyte", "uint8"), ("longlong", "int64"), ("intp", "int64"),
    (float, "float64"), (int, "int64"), (bool, "bool"),
])
def test_a_view_takes_numpys_spellings_of_a_dtype(allocator, spelling, name):
    s = allocator.allocate(64)
    assert s.view(spelling, (2,)).dtype == name


def test_numpys_dtype_spellings_need_no_numpy():
    # The package does not require numpy: its spellings are read without importing it.
    program = (
        "import sys\n"
        "sys.modules['numpy'] = None  # any import of numpy fails\n"
        "import shoal\n"
        "s = shoal.Allocator(shoal.host_device(), use_environment=False).allocate(64)\n"
        "assert [s.view(d).dtype for d in ('f4', '<i8', 'u1', '?')] == ['float32', 'int64', 'uint8', 'bool']\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("spelling, says", [
    ("c16", r"'c16' \(complex128\) is not supported"), ("f16", r"'f16' \(float128\) is not supported"),
    ("D", r"'D' \(complex128\) is not supported"), ("i3", "'i3' is not supported"),
    ("complex128", "'complex128' is not supported"), ("<float32", "'<float32' is not supported"),
    ("", "'' is not supported"), ("<", "'<' is not supported"), ("O", "'O' is not supported"),
    (complex, "'complex' is not supported"), (3.5, "not float"),
])
def test_an_unsupported_dtype_is_refused_naming_the_supported_set(allocator, spelling, says):
    s = allocator.allocate(64)
    with pytest.raises(TypeError, match=says + r".*views take bool, int8, .*complex64 \(shoal\.view_dtypes\(\)\)"):
        s.view(spelling)


def test_a_dtype_spelled_in_the_other_byte_order_is_refused_naming_the_supported_set(allocator):
    other = ">" if sys.byteorder == "little" else "<"
    s = allocator.allocate(64)
    for spelling in (other + "f4", other + "i8", other + "f", other + "c8"):
        with pytest.raises(TypeError, match=r"not in this machine's byte order.*\(shoal\.view_dtypes\(\)\)"):
            s.view(spelling)
    # One byte has no byte order: numpy reads '>u1' as uint8, and so do views.
    assert [s.view(other + d).dtype for d in ("u1", "i1", "?", "b1")] == ["uint8", "int8", "bool", "bool"]


def test_dtype_spellings_numpy_reads_as_bytes_and_odd_strings_are_named_plainly(allocator):
    s = allocator.allocate(64)
    assert s.view(b"f4", (2,)).dtype == "float32"  # numpy takes bytes too
    with pytest.raises(TypeError, match="a str that is not UTF-8 is not supported"):
        s.view("\ud800")
    with pytest.raises(TypeError) as refused:
        s.view("f4\x00x")
    assert r"'f4\x00x' is not supported" in str(refused.value)  # escaped, not cut at the NUL
    with pytest.raises(TypeError) as refused:
        s.view("f" * 100_000)
    assert "'" + "f" * 64 + "'..." in str(refused.value) and len(str(refused.value)) < 1000


def test_view_shapes_strides_and_dtypes_are_typed_tuples(allocator):
    # What the stubs say (generated from these signatures): tuple[int, ...], not a bare tuple.
    view = allocator.allocate(64).view("int32", (2, 4))
    assert (view.shape, view.strides) == ((2, 4), (4, 1))
    assert all(type(n) is int for n in view.shape + view.strides)
    for getter in (shoal.ArrayView.shape.fget, shoal.ArrayView.strides.fget):
        assert getter.__nb_signature__[0][0].endswith("-> tuple[int, ...]")
    assert shoal.view_dtypes.__nb_signature__[0][0].endswith("-> tuple[str, ...]")
    assert all(type(name) is str for name in shoal.view_dtypes())


def test_storages_compare_by_identity_and_aliases_says_whether_they_share_memory(allocator):
    s = allocator.allocate(64)
    view = s.view()
    a, b = view.storage, view.storage  # two objects of one storage
    assert a.aliases(b) and a == a and a != b and not a == b
    assert {a: 1}[a] == 1 and hash(a) == object.__hash__(a) and len({a, b}) == 2
    assert s == unittest.mock.ANY  # anything else decides for itself, as for any Python object
    doc = shoal.Storage.__eq__.__doc__
    assert "Identity" in doc and "aliases()" in doc
    del a, b, view, s
