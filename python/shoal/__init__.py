"""shoal: shared GPU memory from Python.

Devices and streams, the stream-ordered caching allocator, reference-counted
storages with copy-on-write lazy clones, and zero-copy DLPack export. Runs on
a CUDA GPU or, without one, on the host backend (host memory, executor
threads as streams); ``SHOAL_BACKEND=host`` or ``cuda`` forces the choice.

    import numpy, shoal
    storage = shoal.allocate(4096)
    array = numpy.from_dlpack(storage.view("float32", (32, 32)))
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Iterator, Optional

from ._shoal import (
    Allocator,
    ArrayView,
    BackendError,
    ConnectionClosedError,
    Device,
    DeviceUnavailableError,
    Event,
    InvalidArgumentError,
    InvariantViolationError,
    OrderingViolationError,
    OutOfMemoryError,
    PeerRefusedError,
    ProtocolError,
    ShoalError,
    Storage,
    Stream,
    StreamError,
    cuda_device,
    cuda_device_count,
    current_stream,
    default_device,
    host_device,
    synchronize,
)
from . import _shoal

__all__ = [
    "Allocator",
    "ArrayView",
    "BackendError",
    "ConnectionClosedError",
    "Device",
    "DeviceUnavailableError",
    "Event",
    "InvalidArgumentError",
    "InvariantViolationError",
    "OrderingViolationError",
    "OutOfMemoryError",
    "PeerRefusedError",
    "ProtocolError",
    "ShoalError",
    "Storage",
    "Stream",
    "StreamError",
    "allocate",
    "cuda_device",
    "cuda_device_count",
    "current_stream",
    "default_allocator",
    "default_device",
    "host_device",
    "stream",
    "synchronize",
]

_default_allocator: Optional[Allocator] = None
_default_allocator_lock = threading.Lock()


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


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    """Makes ``s`` this thread's current stream on its device inside the ``with`` block.

    Allocations and frees without a stream, and every ``stream=None`` argument, use it.
    Scopes nest; leaving one restores the previous current stream.
    """
    _shoal._push_stream(s)
    try:
        yield s
    finally:
        _shoal._pop_stream()
