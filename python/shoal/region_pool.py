"""A ``torch.cuda.MemPool`` whose segments come from shoal memory (``shoal.torch.RegionPool``)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import _shoal


class RegionPool:
    """A ``torch.cuda.MemPool`` whose segments are carved from a :class:`shoal.Storage` —
    typically a region borrowed from a lender — while PyTorch keeps its own allocator, so a
    process puts a model's tensors into memory it borrowed without patching PyTorch::

        region = borrower.borrow(4 << 30, "model A")      # shoal.lending.Borrower
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
    segments) at once: PyTorch's custom allocators take C functions with no context, and each
    pool has its own. Not for use while ``shoal.torch.enable()`` is in force (shoal is then
    PyTorch's allocator, and PyTorch offers no MemPool on a pluggable allocator).

    Thread-safety: ``use()`` follows ``torch.cuda.use_mem_pool`` (per thread); PyTorch may
    allocate and free segments from any thread.
    """

    def __init__(self, storage: _shoal.Storage) -> None:
        import torch

        from . import torch as shoal_torch

        if shoal_torch.is_enabled():
            raise RuntimeError(
                "shoal.torch.RegionPool: shoal is PyTorch's allocator in this process "
                "(shoal.torch.enable()); PyTorch's MemPool needs its own caching allocator"
            )
        self._closed = False
        self._slot: int | None = _shoal._segment_source_open(storage)
        try:
            allocate, free = _shoal._segment_source_functions(self._slot)
            self._allocator = torch._C._cuda_customAllocator(allocate, free)
            self.mem_pool: Any = torch.cuda.MemPool(self._allocator)
        except BaseException:
            _shoal._segment_source_close(self._slot)
            self._slot = None
            raise

    @contextlib.contextmanager
    def use(self) -> Iterator[RegionPool]:
        """Within it, this thread's CUDA allocations come from the pool
        (``torch.cuda.use_mem_pool``)."""
        import torch

        if self.mem_pool is None:
            raise RuntimeError("shoal.torch.RegionPool.use: the pool is closed")
        with torch.cuda.use_mem_pool(self.mem_pool):
            yield self

    def stats(self) -> dict[str, Any]:
        """``segments`` and ``reserved_bytes`` PyTorch holds from the storage now,
        ``capacity_bytes`` it may hold, ``base`` the storage's address, and whether the pool is
        ``open`` and still ``bound`` to the storage (closed pools stay bound while a segment is
        out)."""
        if self._slot is None:
            return {"open": False, "bound": False, "segments": 0, "reserved_bytes": 0,
                    "capacity_bytes": 0, "base": 0}
        return dict(_shoal._segment_source_stats(self._slot))

    def close(self) -> None:
        """No more allocations from the pool; PyTorch gives back the segments no tensor uses
        (the MemPool goes), and the storage is let go once every segment is back. Idempotent."""
        if self._slot is None or self._closed:
            return
        import torch

        self._closed = True
        pool, self.mem_pool = self.mem_pool, None
        del pool  # PyTorch releases the pool and empties its free segments
        torch.cuda.empty_cache()
        _shoal._segment_source_close(self._slot)

    def __enter__(self) -> RegionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"RegionPool(segments={s['segments']}, reserved_bytes={s['reserved_bytes']}, "
                f"capacity_bytes={s['capacity_bytes']}, open={s['open']})")
