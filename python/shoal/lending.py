"""Borrowing device memory from a lender (the memory daemon), and lending it.

One process owns a GPU's memory and lends it region by region to worker processes over a
UNIX socket whose peer credentials are checked; a worker maps each region at its own address
and gets it as a :class:`shoal.Storage`, so views, DLPack and copies work as for any
storage::

    import shoal, shoal.lending, torch

    with shoal.lending.Borrower(shoal.runtime_dir_address("lender.sock")) as borrower:  # `shoal daemon`'s default
        region = borrower.borrow(1 << 30, "parameters")            # a Storage of >= 1 GiB
        weights = torch.from_dlpack(region.view("float16", (512, 1 << 20)))

The region is given back once the storage and every view of it are gone (after the streams
it was used on have passed their work). A lender's refusals are typed: ``OutOfMemoryError``
(its capacity: not that much free, a wait that ran out, a borrow without a wait while
others wait), ``PeerRefusedError`` (this borrower's quota, or turned away as it connects:
as many borrowers as the lender admits are connected, or a user it does not admit),
``InvalidArgumentError`` (a bad request); a lender that does not answer in time gives
``PeerTimeoutError`` (a region it lends later is given back unmapped at this borrower's
next call, or as it closes). When a borrower dies — SIGKILL included — the lender reclaims
its regions.

:class:`Lender` runs the lender in this process (on its own thread); ``status()`` says who
holds what, and ``metrics()`` gives the Prometheus text. Models take turns by revocation
and waiting: the next model's ``borrow(..., wait=30.0)`` waits at the lender, in line; the
lender's operator (``Lender.revoke`` in its process, or ``Borrower.revoke`` /
``shoal daemon revoke`` from a process of the lender's uid) asks a region back, its
borrower sees it in ``revocations()`` and drops the region, and the waiting borrow is lent
it at once. Give each model its own :class:`Borrower`: a borrower's calls go one at a time.

Shared read-only regions: several processes serving one model map one copy of its weights. A
writer borrows a region under the model's name, fills it, and publishes it with a layout (named
entries: offset, size, dtype, shape); from then on it is immutable. Readers ask for it by name
and get a :class:`SharedRegion`, whose entries are read-only array views::

    # sketch: writer and reader are Borrowers, embed a float16 CUDA tensor of 4096 x 4096
    import torch
    from shoal.lending import Entry

    region = writer.borrow(4096 * 4096 * 2, "llama-7b@v3")
    torch.from_dlpack(region.view("float16", (4096, 4096))).copy_(embed)   # fill; the view goes at once
    shared = writer.publish(region, [Entry("embed", 0, 4096 * 4096 * 2, "float16", (4096, 4096))])
    # in each reader process:
    weights = reader.borrow_shared("llama-7b@v3", expected_hash=shared.hash)
    embed = torch.from_dlpack(weights.entry("embed"))                       # read-only

Every holder maps a shared region read-only (a write through it faults). The content hash is
SHA-256 of the entries' bytes in offset order, computed by the writer; a reader that asks with
``expected_hash`` is refused with ``ContentMismatchError`` when the writer committed another,
and ``SharedRegion.verify()`` hashes what it mapped. The hash is the writer's claim: it tells a
reader it has the model it asked for, not that the writer is honest.
"""

from __future__ import annotations

import collections.abc
import operator
import os
import threading
import time
import weakref
from types import TracebackType
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

from . import _checks, _device_defaults, _shoal, default_allocator

__all__ = ["Borrower", "CancelEvent", "Entry", "Lender", "RevocationWatcher", "SharedRegion"]

class CancelEvent(Protocol):
    """What ``Borrower.borrow(cancel=...)`` and ``Borrower.revocations(cancel=...)`` take: a
    ``threading.Event``, or anything whose ``is_set()`` says (as a truth value) whether to
    stop. It is called about every 50 ms while a borrow waits, with the borrower's connection
    held (and every 10 ms while ``revocations`` waits): it must not call the same
    ``Borrower``."""

    def is_set(self) -> bool: ...


# The longest wait the protocol carries (2**32 - 1 ms): "as long as the lender allows".
_FOREVER = 4294967.295


class Entry(NamedTuple):
    """One named entry of a region's layout: ``nbytes`` bytes at ``offset`` holding a
    row-major array of ``dtype`` (a name: 'float16', 'bfloat16', 'float32', 'int64', 'bool',
    ...) and ``shape``. A layout given to ``Borrower.publish`` may spell the dtype as
    ``Storage.view`` takes it ('f4', numpy.float32, numpy.dtype('float16')): a published
    layout's entries name it as shoal does ('float32'). ``nbytes`` must be the shape's element count times the dtype's size, and
    ``offset`` a multiple of that size."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def _entries(where: str, layout: Sequence[Union[Entry, tuple]]) -> list[tuple]:
    """The layout as the native layer takes it, each field checked by name."""
    _checks.instance_of(where, "layout", layout, collections.abc.Iterable, "a sequence of Entry")
    out = []
    for i, e in enumerate(layout):
        said = f"layout[{i}]"
        _checks.instance_of(where, said, e, tuple, "an Entry (or a tuple of its fields)")
        if len(e) != len(Entry._fields):
            raise _shoal.InvalidArgumentError(
                f"{where}: {said} must have the {len(Entry._fields)} fields of an Entry {Entry._fields}, not {e!r}")
        name, offset, nbytes, dtype, shape = e
        _checks.instance_of(where, f"{said}.name", name, str, "a str")
        _checks.whole_number(where, f"{said}.offset", offset)
        _checks.whole_number(where, f"{said}.nbytes", nbytes)
        _checks.instance_of(where, f"{said}.shape", shape, collections.abc.Iterable, "a sequence of whole numbers")
        shape = list(shape)
        for k, extent in enumerate(shape):
            _checks.whole_number(where, f"{said}.shape[{k}]", extent)
        # The dtype as given: the native layer reads numpy's spellings of it as a view's, and names it as shoal does.
        out.append((name, operator.index(offset), operator.index(nbytes), dtype, [operator.index(x) for x in shape]))
    return out


_HASH_BYTES = 32  # SHA-256


def _hash_bytes(where: str, name: str, hash: Union[bytes, str, None]) -> Optional[bytes]:
    """A content hash given as bytes or hex digits (or None), as bytes."""
    _checks.instance_of(where, name, hash, (bytes, str), "bytes (or their hex digits as a str)", allow_none=True)
    if hash is None:
        return None
    try:
        digest: Optional[bytes] = hash if isinstance(hash, bytes) else bytes.fromhex(hash)
    except ValueError:
        digest = None
    if digest is None or len(digest) != _HASH_BYTES:
        raise _shoal.InvalidArgumentError(
            f"{where}: {name} must be {_HASH_BYTES} bytes (SHA-256) or their {2 * _HASH_BYTES} hex digits, "
            f"not {hash!r}")
    return digest


class SharedRegion:
    """A published region mapped read-only in this process, with its layout. Its entries come
    out as read-only :class:`shoal.ArrayView` s (DLPack 1.x consumers see them read-only); this
    process's hold is given back once ``close()`` was called (or this object is gone) and every
    view of it is gone. Usable from several threads at once; after ``close()``, :meth:`entry` and
    :meth:`verify` raise ``InvalidArgumentError`` and views taken before stay valid."""

    def __init__(self, storage: _shoal.Storage) -> None:
        layout = _shoal._region_layout(storage)
        region = _shoal._region_id(storage)
        if layout is None or region is None:
            raise _shoal.InvalidArgumentError("shoal.lending.SharedRegion: the storage is not a shared region")
        self._storage: Optional[_shoal.Storage] = storage
        self._layout = [Entry(n, o, b, d, tuple(s)) for (n, o, b, d, s) in layout[0]]
        self._hash: bytes = layout[1]
        self._id: int = region
        self._nbytes: int = storage.nbytes

    @property
    def id(self) -> int:
        """The region's id at the lender (the same in every process holding it)."""
        return self._id

    @property
    def nbytes(self) -> int:
        """The region's size in bytes."""
        return self._nbytes

    @property
    def layout(self) -> list[Entry]:
        """The entries its writer committed, in the order it listed them."""
        return list(self._layout)

    @property
    def hash(self) -> bytes:
        """The content hash its writer committed (32 bytes of SHA-256; ``.hex()`` to print)."""
        return self._hash

    def entry(self, name: str) -> _shoal.ArrayView:
        """A read-only array view of the entry ``name`` (its dtype and shape, on the mapped
        memory; no copy). ``InvalidArgumentError`` for a name the layout does not have."""
        for e in self._layout:
            if e.name == name:
                return self._open().view(e.dtype, list(e.shape), offset=e.offset, readonly=True)
        raise _shoal.InvalidArgumentError(
            f"shoal.lending.SharedRegion.entry: no entry is named {name!r}; the layout has {[e.name for e in self._layout]}"
        )

    def verify(self) -> bool:
        """Whether the entries' bytes as mapped here hash to the committed hash (reads every
        entry: device memory is copied to the host piece by piece)."""
        entries = _entries("shoal.lending.SharedRegion.verify", self._layout)
        return _shoal._content_hash(self._open(), entries) == self._hash

    def close(self) -> None:
        """Drops this object's reference: the hold is given back once every view is gone too."""
        self._storage = None

    @property
    def closed(self) -> bool:
        """True once close() has dropped this object's reference."""
        return self._storage is None

    def _open(self) -> _shoal.Storage:
        if self._storage is None:
            raise _shoal.InvalidArgumentError("shoal.lending.SharedRegion: closed")
        return self._storage

    def __enter__(self) -> "SharedRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        return f"shoal.lending.SharedRegion(id={self._id}, nbytes={self._nbytes}, entries={len(self._layout)}{closed})"


def _allocator_on(where: str, device: Optional[_shoal.Device], allocator: Optional[_shoal.Allocator]) -> _shoal.Allocator:
    """`allocator=`, or `device=`'s allocator, or the default device's."""
    if device is not None and not isinstance(device, _shoal.Device):
        raise TypeError(f"{where}: device must be a shoal.Device or None, not {type(device).__name__}")
    return _device_defaults.allocator_for(where, allocator, device, default_allocator)


class Borrower:
    """A connection to the lender at ``address`` (a socket path, a str or a pathlib.Path, or
    ``@name`` for an abstract name); the lender's uid must be this process's or in ``allowed_uids``.

    Kept mappings: a region given back stays mapped in this process (up to
    ``kept_mapping_bytes`` at once) when ``keep_mappings`` is on, so that the same memory lent
    to this borrower again — the lender lends given-back memory again within one uid — comes
    back at the same address with no import or map (a re-borrow then costs a round trip). The
    lender tells the borrower to unmap it when it releases that memory; keep nothing in a region
    after giving it back. ``keep_mappings=False`` unmaps every region as it is given back.

    ``observer=True`` connects as an observer: :meth:`metrics` and :meth:`revoke` only
    (borrowing raises ``InvalidArgumentError``), never counted among the lender's borrowers
    and served while it has all the borrowers it admits (up to its ``max_observers``
    observers) — how a dashboard or an operator's script looks at a full lender.

    Regions are mapped on ``device`` (the lender's; default: the default device, as for
    :class:`Lender`) through ``allocator`` (default: one of that device's); pass either.

    Usable from several threads: its requests go to the lender one at a time, each call waiting
    behind the one in progress up to its own timeout (:meth:`revocations` waits without a turn),
    and ``close()`` from another thread ends a waiting call."""

    def __init__(
        self,
        address: Union[str, os.PathLike[str]],
        *,
        device: Optional[_shoal.Device] = None,
        allocator: Optional[_shoal.Allocator] = None,
        allowed_uids: Sequence[int] = (),
        timeout: float = 5.0,
        keep_mappings: bool = True,
        kept_mapping_bytes: int = 16 << 30,
        observer: bool = False,
    ) -> None:
        address = _checks.socket_address("shoal.lending.Borrower", address)
        _checks.whole_number("shoal.lending.Borrower", "kept_mapping_bytes", kept_mapping_bytes)
        _checks.real_number("shoal.lending.Borrower", "timeout", timeout, "a number of seconds")
        allowed_uids = _checks.uids("shoal.lending.Borrower", allowed_uids)
        self._address = address
        self._allocator = _allocator_on("shoal.lending.Borrower", device, allocator)
        self._watch_lock = threading.Lock()  # the one-reader rule: a watcher, or revocations() calls
        self._watcher: Optional[weakref.ref[RevocationWatcher]] = None
        self._reading = 0  # revocations() calls in progress
        self._native = _shoal.Borrower(address, self._allocator.device, list(allowed_uids), timeout,
                                       keep_mappings, kept_mapping_bytes, observer)

    def kept(self) -> tuple[int, int]:
        """``(count, bytes)`` of the given-back regions whose mappings this borrower keeps."""
        return self._native.kept()

    def borrow(
        self,
        nbytes: int,
        purpose: str,
        *,
        timeout: float = 5.0,
        wait: Optional[float] = 0.0,
        cancel: Optional[CancelEvent] = None,
    ) -> _shoal.Storage:
        """A region of at least ``nbytes`` (rounded up to the device's granularity) for
        ``purpose`` (1 to 64 printable ASCII characters), mapped in this process.

        ``wait``: how many seconds a region that does not fit may wait at the lender for
        memory to be given back (another model's turn ending, a revoke answered), in line
        behind the borrows that came first; ``None``: as long as the lender allows. The lender
        cuts a wait to its ``max_wait`` (5 minutes unless configured). With no wait (the
        default) a region that does not fit is refused at once.

        Raises ``OutOfMemoryError``, its ``reason`` saying which, when: not that much is free
        and the borrow has no wait (``"capacity"``); the wait ran out (``"wait_expired"``); the
        borrow has no wait and others wait in line (``"others_waiting"``: the memory given
        back goes to them first; a model that holds memory and asks for more, with a wait,
        gets in line behind them); it could never fit (``"cannot_fit"``: past the capacity, or
        beside this borrower's own regions: nothing is given back on a connection while its
        borrow waits). ``PeerRefusedError``
        for this borrower's or its user's quota (what its other connections wait for counts
        too); ``PeerTimeoutError`` when no answer comes within ``wait`` plus ``timeout``
        seconds, or another call of this borrower holds the connection past ``timeout``.

        A borrower's calls go one at a time: while this one waits, the others wait behind
        it (a region dropped meanwhile is unmapped at once and given back at the next call),
        so give each model its own ``Borrower``. Three things end a waiting borrow within
        about 50 ms: ``cancel`` being set (``cancel``: a ``threading.Event`` another thread
        sets; ``shoal.CancelledError``, the borrower still usable — for worker threads,
        where Ctrl-C does not reach), Ctrl-C (``KeyboardInterrupt``, on the main thread),
        and :meth:`close` from another thread (``ConnectionClosedError``). The lender is
        told, and a region it lent just before is given back unmapped at this borrower's
        next call (or as it closes). A ``cancel`` set before the call raises
        ``CancelledError`` without asking (with ``wait=0`` that is all it does).
        ``OutOfMemoryError`` with ``reason`` ``"stopped_waiting"``: the lender ended the wait
        because this borrower's own regions were preempted for a borrow ahead of it (see
        :meth:`revocations`)."""
        _checks.whole_number("shoal.lending.Borrower.borrow", "nbytes", nbytes, least=1)
        _checks.real_number("shoal.lending.Borrower.borrow", "timeout", timeout, "a number of seconds")
        _checks.real_number("shoal.lending.Borrower.borrow", "wait", wait, "a number of seconds", allow_none=True)
        _checks.cancel_event("shoal.lending.Borrower.borrow", cancel)
        _checks.instance_of("shoal.lending.Borrower.borrow", "purpose", purpose, str,
                            "a str of 1 to 64 printable ASCII characters")
        return self._native._borrow(
            self._allocator, nbytes, purpose, timeout, _FOREVER if wait is None else wait, cancel)

    def publish(
        self,
        region: _shoal.Storage,
        layout: Sequence[Union[Entry, tuple]],
        hash: Union[bytes, str, None] = None,
        timeout: float = 5.0,
    ) -> SharedRegion:
        """Publishes ``region`` (a region this borrower borrowed, filled) under the purpose it was
        borrowed for, with ``layout`` (:class:`Entry` s or tuples of the same fields) and its
        content hash (``hash``: computed here from the entries when None). Every view, DLPack
        export and tensor of ``region`` must be gone: the writable mapping is given up (``region``
        is emptied; using it raises) and the region comes back read-only. A layout has at most one
        entry per 16 KiB of the region (at least 128 allowed, at most 4096: the lender keeps it for
        the region's life). ``InvalidArgumentError``
        for live views or a malformed layout (the region left as it was); when the lender refuses
        (the name is published already) the region is given back and the refusal raised."""
        where = "shoal.lending.Borrower.publish"
        _checks.instance_of(where, "region", region, _shoal.Storage, "a shoal.Storage (a region borrow() returned)")
        entries = _entries(where, layout)
        digest = _hash_bytes(where, "hash", hash)
        _checks.real_number(where, "timeout", timeout, "a number of seconds")
        return SharedRegion(self._native._publish(self._allocator, region, entries, digest, timeout))

    def borrow_shared(
        self,
        name: str,
        expected_hash: Union[bytes, str, None] = None,
        timeout: float = 5.0,
        expected_writer_uid: Optional[int] = None,
    ) -> SharedRegion:
        """Maps, read-only, the region published as ``name``, with its layout. With
        ``expected_hash`` (bytes or hex), ``ContentMismatchError`` unless its writer committed
        that hash; with ``expected_writer_uid``, ``ContentMismatchError`` unless a process of
        that uid published it (names are first come among the uids the lender admits). Its
        bytes count in full against this borrower's quota."""
        where = "shoal.lending.Borrower.borrow_shared"
        _checks.instance_of(where, "name", name, str, "a str")
        expected = _hash_bytes(where, "expected_hash", expected_hash)
        _checks.real_number(where, "timeout", timeout, "a number of seconds")
        _checks.whole_number(where, "expected_writer_uid", expected_writer_uid, most=_checks.UID_MAX, allow_none=True)
        return SharedRegion(self._native._borrow_shared(self._allocator, name, expected, expected_writer_uid, timeout))

    def revocations(self, wait: float = 0.0, *, cancel: Optional[CancelEvent] = None) -> list[tuple[int, float]]:
        """The lender's requests to give regions back, as (region id, seconds left), waiting up to
        ``wait`` seconds for a first one (or until ``cancel`` is set: the wait ends within about
        10 ms, with the revokes that came). Answer each by dropping every reference to that
        region's storage (and its views) before the time is up: it is given back as it goes
        (or, while a borrow of this borrower waits, when that borrow ends: take turns with
        one ``Borrower`` per model). Revokes that another call of this borrower read are
        returned at once, whatever that call is doing; it holds no connection, so a thread of
        its own may watch with a ``wait`` while other threads borrow (or let
        :meth:`watch_revocations` do it). Each revoke is returned once (unless a watcher that
        stopped part-way through a batch put it back, unanswered). Until the region goes
        it stays mapped and usable (``revoking`` in the lender's status); seconds left below 0
        mean the deadline has passed. A borrower that lets the time pass keeps the region, the
        lender names it in its log and does not ask again.

        ``InvalidArgumentError`` while a :class:`RevocationWatcher` watches this borrower (one
        of the two would miss revokes the other read)."""
        _checks.real_number("shoal.lending.Borrower.revocations", "wait", wait, "a number of seconds")
        _checks.cancel_event("shoal.lending.Borrower.revocations", cancel)
        counted = False
        try:
            with self._watch_lock:
                self._refuse_while_watched("revocations")
                self._reading += 1
                counted = True
            return self._native.revocations(wait, cancel)
        finally:
            if counted:
                with self._watch_lock:
                    self._reading -= 1

    def watch_revocations(self, on_revoke: Callable[[int, float], object]) -> RevocationWatcher:
        """Calls ``on_revoke(region id, seconds left)`` on a thread of its own for each revoke
        this borrower has not read yet (those that came before included), until the returned
        :class:`RevocationWatcher` stops (:meth:`RevocationWatcher.stop`, the end of its
        ``with`` block) or this borrower closes. One watcher for the borrower's life is the
        pattern: a turn's end is an event the serving loop looks at between batches::

            # sketch: nbytes, serve and next_batch are yours
            turn_over = threading.Event()
            with borrower.watch_revocations(lambda region, left: turn_over.set()) as watcher:
                while True:                      # one turn after another
                    turn_over.clear()
                    weights = borrower.borrow(nbytes, "model A", wait=60.0)
                    while watcher.watching and not turn_over.is_set():
                        serve(next_batch())
                    del weights                  # and every view of it: it goes back

        ``on_revoke`` runs on the watcher's thread: keep it short (set an event, queue the
        id) and drop the region where the model runs. One watcher per borrower at a time,
        and none while a :meth:`revocations` call waits: ``InvalidArgumentError``;
        ``ConnectionClosedError`` for a closed borrower. The watcher holds the borrower
        weakly: dropping the borrower closes its connection and ends the watcher."""
        return RevocationWatcher(self, on_revoke)

    def _start_watching(self, watcher: RevocationWatcher) -> None:
        with self._watch_lock:
            if self.closed:
                raise _shoal.ConnectionClosedError("shoal.lending.Borrower.watch_revocations: the borrower is closed")
            self._refuse_while_watched("watch_revocations")
            if self._reading:
                raise _shoal.InvalidArgumentError(
                    "shoal.lending.Borrower.watch_revocations: a revocations() call of this borrower waits; each "
                    "revoke is returned once, so one of the two would miss some (let it return first)")
            self._watcher = weakref.ref(watcher)
            watcher._active = True

    def _refuse_while_watched(self, who: str) -> None:
        watcher = self._watcher() if self._watcher is not None else None
        if watcher is not None and watcher.watching:
            raise _shoal.InvalidArgumentError(
                f"shoal.lending.Borrower.{who}: a RevocationWatcher watches this borrower; each revoke is "
                "returned once, so one of the two would miss some (stop it first, or let it call you back)")

    @staticmethod
    def region_id(storage: _shoal.Storage) -> Optional[int]:
        """The id of the borrowed region behind ``storage`` (what ``revocations`` names), or
        None for a storage that is not a borrowed region."""
        _checks.instance_of("shoal.lending.Borrower.region_id", "storage", storage, _shoal.Storage, "a shoal.Storage")
        return _shoal._region_id(storage)

    def metrics(self, timeout: float = 5.0) -> str:
        """The lender's status in the Prometheus text format (this connection counted in
        ``shoal_lending_borrowers``, or in ``shoal_lending_observers`` for an observer)."""
        _checks.real_number("shoal.lending.Borrower.metrics", "timeout", timeout, "a number of seconds")
        return self._native.metrics(timeout)

    def revoke(self, region: int, deadline: float, timeout: float = 5.0) -> None:
        """Asks the lender to revoke ``region`` — any borrower's, by the id ``status`` and the
        metrics name it (``shoal_lending_region_bytes{id=...}``) — giving its borrower
        ``deadline`` seconds to give it back: how an operator takes one model's memory for
        the next model's turn (``shoal daemon revoke`` on the command line). Returns once the
        lender accepted. ``PeerRefusedError`` unless this process runs as the lender's uid or
        root; ``InvalidArgumentError`` for a region not lent to a connected borrower, or a
        shared one."""
        for name, seconds in (("deadline", deadline), ("timeout", timeout)):
            _checks.real_number("shoal.lending.Borrower.revoke", name, seconds, "a number of seconds")
        self._native.revoke(region, deadline, timeout)

    def close(self) -> None:
        """Closes the connection; regions already borrowed stay mapped until their storages
        are gone. A wait for revocations in another thread ends first; calls made after raise
        ConnectionClosedError."""
        self._native.close()

    @property
    def closed(self) -> bool:
        """True once close() has begun."""
        return self._native.closed

    def __repr__(self) -> str:
        if "_native" not in vars(self):  # its __init__ raised (a traceback shows it)
            return "shoal.lending.Borrower(not made)"
        try:
            count, nbytes = self.kept()
        except _shoal.ConnectionClosedError:  # closed, now or by another thread meanwhile
            return f"shoal.lending.Borrower({self._address!r}, closed)"
        return f"shoal.lending.Borrower({self._address!r}, {count} kept mappings of {nbytes} bytes)"

    def __enter__(self) -> "Borrower":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RevocationWatcher:
    """Watches a :class:`Borrower` for the lender's revokes on a thread of its own and calls
    ``on_revoke(region id, seconds left)`` for each (made by
    :meth:`Borrower.watch_revocations`). It watches until :meth:`stop`, the end of its
    ``with`` block, or the borrower's close (or the borrower being dropped). If ``on_revoke``
    raises, or the connection fails (the lender gone, a malformed message), the watcher stops
    there: the exception goes to ``threading.excepthook`` (printed, as for any thread), is kept
    in ``error`` and is raised by :meth:`stop`.

    The thread is a daemon thread: a process may exit while it watches.

    Once stopped it calls back no more: revokes it read and had not passed on go back to the
    borrower, and its next :meth:`Borrower.revocations` call (or a new watcher) returns them —
    so do the revoke whose ``on_revoke`` raised and those after it, less any whose give back
    the lender has confirmed meanwhile.

    Thread-safety: :meth:`stop` may be called from any thread, ``on_revoke`` included: there it
    does not wait, and the watcher ends once that call returns."""

    def __init__(self, borrower: Borrower, on_revoke: Callable[[int, float], object]) -> None:
        if not callable(on_revoke):
            raise TypeError(f"shoal.lending.RevocationWatcher: on_revoke must be callable, not {on_revoke!r}")
        self._stop = _shoal._StopFlag()  # read by the wait without the GIL
        # The borrower weakly: once it is dropped the stop flag is set, the thread's wait ends
        # within 10 ms and lets go of the connection, which closes. The callback is the flag's
        # set, a C call: a finalizer would run Python code, where a Ctrl-C that came as the
        # borrower went would be printed and lost, and the flag never set.
        self._borrower = weakref.ref(borrower, self._stop.set)
        self._on_revoke: Optional[Callable[[int, float], object]] = on_revoke
        self._error: Optional[BaseException] = None
        self._traceback: Optional[TracebackType] = None
        self._active = False  # set by the borrower as it registers this watcher
        self._thread = threading.Thread(target=self._watch, name="shoal revocation watcher", daemon=True)
        borrower._start_watching(self)
        try:
            self._thread.start()
        except BaseException:
            self._stop.set()
            self._active = False
            raise

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                borrower = self._borrower()
                if borrower is None:
                    return  # dropped: its connection closes with it
                native = borrower._native
                del borrower  # (a frame a kept traceback holds must not hold it)
                try:
                    asked = native.revocations(_FOREVER, self._stop)
                    read_at = time.monotonic()
                except _shoal.ConnectionClosedError:
                    owner = self._borrower()
                    by_its_owner = owner is None or owner.closed
                    del owner
                    if by_its_owner:
                        return  # closed (or dropped) by its owner: nothing to say
                    raise  # the lender went away
                finally:
                    del native
                for i, (region, seconds_left) in enumerate(asked):
                    if self._stop.is_set():  # stopped (from the callback, say): no more calls
                        self._put_back(asked[i:], read_at)
                        return
                    assert self._on_revoke is not None
                    try:
                        self._on_revoke(region, seconds_left)
                    except BaseException as failed:
                        try:
                            self._put_back(asked[i:], read_at)  # this one too
                        except Exception as put_back_failed:  # the callback's failure is the one kept
                            failed.add_note(f"and its unhandled revokes could not be put back: {put_back_failed!r}")
                        raise
        except BaseException as e:
            self._error, self._traceback = e, e.__traceback__
            raise  # to threading.excepthook, as any thread's
        finally:
            self._active = False
            self._on_revoke = None  # what it holds is let go with the watcher's end

    def _put_back(self, unhandled: list[tuple[int, float]], read_at: float) -> None:
        """Returns revokes read and not passed on to the borrower, for its next reader."""
        borrower = self._borrower()
        try:
            if borrower is None or borrower.closed:
                return  # gone: nothing more to answer through it
            spent = time.monotonic() - read_at
            borrower._native.return_revocations([(region, left - spent) for region, left in unhandled])
        except _shoal.ConnectionClosedError:
            pass  # closed meanwhile: nothing more to answer through it
        finally:
            del borrower  # (a frame a kept traceback holds must not hold it)

    @property
    def watching(self) -> bool:
        """True until the watcher ends (stopped, failed, or its borrower closed)."""
        return self._active

    @property
    def error(self) -> Optional[BaseException]:
        """What stopped the watcher: ``on_revoke``'s exception or the connection's, else None."""
        return self._error

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Stops watching and waits (up to ``timeout`` seconds; None: as long as it takes, about
        10 ms plus an ``on_revoke`` that runs) for the thread to end; raises what stopped the
        watcher, if anything did. Returns whether the thread has ended (False when ``timeout``
        passed first, or when called from ``on_revoke``). Revokes that come later are returned
        by :meth:`Borrower.revocations` or a new watcher."""
        self._end(timeout)
        if self._error is not None:
            raise self._error.with_traceback(self._traceback)
        return not self._thread.is_alive()

    def _end(self, timeout: Optional[float] = None) -> None:
        """Sets the stop flag and waits for the thread, unless on it."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> "RevocationWatcher":
        return self

    def __exit__(self, exc_type: object, exc: Optional[BaseException], tb: object) -> None:
        if exc is None:
            self.stop()
            return
        # An exception leaves the block: it wins, and the watcher's is noted on it — not
        # raised, which would make the block's exception (and its frames) its context.
        self._end()
        if self._error is not None:
            exc.add_note(f"(the revocation watcher had stopped on {self._error!r})")

    def __repr__(self) -> str:
        state = "watching" if self.watching else ("failed" if self._error is not None else "stopped")
        return f"shoal.lending.RevocationWatcher({state})"


class Lender:
    """Lends ``device``'s memory (default: the default device) at ``address`` (a str or a
    pathlib.Path), on a thread of its own: at most ``capacity_bytes`` in all (1 GiB unless given) and
    ``quota_bytes`` per borrower connection (memory it gave back and keeps mapped included: a
    borrow past it has the lender tell it to forget kept mappings first, or is refused when that
    is not enough), to at most ``max_borrowers`` connected at
    once of this process's uid and root, and as many of all other uids together (besides
    up to ``max_observers`` observer connections of each, ``Borrower(observer=True)``),
    each holding at most ``max_regions_per_borrower`` regions; every wait on a
    borrower ends after ``peer_timeout`` seconds. Borrowers of this process's uid and of
    ``allowed_uids`` are admitted. ``reuse``: ``"same_uid"`` lends given-back memory
    again within one uid, ``"never"`` makes every region fresh memory.
    ``prepared_chunks``: sizes of chunks made now, from which regions of those sizes are
    lent with no device call at borrow time. ``max_wait``: the longest a borrow may wait
    for memory, in seconds (a longer ``wait`` is cut to it). ``max_connections_per_uid`` (0: no
    cap) bounds the connections at once of any one uid other than this process's and root, so
    that one admitted uid cannot take every place the other uids share (idle connections
    included) and keep them out; one more is turned away as it connects.

    ``preempt_after`` (seconds, off when None): once the borrow first in the waiting line
    has waited this long (0: at once) and does not fit, the lender revokes regions of other
    borrowers for it — lent longest ago first, only as many as it lacks (a model may lose
    some of its regions, not all), none when all it may revoke would not be enough — each
    to be given back within ``preempt_deadline`` seconds (10 unless given; see
    :meth:`Borrower.revocations`). It is also the least turn: a region lent less than
    ``preempt_after`` ago is not revoked. A waiting borrow's ``wait`` should exceed twice
    ``preempt_after`` plus ``preempt_deadline``. Shared and orphaned regions are never
    revoked; a borrower whose own borrow waits behind has that wait ended first
    (``OutOfMemoryError``, reason ``"stopped_waiting"``); between uids, only while the
    other uid holds more than the waiting borrow's uid (holdings evened out at most). A borrower that lets the deadline
    pass keeps its region (named in the log) and is not asked again, and the lender revokes
    others' regions if there are any to take.
    (``shoal daemon`` runs one as a program.)

    Usable from several threads at once: :meth:`status`, :meth:`metrics` and :meth:`revoke`
    answer at once, and ``close()`` may come from any thread."""

    def __init__(
        self,
        address: Union[str, os.PathLike[str]],
        *,
        device: Optional[_shoal.Device] = None,
        capacity_bytes: int = 1 << 30,
        quota_bytes: int = 1 << 30,
        max_borrowers: int = 64,
        max_regions_per_borrower: int = 1024,
        peer_timeout: float = 1.0,
        allowed_uids: Sequence[int] = (),
        reuse: str = "same_uid",
        prepared_chunks: Sequence[int] = (),
        max_wait: float = 300.0,
        preempt_after: Optional[float] = None,
        preempt_deadline: float = 10.0,
        max_observers: int = 4,
        max_connections_per_uid: int = 0,
    ) -> None:
        address = _checks.socket_address("shoal.lending.Lender", address)
        for name, value in (("capacity_bytes", capacity_bytes), ("quota_bytes", quota_bytes),
                            ("max_borrowers", max_borrowers), ("max_regions_per_borrower", max_regions_per_borrower)):
            _checks.whole_number("shoal.lending.Lender", name, value, least=1)
        _checks.whole_number("shoal.lending.Lender", "max_observers", max_observers)
        _checks.whole_number("shoal.lending.Lender", "max_connections_per_uid", max_connections_per_uid)
        allowed_uids = _checks.uids("shoal.lending.Lender", allowed_uids)
        for chunk in prepared_chunks:
            _checks.whole_number("shoal.lending.Lender", "prepared_chunks", chunk)
        # Types here, ranges in the native layer (its messages name each setting too).
        for name, seconds, may_be_none in (("peer_timeout", peer_timeout, False), ("max_wait", max_wait, False),
                                           ("preempt_after", preempt_after, True),
                                           ("preempt_deadline", preempt_deadline, False)):
            _checks.real_number("shoal.lending.Lender", name, seconds, "a number of seconds", allow_none=may_be_none)
        _checks.instance_of("shoal.lending.Lender", "reuse", reuse, str, "'same_uid' or 'never'")
        self._address = address
        self._native = _shoal.Lender(
            address, device, capacity_bytes, quota_bytes, max_borrowers, max_regions_per_borrower, peer_timeout,
            list(allowed_uids), reuse, list(prepared_chunks), max_wait, preempt_after, preempt_deadline,
            max_observers, max_connections_per_uid)

    def status(self) -> dict:
        """Regions lent (``regions``: id, memory, bytes, purpose, mode, state, pid, uid,
        age_seconds, and for a shared region its holders: pid, uid, state), spare chunks
        (``spares``), borrows waiting for memory in the order they are served (``waiting``:
        bytes, purpose, pid, uid, waited_seconds, left_seconds) and counters (``requests``,
        ``refusals``, ``revocations``, ``revocations_missed``, ``preemptions``, ``waits``,
        ``waits_expired``, ...), and the connections now: ``borrowers`` and ``observers``."""
        return self._native.status()

    def revoke(self, region: int, deadline: float) -> None:
        """Asks the borrower of ``region`` to give it back within ``deadline`` seconds (the
        next model's turn); returns at once. A borrower that lets the time pass keeps the
        region until it gives it back or exits; ``status()`` counts it in
        ``revocations_missed`` and shows the region ``revoking`` meanwhile."""
        _checks.real_number("shoal.lending.Lender.revoke", "deadline", deadline, "a number of seconds")
        self._native.revoke(region, deadline)

    def metrics(self) -> str:
        """The status in the Prometheus text format."""
        return self._native.metrics()

    def close(self) -> None:
        """Stops serving and closes every connection."""
        self._native.close()

    @property
    def closed(self) -> bool:
        """True once close() has begun."""
        return self._native.closed

    def __repr__(self) -> str:
        if "_native" not in vars(self):  # its __init__ raised (a traceback shows it)
            return "shoal.lending.Lender(not made)"
        try:
            s = self.status()
        except _shoal.InvalidArgumentError:  # closed, now or by another thread meanwhile
            return f"shoal.lending.Lender({self._address!r}, closed)"
        return (f"shoal.lending.Lender({self._address!r}, {len(s['regions'])} regions lent, "
                f"{s['lent_bytes']} of {s['capacity_bytes']} bytes)")

    def __enter__(self) -> "Lender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
