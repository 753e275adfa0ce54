"""Grouped loading: a model's parameters copied to the GPU group by group while its first
layers already run.

The copies run on a copy stream, one event after each group; the compute stream waits for
group k on the GPU only before the first layer that needs group k — no host
synchronization, no message per group. The grouping comes from a per-layer profile (bytes
to copy, compute time) and the measured cost of a group: ``plan_groups`` finds the grouping
with the earliest completion of the last layer (docs/architecture.md, "Grouped loading").

For a PyTorch module (its parameters on the CPU)::

    # sketch: model, example_input and batch are yours
    import shoal.loading

    loader = shoal.loading.ModuleLoader(model)        # pins a host copy of every tensor once
    profile = loader.profile(example_input)           # execution order and per-layer time
    plan = loader.plan(profile)                       # the best grouping for this GPU
    loading = loader.load(plan)                       # copies enqueued; returns at once
    output = model(batch)                             # layer by layer, each after its group
    loader.unload()                                   # tensors back on the host

Below that, ``load_groups`` copies groups of host arrays into shoal storages or torch
tensors and hands back a ``GroupedLoad`` whose ``wait(k, stream)`` is the GPU-side wait.
"""

from __future__ import annotations

import collections.abc
import math
import operator
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union, cast

from . import _checks, _shoal

__all__ = [
    "CopyCost",
    "GroupPlan",
    "GroupedLoad",
    "GROUPINGS",
    "LayerProfile",
    "Loading",
    "ModuleLoader",
    "evaluate_grouping",
    "load_groups",
    "measure_copy_cost",
    "plan_groups",
]

GroupedLoad = _shoal.GroupedLoad
GROUPINGS = ("optimal", "per_layer", "whole")


class CopyCost(NamedTuple):
    """What a group costs: a fixed part and the link's bandwidth."""

    per_group_seconds: float
    bytes_per_second: float


class LayerProfile(NamedTuple):
    """One layer of a profile, in execution order."""

    name: str
    bytes: int
    compute_seconds: float


class GroupPlan(NamedTuple):
    """Groups as exclusive end indices into the layers, and the predicted timeline (seconds
    from the start of loading)."""

    group_ends: tuple[int, ...]
    first_layer_start: float
    last_layer_end: float

    @property
    def groups(self) -> int:
        """The number of groups planned."""
        return len(self.group_ends)


def _finite(where: str, name: str, value: Any, *, above_zero: bool = False) -> float:
    """`value` as a float, when it is a finite number >= 0 (> 0 when `above_zero`)."""
    _checks.real_number(where, name, value, "a number")
    number = float(value)
    if not (math.isfinite(number) and (number > 0 if above_zero else number >= 0)):
        raise _shoal.InvalidArgumentError(
            f"{where}: {name} must be a finite number {'>' if above_zero else '>='} 0, not {value!r}")
    return number


def _layer_tuples(where: str, layers: Sequence[Any]) -> list[tuple[int, float]]:
    _checks.instance_of(where, "layers", layers, collections.abc.Iterable, "a sequence of layers")
    out = []
    for layer in layers:
        try:
            nbytes, seconds = (layer.bytes, layer.compute_seconds) if isinstance(layer, LayerProfile) else layer
        except (TypeError, ValueError):
            raise TypeError(
                f"{where}: a layer must be a LayerProfile or a (bytes, compute_seconds) pair, not {layer!r}") from None
        _checks.whole_number(where, "a layer's bytes", nbytes)
        out.append((operator.index(nbytes), _finite(where, "a layer's compute_seconds", seconds)))
    if not out:
        raise _shoal.InvalidArgumentError(f"{where}: layers is empty")
    return out


def _cost_pair(where: str, cost: CopyCost) -> tuple[float, float]:
    _checks.instance_of(where, "cost", cost, CopyCost, "a shoal.loading.CopyCost",
                        hint=" (CopyCost(per_group_seconds, bytes_per_second) or measure_copy_cost() makes one)")
    return (_finite(where, "cost.per_group_seconds", cost.per_group_seconds),
            _finite(where, "cost.bytes_per_second", cost.bytes_per_second, above_zero=True))


def measure_copy_cost(stream: Optional[_shoal.Stream] = None) -> CopyCost:
    """Measures the per-group cost and the host-to-device bandwidth on ``stream``'s device
    (default: a new stream of the default device), from page-locked memory."""
    _checks.instance_of("shoal.loading.measure_copy_cost", "stream", stream, _shoal.Stream, "a shoal.Stream",
                        allow_none=True)
    return CopyCost(*_shoal._measure_copy_cost(stream if stream is not None else _shoal.Stream()))


def plan_groups(layers: Sequence[Any], cost: CopyCost, grouping: str = "optimal") -> GroupPlan:
    """Groups for ``layers`` (LayerProfile or (bytes, compute_seconds), in execution order):
    ``"optimal"`` (earliest completion of the last layer), ``"per_layer"`` or ``"whole"``."""
    where = "shoal.loading.plan_groups"
    native_layers = _layer_tuples(where, layers)
    per_group, bandwidth = _cost_pair(where, cost)
    _checks.instance_of(where, "grouping", grouping, str, f"one of {GROUPINGS}")
    ends, first, last = _shoal._plan_groups(native_layers, per_group, bandwidth, grouping)
    return GroupPlan(tuple(ends), first, last)


def evaluate_grouping(layers: Sequence[Any], cost: CopyCost, group_ends: Sequence[int]) -> GroupPlan:
    """The predicted timeline of a given grouping."""
    where = "shoal.loading.evaluate_grouping"
    native_layers = _layer_tuples(where, layers)
    per_group, bandwidth = _cost_pair(where, cost)
    _checks.instance_of(where, "group_ends", group_ends, collections.abc.Iterable, "a sequence of whole numbers")
    given = list(group_ends)
    for g, end in enumerate(given):
        _checks.whole_number(where, f"group_ends[{g}]", end)
    given = [operator.index(end) for end in given]
    ends, first, last = _shoal._evaluate_grouping(native_layers, per_group, bandwidth, given)
    return GroupPlan(tuple(ends), first, last)


def _host_address(source: Any) -> tuple[int, int, Any]:
    """(address, nbytes, owner) of a contiguous host array: a numpy array or a torch CPU
    tensor. ``owner`` holds the bytes: the source, or for a torch tensor with the conjugate
    or negative bit (``x.conj()``, ``x.conj().imag``) a tensor of the values as read (the
    view's own bytes are the values before the bit)."""
    if type(source).__module__.split(".")[0] == "torch":
        if source.device.type != "cpu" or not source.is_contiguous():
            raise _shoal.InvalidArgumentError("shoal.loading: a source tensor must be a contiguous CPU tensor")
        source = source.resolve_conj().resolve_neg()
        return source.data_ptr(), source.numel() * source.element_size(), source
    import numpy

    if not isinstance(source, numpy.ndarray):
        raise TypeError("shoal.loading: a source is a C-contiguous numpy array or a contiguous torch CPU tensor")
    if not source.flags.c_contiguous:
        raise _shoal.InvalidArgumentError("shoal.loading: a source numpy array must be C-contiguous")
    return source.ctypes.data, source.nbytes, source


def _device_address(destination: Any, stream: _shoal.Stream) -> tuple[int, int]:
    """(address, nbytes) of a destination: a shoal Storage or contiguous ArrayView, or a
    contiguous torch CUDA tensor. A shoal destination records ``stream`` as a user."""
    if isinstance(destination, _shoal.Storage):
        destination.record_stream(stream)
        return destination.mutable_ptr(stream), destination.nbytes
    if isinstance(destination, _shoal.ArrayView):
        count = 1
        for extent in destination.shape:
            count *= extent
        expected: list[int] = []
        step = destination.itemsize
        for extent in reversed(destination.shape):
            expected.insert(0, step // destination.itemsize)
            step *= extent
        if destination.readonly or list(destination.strides) != expected:
            raise _shoal.InvalidArgumentError("shoal.loading: a destination view must be writable and C-contiguous")
        storage = destination.storage
        storage.record_stream(stream)
        return storage.mutable_ptr(stream) + destination.offset, count * destination.itemsize
    if type(destination).__module__.split(".")[0] == "torch":
        if destination.device.type != "cuda" or not destination.is_contiguous():
            raise _shoal.InvalidArgumentError("shoal.loading: a destination tensor must be a contiguous CUDA tensor")
        if destination.is_conj() or destination.is_neg():
            # Bytes written under the bit would read back conjugated or negated.
            raise _shoal.InvalidArgumentError(
                "shoal.loading: a destination tensor with the conjugate or negative bit (x.conj()) would read "
                "the bytes copied into it changed; load into a tensor without it"
            )
        return destination.data_ptr(), destination.numel() * destination.element_size()
    raise TypeError("shoal.loading: a destination is a shoal Storage, an ArrayView or a torch CUDA tensor")


def _copy_groups(where: str, groups: Any) -> list[list[tuple[Any, Any]]]:
    """`groups` as lists of (destination, source) pairs, each checked by its place (and read
    once: a generator is walked twice below)."""
    _checks.instance_of(where, "groups", groups, collections.abc.Iterable,
                        "a sequence of groups of (destination, source) pairs")
    out = []
    for g, group in enumerate(groups):
        _checks.instance_of(where, f"groups[{g}]", group, collections.abc.Iterable,
                            "a sequence of (destination, source) pairs")
        pairs = list(group)
        for i, pair in enumerate(pairs):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"{where}: groups[{g}][{i}] must be a (destination, source) pair, not {pair!r}")
        out.append(pairs)
    return out


def load_groups(groups: Sequence[Sequence[tuple[Any, Any]]], stream: Optional[_shoal.Stream] = None) -> GroupedLoad:
    """Enqueues groups of ``(destination, source)`` copies on ``stream`` (default: a new
    stream of the default device), an event after each group, and returns at once.

    A source is a host array (page-locked — a pinned torch tensor — for copies at the link's
    speed; pageable memory is copied correctly but more slowly); a destination is a Storage,
    an ArrayView or a torch CUDA tensor of the same size. The copies first wait for the work
    already queued on the current stream (and on torch's, for torch destinations). Sources
    and destinations are kept alive until the load is gone, which waits for its copies;
    nothing else may write a destination before its group is ready.
    """
    where = "shoal.loading.load_groups"
    _checks.instance_of(where, "stream", stream, _shoal.Stream, "a shoal.Stream",
                        allow_none=True, hint=" (shoal.Stream.from_handle adopts another library's stream)")
    groups = _copy_groups(where, groups)
    copy_stream = stream if stream is not None else _shoal.Stream()
    # The destinations may have been allocated on the current stream (shoal's, or torch's
    # for torch tensors) right after a free whose work is still queued there: the copies
    # wait for that work first.
    after = _shoal.Event(copy_stream.device)
    after.record(_shoal.current_stream(copy_stream.device))
    copy_stream.wait_event(after)
    torch_streams: set[int] = set()
    for group in groups:
        for destination, _ in group:
            if type(destination).__module__.split(".")[0] == "torch" and destination.device.type == "cuda":
                torch_streams.add(_current_stream_getter(destination.device)())
    for handle in torch_streams:
        if handle != 0 or copy_stream.device.kind == "cuda":
            after = _shoal.Event(copy_stream.device)
            after.record(_shoal.Stream.from_handle(handle, copy_stream.device))
            copy_stream.wait_event(after)
    native = []
    for g, group in enumerate(groups):
        copies, owners = [], []
        for destination, source in group:
            dst, dst_bytes = _device_address(destination, copy_stream)
            src, src_bytes, source = _host_address(source)
            if dst_bytes != src_bytes:
                raise _shoal.InvalidArgumentError(
                    f"{where}: group {g}: a {src_bytes}-byte source does not fill a {dst_bytes}-byte destination"
                )
            if src_bytes == 0:
                raise _shoal.InvalidArgumentError(f"{where}: group {g} has an empty copy; leave it out")
            copies.append((dst, src, src_bytes))
            owners.append((destination, source))
        native.append((copies, tuple(owners)))
    return _shoal._load_groups(native, copy_stream)


def _torch() -> Any:
    return _checks.torch_module("shoal.loading")


def _current_stream_getter(device: Any) -> Callable[[], int]:
    """A function returning the native handle of the current stream on ``device``: runs
    before every layer while a load is under way, so the cheapest call torch offers."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        index = device.index
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(device).cuda_stream


def _own_tensors(module: Any) -> list[tuple[str, str, Any]]:
    """(kind, name, tensor) of the parameters and buffers a module holds directly."""
    out = [("parameter", name, p) for name, p in module._parameters.items() if p is not None]
    out += [("buffer", name, b) for name, b in module._buffers.items() if b is not None]
    return out


class Loading:
    """A module's tensors on their way to the GPU. The module's forward waits per group
    (pre-forward hooks) until every group is copied; then the hooks take themselves off.
    Usable from several threads at once, as forwards on any thread run its hooks."""

    def __init__(self, load: GroupedLoad, plan: GroupPlan, last_group: int, torch_stream: Callable[[], Any]) -> None:
        self.load = load
        self.plan = plan
        self._last_group = last_group
        self._torch_stream = torch_stream  # torch's current stream on the device, as a shoal Stream
        self.load_device = torch_stream().device
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self._waited: dict[int, int] = {}  # stream handle -> highest group that stream waited for

    @property
    def groups(self) -> int:
        """The number of groups being copied."""
        return self.load.groups

    def done(self) -> bool:
        """True once every group has been copied."""
        return self.load.is_ready(self._last_group)

    def wait(self, stream: Any = None) -> None:
        """Work enqueued on ``stream`` (a shoal Stream or a torch stream; default: torch's
        current stream on the device) from now on sees every group (GPU-side wait)."""
        if stream is None:
            stream = self._torch_stream()
        elif not isinstance(stream, _shoal.Stream):
            stream = _shoal.Stream.from_handle(stream.cuda_stream, self.load_device)
        self.load.wait(self._last_group, stream)

    def synchronize(self) -> None:
        """Blocks until every group has been copied."""
        self.load.synchronize()

    def remove_hooks(self) -> None:
        """Takes the hooks that make each layer wait for its group off the module."""
        with self._lock:
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()


class ModuleLoader:
    """Loads a torch module's parameters and buffers onto a CUDA device in groups, while the
    module runs.

    The module starts on the CPU. The loader packs its tensors (tied parameters once) into
    one pinned host buffer, layer after layer in execution order once profiled, and points
    the module at views of it; so a group of consecutive layers is one contiguous copy.
    ``load(plan)`` takes one device buffer of the same size on the current stream, enqueues
    one copy per group on the loader's copy stream (an event after each), points the
    module's parameters and buffers at views of the device buffer (the Parameter objects stay
    the same, so an optimizer holding them still works) and installs pre-forward hooks:
    before a layer runs, the current stream waits for the group that holds the layer's
    tensors. ``unload()`` points them back at the host views; values computed on the device
    are not copied back.

    Not thread-safe: one thread loads and unloads; forwards may run on any thread and stream,
    but not while ``load()`` or ``unload()`` runs. ``profile()`` runs the module in whatever
    mode it is in (call ``eval()`` first for inference: train mode runs dropout and updates
    BatchNorm statistics), and planning allocates 64 MiB of pinned and device memory once to
    measure the link. Waits happen in pre-forward hooks, so only forwards through
    ``Module.__call__`` wait: a captured CUDA graph does not. An optimizer keeps working on
    the same Parameters, but its state on the device and the values computed there are not
    copied back by ``unload()``.
    """

    ALIGNMENT = 256  # bytes between packed tensors: every dtype's alignment and then some

    def __init__(self, module: Any, device: Any = None) -> None:
        torch = _torch()
        self.module = module
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type != "cuda":
            raise _shoal.InvalidArgumentError(f"shoal.loading.ModuleLoader: loads onto a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._shoal_device = _shoal.cuda_device(self.device.index)
        # Layers: modules holding tensors directly; registration order until profiled.
        self._layers = [(name, m) for name, m in module.named_modules() if _own_tensors(m)]
        if not self._layers:
            raise _shoal.InvalidArgumentError("shoal.loading.ModuleLoader: the module holds no parameters or buffers")
        self._entries: list[list[tuple[str, str, int]]] = []  # per layer: (kind, name, tensor index)
        self._originals: list[Any] = []  # distinct tensors (Parameter objects or buffers), by index
        index_of: dict[int, int] = {}
        for _, layer in self._layers:
            own = []
            for kind, name, tensor in _own_tensors(layer):
                if tensor.device.type != "cpu":
                    raise _shoal.InvalidArgumentError("shoal.loading.ModuleLoader: the module's tensors must start on the CPU")
                if id(tensor) not in index_of:
                    index_of[id(tensor)] = len(self._originals)
                    self._originals.append(tensor)
                own.append((kind, name, index_of[id(tensor)]))
            self._entries.append(own)
        self._copy_stream = torch.cuda.Stream(self.device)
        self._shoal_copy_stream = _shoal.Stream.from_handle(self._copy_stream.cuda_stream, self._shoal_device)
        self._streams: dict[int, _shoal.Stream] = {}
        self._current_stream = _current_stream_getter(self.device)
        self._called: Optional[set[int]] = None  # layers whose forward ran in the profile
        self._reads: list[list[int]] = []
        self._uncovered: list[int] = []
        self._cost: Optional[CopyCost] = None  # measured on first need
        self._profile: Optional[list[LayerProfile]] = None
        self._loading: Optional[Loading] = None
        self._device_buffer: Any = None
        self._pack(list(range(len(self._layers))), [t.detach() for t in self._originals])
        self._find_readers()

    def _pack(self, order: list[int], sources: list[Any]) -> None:
        """Lays the tensors out in one pinned buffer, layer by layer in ``order``, copies
        ``sources`` (by tensor index) in, and points the module at the host views."""
        torch = _torch()
        slots: list[Optional[tuple[int, int, Any, tuple]]] = [None] * len(self._originals)
        ranges = []  # per position in order: the layer's byte range
        offset = 0
        for layer in order:
            start = None
            for _, _, index in self._entries[layer]:
                if slots[index] is not None:
                    continue  # tied: packed with an earlier layer
                offset = -(-offset // self.ALIGNMENT) * self.ALIGNMENT
                start = offset if start is None else start
                source = sources[index]
                nbytes = source.numel() * source.element_size()
                slots[index] = (offset, nbytes, source.dtype, tuple(source.shape))
                offset += nbytes
            ranges.append((offset if start is None else start, offset))
        size = max(-(-offset // self.ALIGNMENT) * self.ALIGNMENT, self.ALIGNMENT)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        views = self._views(host, slots)
        for view, source in zip(views, sources):
            view.copy_(source)
        # Every tensor is in some layer's entries: no slot is left None.
        self._order, self._slots, self._ranges = order, cast("list[tuple[int, int, Any, tuple]]", slots), ranges
        self._host_buffer, self._host_views = host, views
        self._swap(views)

    @staticmethod
    def _views(buffer: Any, slots: list) -> list[Any]:
        """Each slot's tensor as a view of ``buffer``: one as_strided per tensor on a typed
        view of the whole buffer (the buffer's size and every offset are multiples of the
        alignment, hence of every element size). Made on every load: the host work before
        the first layer can start."""
        typed: dict[Any, Any] = {}
        out = []
        for offset, _, dtype, shape in slots:
            whole = typed.get(dtype)
            if whole is None:
                whole = typed[dtype] = buffer.view(dtype)
            itemsize = whole.element_size()
            stride: list[int] = []
            step = 1
            for extent in reversed(shape):
                stride.insert(0, step)
                step *= extent
            out.append(whole.as_strided(shape, stride, offset // itemsize))
        return out

    @property
    def copy_stream(self) -> Any:
        """The torch stream the copies run on."""
        return self._copy_stream

    @property
    def loading(self) -> Optional[Loading]:
        """The load in progress or done last (None before the first)."""
        return self._loading

    def layer_bytes(self) -> list[tuple[str, int]]:
        """(name, bytes) of each layer in the current order (a tied tensor counts for its first layer)."""
        counted: set[int] = set()
        out = []
        for layer in self._order:
            nbytes = 0
            for _, _, index in self._entries[layer]:
                if index not in counted:
                    counted.add(index)
                    nbytes += self._slots[index][1]
            out.append((self._layers[layer][0], nbytes))
        return out

    def profile(self, *args: Any, rounds: int = 3, **kwargs: Any) -> list[LayerProfile]:
        """Runs the module on the device (loaded whole, under no_grad) ``rounds`` times after a
        warm-up, and returns each layer's bytes and compute time in execution order (the time
        from a layer's start to the next layer's start, so everything the forward runs is
        counted). The loader packs and plans in that order from now on; the module ends
        unloaded."""
        torch = _torch()
        if rounds < 1:
            raise _shoal.InvalidArgumentError("shoal.loading: rounds must be >= 1")
        self.load("whole").synchronize()
        marks: list[tuple[int, Any]] = []
        handles = []
        try:
            for i, (_, layer) in enumerate(self._layers):
                handles.append(layer.register_forward_pre_hook(self._marker(i, marks)))
            timings: list[list[tuple[int, Any]]] = []
            with torch.no_grad():
                for round_index in range(rounds + 1):
                    marks.clear()
                    self.module(*args, **kwargs)
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    if round_index > 0:
                        timings.append(list(marks) + [(-1, end)])
            torch.cuda.synchronize(self.device)
        finally:
            for handle in handles:
                handle.remove()
            self.unload()
        order: list[int] = []
        for layer_index, _ in timings[0][:-1]:
            if layer_index not in order:
                order.append(layer_index)
        self._called = set(order)
        # A layer never called is read, if at all, by an ancestor's forward: it is packed
        # right after its nearest called ancestor, or first when it has none.
        for layer in range(len(self._layers)):
            if layer in self._called:
                continue
            name = self._layers[layer][0]
            ancestors = [i for i in order if name.startswith(self._layers[i][0] + ".") or self._layers[i][0] == ""]
            if ancestors:
                nearest = max(ancestors, key=lambda i: len(self._layers[i][0]))
                order.insert(order.index(nearest) + 1, layer)
            else:
                order.insert(0, layer)
        self._find_readers()
        seconds = [0.0] * len(self._layers)
        for marks_of_round in timings:
            for (layer_index, start), (_, following) in zip(marks_of_round, marks_of_round[1:]):
                seconds[layer_index] += start.elapsed_time(following) / 1000.0 / len(timings)
        if order != self._order:
            self._pack(order, list(self._host_views))
        self._profile = [
            LayerProfile(name, nbytes, seconds[layer]) for layer, (name, nbytes) in zip(order, self.layer_bytes())
        ]
        return list(self._profile)

    @staticmethod
    def _marker(index: int, marks: list) -> Callable[..., None]:
        torch = _torch()

        def mark(module: Any, inputs: Any) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((index, event))

        return mark

    def plan(
        self, profile: Optional[Sequence[LayerProfile]] = None, grouping: str = "optimal", cost: Optional[CopyCost] = None
    ) -> GroupPlan:
        """The grouping of this module's layers (``profile`` defaults to the last
        ``profile()``; without any, the layers' bytes with no compute time). ``cost`` defaults
        to one measured once on the loader's copy stream."""
        profile = profile if profile is not None else self._profile
        layers = list(profile) if profile is not None else [(b, 0.0) for _, b in self.layer_bytes()]
        if len(layers) != len(self._layers):
            raise _shoal.InvalidArgumentError(f"shoal.loading: the profile has {len(layers)} layers, the module {len(self._layers)}")
        if cost is None:
            if self._cost is None:
                self._cost = measure_copy_cost(self._shoal_copy_stream)
            cost = self._cost
        return plan_groups(layers, cost, grouping)

    def load(self, plan: Union[GroupPlan, str] = "optimal", *, wait: bool = True) -> Loading:
        """Enqueues one copy per group and moves the module's tensors to the device; returns at
        once. ``plan`` is a GroupPlan or a grouping name (planned from the last profile, or
        from the layers' bytes alone). With ``wait`` (the default) the module's forward waits
        per group through pre-forward hooks; without, the caller makes its stream wait
        (``Loading.wait``)."""
        torch = _torch()
        if self._loading is not None:
            raise RuntimeError("shoal.loading: the module is loaded already; unload() first")
        if isinstance(plan, str):
            # Without a profile there is no compute to overlap: "optimal" would be one group.
            plan = self.plan(grouping="per_layer" if plan == "optimal" and self._profile is None else plan)
        ends = list(plan.group_ends)
        if not ends or ends[-1] != len(self._layers) or any(b <= a for a, b in zip([0] + ends, ends)):
            raise _shoal.InvalidArgumentError(f"shoal.loading: a plan for {len(self._layers)} layers must end there, increasing")
        target = torch.empty(self._host_buffer.numel(), dtype=torch.uint8, device=self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # target was allocated there
        target.record_stream(self._copy_stream)
        device_base, host_base = target.data_ptr(), self._host_buffer.data_ptr()
        copies, group_of_position, begin = [], [], 0
        for end in ends:
            low, high = self._ranges[begin][0], self._ranges[end - 1][1]
            if high > low:  # a group of layers holding only tied tensors loaded earlier joins the one before
                copies.append(([(device_base + low, host_base + low, high - low)], None))
            group_of_position += [max(len(copies) - 1, 0)] * (end - begin)
            begin = end
        if not copies:
            # Every tensor is empty: nothing to copy but the buffer's padding, which stands
            # for the load, so that the Loading has a group to wait for like any other.
            copies.append(([(device_base, host_base, self._host_buffer.numel())], None))
        # The source is kept until the load is gone; the device buffer is the module's (its
        # use on the copy stream recorded above), freed by unload() even while the Loading lives.
        copies[0] = (copies[0][0], self._host_buffer)
        load = _shoal._load_groups(copies, self._shoal_copy_stream)
        loading = Loading(load, plan, len(copies) - 1, self._torch_current_stream)
        device_views = self._views(target, self._slots)
        if wait:
            group_of_tensor: dict[int, int] = {}
            for position, layer in enumerate(self._order):
                for _, _, index in self._entries[layer]:
                    group_of_tensor.setdefault(index, group_of_position[position])
            for layer, (_, module) in enumerate(self._layers):
                needed = max(group_of_tensor[index] for index in self._reads[layer])
                loading._hooks.append(module.register_forward_pre_hook(self._waiter(loading, needed)))
            # A forward that reads tensors no hooked layer's forward covers waits at the root.
            root_group = max((group_of_tensor[i] for i in self._uncovered), default=0)
            loading._hooks.append(self.module.register_forward_pre_hook(self._waiter(loading, root_group)))
        try:
            self._swap(device_views)
        except BaseException:
            loading.remove_hooks()
            self._swap(self._host_views)
            raise
        self._device_buffer = target
        self._loading = loading
        return loading

    def _find_readers(self) -> None:
        """What each layer's forward may read (self._reads): its own tensors, and those of
        descendant layers whose forward is never called (nn.MultiheadAttention reads
        out_proj's weight itself); before a profile says which are called, every descendant
        counts. And the tensors no hooked forward covers (self._uncovered), which the root
        waits for. Computed once per profile: load() only looks them up."""
        self._reads = []
        for layer, (name, _) in enumerate(self._layers):
            prefix = name + "." if name else ""
            read = [index for _, _, index in self._entries[layer]]
            for other, (other_name, _) in enumerate(self._layers):
                if other != layer and other_name.startswith(prefix) and (self._called is None or other not in self._called):
                    read += [index for _, _, index in self._entries[other]]
            self._reads.append(read)
        covered = {i for layer in (self._called or ()) for i in self._reads[layer]}
        self._uncovered = [] if self._called is None else [
            i for layer in range(len(self._layers)) if layer not in self._called
            for _, _, i in self._entries[layer] if i not in covered
        ]

    def _torch_current_stream(self) -> _shoal.Stream:
        handle = self._current_stream()
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = _shoal.Stream.from_handle(handle, self._shoal_device)
        return stream

    def _waiter(self, loading: Loading, group: int) -> Callable[..., None]:
        waited = loading._waited
        current_stream = self._current_stream

        def wait_for_group(module: Any, inputs: Any) -> None:
            handle = current_stream()
            if waited.get(handle, -1) >= group:
                return
            if loading.done():  # every copy has run: no stream needs to wait any more
                loading.remove_hooks()
                return
            loading.load.wait(group, self._torch_current_stream())
            waited[handle] = group

        return wait_for_group

    def _swap(self, tensors: list[Any]) -> None:
        """Points the module's parameters and buffers at ``tensors`` (by tensor index)."""
        for layer, (_, module) in enumerate(self._layers):
            for kind, name, index in self._entries[layer]:
                if kind == "parameter":
                    self._originals[index].data = tensors[index]
                else:
                    module._buffers[name] = tensors[index]

    def unload(self) -> None:
        """Waits for the copies and for the device (forwards on any stream may still read the
        tensors: PyTorch's allocator would not know of those streams), takes the hooks off,
        points the module's tensors back at the host views and frees the device buffer.
        Values computed on the device are not copied back. When a wait raises (a kernel
        fault), nothing has changed: the module stays loaded, its hooks on."""
        if self._loading is None:
            return
        torch = _torch()
        loading = self._loading
        loading.synchronize()
        torch.cuda.synchronize(self.device)
        self._loading = None
        loading.remove_hooks()
        self._swap(self._host_views)
        self._device_buffer = None
