"""shoal.traces: PyTorch's memory history converted to shoal traces, written plain or
gzipped, and the recording's own steps (against a stand-in for torch.cuda on the host;
the CUDA test records real allocations)."""

import gzip
import os
import subprocess
import sys
import textwrap
import types

import pytest

from shoal import traces

SIDE = 93824992236000  # a side stream's handle, as PyTorch reports it

HISTORY = [
    {"action": "segment_alloc", "addr": 0x100000, "size": 2 << 20, "stream": 0},
    {"action": "free_requested", "addr": 0x7000, "size": 512, "stream": 0},  # allocated before the recording
    {"action": "free_completed", "addr": 0x7000, "size": 512, "stream": 0},
    {"action": "alloc", "addr": 0x100000, "size": 1000, "stream": 0},
    {"action": "alloc", "addr": 0x100400, "size": 3000, "stream": SIDE},
    {"action": "free_requested", "addr": 0x100000, "size": 1000, "stream": 0},
    {"action": "alloc", "addr": 0x101000, "size": 200, "stream": 0},
    {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
    {"action": "free_completed", "addr": 0x100000, "size": 1000, "stream": 0},
    {"action": "alloc", "addr": 0x102000, "size": 0, "stream": 0},
    {"action": "alloc", "addr": 0x100000, "size": 512, "stream": 0},  # the address, reused: a new id
    {"action": "alloc", "addr": 0x100400, "size": 64, "stream": SIDE},  # a live address: its free was lost
    {"action": "oom", "device_free": 0, "size": 1 << 40, "stream": 0},
    {"action": "free_requested", "addr": 0x101000, "size": 200, "stream": SIDE},  # a cross-stream free
    {"action": "free_completed", "addr": 0x101000, "size": 200, "stream": SIDE},
]

TEXT = "shoal-trace v1\n# a note\na 0 1000 0\na 1 3000 1\nf 0 0\na 2 200 0\na 3 512 0\nf 1 1\na 4 64 1\nf 2 1\n"


def test_the_history_converts_to_trace_events():
    c = traces.convert(HISTORY)
    assert c.events == [("a", 0, 1000, 0), ("a", 1, 3000, 1), ("f", 0, 0), ("a", 2, 200, 0),
                        ("a", 3, 512, 0), ("f", 1, 1), ("a", 4, 64, 1), ("f", 2, 1)]
    assert c.streams == {0: 0, SIDE: 1}
    assert c.peak_requested == 4000
    assert (c.allocs, c.skipped_frees, c.skipped_zero, c.lost_frees, c.live_at_end) == (5, 1, 1, 1, 2)


def test_frees_may_be_taken_where_pytorch_could_reuse_the_block():
    c = traces.convert(HISTORY, "free_completed")
    assert c.events[:4] == [("a", 0, 1000, 0), ("a", 1, 3000, 1), ("a", 2, 200, 0), ("f", 0, 0)]
    assert c.peak_requested == 4200
    with pytest.raises(ValueError, match="free_on"):
        traces.convert(HISTORY, "free")


@pytest.mark.parametrize("name", ["t.trace", "t.trace.gz"])
def test_a_trace_is_written_plain_or_gzipped(tmp_path, name):
    path = tmp_path / name
    traces.write(path, traces.convert(HISTORY), ["a note"])
    data = path.read_bytes()
    if name.endswith(".gz"):
        assert data[:2] == b"\x1f\x8b"
        data = gzip.decompress(data)
    assert data.decode("ascii") == TEXT


def test_a_note_of_several_lines_stays_comments(tmp_path):
    path = tmp_path / "t.trace"
    traces.write(path, traces.convert(HISTORY[:4]), ["one\ntwo"])
    assert path.read_text().splitlines()[:3] == ["shoal-trace v1", "# one", "# two"]


# ---- record(), against a stand-in for torch.cuda ------------------------------------------


class FakeCuda:
    """What record() uses of torch.cuda: a history that the block's "allocations" fill."""

    def __init__(self, backend="native", available=True):
        self.backend, self.available = backend, available
        self.recording = False
        self.history = []
        self.calls = []
        self.memory = types.SimpleNamespace(
            get_allocator_backend=lambda: self.backend,
            _record_memory_history=self._record_memory_history,
            _snapshot=lambda device=None: {"device_traces": [list(self.history)]})

    def _record_memory_history(self, enabled="all", **options):
        self.calls.append((enabled, options))
        self.recording = enabled is not None
        if options.get("clear_history"):
            self.history.clear()

    def allocate(self, address, size):
        if self.recording:
            self.history.append({"action": "alloc", "addr": address, "size": size, "stream": 0})

    def free(self, address, size):
        if self.recording:
            self.history.append({"action": "free_requested", "addr": address, "size": size, "stream": 0})

    def is_available(self):
        return self.available

    def current_device(self):
        return 0

    def synchronize(self, device=None):
        pass

    def reset_peak_memory_stats(self, device=None):
        pass

    def memory_allocated(self, device=None):
        return 0

    def memory_stats(self, device=None):
        return {"reserved_bytes.all.peak": 4 << 20, "allocated_bytes.all.peak": 3 << 10,
                "requested_bytes.all.peak": 3000}

    def get_device_name(self, device=None):
        return "a stand-in GPU"


@pytest.fixture
def fake_torch(monkeypatch):
    cuda = FakeCuda()
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-stand-in"
    torch.cuda = cuda
    torch.device = lambda kind, index: types.SimpleNamespace(index=index)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return cuda


def test_record_writes_what_the_block_allocated(tmp_path, fake_torch):
    path = tmp_path / "run.trace.gz"
    fake_torch.allocate(0x1, 999)  # before the recording: not in it
    with traces.record(path, notes=["mine"]) as recording:
        fake_torch.allocate(0x10, 1000)
        fake_torch.allocate(0x20, 2000)
        fake_torch.free(0x10, 1000)
        recording.notes.append("added while recording")
    assert recording.done and recording.events == 3 and recording.peak_requested == 3000
    assert recording.torch_peak_reserved == 4 << 20 and not recording.truncated
    assert not fake_torch.recording, "the history is switched off again"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    assert lines[0] == "shoal-trace v1"
    assert [line for line in lines if not line.startswith("#")][1:] == ["a 0 1000 0", "a 1 2000 0", "f 0 0"]
    assert "# mine" in lines and "# added while recording" in lines
    assert any("PyTorch 0.0-stand-in" in line for line in lines)
    assert "peak requested 2.9 KiB" in str(recording) and "run.trace.gz" in str(recording)


def test_a_block_that_raises_still_writes_its_trace_and_the_error_goes_on(tmp_path, fake_torch):
    path = tmp_path / "oom.trace"
    with pytest.raises(MemoryError):
        with traces.record(path):
            fake_torch.allocate(0x10, 1000)
            raise MemoryError("out of memory on the device")
    text = path.read_text()
    assert "# the recorded block raised MemoryError: out of memory on the device" in text
    assert "a 0 1000 0" in text
    assert not fake_torch.recording


def test_a_full_history_ring_is_reported(tmp_path, fake_torch):
    with traces.record(tmp_path / "t.trace", max_entries=2) as recording:
        for i in range(3):
            fake_torch.allocate(0x10 * (i + 1), 100)
    assert recording.truncated and "TRUNCATED" in str(recording)


def test_a_path_that_cannot_be_written_fails_before_the_block_runs(tmp_path, fake_torch):
    ran = []
    with pytest.raises(OSError):
        with traces.record(tmp_path / "no-such-directory" / "t.trace"):
            ran.append(True)
    assert not ran and not fake_torch.recording


def test_a_trace_already_at_the_path_stays_until_the_new_one_is_whole(tmp_path, fake_torch):
    path = tmp_path / "t.trace"
    path.write_text("an earlier trace\n")
    with traces.record(path) as recording:
        fake_torch.allocate(0x10, 1000)
        assert path.read_text() == "an earlier trace\n", "replaced before the block ended"
    assert recording.done and "a 0 1000 0" in path.read_text()
    # A recording that cannot be converted (the device broke) leaves the path as it was.
    path.write_text("an earlier trace\n")
    fake_torch.memory._snapshot = lambda device=None: (_ for _ in ()).throw(RuntimeError("the device is gone"))
    with pytest.raises(RuntimeError, match="the device is gone"):
        with traces.record(path):
            fake_torch.allocate(0x10, 1000)
    assert path.read_text() == "an earlier trace\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.trace"], "a partial file was left behind"


def test_a_folder_given_as_the_path_fails_before_the_block_runs(tmp_path, fake_torch):
    ran = []
    with pytest.raises(IsADirectoryError, match="is a folder"):
        with traces.record(tmp_path):
            ran.append(True)
    assert not ran and not fake_torch.recording and list(tmp_path.iterdir()) == []


def test_a_path_given_as_bytes_is_written(tmp_path, fake_torch):
    path = tmp_path / "t.trace.gz"
    with traces.record(os.fsencode(path)):
        fake_torch.allocate(0x10, 1000)
    assert "a 0 1000 0" in gzip.decompress(path.read_bytes()).decode()


@pytest.mark.parametrize("cuda, message", [(FakeCuda(available=False), "no CUDA device"),
                                           (FakeCuda(backend="shoal"), "allocates through 'shoal'")])
def test_record_refuses_where_pytorch_cannot_record(tmp_path, monkeypatch, cuda, message):
    torch = types.ModuleType("torch")
    torch.cuda = cuda
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(RuntimeError, match=message):
        with traces.record(tmp_path / "t.trace"):
            pass
    assert not (tmp_path / "t.trace").exists()


def test_record_checks_its_arguments(tmp_path, fake_torch):
    with pytest.raises(ValueError, match="free_on"):
        with traces.record(tmp_path / "t.trace", free_on="later"):
            pass
    with pytest.raises(ValueError, match="max_entries"):
        with traces.record(tmp_path / "t.trace", max_entries=0):
            pass


def _stand_in_torch(tmp_path):
    package = tmp_path / "stand-in" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from test_traces import FakeCuda
        __version__ = "0.0-stand-in"
        cuda = FakeCuda()
        def device(kind, index):
            import types
            return types.SimpleNamespace(index=index)
    """))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "stand-in"), os.environ.get("PYTHONPATH", "")]))


def test_the_command_line_records_a_program_and_keeps_its_exit_status(tmp_path):
    env = _stand_in_torch(tmp_path)
    program = tmp_path / "program.py"
    program.write_text(textwrap.dedent("""
        import sys, torch
        torch.cuda.allocate(0x10, 4096)
        print("args", sys.argv[1:])
        sys.exit(3)
    """))
    out = tmp_path / "program.trace"
    result = subprocess.run([sys.executable, "-m", "shoal.traces", str(out), "--note", "cli", "--", str(program),
                             "--flag", "x"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "args ['--flag', 'x']" in result.stdout
    text = out.read_text()
    assert "a 0 4096 0" in text and "# cli" in text and "--flag x" in text
    assert "peak requested 4.0 KiB" in result.stderr  # the recording's summary


def test_the_command_line_says_why_it_cannot_record(tmp_path):
    package = tmp_path / "stand-in" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("class cuda:\n    is_available = staticmethod(lambda: False)\n")
    program = tmp_path / "program.py"
    program.write_text("raise SystemExit('the program must not run')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "stand-in"))
    result = subprocess.run([sys.executable, "-m", "shoal.traces", str(tmp_path / "t.trace"), str(program)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "no CUDA device" in result.stderr and "must not run" not in result.stderr


def test_the_command_line_records_nothing_over_out_when_the_program_is_not_there(tmp_path):
    # OUT forgotten: `python -m shoal.traces train.py data.txt` must not empty train.py.
    env = _stand_in_torch(tmp_path)
    program = tmp_path / "train.py"
    program.write_text("print('training')\n")
    result = subprocess.run([sys.executable, "-m", "shoal.traces", str(program), str(tmp_path / "data.txt")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "no program at" in result.stderr, result.stderr
    assert program.read_text() == "print('training')\n"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("stand-in")) == ["train.py"]


def test_notes_of_any_text_are_written_escaped(tmp_path):
    path = tmp_path / "t.trace"
    traces.write(path, traces.convert(HISTORY[:4]), ["données/été.py"])
    assert path.read_text(encoding="ascii").splitlines()[1] == "# donn\\xe9es/\\xe9t\\xe9.py"


def test_long_notes_are_cut_into_lines_shoal_replay_reads(tmp_path):
    # shoal_replay reads lines of at most 4096 bytes, and at most 1 MiB of notes
    # (bench/replay/trace.h): a long command line or error message is cut, not refused there.
    path = tmp_path / "t.trace"
    long_note = "program: train.py " + " ".join(f"--input=/data/shard-{i:05d}.parquet" for i in range(300))
    escaped = "é" * 3000  # four bytes each once escaped
    traces.write(path, traces.convert(HISTORY[:4]), [long_note, escaped])
    lines = path.read_text(encoding="ascii").splitlines()
    notes = [line for line in lines if line.startswith("#")]
    assert all(len(line) <= 4096 for line in lines)
    assert "".join(line[2:] for line in notes) == long_note + "\\xe9" * 3000
    assert len(notes) == 3 + 3  # 10,217 bytes in three lines, 12,000 escaped in three
    huge = ["x" * 4094] * 300  # past 1 MiB together
    traces.write(path, traces.convert(HISTORY[:4]), huge)
    lines = path.read_text(encoding="ascii").splitlines()
    notes = [line for line in lines if line.startswith("#")]
    assert sum(len(line) - 2 for line in notes) <= 1 << 20
    assert notes[-1].startswith("# (the notes were cut short here")
    # Right at the bound: the notes and the cut's own note stay within it.
    bound = 1 << 20
    edge = ["x" * 4094] * ((bound - 70) // 4094) + ["x" * ((bound - 70) % 4094), "y" * 10]
    traces.write(path, traces.convert(HISTORY[:4]), edge)
    lines = path.read_text(encoding="ascii").splitlines()
    notes = [line for line in lines if line.startswith("#")]
    assert sum(len(line) - 2 for line in notes) <= bound
    assert lines[-1] == "a 0 1000 0", "the events follow the notes"


def test_a_history_on_more_streams_than_a_trace_names_is_refused():
    history = [{"action": "alloc", "addr": i, "size": 8, "stream": 1000 + i} for i in range(traces.MAX_STREAMS + 1)]
    with pytest.raises(ValueError, match="streams"):
        traces.convert(history)
    assert len(traces.convert(history[:-1]).streams) == traces.MAX_STREAMS


@pytest.mark.parametrize("argv, script, program_args", [
    (["out.gz", "--", "train.py", "--lr", "1"], "train.py", ["--lr", "1"]),
    (["out.gz", "train.py", "--", "x"], "train.py", ["--", "x"]),
    (["out.gz", "--note", "n", "train.py", "--lr", "1", "--", "--extra"], "train.py", ["--lr", "1", "--", "--extra"]),
    (["--max-entries", "5", "out.gz", "train.py"], "train.py", []),
    (["out.gz", "--"], None, []),
])
def test_the_command_line_gives_the_program_everything_after_it(argv, script, program_args):
    _, got_script, got_args = traces._split_command_line(argv)
    assert (got_script, got_args) == (script, program_args)


def test_the_command_line_runs_a_program_as_python_would(tmp_path):
    """Its folder first on sys.path (a sibling module imports), sys.exit("text") printed."""
    env = _stand_in_torch(tmp_path)
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers.py").write_text("VALUE = 42\n")
    (folder / "main.py").write_text("import sys, helpers\nprint('helper', helpers.VALUE)\nsys.exit('stopped here')\n")
    result = subprocess.run([sys.executable, "-m", "shoal.traces", str(tmp_path / "t.trace"), str(folder / "main.py")],
                            capture_output=True, text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert "helper 42" in result.stdout
    assert "stopped here" in result.stderr
    assert (tmp_path / "t.trace").read_text().startswith("shoal-trace v1")


@pytest.mark.torch
def test_record_on_the_gpu_writes_pytorch_s_allocations(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA")
    path = tmp_path / "gpu.trace.gz"
    with traces.record(path) as recording:
        a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(5000, dtype=torch.uint8, device="cuda")
        del b, c
    assert recording.done and recording.allocs == 3
    assert recording.peak_requested == (1 << 20) + (3 << 20)
    lines = [line for line in gzip.decompress(path.read_bytes()).decode().splitlines() if not line.startswith("#")]
    assert lines == ["shoal-trace v1", "a 0 1048576 0", "a 1 3145728 0", "f 0 0", "a 2 5000 0", "f 1 0", "f 2 0"]
