"""Batches of arrays shared between processes, zero-copy.

    # sketch: start_producers and labels (an ArrayView) are yours
    import shoal, shoal.sharing, torch

    # consumer process
    with shoal.sharing.Consumer() as consumer:        # listens at consumer.address
        start_producers(consumer.address, workers=4)   # a str: pass it to the producer processes
        for batch in consumer.batches(producers=4, timeout=60):  # {"x": ArrayView, "y": [...]}
            images = torch.from_dlpack(batch["x"])     # or numpy / CuPy / JAX: no copy

    # producer process (spawn / forkserver), given consumer.address as address
    with shoal.sharing.Producer(address) as producer:
        view = shoal.allocate(64 * 3 * 224 * 224 * 4).view("float32", (64, 3, 224, 224))
        ...                                            # fill it (DLPack, Storage.write)
        producer.put({"x": view, "y": [labels]})
    # leaving the block waits for the queued writes to run, then (60 s at most)
    # until the consumer took every batch

A batch is an ArrayView (or a Storage, sent as bytes, or a CUDA tensor PyTorch
allocated on shoal: see ``shoal.torch``) or a list, tuple or dict (str keys)
nesting them. Each array's memory stays where the producer
allocated it; the consumer maps it once per segment and gets ArrayViews with
the producer's dtype, shape, strides and offset. The consumer's stream waits
for the work the producer enqueued before put(); the memory is freed only
when every process has dropped it, and the references of a process that dies
(SIGKILL included) are reclaimed. Arrays to send must be shoal memory of the
producer's allocator: copy others in first (e.g. ``shoal.from_dlpack`` then a
copy, or ``Storage.write``). Without ``allocator=`` or ``device=``, a
Producer whose first put holds CUDA tensors sends memory of their device,
and both sides otherwise take the calling thread's current CUDA device in
PyTorch (``torch.cuda.current_device()``, which is per thread) where the
process initialized CUDA in PyTorch (a DDP rank's), else shoal's default
device: a Consumer in the thread that makes it, a Producer in the thread of
its first put (see Producer).

Trust: a producer is admitted by its uid (this user, or ``allowed_uids``)
and is still untrusted. Everything it sends — the layout of every array, the
nesting, the number of arrays — is validated; a malformed batch raises
ProtocolError and that producer is disconnected, others go on.

Objects belong to the process that made them: make a Producer in the
producer process after it started (the address is a plain string, fine to
pickle); with ``multiprocessing`` use the spawn or forkserver start methods.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import difflib
import json
import math
import numbers
import operator
import os
import re
import secrets
import selectors
import socket
import threading
import time
from typing import Any, Sequence, Union

from . import _checks, _device_defaults, _fork, _shoal

__all__ = ["Producer", "Consumer", "Batches", "Batch", "MAX_ARRAYS_PER_BATCH", "MAX_NESTING"]

# What a producer puts. What a consumer gets is typed Any: the batch's shape is
# whatever the producer put (say a dict of views), which the consumer knows.
Batch = Union[_shoal.ArrayView, _shoal.Storage, list, tuple, dict]

MAX_ARRAYS_PER_BATCH = 4096
MAX_NESTING = 32
MAX_ERRORS = 64
_MAX_DIMS = 32
_MAX_EXTENT = 1 << 48  # elements or bytes: past any device
_VERSION = 1
_WAKE = object()  # the selector key of Consumer's wake-up socket


def _check_options(caller: str, own: Sequence[str], options: dict[str, int]) -> None:
    """The SharingContext options among a Producer's or Consumer's keywords; a name that is
    none of them is refused naming `caller`'s own keywords too, and the nearest name."""
    try:
        _shoal._check_sharing_options(**options)
    except _shoal.InvalidArgumentError as e:
        said = str(e)
        listed = re.search(r"unknown option (\S+) \(([^)]*)\)", said)
        if listed is None:
            raise
        name, context_options = listed.group(1), listed.group(2).split(", ")
        near = difflib.get_close_matches(name, [*own, *context_options], n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise _shoal.InvalidArgumentError(
            f"{caller}: unknown keyword {name}{hint} (its own: {', '.join(own)}; "
            f"the SharingContext options: {listed.group(2)})"
        ) from None
_MAX_SELECT_WAIT = 3600.0  # seconds: one select's wait, so a long batch_timeout never overflows it
_END_NOTE = json.dumps({"v": _VERSION, "end": True}, separators=(",", ":")).encode()
_MESSAGES_PER_TURN = 256  # a producer's messages read in one turn (a batch may span turns)


# Producers of one allocator and options in one process share a context, kept for
# the process once made (one collector thread each; they go at exit): a storage
# belongs to the first context that sends it, so one sent through one Producer can
# then be sent through another (to a second consumer, or to one that restarted),
# also after every Producer before it is gone (a reconnect loop's). The pid keeps a
# forked child, whose inherited contexts belong to its parent, from finding them.
_producer_contexts: "dict[tuple, _shoal.SharingContext]" = {}
_producer_contexts_lock = threading.Lock()
_fork.renew_lock_in_fork_child(__name__, "_producer_contexts_lock")  # a parent thread making a Producer at a fork


@atexit.register
def _drop_producer_contexts() -> None:
    # As the default allocators: the Python objects go at exit, before the interpreter tears
    # modules down in no set order; what storages still hold keeps its C++ state.
    with _producer_contexts_lock:
        _producer_contexts.clear()


def _producer_context(allocator: _shoal.Allocator, options: dict[str, int]) -> _shoal.SharingContext:
    key = (os.getpid(), allocator, tuple(sorted(options.items())))
    try:
        hash(key)
    except TypeError:  # an option of a type no context takes: its own says which
        return _shoal.SharingContext(allocator, **options)
    with _producer_contexts_lock:
        context = _producer_contexts.get(key)
        if context is None:
            context = _shoal.SharingContext(allocator, **options)
            _producer_contexts[key] = context
        return context


def _device_of(where: str, device: Any) -> _shoal.Device:
    """`device=` as a shoal Device: a Device, a CUDA ordinal, "cuda:N", "cuda",
    "host" (or "cpu", "host:0", "cpu:0": host memory) or a torch.device."""
    if isinstance(device, _shoal.Device):
        return device
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):  # numpy's integers too
        device = operator.index(device)
        if device < 0:
            raise _shoal.InvalidArgumentError(f"{where}: device must be a CUDA ordinal >= 0, not {device!r}")
        return _shoal.cuda_device(device)
    if type(device).__module__.split(".")[0] == "torch" and hasattr(device, "type"):
        device = str(device)  # a torch.device: "cuda:3", "cuda" or "cpu"
    if isinstance(device, str):
        kind, _, ordinal = device.partition(":")
        if kind in ("host", "cpu") and ordinal in ("", "0"):  # shoal's one host device serves host memory
            return _shoal.host_device()
        if kind == "cuda" and not ordinal:
            default = _device_defaults.default_device()
            return default if default.kind == "cuda" else _shoal.cuda_device(0)
        if kind == "cuda" and ordinal.isdigit():
            return _shoal.cuda_device(int(ordinal))
        raise _shoal.InvalidArgumentError(
            f"{where}: device must be 'cuda:N', 'cuda', 'host' or 'cpu' (or a CUDA ordinal, a torch.device, "
            f"a shoal.Device), not {device!r}"
        )
    raise TypeError(
        f"{where}: device must be a shoal.Device, a CUDA ordinal, a torch.device or a str such as 'cuda:1', "
        f"not {type(device).__name__}"
    )


def _allocator_for(where: str, allocator: _shoal.Allocator | None, device: Any) -> _shoal.Allocator:
    """`allocator=` or `device=` as an allocator; without either, that of the
    calling thread's current CUDA device in PyTorch, else shoal's default device
    (see _device_defaults: shoal's CUDA device 0 is not made where PyTorch names another)."""
    if allocator is not None and not isinstance(allocator, _shoal.Allocator):
        raise TypeError(f"{where}: allocator must be a shoal.Allocator or None, not {type(allocator).__name__}")
    wanted = _device_of(where, device) if device is not None else None
    return _device_defaults.allocator_for(
        where, allocator, wanted, lambda: _device_defaults.allocator_on(_device_defaults.default_device())
    )


def _torch_stream(ordinal: int) -> _shoal.Stream:
    """PyTorch's current stream on CUDA device `ordinal`, as a shoal Stream."""
    import torch

    return _shoal.Stream.from_handle(torch.cuda.current_stream(ordinal).cuda_stream, _shoal.cuda_device(ordinal))


class _Leaf:
    """An array of a batch being sent: where it is in the batch, and for a
    torch tensor its device's ordinal and PyTorch's current stream there."""

    __slots__ = ("view", "path", "torch_ordinal", "torch_stream")

    def __init__(self, view: _shoal.ArrayView, path: str, torch_ordinal: int | None = None,
                 torch_stream: _shoal.Stream | None = None) -> None:
        self.view = view
        self.path = path
        self.torch_ordinal = torch_ordinal
        self.torch_stream = torch_stream


def _leaf_header(view: _shoal.ArrayView) -> bytes:
    return json.dumps(
        {
            "v": _VERSION,
            "dtype": view.dtype,
            "shape": list(view.shape),
            "strides": list(view.strides),
            "offset": view.offset,
            "readonly": view.readonly,
        },
        separators=(",", ":"),
    ).encode()


def _flatten(batch: Any, leaves: list, depth: int, path: str = "batch") -> Any:
    """The batch's structure with leaves replaced by their index in `leaves` (_Leaf objects)."""
    if depth > MAX_NESTING:
        raise _shoal.InvalidArgumentError(f"shoal.sharing: a batch nests deeper than {MAX_NESTING} levels")
    torch_ordinal = torch_stream = None
    if isinstance(batch, _shoal.Storage):
        batch = batch.view("uint8")
    elif type(batch).__module__.split(".")[0] == "torch":
        from . import torch as shoal_torch  # a CUDA tensor allocated on shoal: its own memory, no copy

        view = shoal_torch.share(batch)
        # Its writes were enqueued on PyTorch's current stream of its device
        # (shoal.torch.share records the block's use there): the consumer waits for that stream.
        torch_ordinal = batch.device.index
        torch_stream = _torch_stream(torch_ordinal)
        batch = view
    if isinstance(batch, _shoal.ArrayView):
        if len(leaves) >= MAX_ARRAYS_PER_BATCH:
            raise _shoal.InvalidArgumentError(f"shoal.sharing: a batch holds more than {MAX_ARRAYS_PER_BATCH} arrays")
        leaves.append(_Leaf(batch, path, torch_ordinal, torch_stream))
        return {"a": len(leaves) - 1}
    if isinstance(batch, (list, tuple)):
        return {
            "l" if isinstance(batch, list) else "t": [
                _flatten(x, leaves, depth + 1, f"{path}[{i}]") for i, x in enumerate(batch)
            ]
        }
    if isinstance(batch, dict):
        for key in batch:
            if not isinstance(key, str):
                raise TypeError(f"shoal.sharing: dict keys must be str, not {type(key).__name__}")
        return {"d": [[key, _flatten(value, leaves, depth + 1, f"{path}[{key!r}]")] for key, value in batch.items()]}
    raise TypeError(
        f"shoal.sharing: cannot send a {type(batch).__name__}: a batch holds shoal ArrayViews or Storages, "
        "or CUDA tensors allocated on shoal (shoal.torch.enable) "
        "(copy other arrays into shoal memory first), in lists, tuples and dicts"
    )


def _protocol_error(message: str) -> _shoal.ProtocolError:
    return _shoal.ProtocolError(f"shoal.sharing: {message}")


def _int_in(value: Any, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _protocol_error(f"{what} {value!r} is not an integer in [{low}, {high}]")
    return value


def _view_of(storage: _shoal.Storage, header: bytes) -> _shoal.ArrayView:
    """The ArrayView a producer's header describes, checked to lie inside `storage`."""
    try:
        h = json.loads(header)
    except (ValueError, RecursionError) as e:
        raise _protocol_error(f"an array header is not JSON ({e})") from None
    if not isinstance(h, dict) or h.get("v") != _VERSION:
        raise _protocol_error("an array header of another version or form")
    dtype, shape, strides = h.get("dtype"), h.get("shape"), h.get("strides")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(strides, list):
        raise _protocol_error("an array header without dtype, shape and strides")
    if len(shape) > _MAX_DIMS or len(strides) != len(shape):
        raise _protocol_error(f"an array of {len(shape)} dimensions with {len(strides)} strides")
    shape = [_int_in(d, 0, _MAX_EXTENT, "a dimension") for d in shape]
    strides = [_int_in(s, -_MAX_EXTENT, _MAX_EXTENT, "a stride") for s in strides]
    offset = _int_in(h.get("offset"), 0, _MAX_EXTENT, "an offset")
    readonly = h.get("readonly")
    if type(readonly) is not bool:
        raise _protocol_error("an array header without a readonly flag")
    try:
        return storage.view(dtype, shape, strides, offset, readonly)
    except (ValueError, TypeError) as e:  # bounds, dtype: checked by Storage.view
        raise _protocol_error(f"an array that does not fit what was sent ({e})") from None


def _rebuild(node: Any, arrays: list, depth: int, used: set) -> Any:
    if depth > MAX_NESTING or not isinstance(node, dict) or len(node) != 1:
        raise _protocol_error("a malformed batch structure")
    (kind, value), = node.items()
    if kind == "a":
        index = _int_in(value, 0, len(arrays) - 1, "an array index") if arrays else None
        if index is None or index in used:
            raise _protocol_error("a batch structure that names an array twice or one not sent")
        used.add(index)
        return arrays[index]
    if kind in ("l", "t") and isinstance(value, list):
        items = [_rebuild(x, arrays, depth + 1, used) for x in value]
        return items if kind == "l" else tuple(items)
    if kind == "d" and isinstance(value, list):
        out = {}
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                raise _protocol_error("a malformed dict entry in a batch")
            if pair[0] in out:  # a Producer's dict has each key once: one named twice would drop an array
                raise _protocol_error(f"a dict entry named twice in a batch ({pair[0]!r})")
            out[pair[0]] = _rebuild(pair[1], arrays, depth + 1, used)
        return out
    raise _protocol_error("a malformed batch structure")


class Producer:
    """Sends batches to a Consumer's address. One connection; not for use
    from several threads at once. With `max_ahead`, at most that many of
    its batches with arrays are ever sent and not yet received by the
    consumer process: put() waits for room first, so a producer faster than
    its consumer does not pile up batches (what the consumer took stays held
    while it keeps it). None: no limit.

    The arrays it sends are memory of `allocator` (``Producer.allocator``).
    `device` (a CUDA ordinal, ``"cuda:1"``, a torch.device, ``"host"`` or a
    shoal.Device; ``"cpu"`` and ``torch.device("cpu")`` name the host device,
    whose memory is host memory) names the device instead, for its default
    allocator: PyTorch's there when ``shoal.torch.enable()`` made shoal
    PyTorch's allocator, else the package's. With neither, nothing is chosen
    when the Producer is made: its first put() takes the device of the first
    CUDA tensor it holds, else the calling thread's current CUDA device in
    PyTorch where this process initialized CUDA in PyTorch
    (``torch.cuda.set_device``; PyTorch's current device is per thread, and
    a thread that set none has device 0), else shoal's default device. That
    first put — a batch without arrays, or of shoal memory alone, included —
    or the first read of ``context`` or ``peer`` (``close()`` included)
    fixes the allocator for good, and makes the SharingContext (its
    options were checked when the Producer was made): the tensors of a later
    put do not move it.
    Until then ``allocator`` is the one a put of this thread without tensors
    would take. An array on another device, or of another allocator, is
    refused by put() with an InvalidArgumentError saying which argument to
    pass."""

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        allocator: _shoal.Allocator | None = None,
        device: Any = None,
        allowed_uids: Sequence[int] = (),
        max_ahead: int | None = None,
        **options: int,
    ) -> None:
        address = _checks.socket_address("shoal.sharing.Producer", address)
        _checks.whole_number("shoal.sharing.Producer", "max_ahead", max_ahead, least=1, allow_none=True)
        self.max_ahead = None if max_ahead is None else operator.index(max_ahead)
        uids = _checks.uids("shoal.sharing.Producer", allowed_uids)
        # A misspelt option fails here, not at the first put.
        _check_options("shoal.sharing.Producer", ("allocator", "device", "allowed_uids", "max_ahead"), options)
        self._options = options
        # Both None until fixed: a Producer made without allocator= or device= chooses its
        # device at its first put (its tensors', else the putting thread's; see _fix).
        self._allocator: _shoal.Allocator | None = None
        self._context: _shoal.SharingContext | None = None
        if allocator is not None or device is not None:
            self._fix(_allocator_for("shoal.sharing.Producer", allocator, device))
        self._connection: _shoal.Connection | None = _shoal.connect(
            _checks.absolute_address("shoal.sharing.Producer", address), uids)
        # The Peer, made at the first put (or close): it binds the context's allocator for good.
        self._link: _shoal.Peer | None = None
        self._streams: set[_shoal.Stream] = set()  # what sent batches wait on
        # Arrays sent on the connection, those of puts taken back included, and
        # where each of the newest whole batches ended in that count. The
        # consumer takes a connection's arrays in order: a batch is taken once
        # no more than the arrays sent after it are untaken.
        self._arrays_sent = 0
        self._ends: collections.deque[int] = collections.deque(maxlen=self.max_ahead or 1)

    def put(self, batch: Batch, stream: _shoal.Stream | None = None, timeout: float | None = 60.0) -> None:
        """Sends `batch`; the consumer's stream waits for the work enqueued on
        `stream` before it uses the arrays (default: for a tensor, PyTorch's
        current stream of its device, as ``torch.cuda.stream(s)`` sets it; for
        shoal memory, shoal's current stream, as ``shoal.stream(s)`` sets it).
        With `max_ahead`, first waits until fewer than that many batches sent
        before are untaken, for at most `timeout` seconds (None: no limit):
        PeerTimeoutError then, and nothing of `batch` is sent (a Consumer in
        this same thread takes nothing meanwhile: take batches first).
        A put that fails part-way (an array that cannot be sent, a note over
        the size limit, a timeout) takes back the arrays it sent, so the next
        put arrives whole; where even that cannot be sent, the connection is
        closed and the next put raises ConnectionClosedError. When the
        address is not a Consumer's: a
        ProtocolError naming both protocols once that endpoint's greeting has
        come (a lender greets as it accepts), or ConnectionClosedError when it
        hung up first."""
        timeout = _checks.timeout_seconds("shoal.sharing.Producer.put", timeout)
        _checks.instance_of("shoal.sharing.Producer.put", "stream", stream, _shoal.Stream, "a shoal.Stream",
                            allow_none=True)
        if self._link is not None and self._link.closed:
            raise _shoal.ConnectionClosedError("shoal.sharing.Producer.put: this Producer is closed")
        leaves: list[_Leaf] = []
        structure = _flatten(batch, leaves, 0)
        if self._context is None:
            self._choose(leaves)
        self._check_devices(leaves)
        headers = [_leaf_header(leaf.view) for leaf in leaves]  # built before any array is sent
        # An endpoint of another protocol (a lender greets as it accepts) is
        # found out here: ProtocolError naming both.
        self._peer.check_greeting()
        if self.max_ahead is not None and leaves and len(self._ends) == self.max_ahead:
            self._wait_for_room(timeout)
        note = json.dumps({"v": _VERSION, "arrays": len(leaves), "batch": structure}, separators=(",", ":"))
        attempted = False  # a send may have gone although it raised: a Ctrl-C is raised as it returns
        waited: set[_shoal.Stream] = set()
        try:
            for leaf, header in zip(leaves, headers):
                # A tensor's writes are on PyTorch's current stream, shoal memory's on shoal's.
                on = stream if stream is not None else leaf.torch_stream
                attempted = True
                try:
                    self._peer.send(leaf.view, header, on)
                except _shoal.InvalidArgumentError as e:
                    # Refused: said in Python terms where its memory is another
                    # allocator's (told by the allocator itself, not by the message);
                    # the allocator's own memory (adopted: received, imported) keeps
                    # the binding's words, which say to copy it.
                    if isinstance(e, _shoal.ProtocolError) or leaf.view.storage.same_allocator(self.allocator):
                        raise
                    raise self._foreign(leaf) from None
                self._arrays_sent += 1
                waited.add(on if on is not None else _shoal.current_stream(self.allocator.device))
            self._peer.send_note(note.encode())
        except BaseException:
            if attempted:  # the consumer lets go of what came (nothing came: the note does nothing there)
                self._take_back()
            raise
        self._streams |= waited or {stream if stream is not None else _shoal.current_stream(self.allocator.device)}
        if leaves:
            self._ends.append(self._arrays_sent)

    @property
    def _peer(self) -> _shoal.Peer:
        if self._link is None:
            if self._connection is None:
                raise _shoal.ConnectionClosedError(
                    "shoal.sharing.Producer: closed (the connection failed as its first put began)"
                )
            # The Peer takes the connection whether or not it is made: one that
            # failed (an endpoint of another protocol) leaves this Producer closed.
            connection, self._connection = self._connection, None
            self._link = _shoal.Peer(self.context, connection)
        return self._link

    @property
    def _gone(self) -> bool:
        """No connection is left: closed, or lost as the Peer was made."""
        return self._connection is None and (self._link is None or self._link.closed)

    @property
    def allocator(self) -> _shoal.Allocator:
        """The allocator whose memory this Producer sends. For one made without
        allocator= or device=, until its first put (or a read of ``context`` or
        ``peer``) fixes it: the one a put of the calling thread without tensors
        would take now."""
        if self._allocator is not None:
            return self._allocator
        return _allocator_for("shoal.sharing.Producer", None, None)

    @property
    def context(self) -> _shoal.SharingContext:
        """The SharingContext of the allocator, shared by this process's Producers of
        that allocator and these options (so that what one sent another may send
        too; its stats and holders count them all): made, for a Producer made without
        allocator= or device=, at its first put or by this read, which fixes
        the allocator (on the calling thread's device, see Producer)."""
        if self._context is None:
            return self._fix(_allocator_for("shoal.sharing.Producer", None, None))
        return self._context

    def _fix(self, allocator: _shoal.Allocator) -> _shoal.SharingContext:
        """Fixes the allocator and takes its context (made at the first: it checks the options)."""
        context = _producer_context(allocator, self._options)
        self._allocator, self._context = allocator, context
        return context

    def _choose(self, leaves: list[_Leaf]) -> None:
        """The first put of a Producer made without allocator= or device=: the
        device of its first CUDA tensor, else the calling thread's default
        device (PyTorch's current one of this thread, else shoal's)."""
        ordinal = next((leaf.torch_ordinal for leaf in leaves if leaf.torch_ordinal is not None), None)
        if ordinal is None:
            self._fix(_allocator_for("shoal.sharing.Producer", None, None))
        else:
            self._fix(_device_defaults.allocator_on(_shoal.cuda_device(ordinal)))

    def _what(self, leaf: _Leaf) -> str:
        on = _device_defaults.device_text(leaf.view.storage.device)
        return f"a tensor on {on}" if leaf.torch_ordinal is not None else f"shoal memory on {on}"

    def _check_devices(self, leaves: list[_Leaf]) -> None:
        """An array on another device than the allocator's cannot be sent: said
        in Python terms, with the argument that fits it."""
        mine = self.allocator.device
        for leaf in leaves:
            device = leaf.view.storage.device
            if device == mine:
                continue
            on = _device_defaults.device_text(device)
            if leaf.torch_ordinal is not None:
                fix = f"device='{on}' (or allocator=shoal.torch.allocator({device.ordinal}))"
            else:
                fix = f"allocator= the shoal.Allocator it came from (or device='{on}' for that device's default one)"
            raise _shoal.InvalidArgumentError(
                f"shoal.sharing.Producer.put: {leaf.path} is {self._what(leaf)}, but this Producer sends memory "
                f"of an allocator on {_device_defaults.device_text(mine)} (one Producer, one device); for {on}, make a Producer "
                f"with {fix}"
            )

    def _foreign(self, leaf: _Leaf) -> _shoal.InvalidArgumentError:
        """The error for an array of this device that another allocator handed out."""
        if leaf.torch_ordinal is not None:
            fix = f"allocator=shoal.torch.allocator({leaf.torch_ordinal}) (or device='cuda:{leaf.torch_ordinal}')"
        else:
            fix = "allocator= the shoal.Allocator it came from"
        return _shoal.InvalidArgumentError(
            f"shoal.sharing.Producer.put: {leaf.path} is {self._what(leaf)} from another allocator than this "
            f"Producer's (Producer.allocator, on {_device_defaults.device_text(self.allocator.device)}); send memory of "
            f"Producer.allocator, or make the Producer with {fix}"
        )

    def _wait_for_room(self, timeout: float | None) -> None:
        """Waits until the oldest of the max_ahead newest batches is taken (a
        consumer that went away leaves room: the send then says so)."""
        try:
            self._peer.wait_taken(timeout, at_most=self._arrays_sent - self._ends[0])
        except _shoal.PeerTimeoutError:
            raise _shoal.PeerTimeoutError(
                f"shoal.sharing.Producer.put: the consumer (pid {self._peer.peer_pid}) had not taken the oldest "
                f"of the {self.max_ahead} batches ahead within {timeout} s; nothing of this batch was sent"
            ) from None

    def _take_back(self) -> None:
        """Tells the consumer to let go of the arrays of an unfinished batch."""
        try:
            self._peer.send_note(json.dumps({"v": _VERSION, "abort": True}).encode())
        except Exception:  # the consumer would count them into the next batch: end the connection instead
            self._peer.close()

    @property
    def peer(self) -> _shoal.Peer:
        """The connection (for stats, or notes both ways). Made on first use,
        by put() or here: from then on the Producer's allocator is fixed."""
        return self._peer

    def close(self, timeout: float | None = 60.0) -> None:
        """Waits until the work the sent batches wait on has run (no limit:
        it is this process's own), then until the consumer has taken every
        batch sent with arrays (received it, its memory mapped there and from
        then on outliving this process, or let it go), for at most `timeout`
        seconds (None: no limit; 0: looks once), then closes the connection;
        what was taken stays valid in the consumer. A consumer that went
        away first ends the wait without an error (what it had not taken is
        lost). A process that ends before that takes its batches along: the
        consumer cannot identify a producer gone before it accepted the
        connection, and reads of work that had not run fail there with
        StreamError. (A batch without arrays is a note alone and is not
        waited for. A Consumer takes connections and batches only inside
        get() and batches(): one in this same thread must take every batch
        put before this close, or it waits out `timeout`.) It also tells the
        consumer this producer ended (Consumer.batches counts one that put
        nothing). Raises PeerTimeoutError when
        the consumer had not taken every batch in time, StreamError when the
        work failed, ProtocolError when the address was not a Consumer's (an
        endpoint of another protocol hangs up at once: what put() sent is
        lost); the connection is closed either way (a timeout that is no
        wait is refused first: the producer stays open)."""
        timeout = _checks.timeout_seconds("shoal.sharing.Producer.close", timeout)
        if self._gone:
            self._streams.clear()
            return
        taken = True
        try:
            for stream in self._streams:
                stream.synchronize()
            if not self._peer.closed:
                # An endpoint of another protocol (a lender greets as it
                # accepts) hangs up at once, its greeting sent first: found out
                # here, before a send there fails and the connection can no
                # longer be read (ProtocolError naming both).
                with contextlib.suppress(_shoal.ConnectionClosedError):
                    self._peer.check_greeting()
                # Counts this producer as ended in a Consumer's batches() even
                # when it put nothing. A consumer gone already needs nothing.
                with contextlib.suppress(_shoal.ConnectionClosedError, _shoal.PeerTimeoutError):
                    self._peer.send_note(_END_NOTE)
                # Arrays of puts taken back after the last batch need no wait.
                last_end = self._ends[-1] if self._ends else 0
                try:
                    gone = not self._peer.wait_taken(timeout, at_most=self._arrays_sent - last_end)
                except _shoal.PeerTimeoutError:
                    taken = False
                else:
                    if gone:  # its greeting may have come during the wait
                        with contextlib.suppress(_shoal.ConnectionClosedError):
                            self._peer.check_greeting()
        finally:
            self._streams.clear()
            link = self._link  # none when making it failed above (ProtocolError): that error goes on
            pid = None if link is None or link.closed else link.peer_pid
            if link is not None:
                link.close()
        if not taken:
            raise _shoal.PeerTimeoutError(
                f"shoal.sharing.Producer.close: the consumer (pid {pid}) had not taken every batch sent "
                f"within {timeout} s; what it had not taken is lost if this process ends"
            )

    @property
    def closed(self) -> bool:
        """True once closed (by close(), the with block, or a first put whose connection
        failed). A consumer that hung up is found out by the next put() or close()
        (ConnectionClosedError, or close() returning at once)."""
        return self._gone

    def __repr__(self) -> str:
        if self.closed:
            return "shoal.sharing.Producer(closed)"
        pid = self._peer.peer_pid if self._connection is None else self._connection.peer_pid
        return f"shoal.sharing.Producer(to pid {pid})"

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """close(). When an exception leaves the block (Ctrl-C included) the
        connection closes at once, waiting neither for the work the batches
        wait on nor for the consumer, and that exception is what propagates:
        what the consumer had not taken, or reads of work that had not run,
        fail there if this process ends."""
        if kind is None:
            self.close()
            return
        self._streams.clear()
        if self._link is None:  # nothing put: the connection alone goes (no allocator, context or Peer made)
            connection, self._connection = self._connection, None
            if connection is not None:
                with contextlib.suppress(OSError, _shoal.ShoalError):
                    connection.close()
        elif not self._link.closed:
            self._link.close()


class _Incoming:
    """One producer's connection and the arrays of its batch in progress."""

    def __init__(self, peer: _shoal.Peer) -> None:
        self.peer = peer
        self.fd = peer.fileno()
        self.arrays: list = []
        # A producer's first message came: its end counts (producers_ended).
        self.sent_something = False
        # Seconds get() or batches() waited while this producer's batch stood unfinished
        # (Consumer.batch_timeout); back to 0 when a batch is whole.
        self.stalled = 0.0


class Consumer:
    """Receives batches from Producers — at most `max_producers` connected at
    once; one more is disconnected at once (its error kept in `errors`), so a
    process that connects over and over cannot exhaust this one's
    descriptors. A producer whose batch stays unfinished (arrays sent, its
    note not) while get() or batches() waits `batch_timeout` seconds in all is
    disconnected too, a PeerTimeoutError kept in `errors`, and the arrays it
    sent are let go. Only the waiting in get() and batches() counts (a get(timeout=0) that
    finds nothing waits no time), so a producer held back while this
    process works elsewhere is not cut off. None: no limit.
    Listens at `address` (a str or a pathlib.Path; default: a fresh name in
    the runtime directory, see shoal.runtime_dir_address). Batches arrive as
    memory of `allocator`'s device; `device` names it instead, for its
    default allocator (as Producer's); with neither, the current CUDA device
    in PyTorch of the thread that makes it (per thread) where this process
    initialized CUDA in PyTorch, else shoal's default device. Not for use
    from several threads at once, but for close(): another thread's, or a
    signal handler's, ends a waiting get() or batches() with the closed error."""

    def __init__(
        self,
        address: str | os.PathLike[str] | None = None,
        *,
        allocator: _shoal.Allocator | None = None,
        device: Any = None,
        allowed_uids: Sequence[int] = (),
        max_producers: int = 256,
        batch_timeout: float | None = 10.0,
        **options: int,
    ) -> None:
        if address is not None:
            address = _checks.socket_address("shoal.sharing.Consumer", address)
        uids = _checks.uids("shoal.sharing.Consumer", allowed_uids)
        _checks.whole_number("shoal.sharing.Consumer", "max_producers", max_producers, least=1)
        max_producers = operator.index(max_producers)
        _checks.real_number("shoal.sharing.Consumer", "batch_timeout", batch_timeout, "a number of seconds",
                            allow_none=True)
        if batch_timeout is not None and not (batch_timeout > 0 and math.isfinite(batch_timeout)):
            raise _shoal.InvalidArgumentError(
                "shoal.sharing.Consumer: batch_timeout must be a finite number of seconds above 0, or None"
            )
        self.max_producers = max_producers
        self.batch_timeout = batch_timeout
        self.allocator = _allocator_for("shoal.sharing.Consumer", allocator, device)
        _check_options("shoal.sharing.Consumer",
                       ("allocator", "device", "allowed_uids", "max_producers", "batch_timeout"), options)
        self.context = _shoal.SharingContext(self.allocator, **options)
        chosen = address is None
        if address is None:
            address = _shoal.runtime_dir_address(f"shoal-{os.getpid()}-{secrets.token_hex(6)}.sock")
        self._listener = _shoal.Listener(_checks.absolute_address("shoal.sharing.Consumer", address), uids)
        self.address: str = self._listener.address
        if chosen:  # socket files of consumers killed before they could remove them
            with contextlib.suppress(_shoal.BackendError):  # a folder that cannot be read: nothing to tidy
                self._listener.remove_abandoned_sockets("shoal-")
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener.fileno(), selectors.EVENT_READ, None)
        # close() from another thread, or from a signal handler inside a get(), writes
        # here so that the get()'s select returns at once (Python resumes a select a
        # signal interrupted).
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector.register(self._wake_reader.fileno(), selectors.EVENT_READ, _WAKE)
        self._call_lock = threading.RLock()  # held by get() and batches() while they run
        self._pid = os.getpid()  # a fork() child's close() leaves the parent's Consumer alone
        self._call_thread: int | None = None  # the thread of the call in flight
        self._torn_down = False
        self._incoming: dict[int, _Incoming] = {}
        # Producers that may have more messages waiting behind a batch just
        # returned: one readable socket can stand for several messages.
        self._unfinished: dict[int, _Incoming] = {}
        # Producers in the middle of a batch (batch_timeout watches them).
        self._partial: dict[int, _Incoming] = {}
        # Producers disconnected or refused, oldest first; the last MAX_ERRORS kept.
        self.errors: list[Exception] = []
        self._ended = 0  # producer connections ended (producers_ended)
        self._closed = False

    @property
    def producers(self) -> int:
        """Producers connected now."""
        return len(self._incoming)

    @property
    def producers_ended(self) -> int:
        """Producers ended since this consumer began: connections that had
        sent something (a batch, or a Producer's close() that had sent
        nothing) and then ended — closed by their producer after its last
        batch, gone, cut off (`errors` says why), or closed by close().
        Connections that sent nothing (a probe, one refused past
        `max_producers` or for its uid) are not counted."""
        return self._ended

    def get(self, timeout: float | None = None, stream: _shoal.Stream | None = None) -> Any:
        """The next whole batch from any producer, its arrays ready for work
        enqueued on `stream` (default: the current stream). Accepts producers
        as they connect. Raises PeerTimeoutError when `timeout` seconds pass
        first. A producer that sends a malformed batch is disconnected and
        its error kept in `errors`; one that goes away is forgotten (what it
        sent stays valid)."""
        batch = self._next("get", timeout, stream, None)
        assert batch is not None  # without an end count, only a batch or an exception leaves _next
        return batch

    def batches(
        self, producers: int, timeout: float | None = None, stream: _shoal.Stream | None = None
    ) -> "Batches":
        """An iterator over batches, as get() returns them, that ends once
        `producers` more producers have ended (counted from this call, see
        `producers_ended`), every batch each sent before its end yielded:
        the loop of a consumer that started that many producers.

            # sketch: start_producers and train_step are yours
            with shoal.sharing.Consumer() as consumer:
                start_producers(consumer.address, workers=4)
                for batch in consumer.batches(producers=4, timeout=60):
                    train_step(batch)

        `timeout`: seconds to wait for each next batch or end;
        PeerTimeoutError past it, after which the same iterator may be
        asked again. Give one: a producer gone before this consumer
        accepted its connection (killed, or one that put no arrays and
        ended at once: its close() waits only for batches with arrays) is
        not counted, nor is one refused past `max_producers` (`errors`
        names it), and without a timeout the loop would wait for it.
        Producers beyond `producers` may have batches left at the end."""
        return Batches(self, producers, timeout, stream)

    @property
    def _inherited(self) -> bool:
        """This is a fork() child's copy: the sockets are shared with the parent's Consumer."""
        return os.getpid() != self._pid

    def _check_call(self, caller: str, timeout: float | None) -> float | None:
        """`timeout` in seconds; InvalidArgumentError for a call on a closed consumer or with a
        timeout that is no wait."""
        if self._closed:
            raise _shoal.InvalidArgumentError(f"shoal.sharing.Consumer.{caller}: the consumer is closed")
        if self._inherited:
            # Its connections and listening socket are the parent's (their copies here read as
            # closed); a parent thread may hold the call lock.
            raise _shoal.DeviceUnavailableError(
                f"shoal.sharing.Consumer.{caller}: this Consumer was made in the parent process, and this is "
                "a fork() child; make a Consumer in this process")
        return _checks.timeout_seconds(f"shoal.sharing.Consumer.{caller}", timeout)

    def _next(
        self, caller: str, timeout: float | None, stream: _shoal.Stream | None, until_ended: int | None
    ) -> Batch | None:
        """The next whole batch; None once `producers_ended` reaches
        `until_ended` (a connection's batches come before its end). A close()
        meanwhile — another thread's, or a signal handler's in this one — ends
        it with the closed error; the consumer is torn down once it has."""
        timeout = self._check_call(caller, timeout)
        _checks.instance_of(f"shoal.sharing.Consumer.{caller}", "stream", stream, _shoal.Stream, "a shoal.Stream",
                            allow_none=True)
        with self._call_lock:
            self._call_thread = threading.get_ident()
            try:
                return self._next_in_call(caller, timeout, stream, until_ended)
            finally:
                self._call_thread = None
                if self._closed:
                    self._tear_down()

    def _closed_error(self, caller: str) -> _shoal.InvalidArgumentError:
        return _shoal.InvalidArgumentError(f"shoal.sharing.Consumer.{caller}: the consumer is closed")

    def _next_in_call(
        self, caller: str, timeout: float | None, stream: _shoal.Stream | None, until_ended: int | None
    ) -> Batch | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise self._closed_error(caller)
            if until_ended is not None and self._ended >= until_ended:
                return None
            self._drop_stalled()
            # Producers left with messages waiting, oldest turn first, then
            # those whose sockets are readable: each gets one turn a round.
            turns = list(self._unfinished.values())
            self._unfinished.clear()
            served = 0
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                started = time.monotonic()
                try:
                    ready = self._selector.select(0 if turns else self._wait_bound(left))
                except (OSError, ValueError):  # closed under it (a close that found no call in flight)
                    if self._closed:
                        raise self._closed_error(caller) from None
                    raise
                self._count_waiting(time.monotonic() - started)
                if self._closed:
                    raise self._closed_error(caller)
                for key, _ in ready:
                    if key.data is _WAKE:
                        # Not reached while open: close() marks it closed before it writes
                        # (a fork child's close() writes nothing). Read all the same, so that
                        # a stray byte cannot make every later select return at once.
                        with contextlib.suppress(OSError):
                            self._wake_reader.recv(64)
                        continue
                    if key.data is None:
                        self._accept()
                    elif all(key.data is not turn for turn in turns):
                        turns.append(key.data)
                for incoming in turns:
                    if served > 0 and deadline is not None and time.monotonic() >= deadline:
                        break  # the rest go first next call: many producers' turns cannot hold get() past it
                    served += 1
                    if self._incoming.get(incoming.fd) is not incoming:
                        continue  # dropped this round
                    batch = self._receive_from(incoming, stream)
                    if batch is not None:
                        self._unfinished[incoming.fd] = incoming  # more may wait behind it
                        return batch
            finally:
                # Those not served this round go first next time (also when
                # a call raised): their messages may wait without a readable socket.
                waiting = {t.fd: t for t in turns[served:] if self._incoming.get(t.fd) is t}
                self._unfinished = {**waiting, **self._unfinished}
            if until_ended is not None and self._ended >= until_ended:
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise _shoal.PeerTimeoutError(f"shoal.sharing: no batch within {timeout} s")

    def _wait_bound(self, left: float | None) -> float | None:
        """How long get() may wait in select: `left` (at most _MAX_SELECT_WAIT: the loop
        waits again for the rest), or less when a partial batch's producer would reach
        batch_timeout first."""
        if left is not None:
            left = min(left, _MAX_SELECT_WAIT)
        if self.batch_timeout is None or not self._partial:
            return left
        first = max(0.0, min(self.batch_timeout - incoming.stalled for incoming in self._partial.values()))
        first = min(first, _MAX_SELECT_WAIT)
        return first if left is None else min(left, first)

    def _count_waiting(self, waited: float) -> None:
        """Adds get()'s wait to every producer in the middle of a batch."""
        for incoming in self._partial.values():
            incoming.stalled += waited

    def _drop_stalled(self) -> None:
        """Disconnects the producers whose batch stood unfinished through
        batch_timeout seconds of get()'s waiting (each had its turn after
        the last of it)."""
        if self.batch_timeout is None:
            return
        for incoming in [i for i in self._partial.values() if i.stalled >= self.batch_timeout]:
            self._note_error(
                _shoal.PeerTimeoutError(
                    f"shoal.sharing: pid {incoming.peer.peer_pid} left a batch unfinished "
                    f"({len(incoming.arrays)} arrays, no note) through {self.batch_timeout} s of waiting"
                )
            )
            self._drop(incoming)

    def _note_error(self, error: Exception) -> None:
        self.errors.append(error)
        del self.errors[:-MAX_ERRORS]  # a peer reconnecting in a loop cannot grow it without bound

    def _accept(self) -> None:
        try:
            connection = self._listener.accept(timeout=0)
        except (_shoal.PeerRefusedError, _shoal.ConnectionClosedError) as e:
            self._note_error(e)
            return
        if connection is None:
            return
        if len(self._incoming) >= self.max_producers:
            self._note_error(
                _shoal.PeerRefusedError(
                    f"shoal.sharing: pid {connection.peer_pid} refused: {self.max_producers} producers are connected"
                )
            )
            connection.close()  # that producer's next put raises ConnectionClosedError
            return
        pid = connection.peer_pid
        try:
            peer = _shoal.Peer(self.context, connection)
        except (_shoal.ConnectionClosedError, _shoal.BackendError) as e:  # gone already, or no descriptors left
            self._note_error(e)
            return
        except _shoal.ProtocolError as e:  # e.g. it takes no descriptors (SO_PASSRIGHTS off): not a producer
            named = _shoal.ProtocolError(f"shoal.sharing: pid {pid} was refused: {e}")
            named.__cause__ = e
            self._note_error(named)
            return
        incoming = _Incoming(peer)
        self._incoming[incoming.fd] = incoming
        self._selector.register(incoming.fd, selectors.EVENT_READ, incoming)

    def _drop(self, incoming: _Incoming) -> None:
        self._selector.unregister(incoming.fd)
        del self._incoming[incoming.fd]
        self._unfinished.pop(incoming.fd, None)
        self._partial.pop(incoming.fd, None)
        incoming.arrays.clear()
        incoming.peer.close()
        if incoming.sent_something:
            self._ended += 1

    def _receive_from(self, incoming: _Incoming, stream: _shoal.Stream | None) -> Batch | None:
        """Reads the messages of `incoming` that have come; returns its batch
        once whole."""
        try:
            for _ in range(_MESSAGES_PER_TURN):
                message = incoming.peer.try_receive(stream=stream)
                if message is None:
                    if incoming.peer.pending() > 0:  # it stopped short: more waits without a readable socket
                        self._unfinished[incoming.fd] = incoming
                    return None
                incoming.sent_something = True
                storage, metadata = message
                if storage is not None:
                    if len(incoming.arrays) >= MAX_ARRAYS_PER_BATCH:
                        raise _protocol_error(f"more than {MAX_ARRAYS_PER_BATCH} arrays in one batch")
                    incoming.arrays.append(_view_of(storage, metadata))
                    self._partial[incoming.fd] = incoming
                    continue
                try:
                    note = json.loads(metadata)
                except (ValueError, RecursionError) as e:
                    raise _protocol_error(f"a batch note that is not JSON ({e})") from None
                if isinstance(note, dict) and note.get("v") == _VERSION and note.get("abort") is True:
                    # A put that failed part-way takes its arrays back.
                    incoming.arrays = []
                    self._partial.pop(incoming.fd, None)
                    incoming.stalled = 0.0
                    continue
                if metadata == _END_NOTE and not incoming.arrays:
                    continue  # a Producer's close(): nothing more comes
                if (
                    not isinstance(note, dict)
                    or type(note.get("v")) is not int  # JSON true would equal 1
                    or note.get("v") != _VERSION
                    or type(note.get("arrays")) is not int
                    or note.get("arrays") != len(incoming.arrays)
                ):
                    raise _protocol_error("a batch note that does not match the arrays sent")
                used: set = set()
                batch = _rebuild(note.get("batch"), incoming.arrays, 0, used)
                if len(used) != len(incoming.arrays):
                    raise _protocol_error("a batch structure that leaves arrays out")
                incoming.arrays = []
                incoming.stalled = 0.0
                self._partial.pop(incoming.fd, None)
                return batch
            # Its turn is over (a peer that keeps sending cannot hold get()
            # past its deadline, nor the others back); the rest waits.
            self._unfinished[incoming.fd] = incoming
        except _shoal.ConnectionClosedError:
            self._drop(incoming)
        except _shoal.ProtocolError as e:
            # Named by its pid: with several producers, `errors` must say which was cut off.
            said = str(e).removeprefix("shoal.sharing: ")
            named = _shoal.ProtocolError(f"shoal.sharing: pid {incoming.peer.peer_pid} was cut off: {said}")
            named.__cause__ = e
            self._note_error(named)
            incoming.sent_something = True  # cut off: a producer's end all the same
            self._drop(incoming)
        except BaseException as interrupted:
            # Ctrl-C (raised as a native call returns, after it took a message) or Python out of
            # memory: a message may be lost, so this connection's batch can no longer be counted
            # right. It goes, said, rather than cut off a producer for a mismatch later.
            self._note_error(_shoal.ConnectionClosedError(
                f"shoal.sharing: pid {incoming.peer.peer_pid}'s connection was closed: a read of it was "
                f"interrupted ({type(interrupted).__name__}), and what it had sent of a batch may be lost"))
            incoming.sent_something = True
            self._drop(incoming)
            raise
        return None

    def close(self) -> None:
        """Disconnects every producer and stops listening; batches received
        stay valid. A get() or batches() waiting in another thread ends with
        the closed error, and close() returns once it has; called from a
        signal handler inside this thread's get(), close() returns at once
        and that get() ends with the closed error. In a fork() child of the
        process that made it, close() (and the end of a ``with`` block) closes
        only the child's copies of its sockets: the parent's Consumer goes on."""
        if self._closed:
            return
        self._closed = True
        if self._inherited:
            # A fork() child's copy: the connections, the listening name and
            # the wake-up socket pair are shared with the parent, whose get()
            # may hold the call lock (its thread is not here). Only this
            # process's descriptors go; nothing is sent.
            self._torn_down = True
            for closable in (self._selector, self._wake_reader, self._wake_writer, self._listener):
                with contextlib.suppress(OSError, _shoal.ShoalError):
                    closable.close()
            return
        with contextlib.suppress(OSError):  # full or closed: a wake-up is there already
            self._wake_writer.send(b"\0")
        if self._call_thread == threading.get_ident():
            return  # inside this thread's call, which tears down as it ends
        with self._call_lock:
            self._tear_down()

    def _tear_down(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        for incoming in list(self._incoming.values()):
            self._drop(incoming)
        self._selector.close()
        self._listener.close()
        self._wake_reader.close()
        self._wake_writer.close()

    @property
    def closed(self) -> bool:
        """True once close() has begun."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.producers} producers"
        return f"shoal.sharing.Consumer({self.address!r}, {state}, {len(self.errors)} errors)"

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Batches:
    """Consumer.batches(): an iterator over batches that ends once a number
    of producers have ended. PeerTimeoutError from next() leaves it usable."""

    def __init__(
        self, consumer: Consumer, producers: int, timeout: float | None, stream: _shoal.Stream | None
    ) -> None:
        _checks.whole_number("shoal.sharing.Consumer.batches", "producers", producers)
        producers = operator.index(producers)
        consumer._check_call("batches", timeout)
        _checks.instance_of("shoal.sharing.Consumer.batches", "stream", stream, _shoal.Stream, "a shoal.Stream",
                            allow_none=True)
        self._consumer = consumer
        self._until = consumer.producers_ended + producers
        self._timeout = timeout
        self._stream = stream
        self._done = False

    @property
    def producers_left(self) -> int:
        """Producers still to end before the iteration does."""
        return max(0, self._until - self._consumer.producers_ended)

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        batch = self._consumer._next("batches", self._timeout, self._stream, self._until)
        if batch is None:
            self._done = True
            raise StopIteration
        return batch
