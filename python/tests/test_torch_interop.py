"""What PyTorch asks of its allocator beyond allocations, with shoal in its
place: cuDNN's benchmark mode (cacheInfo), torch.multiprocessing's CUDA
tensors (shareIpcHandle, getIpcDevPtr), a MemPool's end (emptyCache of one
pool), the memory fraction, PyTorch's memory snapshots (snapshot) and its
memory history (recordHistory). Needs PyTorch with CUDA and a GPU; each case
runs in a fresh interpreter (test_torch.run)."""

import pickle
import sys
import textwrap

import pytest

from test_torch import json_of, run, run_program  # noqa: F401 (skips this module where test_torch is skipped)

pytestmark = pytest.mark.torch


def test_cudnn_benchmark_mode_runs_convolutions():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(3, 16, 3, padding=1).cuda()
        x = torch.randn(8, 3, 64, 64, device="cuda")
        y = conv(x)
        y.sum().backward()
        expected = torch.nn.functional.conv2d(x.cpu(), conv.weight.cpu(), conv.bias.cpu(), padding=1)
        print(json.dumps({"shape": list(y.shape),
                          "close": bool(torch.allclose(y.cpu(), expected, atol=1e-3, rtol=1e-3)),
                          "grad": conv.weight.grad is not None,
                          "backend": torch.cuda.get_allocator_backend()}))
        """
    )
    assert out["backend"] == "shoal"
    assert out["shape"] == [8, 16, 64, 64] and out["close"] and out["grad"]


@pytest.mark.parametrize(
    "producer, consumer",
    [("native", "shoal"), ("shoal-plain", "native"), ("shoal-plain", "shoal"), ("native-expandable", "shoal")],
)
def test_torch_multiprocessing_sends_cuda_tensors_either_way(producer, consumer):
    out = run_program("mp_share.py", producer, consumer)
    assert "refused" not in out, out
    assert out["numel"] == 2000
    assert out["first"] == 1000.0, "the handle's offset: the view starts at element 1000 of its block"
    assert out["sum"] == out["expected_sum"]
    assert out["released"] == "released" and out["exitcode"] == 0
    assert out["backend"] == ("shoal" if consumer == "shoal" else "native")


def test_a_tensor_of_a_growable_segment_is_refused_with_the_way_out():
    out = run_program("mp_share.py", "shoal", "native")
    assert "growable segment" in out.get("refused", ""), out
    assert "shoal.torch.share" in out["refused"] and "expandable_segments=False" in out["refused"]


def test_a_mem_pool_that_ends_leaves_the_rest_of_the_cache():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del x  # cached, not given back
        cached = torch.cuda.memory_reserved()
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del y
        del pool  # PyTorch releases the pool, then empties its cache (that pool's alone)
        after = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        print(json.dumps({"cached": cached, "after": after, "emptied": torch.cuda.memory_reserved()}))
        """
    )
    assert out["cached"] >= 64 << 20
    assert out["after"] >= out["cached"], "a MemPool's end gave back memory that was not its own"
    assert out["emptied"] == 0


def test_the_memory_fraction_reads_as_configured_and_as_set():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False, memory_fraction=0.5)
        configured = torch.cuda.get_per_process_memory_fraction(0)
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        print(json.dumps({"configured": configured, "set": torch.cuda.get_per_process_memory_fraction(0)}))
        """
    )
    assert out == {"configured": 0.5, "set": 0.25}


def test_calls_for_another_device_leave_the_current_device():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        last = torch.cuda.device_count() - 1
        torch.cuda.set_device(0)
        torch.ones(1, device="cuda")
        before = torch.cuda.memory_allocated(last)
        torch.cuda.reset_peak_memory_stats(last)
        after_stats = torch.cuda.current_device()
        torch.cuda.empty_cache()
        y = torch.ones(1, device=f"cuda:{last}")
        del y
        torch.cuda.empty_cache()
        print(json.dumps({"devices": last + 1, "before": before, "after_stats": after_stats,
                          "after_other_device": torch.cuda.current_device(),
                          "where": torch.ones(1, device="cuda").device.index}))
        """
    )
    assert out["after_stats"] == 0 and out["after_other_device"] == 0 and out["where"] == 0
    assert out["before"] == 0 or out["devices"] == 1


def test_a_handle_from_a_newer_or_unknown_format_is_refused_in_words():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        torch.ones(1, device="cuda")
        errors = {}
        for name, handle in {"future_version": b"\\x80c" + bytes(64), "unknown_type": b"\\x02z" + bytes(64),
                             "short": b"\\x02c" + bytes(10), "one_byte": b"\\x02"}.items():
            try:
                torch.UntypedStorage._new_shared_cuda(0, handle, 4, 0, b"", 0, b"", False)
                errors[name] = None
            except RuntimeError as e:
                errors[name] = str(e)
        print(json.dumps(errors))
        """
    )
    assert "newer PyTorch" in (out["future_version"] or ""), out
    assert "type 'z'" in (out["unknown_type"] or ""), out
    assert "not 10" in (out["short"] or ""), out
    assert "1 bytes" in (out["one_byte"] or ""), out


def test_torch_memory_snapshot_shows_shoals_segments_and_blocks():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        small = torch.empty(1000, dtype=torch.uint8, device="cuda")     # the small pool's
        large = torch.empty(24 << 20, dtype=torch.uint8, device="cuda")  # the large pool's
        freed = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        freed_ptr = freed.data_ptr()
        del freed  # on its own stream: free at once
        theirs = torch.cuda.memory_snapshot()
        ours = shoal.torch.memory_snapshot()["segments"]
        viewer = torch.cuda.memory._snapshot()
        def segments(snapshot):
            return sorted([s["address"], s["total_size"], s["segment_type"], s["is_expandable"]] for s in snapshot)
        def blocks(snapshot):
            return {b["address"]: [b["size"], b["requested_size"], b["state"]] for s in snapshot for b in s["blocks"]}
        print(json.dumps({"theirs": segments(theirs), "ours": segments(ours),
                          "their_blocks": blocks(theirs), "our_blocks": blocks(ours),
                          "small": small.data_ptr(), "large": large.data_ptr(), "freed": freed_ptr,
                          "allocated": torch.cuda.memory_allocated(),
                          "sums": [[s["allocated_size"], s["active_size"], s["total_size"]] for s in theirs],
                          "block_sums": [[sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated"),
                                          sum(b["size"] for b in s["blocks"])] for s in theirs],
                          "viewer_keys": sorted(viewer), "viewer": segments(viewer["segments"]),
                          "traces": viewer["device_traces"], "devices": torch.cuda.device_count()}))
        """
    )
    assert out["theirs"], "PyTorch's snapshot lists shoal's segments"
    assert out["theirs"] == out["ours"], "the segments of shoal.torch.memory_snapshot(), stretch by stretch"
    blocks = {int(address): block for address, block in out["their_blocks"].items()}
    assert blocks == {int(address): block for address, block in out["our_blocks"].items()}
    for name, requested in (("small", 1000), ("large", 24 << 20)):
        size, asked, state = blocks[out[name]]
        assert state == "active_allocated" and asked == requested and size >= requested, (name, blocks[out[name]])
    (freed,) = [b for a, b in blocks.items() if a <= out["freed"] < a + b[0]]
    assert freed[2] == "inactive", freed
    assert sum(size for size, _, state in blocks.values() if state == "active_allocated") == out["allocated"]
    for (allocated, active, total), (allocated_blocks, covered) in zip(out["sums"], out["block_sums"]):
        assert allocated == allocated_blocks and allocated <= active <= total == covered
    assert {"segments", "device_traces"} <= set(out["viewer_keys"])
    assert out["viewer"] == out["theirs"]
    assert out["traces"] == [[] for _ in range(out["devices"])], "no history is kept: one empty trace per device"


def test_torch_memory_snapshot_of_a_mem_pool_shows_its_segments_alone():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        outside = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            inside = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
        def starts(snapshot):
            return [b["address"] for s in snapshot for b in s["blocks"] if b["state"] == "active_allocated"]
        of_pool = torch.cuda.memory_snapshot(pool.id)
        every = torch.cuda.memory_snapshot()
        print(json.dumps({"pool": list(pool.id), "of_pool": starts(of_pool), "every": starts(every),
                          "owners": [list(s["segment_pool_id"]) for s in of_pool],
                          "every_owners": sorted(list(s["segment_pool_id"]) for s in every),
                          "inside": inside.data_ptr(), "outside": outside.data_ptr()}))
        """
    )
    assert out["of_pool"] == [out["inside"]], out
    assert out["owners"] and all(owner == out["pool"] for owner in out["owners"]), out
    assert out["inside"] in out["every"] and out["outside"] in out["every"]
    assert [0, 0] in out["every_owners"] and out["pool"] in out["every_owners"]


def test_memory_history_records_allocations_frees_and_their_stacks(tmp_path):
    pickled = tmp_path / "s.pickle"
    out = run(
        """
        import json, time, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        torch.cuda.memory._record_memory_history(stacks="python")
        def shoal_history_allocates_here():
            return [torch.empty(3 << 20, dtype=torch.uint8, device="cuda"),
                    torch.empty(5000, dtype=torch.uint8, device="cuda")]
        def shoal_history_frees_here(tensors):
            tensors.pop()  # the last reference: freed here
        kept, dropped = tensors = shoal_history_allocates_here()
        dropped_ptr = dropped.data_ptr()
        del dropped
        shoal_history_frees_here(tensors)
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            pass
        recording = torch._C._cuda_isHistoryEnabled()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot(PICKLED)
        def names(entry):
            return [frame["name"] for frame in entry.get("frames", [])]
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        print(json.dumps({
            "entries": [[e["action"], e.get("addr"), e["size"], names(e)] for e in trace
                        if e["action"] in ("alloc", "free_requested", "free_completed")],
            "ooms": [[e["size"], e["device_free"]] for e in trace if e["action"] == "oom"],
            "times": [e["time_us"] for e in trace], "now": time.time(),
            "blocks": [[b["address"], b["state"], names(b)] for s in snapshot["segments"] for b in s["blocks"]],
            "kept": kept.data_ptr(), "dropped": dropped_ptr, "recording": recording}))
        """.replace("PICKLED", repr(str(pickled)))
    )
    assert out["recording"]
    entries = out["entries"]
    allocs = [e for e in entries if e[0] == "alloc"]
    assert [e[1:3] for e in allocs] == [[out["kept"], 3 << 20], [out["dropped"], 5000]], entries
    assert all("shoal_history_allocates_here" in e[3] for e in allocs), "an alloc entry's stack names its caller"
    frees = [e for e in entries if e[0] != "alloc"]
    assert [e[:3] for e in frees] == [[action, out["dropped"], 5000] for action in ("free_requested", "free_completed")]
    assert all("shoal_history_frees_here" in e[3] for e in frees), "context='all': a free's own stack"
    assert out["ooms"] and out["ooms"][0][0] == 1 << 50, out["ooms"]
    assert all(abs(t / 1e6 - out["now"]) < 600 for t in out["times"]), "times are microseconds since the epoch"
    (kept,) = [b for b in out["blocks"] if b[0] == out["kept"]]
    assert kept[1] == "active_allocated" and "shoal_history_allocates_here" in kept[2], kept
    with open(pickled, "rb") as f:
        dumped = pickle.load(f)
    assert {"segments", "device_traces"} <= set(dumped)
    assert any(e["action"] == "alloc" and e.get("addr") == out["kept"] for t in dumped["device_traces"] for e in t)


def test_memory_history_stops_when_asked():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        torch.cuda.memory._record_memory_history(stacks="python")
        before = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.memory._record_memory_history(enabled=None)
        stopped = torch._C._cuda_isHistoryEnabled()
        def shoal_history_while_stopped():
            return torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
        during = shoal_history_while_stopped()
        del before  # freed while stopped
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(stacks="python")
        after = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        restarted = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        print(json.dumps({
            "stopped": stopped, "traces": [len(t) for t in snapshot["device_traces"]],
            "framed": [f["name"] for s in snapshot["segments"] for b in s["blocks"] for f in b.get("frames", [])],
            "restarted": [[e["action"], e.get("addr"), e["size"]] for e in restarted], "after": after.data_ptr()}))
        """
    )
    assert out["stopped"] is False
    assert out["traces"] and set(out["traces"]) == {0}, "stopping clears the history, as PyTorch's allocator does"
    assert "shoal_history_while_stopped" not in out["framed"], "an allocation while stopped is not recorded"
    blocks = [e for e in out["restarted"] if not e[0].startswith("segment_")]
    assert blocks == [["alloc", out["after"], 3 << 20]], "nothing recorded while stopped"
    # Before it, only segment entries: idle memory given back before growing, the stretch mapped for it.
    assert all(e[0].startswith("segment_") for e in out["restarted"][:-1]), out["restarted"]
    assert any(e[0] == "segment_map" and e[1] <= out["after"] < e[1] + e[2] for e in out["restarted"]), out["restarted"]


@pytest.mark.parametrize("growable", [True, False])
@pytest.mark.parametrize("context", ["alloc", "all"])
def test_memory_history_records_segments_as_they_come_and_go(growable, context):
    out = run(
        f"""
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False, expandable_segments={growable})
        torch.cuda.memory._record_memory_history(stacks="python", context="{context}")
        """
        + """
        def shoal_history_grows_here():
            return torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        def shoal_history_empties_here():
            torch.cuda.empty_cache()
        x = shoal_history_grows_here()
        ptr = x.data_ptr()
        snapshot = torch.cuda.memory._snapshot()
        del x
        shoal_history_empties_here()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        def names(entry):
            return [frame["name"] for frame in entry.get("frames", [])]
        print(json.dumps({
            "entries": [[e["action"], e["addr"], e["size"], names(e)] for e in trace],
            "segments": [[s["address"], s["total_size"], names(s)] for s in snapshot["segments"]],
            "ptr": ptr}))
        """
    )
    taken, given_back = ("segment_map", "segment_unmap") if growable else ("segment_alloc", "segment_free")
    entries, ptr = out["entries"], out["ptr"]
    assert [e[0] for e in entries] == [taken, "alloc", "free_requested", "free_completed", given_back], entries
    (_, base, size, stack), (_, freed_base, freed_size, freed_stack) = entries[0], entries[-1]
    assert base <= ptr and ptr + (40 << 20) <= base + size, "the segment entry covers the tensor"
    assert (freed_base, freed_size) == (base, size), "given back, the same memory"
    assert "shoal_history_grows_here" in stack, "a segment taken for an allocation carries its stack"
    if context == "all":
        assert "shoal_history_empties_here" in freed_stack, "context='all': empty_cache's own stack"
    elif growable:
        assert freed_stack == [], "a growable stretch given back outside an allocation: none (documented)"
    else:
        assert "shoal_history_grows_here" in freed_stack, "a plain segment given back: the stack it was taken with"
    if not growable:
        (segment,) = [s for s in out["segments"] if s[0] == base]
        assert segment[1] == size and "shoal_history_grows_here" in segment[2], "the snapshot's segment has its stack"


@pytest.mark.parametrize("allocator", ["shoal", "pytorch"])
def test_memory_history_completes_a_free_once_the_stream_it_waits_for_passed(allocator):
    out = run(
        f"""
        import json, shoal.torch, torch
        if "{allocator}" == "shoal":
            shoal.torch.enable(use_environment=False)
        """
        + """
        torch.cuda.memory._record_memory_history(stacks="python")
        side = torch.cuda.Stream()
        def shoal_history_allocates_here():
            return torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        def shoal_history_finds_the_wait_over_here():
            return torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # misses the cache
        x = shoal_history_allocates_here()
        ptr = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)
            x.add_(1)
        x.record_stream(side)
        del x  # freed on the current stream: its memory waits for `side`
        def entries():
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            return [[e["action"], [f["name"] for f in e.get("frames", [])]] for e in trace
                    if e.get("addr") == ptr and not e["action"].startswith("segment_")]
        while_waiting = entries()
        torch.cuda.synchronize()
        y = shoal_history_finds_the_wait_over_here()
        print(json.dumps({"while_waiting": while_waiting, "after": entries()}))
        """
    )
    assert [e[0] for e in out["while_waiting"]] == ["alloc", "free_requested"], out["while_waiting"]
    after = out["after"]
    assert [e[0] for e in after[:3]] == ["alloc", "free_requested", "free_completed"], after
    assert "shoal_history_finds_the_wait_over_here" in after[2][1], "the stack of the call that found the wait over"


def test_an_out_of_memory_observer_is_told_and_may_take_a_snapshot():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        seen = []
        def observer(device, allocated, device_total, device_free):  # PyTorch's documented use: dump a snapshot
            seen.append({"device": device, "allocated": allocated, "total": device_total, "free": device_free,
                         "segments": len(torch.cuda.memory._snapshot()["segments"])})
        torch._C._cuda_attach_out_of_memory_observer(observer)
        kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        raised = []
        for fraction in (None, 0.5):
            if fraction is not None:
                torch.cuda.set_per_process_memory_fraction(fraction)
            try:
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                raised.append(len(seen))
        print(json.dumps({"seen": seen, "raised": raised,
                          "total": torch.cuda.get_device_properties(0).total_memory}))
        """
    )
    assert out["raised"] == [1, 2], "each refusal told once, before the error"
    whole, half = out["seen"]
    assert whole["device"] == 0 and whole["allocated"] == 1 << 50
    assert whole["segments"] >= 1, "a snapshot taken inside the observer shows the live tensor's segment"
    assert 0 < whole["free"] <= whole["total"] and abs(whole["total"] - out["total"]) <= out["total"] // 100
    assert half["total"] == int(0.5 * whole["total"]), "the share a memory fraction allows, as PyTorch reports it"


def test_an_out_of_memory_observer_that_raises_is_reported_and_the_error_goes_on():
    out = run(
        """
        import json, os, tempfile, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        told = []
        def failing(device, allocated, device_total, device_free):
            raise ValueError("an observer failing on purpose")
        torch._C._cuda_attach_out_of_memory_observer(failing)
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: told.append(list(args)))
        with tempfile.TemporaryFile() as err:
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)  # the report goes to stderr
            try:
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
                raised = False
            except torch.cuda.OutOfMemoryError:
                raised = True
            finally:
                os.dup2(saved, 2)
            err.seek(0)
            reported = err.read().decode(errors="replace")
        after = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # the allocator still serves
        print(json.dumps({"raised": raised, "told": told, "reported": reported}))
        """
    )
    assert out["raised"], "the out-of-memory error goes on"
    assert [t[:2] for t in out["told"]] == [[0, 1 << 50]], "the observer after the failing one is told"
    assert "out-of-memory observer failed" in out["reported"], out["reported"]
    assert "failing on purpose" in out["reported"], out["reported"]


# PyTorch's own code attaches allocator trace trackers from C++ (no Python
# call does): a probe built against the installed PyTorch attaches one.
TRACKER_PROBE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>
namespace {
std::mutex seen_mutex;
std::vector<std::tuple<int64_t, int64_t, int64_t>> seen;
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> pools_seen;  // action, address, the pool's id
}
void attach() {
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::cuda::CUDACachingAllocator::TraceEntry& te) {
        std::lock_guard<std::mutex> lock(seen_mutex);
        seen.emplace_back(static_cast<int64_t>(te.action_), static_cast<int64_t>(te.addr_),
                          static_cast<int64_t>(te.size_));
        pools_seen.emplace_back(static_cast<int64_t>(te.action_), static_cast<int64_t>(te.addr_),
                                static_cast<int64_t>(te.mempool_.first), static_cast<int64_t>(te.mempool_.second));
      });
}
void attach_failing() {
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::cuda::CUDACachingAllocator::TraceEntry&) {
        throw std::runtime_error("a tracker failing on purpose");
      });
}
std::vector<std::tuple<int64_t, int64_t, int64_t>> entries() {
  std::lock_guard<std::mutex> lock(seen_mutex);
  return seen;
}
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> pools() {
  std::lock_guard<std::mutex> lock(seen_mutex);
  return pools_seen;
}
"""


def with_tracker_probe(tmp_path, body: str, growable: bool = False) -> str:
    """A program that enables shoal (plain segments unless `growable`), builds
    the tracker probe as `probe`, then runs `body` (indented as this is)."""
    enable = "" if growable else ", expandable_segments=False"
    return f"""
        import json, os, tempfile, shoal.torch, torch
        from torch.utils.cpp_extension import load_inline
        shoal.torch.enable(use_environment=False{enable})
        probe = load_inline("shoal_tracker_probe", cpp_sources={TRACKER_PROBE!r},
                            functions=["attach", "attach_failing", "entries", "pools"], with_cuda=True,
                            build_directory={str(tmp_path)!r})
        """ + body


def test_an_allocator_trace_tracker_is_told_each_segment_as_it_comes_and_goes(tmp_path):
    out = run(
        with_tracker_probe(
            tmp_path,
            """
        probe.attach()  # PyTorch's pluggable allocator refuses this ("only used inside Pytorch")
        x = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        ptr = x.data_ptr()
        del x
        torch.cuda.empty_cache()
        print(json.dumps({"entries": [list(e) for e in probe.entries()], "ptr": ptr}))
        """,
        ),
        timeout=600,
    )
    names = {3: "segment_alloc", 4: "segment_free", 5: "segment_map", 6: "segment_unmap"}
    entries = [[names.get(a, a), addr, size] for a, addr, size in out["entries"]]
    assert [e[0] for e in entries] == ["segment_alloc", "segment_free"], entries
    (_, base, size), (_, freed_base, freed_size) = entries
    assert base <= out["ptr"] and out["ptr"] + (40 << 20) <= base + size, "the segment that holds the tensor"
    assert (freed_base, freed_size) == (base, size), "given back, the same memory"


def test_trace_tracker_entries_name_the_mem_pool_whose_segment_they_are(tmp_path):
    out = run(
        with_tracker_probe(
            tmp_path,
            """
        probe.attach()
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            inside = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        outside = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        ptrs = {"inside": inside.data_ptr(), "outside": outside.data_ptr()}
        del inside, outside
        torch.cuda.empty_cache()
        pool_id = list(pool.id)
        del pool  # released: its segment goes back under its name
        torch.cuda.empty_cache()
        print(json.dumps({"pools": [list(e) for e in probe.pools()], "ptrs": ptrs, "pool": pool_id}))
        """,
        ),
        timeout=600,
    )
    names = {3: "segment_alloc", 4: "segment_free"}
    entries = [(names.get(a, a), addr, [first, second]) for a, addr, first, second in out["pools"]]
    taken = [(addr, pool) for action, addr, pool in entries if action == "segment_alloc"]
    assert len(taken) == 2, entries
    def holding(ptr):  # the segment whose base is the nearest at or below the block
        return max((t for t in taken if t[0] <= ptr), key=lambda t: t[0])
    (inside_base, inside_pool), (outside_base, outside_pool) = holding(out["ptrs"]["inside"]), holding(
        out["ptrs"]["outside"])
    assert inside_base != outside_base
    assert inside_pool == out["pool"] and out["pool"] != [0, 0], "the MemPool's segment names it"
    assert outside_pool == [0, 0], "an ordinary segment names no pool"
    freed = {addr: pool for action, addr, pool in entries if action == "segment_free"}
    assert freed.get(inside_base) == out["pool"], entries
    assert freed.get(outside_base) == [0, 0], entries


def test_an_allocator_trace_tracker_that_throws_is_reported_and_the_next_one_is_told(tmp_path):
    out = run(
        with_tracker_probe(
            tmp_path,
            """
        probe.attach_failing()
        probe.attach()
        with tempfile.TemporaryFile() as err:
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)  # the report goes to stderr
            try:
                x = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
                del x
                torch.cuda.empty_cache()
            finally:
                os.dup2(saved, 2)
            err.seek(0)
            reported = err.read().decode(errors="replace")
        after = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # the allocator still serves
        print(json.dumps({"actions": [e[0] for e in probe.entries()], "reported": reported}))
        """,
        ),
        timeout=600,
    )
    assert out["actions"][:2] == [3, 4], "the tracker after the failing one saw segment_alloc, segment_free"
    assert out["reported"].count("allocator trace tracker failed") >= 2, out["reported"]
    assert "failing on purpose" in out["reported"], out["reported"]


def test_an_allocator_trace_tracker_is_refused_over_growable_segments_with_the_way_out(tmp_path):
    out = run(
        with_tracker_probe(
            tmp_path,
            """
        try:
            probe.attach()
            refused = None
        except RuntimeError as e:
            refused = str(e)
        x = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")  # the process goes on
        print(json.dumps({"refused": refused, "entries": len(probe.entries())}))
        """, growable=True,
        ),
        timeout=600,
    )
    assert out["refused"] is not None and "expandable_segments=False" in out["refused"], out
    assert out["entries"] == 0


def test_nccl_registers_shoals_segments_through_its_allocator_hook():
    out = run(
        """
        import json, os, torch, torch.distributed as dist, shoal.torch
        if not dist.is_available() or not dist.is_nccl_available():
            print(json.dumps({"skip": "no NCCL in this PyTorch"}))
            raise SystemExit
        os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"  # attaches a trace tracker
        shoal.torch.enable(use_environment=False, expandable_segments=False)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda:0"))
        x = torch.full((1 << 20,), 2.0, device="cuda")
        dist.all_reduce(x)
        y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a segment taken while the hook is attached
        y.fill_(1)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        ok = bool((x == 2.0).all()) and bool((y == 1).all())
        del y
        torch.cuda.empty_cache()  # its segment deregistered before it goes back
        dist.destroy_process_group()
        print(json.dumps({"ok": ok, "allocator": torch.cuda.memory.get_allocator_backend()}))
        """,
        timeout=300,
    )
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out == {"ok": True, "allocator": "shoal"}, out


# ProcessGroupNCCL.register_mem_pool registers the pool's segments with NCCL
# (from a snapshot of the pool) and, through its trace-tracker hook, every
# segment the pool grows by later (the entry's pool id says whose it is).
# NCCL's REG log names each buffer registered. The same program on PyTorch's
# allocator is the reference.
REGISTER_MEM_POOL = """
    import json, os, re, sys, torch, torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        print(json.dumps({"skip": "no NCCL in this PyTorch"}))
        raise SystemExit
    log = sys.argv[2]
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="REG", NCCL_DEBUG_FILE=log)
    os.environ.pop("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", None)  # only registered pools' segments
    if sys.argv[1] == "shoal":
        import shoal.torch
        shoal.torch.enable(use_environment=False, expandable_segments=False)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda:0"))
    MiB = 1 << 20
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        before = torch.full((8 * MiB,), 1.0, device="cuda")  # a segment the pool had before
    outside = torch.full((8 * MiB,), 1.0, device="cuda")  # an ordinary segment
    backend.register_mem_pool(pool)
    with torch.cuda.use_mem_pool(pool):
        after = torch.full((64 * MiB,), 2.0, device="cuda")  # a segment the pool grows by
    for t in (before, outside, after):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    right = bool((before == 1).all()) and bool((outside == 1).all()) and bool((after == 2).all())

    def segments(pool_id):
        return {s["address"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool_id}

    pool_segments, ordinary = segments(tuple(pool.id)), segments((0, 0))
    if hasattr(backend, "deregister_mem_pool"):
        backend.deregister_mem_pool(pool)
    del before, outside, after
    dist.destroy_process_group()
    with open(log) as f:
        registered = {int(a, 16) for a in re.findall(r"buffer (0x[0-9a-f]+) size", f.read())}
    print(json.dumps({"right": right, "pool_segments": len(pool_segments),
                      "pool_segments_registered": pool_segments <= registered,
                      "ordinary_registered": len(ordinary & registered),
                      "others_registered": len(registered - pool_segments),
                      "allocator": torch.cuda.memory.get_allocator_backend()}))
"""


def test_nccl_register_mem_pool_registers_the_pools_segments_now_and_as_it_grows(tmp_path):
    program = textwrap.dedent(REGISTER_MEM_POOL)
    results = {}
    for allocator in ("native", "shoal"):  # one rank: the registrations, not a collective, are what is shown
        results[allocator] = json_of([sys.executable, "-c", program, allocator, str(tmp_path / f"{allocator}.log")],
                                     300)
        if "skip" in results[allocator]:
            pytest.skip(results[allocator]["skip"])
        if allocator == "native" and not results[allocator]["pool_segments_registered"]:
            pytest.skip(f"this NCCL's REG log names no buffer as expected (see {tmp_path}/native.log)")
    ours, theirs = results["shoal"], results["native"]
    assert (ours["allocator"], theirs["allocator"]) == ("shoal", "native")
    assert ours["right"] and ours["pool_segments"] >= 2, ours
    assert ours["pool_segments_registered"], "a segment of the pool, before or after registration, was not registered"
    assert ours["ordinary_registered"] == ours["others_registered"] == 0, ours
    assert {**ours, "pool_segments": 0} == {**theirs, "pool_segments": 0, "allocator": "shoal"}, (ours, theirs)


def test_memory_history_names_the_stream_of_a_block_a_restore_allocates_again():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        pool, side = torch.cuda.MemPool(), torch.cuda.Stream()
        with torch.cuda.use_mem_pool(pool), torch.cuda.stream(side):
            kept = torch.full((1 << 18,), 3.0, device="cuda")
        side.synchronize()
        state = torch._C._cuda_getCheckpointState(0, pool.id)
        torch.cuda.memory._record_memory_history(stacks="python")
        # The same layout again: `kept`'s block is freed (its storage frees nothing from now on)
        # and allocated again, with no owner: the pool holds it until the end.
        torch._C._cuda_setCheckpointPoolState(0, state, [kept.untyped_storage()._cdata], [])
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        entries = [[e["action"], e["stream"]] for e in trace if e["addr"] == kept.data_ptr()]
        print(json.dumps({"entries": entries, "side": side.cuda_stream, "kept": bool((kept == 3).all())}))
        torch.cuda.memory._record_memory_history(enabled=None)
        """
    )
    assert out["kept"], out
    allocs = [stream for action, stream in out["entries"] if action == "alloc"]
    assert allocs == [out["side"]], f"the restore's allocation names the stream the checkpoint has: {out}"


def test_memory_history_keeps_the_newest_max_entries():
    out = run(
        """
        import json, shoal.torch, torch
        shoal.torch.enable(use_environment=False)
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=10)
        for i in range(20):
            x = torch.empty(1000 + i, dtype=torch.uint8, device="cuda")
            del x
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        print(json.dumps({"trace": [[e["action"], e["size"]] for e in trace]}))
        """
    )["trace"]
    assert len(out) == 10, out
    assert out[-3:] == [["alloc", 1019], ["free_requested", 1019], ["free_completed", 1019]], "the newest, oldest first"
