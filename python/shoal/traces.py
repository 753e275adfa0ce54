"""Record a program's GPU allocations as a shoal trace, to replay through every allocator.

A trace is every allocation and free a program made, with sizes and streams, in order
(the format: docs/traces.md). Record one from your own PyTorch program::

    # sketch: train_one_epoch, model and loader are yours
    import shoal.traces

    with shoal.traces.record("train.trace.gz") as recording:
        train_one_epoch(model, loader)
    print(recording)    # events, the trace's peak of live bytes, PyTorch's own peaks

or without touching the program::

    $ python -m shoal.traces train.trace.gz -- train.py --epochs 1

then replay it through shoal's settings (any machine; a GPU gives the device's own costs),
and through PyTorch's allocator, cudaMallocAsync and RMM with the comparison build::

    $ shoal_replay train.trace.gz
    $ shoal_replay --conf "" --conf expandable_segments:true train.trace.gz

The recording uses PyTorch's memory history (``torch.cuda.memory._record_memory_history``),
so the program must run on PyTorch's own caching allocator while it is recorded (not on
``shoal.torch``'s, nor with ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``), and any
history the program records itself is replaced. What is recorded: every allocation of the
device, and its free when the program dropped the block (``free_on="free_requested"``,
the default: what the allocators under comparison then do is theirs) or when PyTorch could
reuse it (``"free_completed"``). Frees of blocks allocated before the recording began are
left out; blocks still live at its end stay live in the trace.

The module needs nothing of shoal's native extension, and imports PyTorch only inside
``record``: the conversion works on any machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import gzip
import os
import runpy
import sys
import tempfile
import time
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

__all__ = ["HEADER", "ConvertedTrace", "Recording", "convert", "write", "record", "main"]

HEADER = "shoal-trace v1"
FREE_ACTIONS = ("free_requested", "free_completed")
MAX_STREAMS = 1024  # the format's stream ids are 0 to 1023
# What shoal_replay reads (bench/replay/trace.h): a line is at most 4096
# bytes, so a note ("# " and its text) at most 4094, and the notes together
# at most 1 MiB.
MAX_NOTE_BYTES = 4094
MAX_NOTES_TOTAL_BYTES = 1 << 20
_NOTES_CUT = "(the notes were cut short here: shoal_replay reads at most 1 MiB of them)"

PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass
class ConvertedTrace:
    """PyTorch's history entries as trace events.

    ``events`` holds ``("a", id, bytes, stream)`` and ``("f", id, stream)`` tuples in order;
    ids are unique among live blocks, streams small integers in order of first use.
    """

    events: list = dataclasses.field(default_factory=list)
    #: PyTorch's stream handle -> the trace's stream id
    streams: dict = dataclasses.field(default_factory=dict)
    #: the most bytes live at once, as the program asked
    peak_requested: int = 0
    allocs: int = 0
    #: frees of blocks allocated before the recording began
    skipped_frees: int = 0
    #: zero-byte allocations (the format has none)
    skipped_zero: int = 0
    #: an address allocated again while live (PyTorch's history ring dropped its free): closed here
    lost_frees: int = 0
    live_at_end: int = 0


def convert(entries: Iterable[dict], free_on: str = "free_requested") -> ConvertedTrace:
    """Converts PyTorch's device history (``torch.cuda.memory._snapshot()["device_traces"][device]``).

    ``alloc`` becomes an allocation and ``free_on`` (``"free_requested"`` or
    ``"free_completed"``) its free; every other action (segment_*, snapshot, oom, ...) is
    left out. Raises ValueError for another ``free_on``, and for a history on more
    streams than a trace names (1,024).
    """
    if free_on not in FREE_ACTIONS:
        raise ValueError(f"free_on must be one of {FREE_ACTIONS}, not {free_on!r}")
    out = ConvertedTrace()
    live: dict = {}  # address -> (id, bytes, stream)
    live_bytes = 0

    def stream_id(handle: Any) -> int:
        if handle not in out.streams and len(out.streams) == MAX_STREAMS:
            raise ValueError(f"the history uses more than {MAX_STREAMS} streams; a trace names 0 to "
                             f"{MAX_STREAMS - 1} (docs/traces.md)")
        return out.streams.setdefault(handle, len(out.streams))

    for entry in entries:
        action = entry["action"]
        if action == "alloc":
            size = int(entry["size"])
            if size <= 0:
                out.skipped_zero += 1
                continue
            address = entry["addr"]
            stream = stream_id(entry["stream"])
            if address in live:
                old_id, old_size, old_stream = live.pop(address)
                out.events.append(("f", old_id, old_stream))
                live_bytes -= old_size
                out.lost_frees += 1
            live[address] = (out.allocs, size, stream)
            out.events.append(("a", out.allocs, size, stream))
            out.allocs += 1
            live_bytes += size
            out.peak_requested = max(out.peak_requested, live_bytes)
        elif action == free_on:
            block = live.pop(entry["addr"], None)
            if block is None:
                out.skipped_frees += 1
                continue
            block_id, size, _ = block
            out.events.append(("f", block_id, stream_id(entry["stream"])))
            live_bytes -= size
    out.live_at_end = len(live)
    return out


def _note_lines(notes: Sequence[str]) -> list[str]:
    """The notes as comment lines shoal_replay reads: any text escaped to
    ASCII (a path, an error message: never refused), each line of a note cut
    into pieces of at most MAX_NOTE_BYTES, and the whole cut short at
    MAX_NOTES_TOTAL_BYTES (said in a last note)."""
    lines: list[str] = []
    total = 0
    for note in notes:
        for line in str(note).splitlines() or [""]:
            text = line.encode("ascii", errors="backslashreplace").decode("ascii")
            for start in range(0, max(len(text), 1), MAX_NOTE_BYTES):
                piece = text[start:start + MAX_NOTE_BYTES]
                if total + len(piece) > MAX_NOTES_TOTAL_BYTES - len(_NOTES_CUT):
                    lines.append(f"# {_NOTES_CUT}")
                    return lines
                total += len(piece)
                lines.append(f"# {piece}")
    return lines


def _trace_text(trace: ConvertedTrace, notes: Sequence[str]) -> bytes:
    lines = [HEADER, *_note_lines(notes)]
    lines.extend(" ".join(str(field) for field in event) for event in trace.events)
    return ("\n".join(lines) + "\n").encode("ascii")


def write(path: PathLike, trace: ConvertedTrace, notes: Sequence[str] = ()) -> None:
    """Writes ``trace`` to ``path``, gzip-compressed when the name ends in ``.gz``.

    Each note becomes a comment line (``# ...``) after the header.
    """
    _write_text(path, _trace_text(trace, notes), compressed=os.fsdecode(os.fspath(path)).endswith(".gz"))


def _write_text(path: PathLike, text: bytes, compressed: bool) -> None:
    if compressed:
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(text)
    else:
        with open(path, "wb") as f:
            f.write(text)


@dataclasses.dataclass
class Recording:
    """What ``record`` wrote: filled in when its ``with`` block ends."""

    path: str
    device: int = 0
    events: int = 0
    allocs: int = 0
    streams: int = 0
    #: the trace's peak of live bytes (what replays compare reserved memory against)
    peak_requested: int = 0
    #: PyTorch's own peaks over the recording, from ``torch.cuda.memory_stats``
    torch_peak_reserved: int = 0
    torch_peak_allocated: int = 0
    torch_peak_requested: int = 0
    skipped_frees: int = 0
    lost_frees: int = 0
    live_at_end: int = 0
    #: PyTorch's history ring filled up (``max_entries``): the start of the program was lost
    truncated: bool = False
    seconds: float = 0.0
    #: comments written after the trace's own; the block may add more while it runs
    notes: list = dataclasses.field(default_factory=list)
    #: where the trace is written until it replaces ``path``
    _partial: str = dataclasses.field(default="", repr=False, compare=False)
    #: the trace is written
    done: bool = False

    def __str__(self) -> str:
        if not self.done:
            return f"shoal.traces.Recording({self.path!r}, recording)"
        ratio = self.torch_peak_reserved / self.peak_requested if self.peak_requested else 0.0
        text = (f"{self.path}: {self.events} events ({self.allocs} allocations, {self.streams} streams) in "
                f"{self.seconds:.1f} s; peak requested {_size(self.peak_requested)}; PyTorch reserved "
                f"{_size(self.torch_peak_reserved)} at its peak ({ratio:.3f} of it)")
        if self.truncated:
            text += "; TRUNCATED: the history ring filled, raise max_entries"
        return text


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _cuda_torch(device: Optional[int]) -> tuple:
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("shoal.traces.record needs PyTorch with CUDA: it records PyTorch's caching "
                           "allocator") from e
    if not torch.cuda.is_available():
        raise RuntimeError("shoal.traces.record: PyTorch sees no CUDA device; record on the machine that "
                           "runs the program on its GPU (the trace then replays anywhere)")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        raise RuntimeError(f"shoal.traces.record: this process allocates through {backend!r}; the recording "
                           "reads PyTorch's own caching allocator ('native'): record without shoal.torch "
                           "and without PYTORCH_CUDA_ALLOC_CONF's backend setting")
    index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
    return torch, index


@contextlib.contextmanager
def record(path: PathLike, *, device: Optional[int] = None, max_entries: int = 1_000_000,
           free_on: str = "free_requested", notes: Sequence[str] = ()) -> Iterator[Recording]:
    """Records the allocations made on ``device`` (the current one by default) inside the
    ``with`` block, and writes them to ``path`` when it ends (gzipped for ``.gz``).

    ``max_entries`` bounds PyTorch's history ring (about 1 KiB each); a recording that
    fills it loses its start and says so (``Recording.truncated``). ``notes`` are written
    as comments after the trace's own (what was recorded, when, PyTorch's peaks); the
    block may add more to the yielded ``Recording.notes``.

    The trace is written beside ``path`` (a hidden ``.partial`` file, made when the block
    begins, so a folder that cannot be written fails before the program runs) and takes
    ``path``'s place once whole: a file already there stays as it was until then. When
    the block raises (say, out of memory), the trace up to then is still written, with a
    note naming the error, and the error goes on; where even that cannot be (the device
    is broken), nothing replaces ``path``. Raises RuntimeError
    without PyTorch, without a CUDA device, or when the process does not allocate
    through PyTorch's own caching allocator; ValueError for a bad ``free_on`` or
    ``max_entries``.
    """
    if free_on not in FREE_ACTIONS:
        raise ValueError(f"free_on must be one of {FREE_ACTIONS}, not {free_on!r}")
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries <= 0:
        raise ValueError(f"max_entries must be a positive int, not {max_entries!r}")
    torch, index = _cuda_torch(device)
    path = os.fsdecode(os.fspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"shoal.traces.record: {path} is a folder; name the trace file")
    # Made now, so what cannot be written fails before the program runs; renamed over `path` once whole.
    fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial",
                                   dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    recording = Recording(path=path, device=index, notes=list(notes), _partial=partial)
    history = torch.cuda.memory._record_memory_history
    try:
        gc.collect()
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)
        before = torch.cuda.memory_allocated(index)
        history(enabled="all", context=None, stacks="python", max_entries=max_entries, device=index,
                clear_history=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    start = time.perf_counter()
    try:
        yield recording
    except BaseException as e:
        with contextlib.suppress(Exception):  # the error that ended the block is the one to hear
            recording.notes.insert(0, f"the recorded block raised {type(e).__name__}: {e}")
            _finish(torch, index, recording, start, before, max_entries, free_on)
        if not recording.done:
            with contextlib.suppress(OSError):
                os.remove(partial)
        raise
    _finish(torch, index, recording, start, before, max_entries, free_on)


def _finish(torch: Any, index: int, recording: Recording, start: float, before: int, max_entries: int,
            free_on: str) -> None:
    """Ends the history, converts it and writes the trace over ``recording.path`` (on a
    failure, the partial file goes and the path stays as it was)."""
    try:
        try:
            gc.collect()  # what the block dropped is freed inside the recording
            torch.cuda.synchronize(index)
            snapshot = torch.cuda.memory._snapshot(index)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=index)
        recording.seconds = time.perf_counter() - start
        stats = torch.cuda.memory_stats(index)
        traces = snapshot["device_traces"]
        entries = traces[index] if index < len(traces) else []
        converted = convert(entries, free_on)
        recording.events = len(converted.events)
        recording.allocs = converted.allocs
        recording.streams = len(converted.streams)
        recording.peak_requested = converted.peak_requested
        recording.torch_peak_reserved = int(stats.get("reserved_bytes.all.peak", 0))
        recording.torch_peak_allocated = int(stats.get("allocated_bytes.all.peak", 0))
        recording.torch_peak_requested = int(stats.get("requested_bytes.all.peak", 0))
        recording.skipped_frees = converted.skipped_frees
        recording.lost_frees = converted.lost_frees
        recording.live_at_end = converted.live_at_end
        recording.truncated = len(entries) >= max_entries
        own_notes = [
            f"recorded by shoal.traces.record, {datetime.date.today().isoformat()}, PyTorch {torch.__version__}, "
            f"{torch.cuda.get_device_name(index)} (device {index})",
            f"torch peaks over the recording: reserved {recording.torch_peak_reserved} allocated "
            f"{recording.torch_peak_allocated} requested {recording.torch_peak_requested} bytes "
            f"(allocated before it: {before})",
            f"conversion: frees from '{free_on}'; {converted.skipped_frees} frees of earlier blocks skipped, "
            f"{converted.skipped_zero} zero-byte allocs skipped, {converted.lost_frees} lost frees closed, "
            f"{converted.live_at_end} blocks live at the end"
            + ("; the history ring filled: the start was lost" if recording.truncated else ""),
        ]
        _write_text(recording._partial, _trace_text(converted, own_notes + [str(note) for note in recording.notes]),
                    compressed=recording.path.endswith(".gz"))
        os.replace(recording._partial, recording.path)
        recording.done = True
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(recording._partial)
        raise


# The command line's own options that take a value: everything up to the
# program's path is ours, everything after it the program's, untouched.
_VALUED_OPTIONS = ("--device", "--max-entries", "--free-on", "--note")


def _split_command_line(args: Sequence[str]) -> tuple:
    """(our arguments, the program's path or None, the program's arguments): the
    program is the first argument after OUT that is not one of our options, or the one
    after a ``--`` that comes before it."""
    ours: list = []
    positionals = 0
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return ours, (args[i + 1] if i + 1 < len(args) else None), list(args[i + 2:])
        if a in _VALUED_OPTIONS:
            ours.extend(args[i:i + 2])
            i += 2
            continue
        if a.startswith("-") and a != "-":
            ours.append(a)  # --help, --note=x, or an unknown one argparse will name
        elif positionals == 0:
            ours.append(a)  # OUT
            positionals = 1
        else:
            return ours, a, list(args[i + 1:])
        i += 1
    return ours, None, []


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m shoal.traces OUT [options] [--] SCRIPT [ARGS...]``: runs SCRIPT as
    ``python SCRIPT ARGS...`` would (in this process, its folder first on ``sys.path``)
    under ``record`` and writes OUT."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m shoal.traces",
        usage="%(prog)s OUT [options] [--] SCRIPT [ARGS...]",
        description="Runs a Python program under PyTorch's memory history and writes its allocations as a "
                    "shoal trace (gzipped when OUT ends in .gz), for shoal_replay. Everything after SCRIPT "
                    "is the program's.",
        epilog="example: python -m shoal.traces train.trace.gz -- train.py --epochs 1")
    parser.add_argument("out", help="the trace file to write")
    parser.add_argument("--device", type=int, default=None, help="CUDA device index (default: the current one)")
    parser.add_argument("--max-entries", type=int, default=1_000_000, help="PyTorch's history ring size")
    parser.add_argument("--free-on", choices=FREE_ACTIONS, default="free_requested")
    parser.add_argument("--note", action="append", default=[], help="a comment for the trace (repeatable)")
    ours, script, program_args = _split_command_line(list(sys.argv[1:] if argv is None else argv))
    options = parser.parse_args(ours)
    if script is None:
        parser.error("no program to run (SCRIPT)")
    if not os.path.exists(script):  # before anything is recorded over OUT
        parser.error(f"no program at {script} (the trace goes to {options.out}: OUT comes first)")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script] + program_args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts it first
    status = 0
    try:
        recorder = record(options.out, device=options.device, max_entries=options.max_entries,
                          free_on=options.free_on, notes=[f"program: {' '.join(sys.argv)}"] + options.note)
        try:
            recording = recorder.__enter__()
        except (RuntimeError, OSError, ValueError) as e:
            print(f"shoal.traces: {e}", file=sys.stderr)
            return 1
        with contextlib.ExitStack() as finish:
            finish.push(recorder)
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:  # the program's own exit: its trace is still written
                if e.code is None or isinstance(e.code, int):
                    status = e.code or 0
                else:  # sys.exit("message"), as Python reports it
                    print(e.code, file=sys.stderr)
                    status = 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    print(f"shoal.traces: {recording}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
