"""Borrowing device memory from a lender (the memory daemon), and lending it.

One process owns a GPU's memory and lends it region by region to worker processes over a
UNIX socket whose peer credentials are checked; a worker maps each region at its own address
and gets it as a :class:`shoal.Storage`, so views, DLPack and copies work as for any
storage::

    import shoal.lending, torch

    with shoal.lending.Borrower("/run/user/1000/shoal/lender.sock") as borrower:
        region = borrower.borrow(1 << 30, "parameters")            # a Storage of >= 1 GiB
        weights = torch.from_dlpack(region.view("float16", (512, 1 << 20)))

The region is given back once the storage and every view of it are gone (after the streams
it was used on have passed their work). A lender's refusals are typed: ``OutOfMemoryError``
(its capacity), ``PeerRefusedError`` (this borrower's quota), ``InvalidArgumentError`` (a
bad request); a lender that does not answer in time gives ``PeerTimeoutError``. When a
borrower dies — SIGKILL included — the lender reclaims its regions.

:class:`Lender` runs the lender in this process (on its own thread); ``status()`` says who
holds what, and ``metrics()`` gives the Prometheus text.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from . import _shoal, default_allocator

__all__ = ["Borrower", "Lender"]


class Borrower:
    """A connection to the lender at ``address`` (a socket path, or ``@name`` for an
    abstract name); the lender's uid must be this process's or in ``allowed_uids``."""

    def __init__(
        self,
        address: str,
        *,
        allocator: Optional[_shoal.Allocator] = None,
        allowed_uids: Sequence[int] = (),
        timeout: float = 5.0,
    ) -> None:
        self._allocator = allocator if allocator is not None else default_allocator()
        self._native = _shoal.Borrower(address, self._allocator.device, list(allowed_uids), timeout)

    def borrow(self, nbytes: int, purpose: str, timeout: float = 5.0) -> _shoal.Storage:
        """A region of at least ``nbytes`` (rounded up to the device's granularity) for
        ``purpose`` (1 to 64 printable ASCII characters), mapped in this process."""
        return self._native._borrow(self._allocator, nbytes, purpose, timeout)

    def revocations(self, wait: float = 0.0) -> list[tuple[int, float]]:
        """The lender's requests to give regions back, as (region id, seconds left), waiting up
        to ``wait`` seconds for a first one. Answer each by dropping every reference to that
        region's storage (and its views) before the time is up: it is given back as it goes.
        A borrower that lets the time pass keeps the region, and the lender names it in its log.
        """
        return self._native.revocations(wait)

    @staticmethod
    def region_id(storage: _shoal.Storage) -> Optional[int]:
        """The id of the borrowed region behind ``storage`` (what ``revocations`` names), or
        None for a storage that is not a borrowed region."""
        return _shoal._region_id(storage)

    def metrics(self, timeout: float = 5.0) -> str:
        """The lender's status in the Prometheus text format."""
        return self._native.metrics(timeout)

    def close(self) -> None:
        """Closes the connection; regions already borrowed stay mapped until their storages
        are gone."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> "Borrower":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lender:
    """Lends this process's device memory at ``address`` (see :class:`shoal.Lender`'s
    keywords: ``capacity_bytes``, ``quota_bytes``, ``max_borrowers``,
    ``max_regions_per_borrower``, ``peer_timeout``, ``allowed_uids``)."""

    def __init__(self, address: str, **settings: Any) -> None:
        self._native = _shoal.Lender(address, **settings)

    def status(self) -> dict:
        """Regions lent (id, bytes, purpose, state, pid, uid, age_seconds) and counters."""
        return self._native.status()

    def revoke(self, region: int, deadline: float) -> None:
        """Asks the borrower of ``region`` to give it back within ``deadline`` seconds (the
        next model's turn); returns at once. A borrower that lets the time pass is named in the
        log and keeps the region until it gives it back or exits."""
        self._native.revoke(region, deadline)

    def metrics(self) -> str:
        """The status in the Prometheus text format."""
        return self._native.metrics()

    def close(self) -> None:
        """Stops serving and closes every connection."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> "Lender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
