"""DLPack with PyTorch, CuPy and JAX on a CUDA device, both ways. Skipped
where shoal's default device is not CUDA (CI) or the library is missing.
The stream tests delay shoal's writer with a spin kernel (torch.cuda._sleep
on shoal's stream) so a consumer that did not wait would read stale data;
the control export with stream=-1 shows that race is really there."""

import pytest

import shoal

pytestmark = pytest.mark.cuda

if shoal.default_device().kind != "cuda":
    pytest.skip("shoal's default device is not CUDA", allow_module_level=True)

SPIN_CYCLES = 300_000_000  # a few hundred milliseconds on an H100
N = 1 << 20


def delayed_fill(value: int):
    """A float32 view of N elements holding `value`'s bytes once shoal's stream
    has passed a long spin; returns (view, stream). Zeroed beforehand."""
    torch = pytest.importorskip("torch")
    s = shoal.Stream()
    storage = shoal.allocate(4 * N, stream=s)
    storage.fill(0, stream=s)
    s.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(s.handle)):
        torch.cuda._sleep(SPIN_CYCLES)
    storage.fill(value, stream=s)  # enqueued after the spin
    return storage.view("float32", (N,)), s


def expected_float(value: int) -> float:
    import struct

    return struct.unpack("f", bytes([value]) * 4)[0]


@pytest.mark.parametrize("torch_stream", ["default", "side"])
def test_torch_waits_for_shoals_pending_writes(torch_stream):
    torch = pytest.importorskip("torch")
    view, s = delayed_fill(0x3F)
    consumer = torch.cuda.Stream() if torch_stream == "side" else torch.cuda.current_stream()
    with shoal.stream(s), torch.cuda.stream(consumer):
        x = torch.from_dlpack(view)  # torch's stream (a foreign one for shoal) waits on shoal's
        ok = torch.all(x == expected_float(0x3F))
    consumer.synchronize()  # item() reads on the current stream, which does not wait for a side stream
    assert x.data_ptr() == view.storage.ptr, "zero-copy"
    assert ok.item()


def test_without_the_stream_wait_torch_reads_stale_data():
    torch = pytest.importorskip("torch")
    view, s = delayed_fill(0x3F)
    x = torch.from_dlpack(view.__dlpack__(stream=-1))  # the control: no synchronization
    stale = not torch.all(x == expected_float(0x3F)).item()
    s.synchronize()
    assert stale, "the spin did not make the race observable: the protected test proves nothing"


def test_cupy_waits_for_shoals_pending_writes():
    cupy = pytest.importorskip("cupy")
    view, s = delayed_fill(0x40)
    with shoal.stream(s):
        x = cupy.from_dlpack(view)
    assert x.data.ptr == view.storage.ptr
    assert bool((x == expected_float(0x40)).all())


def test_jax_reads_shoal_memory():
    jax = pytest.importorskip("jax")
    storage = shoal.allocate(4 * 1024)
    storage.fill(0x41)
    shoal.synchronize()
    x = jax.dlpack.from_dlpack(storage.view("float32", (1024,)))
    assert float(x[7]) == expected_float(0x41)


def test_torch_cupy_and_jax_arrays_come_in_without_a_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(1024, dtype=torch.float32, device="cuda")
    v = shoal.from_dlpack(t)
    assert v.storage.ptr == t.data_ptr() and v.shape == (1024,) and v.dtype == "float32"
    v.storage.fill(0)  # shoal writes through; torch sees it after shoal's stream
    shoal.synchronize()
    assert t.sum().item() == 0.0
    cupy = pytest.importorskip("cupy")
    c = cupy.arange(16, dtype=cupy.int64)
    cv = shoal.from_dlpack(c)
    assert cv.storage.ptr == c.data.ptr and cv.dtype == "int64"
    jax = pytest.importorskip("jax")
    j = jax.numpy.arange(8, dtype=jax.numpy.float32)
    jv = shoal.from_dlpack(j)
    assert jv.shape == (8,)
    assert shoal.from_dlpack(t).storage.read(4, 4) == bytes(4)


def test_a_torch_tensor_stays_alive_while_shoal_uses_it():
    torch = pytest.importorskip("torch")
    t = torch.ones(N, device="cuda")
    v = shoal.from_dlpack(t)
    ptr = t.data_ptr()
    del t  # shoal's view now holds the only reference
    torch.cuda.synchronize()
    again = torch.empty(N, device="cuda")
    assert again.data_ptr() != ptr, "the memory went back to torch while shoal still viewed it"
    assert v.storage.read(0, 4) == bytes([0, 0, 0x80, 0x3F])


KERNEL_FAULT_THEN_SHOAL = """
import shoal, torch
s = shoal.Stream()
storage = shoal.allocate(4096, stream=s)
s.synchronize()
x = torch.zeros(4, device="cuda")
x[torch.tensor([1 << 40], device="cuda")] = 1  # out of bounds: a device-side assert, which CUDA keeps
try:
    torch.cuda.synchronize()
except RuntimeError:
    pass
for name, call in [("fill", lambda: storage.fill(1, stream=s)), ("synchronize", s.synchronize)]:
    try:
        call()
        print(name, "passed")
    except shoal.ShoalError as e:
        print(name, type(e).__name__, "must restart" in str(e))
"""


def test_a_kernel_fault_is_a_stream_error_saying_to_restart_also_from_a_call_that_only_enqueues():
    # In a process of its own: the fault ends CUDA's use there for good.
    pytest.importorskip("torch")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", KERNEL_FAULT_THEN_SHOAL], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[:2] == ["fill StreamError True", "synchronize StreamError True"], (
        done.stdout + done.stderr
    )
