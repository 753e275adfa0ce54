"""PyTorch on shoal's allocator.

    import shoal.torch
    shoal.torch.enable()            # before PyTorch touches CUDA
    import torch
    x = torch.empty(1 << 20, device="cuda")   # from shoal's caching allocator

Every PyTorch CUDA allocation then comes from shoal's stream-ordered caching
allocator, and a tensor's memory is freed on the *freeing thread's current
stream*: a batch made on a loader thread's stream and dropped by the model
thread is reused only after the model's stream has passed its last use, with
no ``record_stream`` call and no batches held back.

``Tensor.record_stream``, ``torch.cuda.empty_cache()``,
``torch.cuda.set_per_process_memory_fraction()``, ``torch.cuda.memory_stats()``
(and the functions built on it) reach shoal; so do the functions of this
module, in PyTorch's names. Out of memory raises ``torch.cuda.OutOfMemoryError``
with shoal's message. Three differences from PyTorch's own allocator: its
settings come from ``SHOAL_ALLOC_CONF`` and enable()'s arguments, never from
``PYTORCH_CUDA_ALLOC_CONF`` (enable() warns when that is set); enable() is
one-way, with no disable, for the rest of the process; and
``set_per_process_memory_fraction(0)`` sets no limit where PyTorch allows 0
bytes.

CUDA tensors go to other processes through ``shoal.sharing`` as they are:
``Producer.put`` takes them (or ``share(tensor)``, an ArrayView on the
tensor's memory). The memory stays allocated until the tensor and every
process it was sent to have dropped it.

CUDA graphs capture on shoal: ``torch.cuda.graph`` (its ``pool=`` argument and
``torch.cuda.graph_pool_handle()`` included) allocates from a pool of shoal's
that stays the graph's until the graph is reset, and ``torch.cuda.MemPool`` with
``torch.cuda.use_mem_pool`` routes a thread's allocations to one. A pool's
memory goes back to the device once it is released and none of its tensors is
left (then, or at the next ``empty_cache`` or out of memory). Entering a
capture or ``use_mem_pool`` waits for the streams that last used the pool's free
blocks. While one is underway, an allocation the cache and a new segment cannot
serve raises out of memory without emptying the cache (that would synchronize a
capturing stream), and every free that would wait for another stream (a tensor
dropped on another stream than its own, or one ``record_stream`` named) takes
effect when the last one ends, so ``memory_allocated`` counts it until then.

``torch.compile(mode="reduce-overhead")`` runs on shoal with its CUDA graph
trees (the default), which checkpoint a graph pool's layout and restore it
when a new graph is warmed up or recorded while a path of graphs replays, and
without them (``torch._inductor.config.triton.cudagraph_trees = False``). A
restore raises RuntimeError when a block of the pool is shared with another
process, while allocations are routed to that pool (its ``use_mem_pool``, a
capture into it) or while a free of one of its blocks waits for the routes to
end (a block freed on another stream than its own, or one ``record_stream``
named, while any ``use_mem_pool`` or capture is active on any thread): call
compiled functions outside ``use_mem_pool`` blocks. It waits
on the host for the pool's pending frees. A
``torch.cuda.MemPool`` with an allocator of its own, or with
``use_on_oom=True``, is refused while shoal is PyTorch's allocator.

Without ``enable()``, PyTorch keeps its own allocator and :class:`RegionPool` makes
shoal memory — a region borrowed from a lender — the segment source of a
``torch.cuda.MemPool``, so a model's tensors go into borrowed memory::

    # sketch: borrower (a shoal.lending.Borrower) and build_model are yours
    pool = shoal.torch.RegionPool(borrower.borrow(4 << 30, "model A"))
    with pool.use():
        model = build_model().cuda()

The plugin is built when the package is installed where PyTorch with CUDA is
importable (``pip install --no-build-isolation .``); elsewhere ``enable()``
says so.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
import warnings
from typing import Any

from . import _checks, _shoal
from .region_pool import RegionPool

__all__ = [
    "enable",
    "is_enabled",
    "allocator",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "memory_snapshot",
    "empty_cache",
    "share",
    "RegionPool",
]

_lock = threading.Lock()
_enabled = False
_warned = False  # of PyTorch's settings, once (_warn_of_pytorch_settings)
_PYTORCH_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_plugin: ctypes.CDLL | None = None


def _plugin_path() -> pathlib.Path | None:
    found = sorted(pathlib.Path(__file__).parent.glob("_shoal_torch*.so"))
    return found[0] if found else None


def enable(*, conf: str | None = None, use_environment: bool = True, **settings: Any) -> None:
    """Make shoal's caching allocator PyTorch's CUDA allocator, in this process.

    Settings are those of :class:`shoal.Allocator` (``SHOAL_ALLOC_CONF`` unless
    ``use_environment`` is False, then ``conf``, then keyword arguments), and
    apply to the allocator of every CUDA device. One default differs from
    ``shoal.Allocator``'s: growable segments (``expandable_segments:true``),
    which pack a model's weights tighter; any of the three sources can turn
    them off, and ``memory="pinned_host"`` goes without them. Plain segments
    serve where the device has no growable ranges. Turn growable segments off
    (``expandable_segments=False``) to use NCCL's allocator hook
    (``ProcessGroupNCCL.register_mem_pool``,
    ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK``) or to send tensors with
    ``torch.multiprocessing`` (CUDA IPC exports plain segments only).

    ``PYTORCH_CUDA_ALLOC_CONF`` (and ``PYTORCH_ALLOC_CONF``) is not read
    once shoal is PyTorch's allocator: its settings come from
    ``SHOAL_ALLOC_CONF`` and this function's arguments alone (the same
    ``key:value,...`` text). enable() warns once (UserWarning) when either
    PyTorch variable is set, as it would otherwise be ignored silently.

    It is one-way: there is no disable(). Once enabled, shoal stays PyTorch's
    CUDA allocator until the process ends (PyTorch cannot swap allocators
    while tensors of the first one live).

    ``torch.cuda.set_per_process_memory_fraction(0)`` differs: under PyTorch's
    own allocator a fraction of 0 allows 0 bytes (every allocation is out of
    memory); under shoal 0 means no share limit (the device's whole memory).
    To forbid a device's allocations, use a fraction small enough instead.

    Call it before PyTorch initializes CUDA (before the first CUDA tensor,
    stream or ``torch.cuda`` query that creates a context). Calling it again
    with the same settings does nothing; with other settings, or after CUDA
    was initialized, it raises RuntimeError. Raises RuntimeError too when
    PyTorch has no CUDA or the plugin was not built; TypeError when ``conf``
    is not a str (or None) or ``use_environment`` not a bool.
    """
    global _enabled, _plugin
    # Checked before PyTorch is touched: the settings' own checks name _torch_configure().
    _checks.instance_of("shoal.torch.enable()", "conf", conf, str, "a str ('key:value,...')", allow_none=True)
    _checks.instance_of("shoal.torch.enable()", "use_environment", use_environment, bool, "a bool")
    torch = _checks.torch_module("shoal.torch.enable()")

    with _lock:
        if not torch.cuda.is_available():
            raise RuntimeError("shoal.torch.enable(): PyTorch sees no CUDA device")
        if _enabled:
            wanted = _shoal._torch_config_text(conf=conf, use_environment=use_environment, **settings)
            if wanted != _shoal._torch_settings():
                raise RuntimeError(
                    f"shoal.torch.enable(): already enabled with '{_shoal._torch_settings()}', "
                    f"not '{wanted}'"
                )
            return
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "shoal.torch.enable() must run before PyTorch initializes CUDA: call it before the first "
                "CUDA tensor, stream or torch.cuda query of this process"
            )
        path = _plugin_path()
        if path is None:
            raise RuntimeError(
                "shoal.torch.enable(): this shoal was built without its PyTorch plugin (PyTorch with CUDA was "
                "not importable when it was built); reinstall it where PyTorch is, with "
                "'pip install --no-build-isolation .'"
            )
        plugin = ctypes.CDLL(str(path))
        plugin.shoal_torch_built_for.restype = ctypes.c_char_p
        built_for = plugin.shoal_torch_built_for().decode()
        if built_for != torch.__version__:
            raise RuntimeError(
                f"shoal.torch.enable(): the plugin was built for PyTorch {built_for}, this is "
                f"{torch.__version__}; reinstall shoal"
            )
        _shoal._torch_configure(conf=conf, use_environment=use_environment, **settings)
        plugin.shoal_torch_install.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        error = ctypes.create_string_buffer(4096)
        if plugin.shoal_torch_install(_shoal._torch_api(), error, len(error)) != 0:
            raise RuntimeError(f"shoal.torch.enable(): {error.value.decode(errors='replace')}")
        _plugin = plugin
        _enabled = True
    _warn_of_pytorch_settings()


def _warn_of_pytorch_settings() -> None:
    """Says, once, that PyTorch's allocator settings are set and not read."""
    global _warned
    names = [n for n in _PYTORCH_SETTINGS if os.environ.get(n)]
    if _warned or not names:
        return
    _warned = True
    warnings.warn(
        f"shoal.torch.enable(): {' and '.join(names)} is set but not read: shoal is PyTorch's CUDA allocator "
        "now, its settings come from SHOAL_ALLOC_CONF and enable()'s arguments",
        UserWarning,
        stacklevel=3,
    )


def is_enabled() -> bool:
    """Whether enable() has made shoal PyTorch's CUDA allocator."""
    return _enabled


def _device_index(device: Any) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise _shoal.InvalidArgumentError(f"shoal.torch: {device!r} is not a CUDA device")
    return d.index if d.index is not None else torch.cuda.current_device()


def _require_enabled() -> None:
    if not _enabled:
        raise _shoal.InvalidArgumentError(
            "shoal.torch: shoal is not PyTorch's allocator in this process: call shoal.torch.enable() first "
            "(before PyTorch touches CUDA)")


def allocator(device: Any = None) -> _shoal.Allocator:
    """The :class:`shoal.Allocator` PyTorch allocates from on ``device``
    (default: the current CUDA device): its ``stats()``, ``snapshot()`` and
    ``trace()`` in shoal's own layout."""
    _checks.torch_module("shoal.torch.allocator()")  # without PyTorch, "enable() first" would mislead
    _require_enabled()
    return _shoal._torch_allocator(_device_index(device))


def share(tensor: Any) -> _shoal.ArrayView:
    """An :class:`shoal.ArrayView` on ``tensor``'s memory (its dtype, shape,
    strides and offset), without copying, for ``shoal.sharing`` to send to
    other processes (``Producer.put`` calls it for the tensors of a batch).

    ``tensor`` is a CUDA tensor PyTorch allocated while shoal backed it. Its
    block passes to a shoal storage: PyTorch's free of the tensor then drops
    a handle, and the block is freed once the tensor, every Storage or view
    of it and every process it was sent to have let go, after the streams
    they used it on. ``ValueError`` for a tensor on another device type or
    memory shoal did not allocate (made before ``enable()``, or a view into
    another allocator's memory)."""
    torch = _checks.torch_module("shoal.torch.share()")
    _require_enabled()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"shoal.torch.share: expected a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise _shoal.InvalidArgumentError(f"shoal.torch.share: the tensor is on {tensor.device}, not a CUDA device")
    untyped = tensor.untyped_storage()
    device = tensor.device.index
    stream = torch.cuda.current_stream(device).cuda_stream
    try:
        storage = _shoal._torch_share(untyped.data_ptr(), untyped.nbytes(), device, stream)
    except ValueError as e:
        raise _shoal.InvalidArgumentError(
            "shoal.torch.share: the tensor's memory is not a block shoal's allocator handed to PyTorch "
            f"(allocated before enable(), or by another allocator): {e}"
        ) from e
    dtype = str(tensor.dtype).removeprefix("torch.")
    return storage.view(
        dtype,
        list(tensor.shape),
        list(tensor.stride()),
        int(tensor.storage_offset()) * tensor.element_size(),  # an int on a real tensor (SymInt under tracing)
    )


_STAT_NAMES = {
    "allocations": "allocation",
    "segments": "segment",
    "active": "active",
    "inactive_split": "inactive_split",
    "allocated_bytes": "allocated_bytes",
    "reserved_bytes": "reserved_bytes",
    "active_bytes": "active_bytes",
    "inactive_split_bytes": "inactive_split_bytes",
    "requested_bytes": "requested_bytes",
}


def memory_stats(device: Any = None) -> dict[str, int]:
    """The counters in ``torch.cuda.memory_stats()``'s flat layout
    (``"allocated_bytes.all.current"``, ..., ``"num_ooms"``), sorted by key."""
    stats = allocator(device).stats()
    flat: dict[str, int] = {}
    for ours, theirs in _STAT_NAMES.items():
        for pool, counters in stats[ours].items():
            for name, value in counters.items():
                flat[f"{theirs}.{pool}.{name}"] = value
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
        flat[key] = stats[key]
    return dict(sorted(flat.items()))


def memory_allocated(device: Any = None) -> int:
    """Bytes of tensors currently allocated (rounded block sizes)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    """Peak of memory_allocated() since the start or reset_peak_memory_stats()."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Any = None) -> int:
    """Bytes of device memory shoal holds for PyTorch (allocated and cached)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Any = None) -> int:
    """Peak of memory_reserved() since the start or reset_peak_memory_stats()."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    """Sets every peak to its current value."""
    allocator(device).reset_peak_stats()


def empty_cache() -> None:
    """Returns every cached segment of every device to the driver (as
    ``torch.cuda.empty_cache()`` does while enabled)."""
    _require_enabled()
    import torch

    torch.cuda.empty_cache()


# A tombstone (the 512 bytes a forced clear leaves where it took a block
# back) keeps shoal's own state name, "invalidated": it is neither in use
# nor free, so it counts in no active or allocated size.
_BLOCK_STATES = {
    "allocated": "active_allocated",
    "pending_free": "active_pending_free",
    "free": "inactive",
    "invalidated": "invalidated",
}


def memory_snapshot(device: Any = None) -> dict[str, Any]:
    """Every segment and block in the layout of ``torch.cuda.memory._snapshot()``
    (``{"segments": [...], "device_traces": [...]}``), which PyTorch's memory
    viewer (``torch.cuda._memory_viz``, pytorch.org/memory_viz) reads. Blocks
    carry no stack frames. A forced clear's tombstones have the state
    ``"invalidated"`` and count in no active size; each segment's
    ``invalidated_size`` sums them. A growable segment (expandable_segments)
    shows as one segment per stretch of it that memory backs, as PyTorch's
    own expandable segments do. Under ``enable()``, PyTorch's own
    ``torch.cuda.memory._snapshot()`` shows the same segments with each
    MemPool's segments named by its id and the memory history's entries and
    stacks (``torch.cuda.memory._record_memory_history``), which this one
    lacks; there a tombstone is an ``"inactive"`` block, as PyTorch's layout
    has no invalidated state."""
    _require_enabled()
    index = _device_index(device)
    return _torch_layout_snapshot(allocator(index).snapshot(), index)


def _mapped_runs(segment: dict[str, Any]) -> list[tuple[int, list[dict[str, Any]]]]:
    """A segment's blocks as (start, blocks) runs of contiguous memory. A
    growable segment lists only its mapped blocks, so each run is a stretch
    backed by memory (its reserved address range is not); as in PyTorch's
    snapshot, each run is shown as a segment of its own, and a segment with
    nothing mapped is not shown."""
    if not segment["expandable"]:
        return [(segment["address"], segment["blocks"])]
    runs: list[tuple[int, list[dict[str, Any]]]] = []
    end = None
    for b in segment["blocks"]:
        if b["address"] != end:
            runs.append((b["address"], []))
        runs[-1][1].append(b)
        end = b["address"] + b["size"]
    return runs


def _torch_layout_snapshot(snap: dict[str, Any], index: int) -> dict[str, Any]:
    """shoal's snapshot (``Allocator.snapshot()``) in the layout of
    ``torch.cuda.memory._snapshot()``."""
    segments = []
    for s in snap["segments"]:
        for start, run in _mapped_runs(s):
            blocks = [
                {
                    "address": b["address"],
                    "size": b["size"],
                    "requested_size": b["requested_size"],
                    "state": _BLOCK_STATES.get(b["state"], b["state"]),
                    "frames": [],
                }
                for b in run
            ]
            in_use = [b for b in blocks if b["state"] in ("active_allocated", "active_pending_free")]
            segments.append(
                {
                    "device": index,
                    "address": start,
                    "total_size": sum(b["size"] for b in blocks) if s["expandable"] else s["total_size"],
                    "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                    "active_size": sum(b["size"] for b in in_use),
                    "requested_size": sum(b["requested_size"] for b in in_use),
                    "invalidated_size": sum(b["size"] for b in blocks if b["state"] == "invalidated"),
                    "stream": s["stream"],
                    "segment_type": s["pool"],
                    "segment_pool_id": (0, 0),
                    "is_expandable": s["expandable"],
                    "frames": [],
                    "blocks": blocks,
                }
            )
    return {"segments": segments, "device_traces": [[] for _ in range(max(index + 1, 1))]}
