"""The C table the PyTorch plugin calls (python/src/torch_api.h), driven
through ctypes on the host backend (_torch_table_on_host), so that its
entries run where no GPU is: the layout, allocation, the direct queries
(largest free block, a block's segment) and the snapshot walk. Each case
runs in a fresh interpreter: the table's allocators live as long as the
process."""

import json
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    """
    import ctypes, json, shoal
    from shoal import _shoal

    OK, INVALID_ARGUMENT, ERROR = 0, 2, 3
    ALLOCATED, PENDING_FREE, FREE = 0, 1, 2

    class Block(ctypes.Structure):
        _fields_ = [("size", ctypes.c_size_t), ("requested_size", ctypes.c_size_t), ("state", ctypes.c_int)]

    class Segment(ctypes.Structure):
        _fields_ = [("device", ctypes.c_int), ("address", ctypes.c_size_t), ("total_size", ctypes.c_size_t),
                    ("stream", ctypes.c_void_p), ("is_large", ctypes.c_int), ("is_expandable", ctypes.c_int),
                    ("private_pool", ctypes.c_uint64), ("sequence", ctypes.c_uint64)]

    Visitor = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Segment), ctypes.POINTER(Block),
                               ctypes.c_size_t)
    class FreeWaitEvent(ctypes.Structure):
        _fields_ = [("device", ctypes.c_int), ("action", ctypes.c_int), ("address", ctypes.c_size_t),
                    ("size", ctypes.c_size_t), ("stream", ctypes.c_void_p)]

    class SegmentEvent(ctypes.Structure):
        _fields_ = FreeWaitEvent._fields_ + [("private_pool", ctypes.c_uint64)]

    Observer = ctypes.CFUNCTYPE(None, ctypes.POINTER(SegmentEvent))
    FreeWaitObserver = ctypes.CFUNCTYPE(None, ctypes.POINTER(FreeWaitEvent))
    Restored = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)
    F = ctypes.CFUNCTYPE
    i, sz, vp, u64 = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64

    class Table(ctypes.Structure):  # torch_api.h's shoal_torch_api, entry by entry
        _fields_ = [
            ("version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
            ("allocate", F(i, sz, i, vp, ctypes.POINTER(vp))), ("deallocate", F(i, vp, i, vp)),
            ("record_stream", F(i, vp, i, vp)), ("empty_cache", F(i)), ("set_memory_fraction", vp), ("get_stats", vp),
            ("reset_peak_stats", vp), ("reset_accumulated_stats", vp), ("last_error", F(ctypes.c_char_p)),
            ("create_graph_pool", F(i, i, ctypes.POINTER(u64))),
            ("allocate_in_pool", F(i, u64, sz, i, vp, ctypes.POINTER(vp))),
            ("deallocate_without_events", vp), ("settle_graph_pool", vp),
            ("destroy_graph_pool", F(i, u64, i, ctypes.POINTER(i))),
            ("graph_pool_allocated_blocks", vp),
            ("largest_free_block", F(i, i, ctypes.POINTER(sz))),
            ("block_segment", F(i, vp, i, ctypes.POINTER(vp), ctypes.POINTER(sz))),
            ("configured_memory_fraction", vp),
            ("snapshot", F(i, vp, Visitor)),
            ("observe_segments", F(i, Observer)),
            ("observe_free_waits", F(i, FreeWaitObserver)),
            ("configured_growable_segments", F(i, ctypes.POINTER(i))),
            ("checkpoint_graph_pool", F(i, u64, i, ctypes.POINTER(vp), ctypes.POINTER(sz))),
            ("free_graph_pool_checkpoint", F(i, vp)),
            ("restore_graph_pool", F(i, u64, i, vp, vp, Restored)),
            ("grant_peer_access", F(i, i, i)),
        ]

    api = Table.from_address(_shoal._torch_api())
    out = {"version": api.version, "size_matches": api.struct_size == ctypes.sizeof(Table)}

    def allocate(n, pool=0, stream=None):
        p = vp()
        status = api.allocate(n, 0, stream, ctypes.byref(p)) if pool == 0 else \\
            api.allocate_in_pool(pool, n, 0, stream, ctypes.byref(p))
        assert status == OK, api.last_error()
        return p.value

    def segment_of(ptr):
        base, size = vp(), sz()
        status = api.block_segment(ptr, 0, ctypes.byref(base), ctypes.byref(size))
        return [base.value, size.value] if status == OK else [status, api.last_error().decode()]

    def largest():
        n = sz()
        assert api.largest_free_block(0, ctypes.byref(n)) == OK, api.last_error()
        return n.value

    def walk(stop=False):
        seen = []
        def visit(_context, segment, blocks, count):
            s = segment.contents
            address, listed = s.address, []
            for k in range(count):  # blocks cover their segment in address order
                listed.append([address, blocks[k].size, blocks[k].requested_size, blocks[k].state])
                address += blocks[k].size
            seen.append({"address": s.address, "total": s.total_size, "large": s.is_large,
                         "expandable": s.is_expandable, "pool": s.private_pool, "sequence": s.sequence,
                         "blocks": listed})
            return 1 if stop else 0
        status = api.snapshot(None, Visitor(visit))
        return status, seen
    """
)


def run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_tables_entries_answer_on_plain_segments():
    out = run(
        """
        _shoal._torch_configure(conf="expandable_segments:false", use_environment=False)
        _shoal._torch_table_on_host()
        small, kept, freed = allocate(1000), allocate(3 << 20), allocate(5 << 20)
        assert api.deallocate(freed, 0, None) == OK, api.last_error()
        status, seen = walk()
        free_sizes = [b[1] for s in seen for b in s["blocks"] if b[3] == FREE]
        out.update(small=small, kept=kept, freed=freed, status=status, seen=seen,
                   largest=largest(), largest_in_walk=max(free_sizes, default=0),
                   kept_segment=segment_of(kept), inside=segment_of(kept + 512), freed_segment=segment_of(freed),
                   stopped=walk(stop=True)[0])
        """
    )
    assert out["version"] == 11 and out["size_matches"], "the table's layout is torch_api.h's"
    assert out["status"] == 0 and out["seen"], "a walk of the host allocator's segments"
    blocks = {b[0]: b for s in out["seen"] for b in s["blocks"]}
    for s in out["seen"]:
        assert sum(b[1] for b in s["blocks"]) == s["total"] and not s["expandable"] and s["pool"] == 0
    taken = {b[0]: s["sequence"] for s in out["seen"] for b in s["blocks"]}
    assert 0 < taken[out["small"]] < taken[out["kept"]], "segments are numbered in the order they were taken"
    assert len({s["sequence"] for s in out["seen"]}) == len(out["seen"]), "a number per plain segment"
    assert blocks[out["small"]][2:] == [1000, 0] and blocks[out["kept"]][2:] == [3 << 20, 0], "requested, allocated"
    assert blocks[out["freed"]][3] in (1, 2), "the freed block is pending or free"
    assert out["largest"] == out["largest_in_walk"] >= 5 << 20, "largest_free_block agrees with the walk"
    base, size = out["kept_segment"]
    assert base <= out["kept"] < base + size, "block_segment names the segment that holds the block"
    assert out["inside"][0] == 2 and out["freed_segment"][0] == 2, (out["inside"], out["freed_segment"])
    assert out["stopped"] == 3, "a visitor that stops the walk: SHOAL_TORCH_ERROR"


def test_a_growable_segments_block_is_refused_and_a_graph_pools_segments_are_named():
    out = run(
        """
        _shoal._torch_configure(use_environment=False)  # PyTorch's default: growable segments
        _shoal._torch_table_on_host()
        grown = allocate(3 << 20)
        pool = u64()
        assert api.create_graph_pool(0, ctypes.byref(pool)) == OK, api.last_error()
        in_pool = allocate(1 << 20, pool.value)
        status, seen = walk()
        out.update(grown=grown, refused=segment_of(grown), status=status, seen=seen, pool=pool.value,
                   in_pool=in_pool)
        """
    )
    assert out["refused"][0] == 2 and "growable segment" in out["refused"][1], out["refused"]
    owner = {b[0]: s for s in out["seen"] for b in s["blocks"]}
    assert owner[out["grown"]]["expandable"] == 1 and owner[out["grown"]]["pool"] == 0
    assert owner[out["in_pool"]]["pool"] == out["pool"] != 0, "a graph pool's segment names its pool"


def test_the_host_table_is_refused_once_cuda_allocators_could_exist():
    out = run(
        """
        _shoal._torch_configure(conf="expandable_segments:false", use_environment=False)
        _shoal._torch_table_on_host()
        allocate(512)
        try:
            _shoal._torch_table_on_host()
            out["again"] = "accepted"
        except shoal.InvalidArgumentError as e:
            out["again"] = str(e)
        """
    )
    assert "exist already" in out["again"], out


@pytest.mark.parametrize("growable", [False, True])
def test_segment_events_reach_the_observer_the_table_was_given(growable):
    out = run(
        f"""
        _shoal._torch_configure(conf="expandable_segments:{str(growable).lower()}", use_environment=False)
        _shoal._torch_table_on_host()
        """
        + """
        events = []
        observer = Observer(lambda e: events.append([e.contents.device, e.contents.action, e.contents.address,
                                                     e.contents.size]))
        assert api.observe_segments(observer) == OK
        p = allocate(30 << 20)
        assert api.deallocate(p, 0, None) == OK, api.last_error()
        assert api.empty_cache() == OK, api.last_error()
        told = list(events)
        assert api.observe_segments(ctypes.cast(None, Observer)) == OK
        q = allocate(30 << 20)
        out.update(told=told, after_none=len(events) - len(told), p=p)
        """
    )
    taken, given_back = (2, 3) if growable else (0, 1)  # MAP, UNMAP or ALLOC, FREE
    assert [e[1] for e in out["told"]] == [taken, given_back], out["told"]
    (_, _, base, size), (_, _, freed_base, freed_size) = out["told"]
    assert all(e[0] == 0 for e in out["told"]), "device 0"
    assert base <= out["p"] < base + size and size >= 30 << 20, "the memory that holds the block"
    assert (freed_base, freed_size) == (base, size), "given back whole"
    assert out["after_none"] == 0, "a NULL observer is told nothing"


def test_segment_events_name_the_graph_pool_whose_memory_they_are():
    out = run(
        """
        _shoal._torch_configure(conf="", use_environment=False)
        _shoal._torch_table_on_host()
        events = []
        observer = Observer(lambda e: events.append([e.contents.action, e.contents.size, e.contents.private_pool]))
        assert api.observe_segments(observer) == OK
        ordinary = allocate(30 << 20)
        pool = u64()
        assert api.create_graph_pool(0, ctypes.byref(pool)) == OK, api.last_error()
        p = allocate(30 << 20, pool.value)
        assert api.deallocate(p, 0, None) == OK, api.last_error()
        destroyed = i()
        assert api.destroy_graph_pool(pool.value, 0, ctypes.byref(destroyed)) == OK, api.last_error()
        assert api.deallocate(ordinary, 0, None) == OK, api.last_error()
        assert api.empty_cache() == OK, api.last_error()
        assert api.observe_segments(ctypes.cast(None, Observer)) == OK
        out.update(events=events, pool=pool.value, destroyed=destroyed.value)
        """
    )
    assert out["destroyed"] == 1 and out["pool"] != 0
    named = [e[2] for e in out["events"]]
    assert named.count(out["pool"]) >= 2, out["events"]  # the pool's memory taken and given back
    assert set(named) == {0, out["pool"]}, "the ordinary pools' segments name none"
    held = {}
    for action, size, pool in out["events"]:
        held[pool] = held.get(pool, 0) + (size if action in (0, 2) else -size)
    assert held == {0: 0, out["pool"]: 0}, "each pool's memory is given back under its own name"


def test_a_free_that_waits_for_a_stream_reaches_the_free_wait_observer():
    out = run(
        """
        _shoal._torch_configure(conf="expandable_segments:false", use_environment=False)
        _shoal._torch_table_on_host()
        side = shoal.Stream(shoal.host_device())
        warm = allocate(512)  # the allocator exists before the observer: it is added to it
        events = []
        observer = FreeWaitObserver(lambda e: events.append([e.contents.device, e.contents.action,
                                                             e.contents.address, e.contents.size]))
        assert api.observe_free_waits(observer) == OK
        at_once = allocate(4096)
        assert api.deallocate(at_once, 0, None) == OK, api.last_error()
        told_at_once = len(events)
        p = allocate(64 << 10)
        assert api.record_stream(p, 0, side.handle) == OK, api.last_error()
        assert api.deallocate(p, 0, None) == OK, api.last_error()
        held = list(events)
        side.synchronize()
        assert api.empty_cache() == OK, api.last_error()  # finds the wait over
        completed = list(events)
        assert api.observe_free_waits(ctypes.cast(None, FreeWaitObserver)) == OK
        q = allocate(64 << 10)
        assert api.record_stream(q, 0, side.handle) == OK and api.deallocate(q, 0, None) == OK
        out.update(told_at_once=told_at_once, held=held, completed=completed, after_none=len(events) - len(completed),
                   p=p)
        """
    )
    assert out["told_at_once"] == 0, "a free that waits for nothing is told nothing"
    assert [e[:3] for e in out["held"]] == [[0, 0, out["p"]]], out["held"]  # device 0, HELD, the block
    assert [e[:3] for e in out["completed"][1:]] == [[0, 1, out["p"]]], out["completed"]  # then COMPLETED
    assert out["completed"][1][3] == out["held"][0][3] >= 64 << 10, "the block's size, both times"
    assert out["after_none"] == 0, "a NULL observer is told nothing"


@pytest.mark.parametrize("growable", [False, True])
def test_the_table_says_whether_the_allocators_use_growable_segments(growable):
    out = run(
        f"""
        _shoal._torch_configure(conf="expandable_segments:{str(growable).lower()}", use_environment=False)
        """
        + """
        flag = i()
        assert api.configured_growable_segments(ctypes.byref(flag)) == OK, api.last_error()
        out["growable"] = flag.value
        """
    )
    assert out["growable"] == int(growable)


def test_a_peer_is_granted_through_the_table_and_the_device_itself_is_refused():
    # On the host backend only the ordinals are checked (host memory is every
    # device's); on CUDA the grant reaches cuMemSetAccess (test_torch.py's
    # two-GPU copies).
    out = run(
        """
        _shoal._torch_configure(use_environment=False)
        _shoal._torch_table_on_host()
        out["peer"] = api.grant_peer_access(0, 1)
        out["again"] = api.grant_peer_access(0, 1)
        out["itself"] = api.grant_peer_access(0, 0)
        out["itself_error"] = api.last_error().decode()
        out["negative"] = api.grant_peer_access(0, -1)
        """
    )
    assert out["peer"] == 0 and out["again"] == 0, "granting a peer, and granting it again, succeed"
    assert out["itself"] == 2 and out["negative"] == 2, "the device itself and no device are invalid arguments"
    assert "names no other device" in out["itself_error"], out["itself_error"]


def test_a_graph_pools_checkpoint_is_restored_through_the_table():
    out = run(
        """
        _shoal._torch_configure(conf="expandable_segments:false", use_environment=False)
        _shoal._torch_table_on_host()
        pool = u64()
        assert api.create_graph_pool(0, ctypes.byref(pool)) == OK, api.last_error()
        side = shoal.Stream(shoal.host_device())
        a, b = allocate(4096, pool.value), allocate(1 << 20, pool.value, side.handle)
        saved, counted = vp(), sz()
        assert api.checkpoint_graph_pool(pool.value, 0, ctypes.byref(saved), ctypes.byref(counted)) == OK, \
            api.last_error()
        assert api.deallocate(a, 0, None) == OK, api.last_error()
        c = allocate(8192, pool.value)
        no_visitor = [api.restore_graph_pool(pool.value, 0, saved, None, ctypes.cast(None, Restored)),
                      api.last_error().decode()]
        told = []
        visit = Restored(lambda _context, action, address, size, stream: told.append([action, address, size, stream]))
        assert api.restore_graph_pool(pool.value, 0, saved, None, visit) == OK, api.last_error()
        other = u64()
        assert api.create_graph_pool(0, ctypes.byref(other)) == OK, api.last_error()
        refused = api.restore_graph_pool(other.value, 0, saved, None, visit)
        side.synchronize()
        out.update(a=a, b=b, c=c, side=side.handle, told=told, refused=[refused, api.last_error().decode()],
                   freed=api.free_graph_pool_checkpoint(saved), counted=counted.value, no_visitor=no_visitor)
        """
    )
    freed = sorted(t[1] for t in out["told"] if t[0] == 0)
    allocated = {t[1]: t[2] for t in out["told"] if t[0] == 1}
    assert freed == sorted([out["b"], out["c"]]), out["told"]  # so the refused restore changed nothing
    assert set(allocated) == {out["a"], out["b"]} and allocated[out["b"]] >= 1 << 20, out["told"]
    streams = {t[1]: t[3] for t in out["told"] if t[0] == 1}
    assert streams == {out["a"]: None, out["b"]: out["side"]}, "each allocated again on its own stream"
    assert all(t[2:] == [0, None] for t in out["told"] if t[0] == 0), "a freed block has no size or stream told"
    assert out["refused"][0] == 2 and "checkpoint is of private pool" in out["refused"][1], out["refused"]
    assert out["freed"] == 0
    assert out["counted"] == 2, "the checkpoint's allocated blocks"
    assert out["no_visitor"][0] == 2 and "visitor" in out["no_visitor"][1], out["no_visitor"]
