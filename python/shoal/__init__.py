"""shoal: shared GPU memory from Python.

Devices and streams, the stream-ordered caching allocator, reference-counted
storages with copy-on-write lazy clones, and zero-copy DLPack export. Runs on
a CUDA GPU or, without one, on the host backend (host memory, executor
threads as streams); ``SHOAL_BACKEND=host`` or ``cuda`` forces the choice.

    import numpy, shoal
    storage = shoal.allocate(4096)
    array = numpy.from_dlpack(storage.view("float32", (32, 32)))

Between processes: ``shoal.sharing`` (Producer / Consumer of batches) on top of
Listener, connect, SharingContext and Peer. From host to device in the background:
``shoal.transfer.Engine`` (batches of numpy arrays or torch CPU tensors in, ArrayViews out).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import threading
from typing import Any, Iterator, Optional

from ._shoal import (
    Allocator,
    ArrayView,
    BackendError,
    CancelledError,
    Connection,
    ConnectionClosedError,
    ContentMismatchError,
    Device,
    DeviceUnavailableError,
    Event,
    InvalidArgumentError,
    InvariantViolationError,
    Listener,
    OrderingViolationError,
    OutOfMemoryError,
    Peer,
    PeerRefusedError,
    PeerTimeoutError,
    ProtocolError,
    SharingContext,
    ShoalError,
    Storage,
    Stream,
    StreamError,
    SystemCallError,
    connect,
    cuda_device,
    cuda_device_count,
    current_stream,
    default_device,
    host_device,
    runtime_dir_address,
    synchronize,
    view_dtypes,
)
from . import _checks, _fork, _shoal

try:
    __version__: str = importlib.metadata.version("shoal")  # pyproject.toml's, as installed
except importlib.metadata.PackageNotFoundError:  # imported from a tree that was never installed
    __version__ = "unknown"

__all__ = [
    "Allocator",
    "ArrayView",
    "BackendError",
    "CancelledError",
    "Connection",
    "ConnectionClosedError",
    "ContentMismatchError",
    "Device",
    "DeviceUnavailableError",
    "Event",
    "InvalidArgumentError",
    "InvariantViolationError",
    "Listener",
    "OrderingViolationError",
    "OutOfMemoryError",
    "Peer",
    "PeerRefusedError",
    "PeerTimeoutError",
    "ProtocolError",
    "SharingContext",
    "ShoalError",
    "Storage",
    "Stream",
    "StreamError",
    "SystemCallError",
    "allocate",
    "connect",
    "cuda_device",
    "cuda_device_count",
    "current_stream",
    "default_allocator",
    "default_device",
    "from_dlpack",
    "host_device",
    "runtime_dir_address",
    "stream",
    "synchronize",
    "view_dtypes",
]

_default_allocator: Optional[Allocator] = None
_default_allocator_lock = threading.Lock()
# A parent thread making the default allocator at a fork: the child's first use is refused, not hung.
_fork.renew_lock_in_fork_child(__name__, "_default_allocator_lock")


def default_allocator() -> Allocator:
    """The process-wide Allocator of the default device (settings from SHOAL_ALLOC_CONF), made on first use."""
    global _default_allocator
    with _default_allocator_lock:
        if _default_allocator is None:
            _default_allocator = Allocator()
        return _default_allocator


@atexit.register
def _drop_default_allocator() -> None:
    # Storages still alive keep its C++ state; the Python object goes now.
    global _default_allocator
    _default_allocator = None


def allocate(nbytes: int, stream: Optional[Stream] = None) -> Storage:
    """A Storage of ``nbytes`` from the default allocator, for use on ``stream`` (default: the current stream)."""
    return default_allocator().allocate(nbytes, stream)


_DLPACK_CPU = 1  # DLPack's device type of host memory


def from_dlpack(source: Any, allocator: Optional[Allocator] = None) -> ArrayView:
    """An ArrayView over another library's array, without copying.

    ``source`` is anything with ``__dlpack__`` (numpy, torch, CuPy, JAX arrays) or a DLPack
    capsule, which is consumed (a capsule consumed already raises BufferError). The memory
    stays the producer's: it is handed back when the view's storage is gone and the current
    stream has passed shoal's work on it. Imported memory is never lazily shared. The array
    must live on ``allocator``'s device (default: default_allocator()), and have at least
    one element (BufferError otherwise: there is no memory to share; ``shoal.transfer.Engine``
    takes arrays with none).
    """
    _checks.instance_of("shoal.from_dlpack", "allocator", allocator, Allocator, "a shoal.Allocator", allow_none=True)
    if allocator is None:
        allocator = default_allocator()
    if type(source) is not _shoal._capsule_type:
        if not hasattr(source, "__dlpack__"):
            raise TypeError("shoal.from_dlpack: the object has no __dlpack__ and is not a DLPack capsule")
        stream = _shoal._dlpack_consumer_stream(allocator)
        device_of = getattr(source, "__dlpack_device__", None)
        if callable(device_of) and device_of()[0] == _DLPACK_CPU:
            stream = None  # DLPack takes no stream for host memory (numpy refuses one); the device check below speaks
        versioned = True
        try:
            capsule = source.__dlpack__(stream=stream, max_version=(1, 0))
        except TypeError:  # a producer older than DLPack 1.0 takes no max_version
            versioned = False
        if not versioned:
            capsule = source.__dlpack__(stream=stream)
        source = capsule
    return _shoal._from_dlpack(allocator, source)


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    """Makes ``s`` this thread's current stream on its device inside the ``with`` block.

    Allocations without a stream, and every ``stream=None`` argument, use it; the memory of a
    ``Storage`` or ``ArrayView`` dropped inside the block is freed only once the work enqueued
    on ``s`` by then has passed (recorded as a use, as ``record_stream(s)`` does). Scopes nest;
    leaving one restores the previous current stream. One left out of order (a generator's,
    closed inside a later scope) leaves the later scopes' streams current.
    """
    _checks.instance_of("shoal.stream", "s", s, Stream, "a shoal.Stream",
                        hint=" (shoal.Stream.from_handle adopts another library's stream)")
    token = _shoal._push_stream(s)
    try:
        yield s
    finally:
        _shoal._pop_stream(token)
