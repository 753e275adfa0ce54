"""The device, and the allocator there, that shoal's modules use when the caller names neither.

A process that runs PyTorch on one GPU of several (a DDP rank on cuda:3 calls
``torch.cuda.set_device(3)``) expects what it makes without naming a device (a
``sharing.Producer`` or ``Consumer``, a ``transfer.Engine``) to land on that GPU, and
nothing of it on another. Making shoal's CUDA device 0 — what ``shoal.default_allocator()``
and ``shoal.default_device()`` do on a GPU machine — creates GPU 0's context (some
0.3-0.5 GiB there, in every rank), so PyTorch's current device is read first, and shoal's
default allocator is asked for only where PyTorch does not decide the device, or where that
allocator would be (or already is) on the device decided.

PyTorch's current device is per thread (a thread that never called set_device is on
device 0), so it is the calling thread's that decides: a Consumer and an Engine read it
where they are made, a default Producer at its first put. A rank that makes them in a
thread of its own must set that thread's device too, or they land on GPU 0.

Where the process never imported torch, or imported it without initializing CUDA in it,
nothing here imports torch or initializes CUDA: shoal's own default device decides.

One allocator per device serves every module here: a process that both shares and
transfers on cuda:1 keeps one cache of cuda:1's memory, not one per module.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Callable, Optional

from . import _fork, _shoal

_allocators: dict[tuple[str, int], _shoal.Allocator] = {}  # made here, by (kind, ordinal)
_allocators_lock = threading.Lock()
# A parent thread making an allocator at a fork: the child's exit (_drop_allocators) and first allocator go on.
_fork.renew_lock_in_fork_child(__name__, "_allocators_lock")


def torch_with_cuda() -> Any:
    """The torch module when this process imported it and initialized CUDA in it, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:  # a torch without CUDA, or a stand-in module
        return None


def current_cuda_ordinal() -> Optional[int]:
    """``torch.cuda.current_device()`` — the calling thread's: PyTorch keeps one per
    thread — where this process uses PyTorch on CUDA (see torch_with_cuda), else None."""
    torch = torch_with_cuda()
    if torch is None:
        return None
    try:
        return int(torch.cuda.current_device())
    except Exception:  # a stand-in module, or CUDA torn down at exit
        return None


def _backend_choice() -> str:
    return os.environ.get("SHOAL_BACKEND", "")


def torch_ordinal() -> Optional[int]:
    """The calling thread's current CUDA device in PyTorch where it decides shoal's default
    device: this process uses PyTorch on CUDA, SHOAL_BACKEND does not force another backend
    than CUDA, and this build of shoal sees that device. Else None: shoal's default device
    decides."""
    ordinal = current_cuda_ordinal()
    if ordinal is None or _backend_choice() not in ("", "cuda"):
        return None
    return ordinal if 0 <= ordinal < _shoal.cuda_device_count() else None


def default_device() -> _shoal.Device:
    """PyTorch's current CUDA device where it decides (torch_ordinal), else shoal's default
    device (which, on a GPU machine, makes CUDA device 0: its context)."""
    ordinal = torch_ordinal()
    return _shoal.default_device() if ordinal is None else _shoal.cuda_device(ordinal)


def _is_shoal_default(device: _shoal.Device) -> bool:
    """Whether ``shoal.default_device()`` is `device`, found without making CUDA device 0."""
    choice = _backend_choice()
    if device.kind == "cuda":
        return device.ordinal == 0 and choice in ("", "cuda")
    return choice == "host" or (choice == "" and _shoal.cuda_device_count() == 0)


def device_text(device: _shoal.Device) -> str:
    """A device as PyTorch writes it ("cuda:3"), or "host"."""
    return f"cuda:{device.ordinal}" if device.kind == "cuda" else "host"


def allocator_for(
    where: str,
    allocator: Optional[_shoal.Allocator],
    device: Optional[_shoal.Device],
    otherwise: Callable[[], _shoal.Allocator],
) -> _shoal.Allocator:
    """`allocator=` when given (refused when `device=` names another device), else
    `device`'s allocator (allocator_on), else `otherwise()`."""
    if allocator is None:
        return otherwise() if device is None else allocator_on(device)
    if device is not None and allocator.device != device:
        raise _shoal.InvalidArgumentError(
            f"{where}: allocator= is on {device_text(allocator.device)} but device= names {device_text(device)}; "
            "pass one of them"
        )
    return allocator


def allocator_on(device: _shoal.Device) -> _shoal.Allocator:
    """The allocator for `device` when the caller names none: PyTorch's there when
    ``shoal.torch.enable()`` made shoal PyTorch's CUDA allocator (so its memory counts in
    torch.cuda's stats and tensors of it can be shared), else ``shoal.default_allocator()``
    where it is on `device` (asked for only where it exists already or would be made on
    `device`), else one made here for `device` on first use (settings from
    SHOAL_ALLOC_CONF), the same one for every module that asks."""
    from . import torch as shoal_torch

    if device.kind == "cuda" and shoal_torch.is_enabled():
        return shoal_torch.allocator(device.ordinal)
    from . import _default_allocator as default, default_allocator  # the package's, made or not yet

    if default is None and _is_shoal_default(device):
        default = default_allocator()
    if default is not None and default.device == device:
        return default
    key = (device.kind, device.ordinal)
    with _allocators_lock:
        if key not in _allocators:
            _allocators[key] = _shoal.Allocator(device)
        return _allocators[key]


@atexit.register
def _drop_allocators() -> None:
    # As shoal's _default_allocator: the Python objects go at exit, before the interpreter
    # tears modules down in no set order; storages still alive keep their C++ state.
    with _allocators_lock:
        _allocators.clear()


def device_named(kind: str, ordinal: int) -> _shoal.Device:
    """The device of `kind` ('host' or 'cuda') and `ordinal` in this process: how a pickled
    Device is made again (Device.__reduce__)."""
    if kind == "host" and ordinal == 0:
        return _shoal.host_device()
    if kind == "cuda":
        return _shoal.cuda_device(ordinal)
    raise _shoal.InvalidArgumentError(f"shoal: no device of kind {kind!r} and ordinal {ordinal}; the kinds are 'host' (0) and 'cuda'")
