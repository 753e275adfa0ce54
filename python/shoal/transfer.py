"""Background host-to-device transfer of batches, with no batch cache.

A data loader submits batches of host arrays (numpy arrays, torch CPU tensors) in a list,
tuple or dict, nested; the engine's own thread copies each array into device memory on its
own stream — directly from pinned memory (a torch tensor with ``pin_memory()``), through
pinned staging blocks otherwise — and the model takes the batches in order as ArrayViews
it hands to torch, CuPy or JAX through DLPack::

    import numpy, shoal.transfer, torch

    with shoal.transfer.Engine() as engine:
        engine.submit({"x": numpy.ones((64, 3, 224, 224), "float32"), "y": numpy.arange(64)})
        batch = engine.get()                    # {"x": ArrayView, "y": ArrayView}
        x = torch.from_dlpack(batch["x"])       # on the current stream, after the copy

``get()`` makes the current stream (or the one given) wait for the batch's copies on the
GPU — no host synchronization — and records that stream as a user of the batch's memory,
so the model may drop the batch the moment its kernels are enqueued: the memory is reused
only after that stream has passed them. No need to keep the last few batches alive.

Backpressure: ``submit`` blocks while ``max_batches_in_flight`` batches, or
``max_bytes_in_flight`` bytes, are submitted and not yet taken (two batches may always be,
whatever their bytes); pinned staging memory never
exceeds ``max_pinned_bytes``. A batch that
cannot be transferred (out of memory) raises its error from ``get`` alone; later batches
are unaffected.
"""

from __future__ import annotations

import math
import queue
import weakref
from typing import Any, Callable, Optional, Union

from . import _checks, _device_defaults, _shoal

__all__ = ["Engine", "TransferredBatch", "MAX_ARRAYS_PER_BATCH", "MAX_NESTING"]

TransferredBatch = _shoal.TransferredBatch  # what Engine.next() hands out

MAX_NESTING = 32
MAX_ARRAYS_PER_BATCH = 4096  # arrays in one batch, those with no elements included

Batch = Union[_shoal.ArrayView, list, tuple, dict]

_EMPTY_STORAGE_BYTES = 64  # what an array with no elements views: aligned for every element type

_VIEW_DTYPES = frozenset(_shoal.view_dtypes())  # looked up once per array submitted
def _host_buffer(leaf: Any) -> tuple[tuple[int, int, bool, Any], str, tuple[int, ...]]:
    """(address, nbytes, pinned, owner), dtype name and shape of one host array."""
    module = type(leaf).__module__.split(".")[0]
    if module == "torch":
        if leaf.device.type != "cpu":
            raise _shoal.InvalidArgumentError(f"shoal.transfer: a tensor on {leaf.device} is not host memory; submit CPU tensors")
        # A conjugate or negative view (x.conj(), x.conj().imag) holds its values unchanged and
        # a bit that says how to read them: the device gets the values as read.
        tensor = leaf.resolve_conj().resolve_neg().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        return (tensor.data_ptr(), nbytes, bool(tensor.is_pinned()), tensor), dtype, tuple(tensor.shape)
    import numpy

    if isinstance(leaf, numpy.generic):  # a numpy scalar: a 0-d array of its value
        leaf = numpy.asarray(leaf)
    if not isinstance(leaf, numpy.ndarray):
        raise TypeError(
            f"shoal.transfer: cannot transfer an object of type {type(leaf).__name__}: a batch holds numpy arrays "
            "or torch CPU tensors, in lists, tuples and dicts"
        )
    shape = tuple(leaf.shape)  # ascontiguousarray makes a 0-d array 1-d
    array = numpy.ascontiguousarray(leaf)
    if not array.dtype.isnative:  # bytes swapped: the copy on the device holds native values
        array = array.astype(array.dtype.newbyteorder("="))
    return (array.ctypes.data, array.nbytes, False, array), array.dtype.name, shape


class _Flattening:
    """One batch taken apart: ``leaves`` holds the arrays with elements to copy (buffer, dtype,
    shape); ``arrays`` counts every array found, those with no elements included, against
    MAX_ARRAYS_PER_BATCH."""

    __slots__ = ("leaves", "arrays")

    def __init__(self) -> None:
        self.leaves: list = []
        self.arrays = 0

    def structure_of(self, batch: Any, depth: int = 0) -> Any:
        """The batch's structure with each array replaced by its index in ``leaves``."""
        if depth > MAX_NESTING:
            raise _shoal.InvalidArgumentError(f"shoal.transfer: a batch nests deeper than {MAX_NESTING} levels")
        if isinstance(batch, (list, tuple)):
            items = [self.structure_of(x, depth + 1) for x in batch]
            if isinstance(batch, list):
                return items
            return _Named(type(batch), items) if _is_namedtuple(batch) else tuple(items)
        if isinstance(batch, dict):
            return {key: self.structure_of(value, depth + 1) for key, value in batch.items()}
        if self.arrays >= MAX_ARRAYS_PER_BATCH:
            raise _shoal.InvalidArgumentError(
                f"shoal.transfer: a batch holds more than {MAX_ARRAYS_PER_BATCH} arrays (those with no elements "
                "included)")
        self.arrays += 1
        buffer, dtype, shape = _host_buffer(batch)
        if dtype not in _VIEW_DTYPES:  # refused now: get() could not give it back as an array
            raise TypeError(
                f"shoal.transfer: arrays of {dtype} cannot be transferred; the element types are "
                + ", ".join(_shoal.view_dtypes())
            )
        if buffer[1] == 0:  # nothing to copy: get() gives an empty view in its place
            return _Empty(dtype, shape)
        self.leaves.append((buffer, dtype, shape))
        return _Leaf(len(self.leaves) - 1)


class _SourcesRead:
    """Counts a batch's arrays the engine has let go of (``submit(reuse_sources=True)``).

    Each source is watched through a weak reference whose callback is a SimpleQueue's put, a
    C function: no Python code runs as a source goes. A ``__del__`` would run some, on the
    thread that drops the last reference — the caller's own when the engine has let go before
    ``submit`` drops its lists — and a Ctrl-C that comes then is raised inside it, where Python
    only prints it: the KeyboardInterrupt was lost, and so was the count, leaving ``wait``
    waiting for a release that had happened. With the callback, the signal's handler runs in
    the caller, and the count is whole."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._released: queue.SimpleQueue[weakref.ref[_Source]] = queue.SimpleQueue()
        self._watches: list[weakref.ref[_Source]] = []  # alive while counted: a dead one calls nothing

    def watch(self, source: _Source) -> None:
        """Counts ``source`` as read once it is gone."""
        self._watches.append(weakref.ref(source, self._released.put))

    def wait(self) -> None:
        """Returns once every source watched is gone. In slices, so that Ctrl-C ends the wait."""
        while self._left > 0:
            try:
                self._released.get(timeout=0.1)
            except queue.Empty:
                continue
            self._left -= 1


class _Source:
    """One array of a batch, held by the engine while it reads it; ``read`` counts it once the
    engine has let it go (it has no ``__del__``: see _SourcesRead)."""

    __slots__ = ("array", "__weakref__")

    def __init__(self, array: Any, read: _SourcesRead) -> None:
        self.array = array
        read.watch(self)


class _Leaf(int):
    """An array's index in a flattened batch. Every leaf of a batch is an array (an int in
    a batch is refused by _host_buffer, as any object that is not an array), so nothing
    else in a flattened structure is a _Leaf."""


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields") and hasattr(type(value), "_make")


class _Empty:
    """An array with no elements in a flattened batch: its dtype and shape, nothing copied."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape


class _Named:
    """A namedtuple's place in a flattened batch: its type and its flattened items."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: Any, items: list) -> None:
        self.kind = kind
        self.items = items


def _rebuild(node: Any, views: list, empty: Callable[[_Empty], Any]) -> Any:
    if isinstance(node, _Leaf):
        return views[node]
    if isinstance(node, _Empty):
        return empty(node)
    if isinstance(node, list):
        return [_rebuild(x, views, empty) for x in node]
    if isinstance(node, tuple):
        return tuple(_rebuild(x, views, empty) for x in node)
    if isinstance(node, _Named):
        return node.kind._make(_rebuild(x, views, empty) for x in node.items)
    return {key: _rebuild(value, views, empty) for key, value in node.items()}


def _default_engine_allocator() -> _shoal.Allocator:
    """On the calling thread's current CUDA device in PyTorch where this process uses
    PyTorch on CUDA (a DDP rank on cuda:3 that makes its Engine in a thread on cuda:3 gets
    its batches on cuda:3, and makes nothing on cuda:0), else on
    shoal's default device: PyTorch's allocator there when shoal backs it (so batches
    count in torch.cuda's stats), else the package's default one where it is on that
    device, else the one shoal.sharing uses there too (see _device_defaults)."""
    return _device_defaults.allocator_on(_device_defaults.default_device())


def _as_torch(view: _shoal.ArrayView) -> Any:
    return _checks.torch_module("shoal.transfer.Engine.get(as_torch=True)").from_dlpack(view)


class Engine:
    """A thread and a stream that copy submitted host batches to the device.

    ``allocator``: where device memory comes from (default: on the current CUDA device in
    PyTorch of the thread that makes the Engine — per thread: a thread that set none has
    device 0 — where this process has initialized CUDA in PyTorch; a DDP rank that called
    ``torch.cuda.set_device(3)`` in that thread gets its batches on cuda:3, and nothing of
    shoal's on cuda:0 — else on shoal's default device; there the allocator PyTorch uses when
    ``shoal.torch`` is enabled, else ``shoal.default_allocator()`` where it is on that
    device, else one allocator per device that ``shoal.sharing`` uses too, made on first use
    with the settings of SHOAL_ALLOC_CONF). Give it a memory limit
    (``shoal.Allocator(memory_limit_mb=...)``) to bound the device memory batches take: a
    consumer whose stream lags keeps dropped batches' memory until the stream passes their
    reads, and at the limit the engine's thread waits for that instead of growing.
    ``max_batches_in_flight``: batches submitted and not yet taken (``submit`` blocks past it);
    ``max_bytes_in_flight``: their bytes in all (two batches may always be in flight, whatever
    their size, so submitting one ahead of taking the last from one thread never waits on
    itself). Together they bound the bytes of batches in flight by the larger of
    max_bytes_in_flight and two batches (the device memory they keep can be more by what a
    taken batch's group still holds):
    the defaults (32 batches, 64 MiB) let small batches form large groups, and keep batches
    of 16 MiB and more at 4 in flight or fewer.
    ``max_pinned_bytes``: the pinned staging memory the engine may hold, a ring that pageable
    arrays are staged through: at least 2 MiB, the least pinned memory staging reserves, and at
    least what one staging chunk takes (its bytes rounded up to a 2 MiB segment), else
    InvalidArgumentError.
    ``staging_chunk_bytes``: pageable arrays are staged in pieces this large.
    ``staging_stores``: how staging writes the ring: ``"automatic"`` (the default:
    non-temporal stores for a copy on up to 8 threads, ordinary stores for one on more, which
    led at every size on 16 threads of an H200 host), ``"streaming"`` (non-temporal stores,
    which skip reading each line first) or ``"cached"`` (ordinary stores).
    ``staging_helpers``: threads that help copy pageable bytes into staging memory (None:
    15 where this process may run on 16 CPUs or more, else half the CPUs less the engine's
    own thread; 0 on 2 CPUs).
    ``max_coalesced_bytes``: batches found queued together are transferred as one group of
    at most this many bytes (0: each batch alone): the group shares one ready event and one
    device block (its arrays are parts of it, freed once all of them are), and its small
    pageable arrays share staging blocks and copies, which cuts the cost of small batches; a
    group's first batch is handed out once the whole group is enqueued. A batch's own arrays
    are parts of one block whatever this is: an array kept keeps its batch's block.

    Thread-safe: several producers may submit, and batches come out of ``get`` in
    submission order. Close it (or use it as a context manager) to stop the thread;
    batches already taken stay valid.
    """

    def __init__(
        self,
        allocator: Optional[_shoal.Allocator] = None,
        *,
        max_batches_in_flight: int = 32,
        max_bytes_in_flight: int = 64 << 20,
        max_pinned_bytes: int = 32 << 20,
        staging_chunk_bytes: int = 4 << 20,
        staging_helpers: Optional[int] = None,
        staging_stores: str = "automatic",
        max_coalesced_bytes: int = 4 << 20,
    ) -> None:
        for name, value, least in (("max_batches_in_flight", max_batches_in_flight, 1),
                                   ("max_bytes_in_flight", max_bytes_in_flight, 1),
                                   ("max_pinned_bytes", max_pinned_bytes, 0),
                                   ("staging_chunk_bytes", staging_chunk_bytes, 1),
                                   ("max_coalesced_bytes", max_coalesced_bytes, 0)):
            _checks.whole_number("shoal.transfer.Engine", name, value, least=least)
        _checks.whole_number("shoal.transfer.Engine", "staging_helpers", staging_helpers, allow_none=True)
        _checks.instance_of("shoal.transfer.Engine", "staging_stores", staging_stores, str,
                            "'automatic', 'streaming' or 'cached'")
        _checks.instance_of("shoal.transfer.Engine", "allocator", allocator, _shoal.Allocator, "a shoal.Allocator",
                            allow_none=True)
        self._allocator = allocator if allocator is not None else _default_engine_allocator()
        # What arrays with no elements are views of: a few bytes of the engine's device,
        # made at the first one, so that such a view keeps no batch's memory alive.
        self._empty_storage: Optional[_shoal.Storage] = None
        self._engine = _shoal.TransferEngine(
            self._allocator,
            max_batches_in_flight,
            max_pinned_bytes,
            staging_chunk_bytes,
            staging_helpers,
            staging_stores,
            max_coalesced_bytes,
            max_bytes_in_flight,
        )
        # Each batch's layout (its structure and leaf types) goes into the engine with the
        # batch and comes back with it: nothing here pairs them, so nothing raised between
        # a native call's return and the next line (Ctrl-C) can part them.

    def submit(self, batch: Any, timeout: Optional[float] = None, *, reuse_sources: bool = False) -> int:
        """Queues a batch (an array, or a list/tuple/dict of them, nested) and returns its sequence number.

        An array with no elements (an image's empty box list) copies nothing and comes back as
        an empty view of its dtype and shape; a batch must hold at least one array with
        elements (InvalidArgumentError otherwise). Dict keys may be any hashable value: the
        structure stays in this process (``shoal.sharing`` sends it, so there they must be str).

        Pageable arrays are copied into staging memory by the engine's threads; pinned torch
        tensors are read directly and kept alive until their copy has run. Blocks while the
        batch does not fit within ``max_batches_in_flight`` and ``max_bytes_in_flight``
        (past ``max_bytes_in_flight`` a batch still goes while at most one other batch is in
        flight: two may always be, whatever their bytes); PeerTimeoutError after ``timeout``
        seconds (nothing queued then). Producers waiting at once are let in as room allows, not
        in the order they came: a batch that fits goes ahead of a larger one still waiting.
        Ctrl-C (KeyboardInterrupt) ends the wait with nothing queued — unless it comes as the
        batch is queued: then it is raised after, and the batch is queued with its structure
        (``get`` delivers it as any other).

        The engine reads the arrays after ``submit`` returns: do not write them until it has
        (a write before that may reach the device copy). A loader that refills one buffer
        passes ``reuse_sources=True``: ``submit`` then returns once the engine has read every
        array of the batch (staged the pageable ones, copied the pinned ones), so the buffers
        may be written again. ``timeout`` bounds the wait for room alone (PeerTimeoutError
        still means nothing was queued); the wait for the engine's own threads to read the
        arrays has no limit. Ctrl-C (KeyboardInterrupt) during that wait leaves the batch
        queued and its arrays still being read.
        """
        timeout = _checks.timeout_seconds("shoal.transfer.Engine.submit", timeout)
        flattening = _Flattening()
        structure = flattening.structure_of(batch)
        leaves = flattening.leaves
        if not leaves:
            raise _shoal.InvalidArgumentError(
                "shoal.transfer: the batch holds no array with any elements; there is nothing to transfer"
            )
        read = _SourcesRead(len(leaves)) if reuse_sources else None
        if read is not None:
            leaves = [((address, nbytes, pinned, _Source(owner, read)), dtype, shape)
                      for (address, nbytes, pinned, owner), dtype, shape in leaves]
        buffers = [buffer for buffer, _, _ in leaves]
        types = [(dtype, shape) for _, dtype, shape in leaves]
        submitted = self._engine.submit(buffers, timeout, (structure, types))
        del buffers, leaves  # the engine's holds are the last ones on the sources
        if read is not None:
            read.wait()
        return submitted

    def next(self, timeout: Optional[float] = None) -> TransferredBatch:
        """The next batch as the engine hands it out (storages and ready state), without waiting
        on a stream. Errors and Ctrl-C as ``get``."""
        timeout = _checks.timeout_seconds("shoal.transfer.Engine.next", timeout)
        taken: list = []
        try:
            self._engine.next(taken, timeout)
            return taken[0][0]
        except BaseException:
            self._put_back(taken)
            raise

    def _put_back(self, taken: list) -> None:
        """Gives the batch in ``taken``, if any, back to the engine: a call that took it raises
        instead of delivering it (Ctrl-C as the native call returned, an error building the
        result), and the next ``get`` or ``next`` delivers it."""
        if taken:
            self._engine.put_back(taken[0])

    def get(
        self, timeout: Optional[float] = None, stream: Optional[_shoal.Stream] = None, *, as_torch: bool = False
    ) -> Any:
        """The next batch in submission order, as ArrayViews in the structure submitted (torch
        tensors with ``as_torch``, on the same memory).

        ``stream`` (default: the current stream) waits for the batch's copies on the GPU and
        is recorded as a user of its memory. With ``as_torch``, PyTorch's current stream is
        then made to wait for ``stream`` (and recorded as a user too), so the tensors' uses
        there come after the copies. Raises the batch's own error when it failed;
        PeerTimeoutError after ``timeout`` seconds. Ctrl-C (KeyboardInterrupt) ends the wait, as
        it does ``submit``'s; so does ``close()`` from another thread (InvalidArgumentError).
        A call that raises delivers no batch and loses none: one it had taken (Ctrl-C as the
        batch came, ``as_torch`` refused by torch) is the next ``get``'s or ``next``'s.
        """
        if as_torch:  # before a batch is taken: without torch it stays queued
            _checks.torch_module("shoal.transfer.Engine.get(as_torch=True)")
        # Checked before a batch is taken: a refusal leaves it queued.
        _checks.instance_of("shoal.transfer.Engine.get", "stream", stream, _shoal.Stream, "a shoal.Stream",
                            allow_none=True, hint=" (shoal.Stream.from_handle adopts another library's stream)")
        if stream is not None and stream.device != self._allocator.device:
            raise _shoal.InvalidArgumentError(
                f"shoal.transfer.Engine.get: stream is of {stream.device}, and the engine's storages of "
                f"{self._allocator.device}")
        timeout = _checks.timeout_seconds("shoal.transfer.Engine.get", timeout)
        taken: list = []
        try:
            self._engine.next(taken, timeout)
            transferred, (structure, types) = taken[0]
            transferred.wait(stream)
            views = [storage.view(dtype, shape) for storage, (dtype, shape) in zip(transferred.storages, types)]

            def empty(node: _Empty) -> _shoal.ArrayView:
                """An array with no elements: a view of none of the engine's few bytes for them."""
                storage = self._empty_storage
                if storage is None:  # two threads may each make one: either serves
                    storage = self._empty_storage = self._allocator.allocate(_EMPTY_STORAGE_BYTES)
                return storage.view(node.dtype, node.shape)
            if not as_torch:
                return _rebuild(structure, views, empty)
            # The export orders PyTorch's stream after shoal's current stream: `stream`
            # here, the one that waited for the copies.
            scope = _shoal._push_stream(stream) if stream is not None else None
            try:
                views = [_as_torch(view) for view in views]
                return _rebuild(structure, views, lambda node: _as_torch(empty(node)))
            except Exception as refused:
                refused.add_note("shoal.transfer.Engine.get: the batch stays queued; get(as_torch=False) returns "
                                 "it as ArrayViews")
                raise
            finally:
                if scope is not None:
                    _shoal._pop_stream(scope)
        except BaseException:
            self._put_back(taken)
            raise

    def stats(self) -> dict:
        """Counters: batches submitted, transferred, failed and taken; ``coalesced_groups``, the
        groups of batches the engine's thread took together (each sharing one ready event; a
        batch alone is a group of one, and groups that failed count too); bytes copied and
        staged; ``copies``, the host-to-device copies enqueued (a run of small pageable arrays
        packed together is one); batches and their bytes in flight (``bytes_in_flight``) now
        and at the peak; pinned staging memory now and at the peak."""
        return self._engine.stats()

    def close(self) -> None:
        """Ends other threads' waits in ``submit`` and ``get`` (InvalidArgumentError), finishes
        the batches submitted, waits for their copies and stops the thread."""
        self._engine.close()
        self._empty_storage = None

    @property
    def closed(self) -> bool:
        """True once close() has begun."""
        return self._engine.closed

    def __repr__(self) -> str:
        if self.closed:
            return "shoal.transfer.Engine(closed)"
        try:
            waiting = self._engine.waiting
        except _shoal.DeviceUnavailableError:
            return "shoal.transfer.Engine(the parent process's: this is a fork() child)"
        except _shoal.InvalidArgumentError:  # closed meanwhile
            return "shoal.transfer.Engine(closed)"
        return f"shoal.transfer.Engine({waiting} batches submitted and not taken)"

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
