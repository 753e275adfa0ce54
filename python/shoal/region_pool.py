"""A ``torch.cuda.MemPool`` whose segments come from shoal memory (``shoal.torch.RegionPool``)."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Iterator

from . import _checks, _shoal

# Per slot, the weak references that end its current binding as its MemPool and
# its RegionPool go (RegionPool.__init__); a later opening of the slot replaces them.
_slot_watches: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


class RegionPool:
    """A ``torch.cuda.MemPool`` whose segments are carved from a :class:`shoal.Storage` —
    typically a region borrowed from a lender — while PyTorch keeps its own allocator, so a
    process puts a model's tensors into memory it borrowed without patching PyTorch::

        # sketch: borrower (a shoal.lending.Borrower) and build_model are yours
        region = borrower.borrow(4 << 30, "model A")
        pool = shoal.torch.RegionPool(region)
        with pool.use():
            model = build_model().cuda()                   # its tensors live in the region
        ...                                                # the model runs, anywhere
        del model
        pool.close()                                       # segments go back to the region
        del region                                         # and the region to the lender

    PyTorch's caching allocator asks the pool for segments (2 MiB and up) and caches blocks in
    them as in any MemPool; shoal carves the segments out of the storage with a stream-ordered
    private pool. When the storage has no room left PyTorch raises
    ``torch.cuda.OutOfMemoryError``: the pool never grows past the storage.

    The storage's memory belongs to the pool while it is open (do not write it through other
    views meanwhile), and the storage stays held until the pool is closed and PyTorch has given
    every segment back (it does when the pool's tensors are gone: ``close()`` empties what it
    can, ``torch.cuda.empty_cache()`` the rest). At most 16 pools are open (or still hold
    segments, or their MemPool objects live) at once: PyTorch's custom allocators take C functions with no context, and each
    pool has its own. Not for use while ``shoal.torch.enable()`` is in force (shoal is then
    PyTorch's allocator, and PyTorch offers no MemPool on a pluggable allocator).

    Thread-safety: ``use()`` follows ``torch.cuda.use_mem_pool`` (per thread); PyTorch may
    allocate and free segments from any thread.
    """

    def __init__(self, storage: _shoal.Storage) -> None:
        hint = " (an ArrayView's is its .storage)" if isinstance(storage, _shoal.ArrayView) else ""
        _checks.instance_of("shoal.torch.RegionPool", "storage", storage, _shoal.Storage, "a shoal.Storage", hint=hint)
        torch = _checks.torch_module("shoal.torch.RegionPool")

        from . import torch as shoal_torch

        if shoal_torch.is_enabled():
            raise RuntimeError(
                "shoal.torch.RegionPool: shoal is PyTorch's allocator in this process "
                "(shoal.torch.enable()); PyTorch's MemPool needs its own caching allocator"
            )
        self._lock = threading.Lock()
        # PyTorch's pools are per device: the MemPool is made, and use() routes, on the
        # storage's device, whatever the current device is.
        self.device: int = storage.device.ordinal
        # The opening's number comes first: a Ctrl-C as _segment_source_open returns loses the
        # slot's number, and the except clause below still ends the opening.
        binding = _shoal._segment_source_new_binding()
        try:
            slot = _shoal._segment_source_open(storage, binding)
            allocate, free = _shoal._segment_source_functions(slot)
            self._allocator = torch._C._cuda_customAllocator(allocate, free)
            with torch.cuda.device(self.device):  # a MemPool belongs to the device current as it is made
                self.mem_pool: Any = torch.cuda.MemPool(self._allocator)
            # The slot goes to no other pool while PyTorch's MemPool object lives
            # (it may still call the slot's functions), nor while this pool is open.
            # Weak references whose callbacks are C calls (partials of the bindings,
            # which end this binding only): a finalizer would run Python code, where a
            # Ctrl-C that came as the object went would be printed and lost, and the
            # slot held for good. Kept here, not on the pool: a reference that is
            # itself garbage when its referent is collected calls nothing.
            _slot_watches[slot] = (
                weakref.ref(self.mem_pool, functools.partial(_shoal._segment_source_mem_pool_gone, slot, binding)),
                weakref.ref(self, functools.partial(_shoal._segment_source_close, slot, binding)),
            )
        except BaseException:
            _shoal._segment_source_abandon(binding)
            raise
        self._slot: int | None = slot  # None once closed
        # stats() after close() too: the slot stays this pool's while this
        # binding of it holds (a segment out, or the MemPool object alive).
        self._index = slot
        self._binding = binding

    @contextlib.contextmanager
    def use(self) -> Iterator[RegionPool]:
        """Within it, this thread's CUDA allocations on the storage's device (``self.device``)
        come from the pool (``torch.cuda.use_mem_pool(pool, device=self.device)``), whichever
        device is current; those on other devices do not."""
        import torch

        pool = self.mem_pool
        if pool is None:
            raise _shoal.InvalidArgumentError("shoal.torch.RegionPool.use: the pool is closed")
        with torch.cuda.use_mem_pool(pool, device=self.device):
            yield self

    def stats(self) -> dict[str, Any]:
        """``segments`` and ``segment_bytes`` PyTorch holds from the storage now,
        ``capacity_bytes`` it may hold, ``base`` the first address it carves from, and whether the
        pool is ``open`` and still ``bound`` to the storage (a closed pool stays bound while a
        segment is out or its MemPool object lives)."""
        # Once unbound, the slot may serve another pool (another binding).
        s = dict(_shoal._segment_source_stats(self._index))
        if s.pop("binding") == self._binding and s["bound"]:
            return s
        return {"open": False, "bound": False, "segments": 0, "segment_bytes": 0,
                "capacity_bytes": 0, "base": 0}

    def close(self) -> None:
        """No more allocations from the pool. PyTorch's cuBLAS workspaces are cleared (one made
        inside ``use()`` would hold a segment for good), the MemPool is dropped and
        ``torch.cuda.empty_cache()`` — process-wide — gives back the segments no tensor uses; the
        storage is let go once every segment is back and no reference to the MemPool remains.
        Idempotent and thread-safe."""
        import torch

        with self._lock:
            slot, self._slot = self._slot, None
            if slot is None:
                return
            self.mem_pool = None  # PyTorch releases the pool once no one else holds it
            try:
                if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                    torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
            finally:  # closed even when those fail (a CUDA error): no later call would close it
                _shoal._segment_source_close(slot, self._binding)

    def __enter__(self) -> RegionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"RegionPool(segments={s['segments']}, segment_bytes={s['segment_bytes']}, "
                f"capacity_bytes={s['capacity_bytes']}, open={s['open']})")
