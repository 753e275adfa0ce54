"""The caching allocator: settings, stats, snapshot, trace, empty_cache, out-of-memory observers."""

import gc
import os
import subprocess
import sys
import weakref

import pytest

import shoal
from conftest import ticks_during


def test_keyword_settings_reach_the_allocator():
    a = shoal.Allocator(use_environment=False, max_split_size_mb=256, expandable_segments=True, trace_entries=8)
    assert "max_split_size_mb:256" in a.config
    assert "expandable_segments:true" in a.config
    assert "trace_entries:8" in a.config


def test_numpys_bools_integers_and_floats_are_taken_as_settings():
    np = pytest.importorskip("numpy")
    a = shoal.Allocator(
        use_environment=False,
        expandable_segments=np.bool_(True),
        trace_entries=np.int64(7),
        memory_fraction=np.float32(0.5),
        debug=np.bool_(False),
    )
    assert "expandable_segments:true" in a.config
    assert "trace_entries:7" in a.config
    assert "memory_fraction:0.5" in a.config
    assert "debug:false" in a.config
    # An array of more than one value is no setting.
    with pytest.raises(shoal.InvalidArgumentError, match="setting trace_entries must be a bool, a number or a string"):
        shoal.Allocator(use_environment=False, trace_entries=np.array([1, 2]))


def test_shoal_alloc_conf_is_read_and_keywords_override_it(monkeypatch):
    monkeypatch.setenv("SHOAL_ALLOC_CONF", "max_split_size_mb:64,trace_entries:5")
    a = shoal.Allocator(trace_entries=9)
    assert "max_split_size_mb:64" in a.config
    assert "trace_entries:9" in a.config
    assert "max_split_size_mb:64" not in shoal.Allocator(use_environment=False).config


def test_pytorchs_allocations_default_to_growable_segments_and_every_source_overrides_it(monkeypatch):
    # The settings shoal.torch.enable() gives the allocators PyTorch uses:
    # growable segments unless the environment, conf or a keyword says
    # otherwise. A plain Allocator keeps plain segments.
    monkeypatch.delenv("SHOAL_ALLOC_CONF", raising=False)
    assert "expandable_segments:true" in shoal._shoal._torch_config_text()
    assert "expandable_segments:false" in shoal.Allocator().config
    assert "expandable_segments:false" in shoal._shoal._torch_config_text(expandable_segments=False)
    assert "expandable_segments:false" in shoal._shoal._torch_config_text(conf="expandable_segments:false")
    monkeypatch.setenv("SHOAL_ALLOC_CONF", "expandable_segments:false,trace_entries:3")
    text = shoal._shoal._torch_config_text()
    assert "expandable_segments:false" in text and "trace_entries:3" in text
    assert "expandable_segments:true" in shoal._shoal._torch_config_text(use_environment=False)
    # Later sources still win among themselves, and pinned host memory, which
    # has no growable segments, is left without them.
    assert "expandable_segments:true" in shoal._shoal._torch_config_text(expandable_segments=True)
    pinned = shoal._shoal._torch_config_text(use_environment=False, memory="pinned_host")
    assert "memory:pinned_host" in pinned and "expandable_segments:false" in pinned


def test_pytorch_layout_shows_a_growable_segment_as_the_stretches_memory_backs():
    # shoal.torch.memory_snapshot's layout is PyTorch's: a growable segment
    # shows as one segment per mapped stretch, sized by it, as PyTorch's own
    # expandable segments do; one with nothing mapped shows not at all.
    import shoal.torch

    mib = 1 << 20
    a = shoal.Allocator(use_environment=False, expandable_segments=True)
    blocks = [a.allocate(4 * mib) for _ in range(6)]
    del blocks[2:4]  # a hole of 8 MiB in the middle
    a.empty_cache()
    (grown,) = a.snapshot()["segments"]
    assert grown["expandable"] and grown["total_size"] > grown["mapped_size"] == 16 * mib
    layout = shoal.torch._torch_layout_snapshot(a.snapshot(), 0)
    segments = layout["segments"]
    assert [s["address"] - grown["address"] for s in segments] == [0, 16 * mib]
    assert [s["total_size"] for s in segments] == [8 * mib, 8 * mib]
    for s in segments:
        assert s["is_expandable"] and s["allocated_size"] == s["total_size"]
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
    del blocks
    a.empty_cache()
    assert shoal.torch._torch_layout_snapshot(a.snapshot(), 0)["segments"] == []
    # Plain segments are shown whole, free memory included.
    plain = shoal.Allocator(use_environment=False)
    x = plain.allocate(mib)
    (segment,) = shoal.torch._torch_layout_snapshot(plain.snapshot(), 0)["segments"]
    assert segment["total_size"] == plain.snapshot()["segments"][0]["total_size"] > segment["allocated_size"] > 0
    del x


def test_a_bad_setting_is_refused_with_its_name():
    with pytest.raises(shoal.InvalidArgumentError, match="expandable_segments"):
        shoal.Allocator(use_environment=False, expandable_segments="maybe")
    with pytest.raises(shoal.InvalidArgumentError, match="bogus"):
        shoal.Allocator(use_environment=False, conf="bogus:1")
    with pytest.raises(shoal.InvalidArgumentError):
        shoal.Allocator(use_environment=False, max_split_size_mb=[1, 2])


def test_stats_count_allocations_and_frees(allocator):
    before = allocator.stats()
    s = allocator.allocate(1000)
    during = allocator.stats()
    assert during["allocations"]["all"]["current"] == before["allocations"]["all"]["current"] + 1
    assert during["allocated_bytes"]["all"]["current"] >= 1000
    assert during["requested_bytes"]["all"]["current"] == 1000
    del s
    gc.collect()
    after = allocator.stats()
    assert after["allocations"]["all"]["current"] == 0
    assert after["allocations"]["all"]["freed"] == 1
    assert after["reserved_bytes"]["all"]["current"] > 0  # cached, not returned
    allocator.empty_cache()
    assert allocator.stats()["reserved_bytes"]["all"]["current"] == 0


def test_snapshot_shows_each_block_and_its_state(allocator):
    s = allocator.allocate(4096)
    blocks = [b for seg in allocator.snapshot()["segments"] for b in seg["blocks"]]
    mine = [b for b in blocks if b["address"] == s.ptr]
    assert len(mine) == 1 and mine[0]["state"] == "allocated" and mine[0]["requested_size"] == 4096
    del s


def test_snapshot_numbers_segments_in_the_order_they_were_taken(allocator):
    small = allocator.allocate(4096)
    large = allocator.allocate(30 << 20)  # a segment of the large pool, taken second

    def number(block):
        (found,) = [s["sequence"] for s in allocator.snapshot()["segments"]
                    if s["address"] <= block.ptr < s["address"] + s["total_size"]]
        return found

    assert 0 < number(small) < number(large)
    del small, large


def test_trace_records_alloc_and_free(allocator):
    s = allocator.allocate(512)
    ptr = s.ptr
    del s
    actions = [(e["action"], e["addr"]) for e in allocator.trace()]
    assert ("alloc", ptr) in actions
    assert ("free_requested", ptr) in actions or ("free_completed", ptr) in actions


def test_a_free_is_held_until_every_stream_the_storage_was_used_on_passes(allocator):
    user, elsewhere = shoal.Stream(), shoal.Stream()
    s = allocator.allocate(4096)
    ptr = s.ptr
    user.delay(0.5)
    s.record_stream(user)  # used on `user`, which is still busy
    with shoal.stream(elsewhere):
        del s  # where it is dropped does not matter
        gc.collect()
    states = [b["state"] for seg in allocator.snapshot()["segments"] for b in seg["blocks"] if b["address"] == ptr]
    assert states == ["pending_free"]
    other = allocator.allocate(4096)
    assert other.ptr != ptr
    del other
    user.synchronize()


def test_out_of_memory_observers_are_called_with_a_report():
    a = shoal.Allocator(use_environment=False, memory_limit_mb=2)
    reports = []
    a.add_oom_observer(reports.append)
    with pytest.raises(shoal.OutOfMemoryError):
        a.allocate(4 << 20)
    assert len(reports) == 1
    assert reports[0]["requested_bytes"] == 4 << 20
    assert reports[0]["limit_bytes"] == 2 << 20
    assert a.stats()["num_ooms"] == 1
    unlimited = shoal.Allocator(use_environment=False)
    unlimited.add_oom_observer(reports.append)
    with pytest.raises(shoal.OutOfMemoryError):
        unlimited.allocate(1 << 62)
    assert reports[1]["limit_bytes"] is None


def test_an_out_of_memory_report_gives_memory_fractions_share_of_the_device_as_its_limit():
    fraction = 2.0**-10  # exact in binary: the share is total * fraction, whole
    a = shoal.Allocator(use_environment=False, memory_fraction=fraction)
    limit = int(a.device.memory()[1] * fraction)
    reports = []
    a.add_oom_observer(reports.append)
    with pytest.raises(shoal.OutOfMemoryError):
        a.allocate(limit + (2 << 20))  # the device has room for it: only the limit refuses it
    assert len(reports) == 1
    assert reports[0]["limit_bytes"] == limit


def test_an_observer_that_raises_does_not_replace_the_out_of_memory_error(monkeypatch):
    a = shoal.Allocator(use_environment=False, memory_limit_mb=2)
    unraisable = []  # messages only: the exceptions' frames would hold `a` in a cycle
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(str(u.exc_value)))

    def broken(report):
        raise RuntimeError("observer failed")

    a.add_oom_observer(broken)
    with pytest.raises(shoal.OutOfMemoryError):
        a.allocate(4 << 20)
    assert unraisable == ["observer failed"]


def test_a_removed_oom_observer_is_not_called_and_is_let_go():
    a = shoal.Allocator(use_environment=False, memory_limit_mb=2)
    released = []

    class Observer:  # refers to the allocator: a cycle through the C++ allocator
        def __init__(self):
            self.allocator = a
            self.calls = 0

        def __call__(self, report):
            self.calls += 1

        def __del__(self):
            released.append(True)

    observer = Observer()
    a.add_oom_observer(observer)
    assert a.remove_oom_observer(observer) is True
    assert a.remove_oom_observer(observer) is False
    assert a.remove_oom_observer(None) is False
    with pytest.raises(shoal.OutOfMemoryError):
        a.allocate(4 << 20)
    assert observer.calls == 0
    del observer
    gc.collect()
    assert released == [True], "the allocator still holds the removed observer"


def test_a_cycle_through_an_oom_observer_is_collected():
    class Server:  # holds its allocator and observes it with a method of its own
        def __init__(self):
            self.allocator = shoal.Allocator(use_environment=False)
            self.allocator.add_oom_observer(self.on_oom)
            self.allocator.add_oom_observer(lambda report: self.allocator.empty_cache())

        def on_oom(self, report):
            self.allocator.empty_cache()

    server = Server()
    server.allocator.allocate(1 << 20)  # dropped: cached memory, which the cycle kept
    gone = weakref.ref(server)
    del server
    gc.collect()
    assert gone() is None, "the allocator's observer kept its owner, and the allocator, alive"


def test_a_cycle_through_an_oom_observer_is_left_whole_while_a_storage_holds_the_allocator():
    # The collector sees the observers only while the Allocator object is the allocator's one
    # holder: a Storage of it could still allocate (a lazy clone's write) and call them, so the
    # cycle stays as documented until the storage goes, and is collected then.
    class Server:
        def __init__(self):
            self.allocator = shoal.Allocator(use_environment=False)
            self.allocator.add_oom_observer(self.on_oom)

        def on_oom(self, report):
            pass

    server = Server()
    kept = server.allocator.allocate(1024)  # a second holder of the allocator, outside the cycle
    gone = weakref.ref(server)
    del server
    gc.collect()
    assert gone() is not None, "the collector broke a cycle whose allocator a storage still uses"
    del kept
    gc.collect()
    assert gone() is None, "the cycle outlived the storage"


def test_the_default_allocator_is_one_per_process():
    assert shoal.default_allocator() is shoal.default_allocator()
    s = shoal.allocate(256)
    assert s.device == shoal.default_device()


def test_a_bad_setting_is_named_with_where_settings_come_from(monkeypatch):
    monkeypatch.delenv("SHOAL_ALLOC_CONF", raising=False)
    with pytest.raises(shoal.InvalidArgumentError) as refused:
        shoal.Allocator(max_split_size_mb=-3)
    assert str(refused.value).startswith("Allocator settings (keywords, conf=): max_split_size_mb:-3 is not valid")
    monkeypatch.setenv("SHOAL_ALLOC_CONF", "bogus:1")
    with pytest.raises(shoal.InvalidArgumentError, match=r"keywords, conf=, SHOAL_ALLOC_CONF\): unknown key 'bogus'"):
        shoal.Allocator()


def test_a_program_that_exits_with_an_observer_registered_prints_nothing():
    # The observer's globals hold the allocator that holds the observer: a cycle the
    # garbage collector cannot see, let go with the process.
    program = (
        "import shoal\n"
        "allocator = shoal.Allocator()\n"
        "def observe(report):\n"
        "    print(allocator)\n"
        "allocator.add_oom_observer(observe)\n"
        "storage = allocator.allocate(64)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "SHOAL_LEAK_WARNINGS"}  # as a user runs it
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            env=environment)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_dropping_an_allocator_with_a_pending_free_lets_other_python_threads_run():
    # The allocator's end waits for its pending frees (a block whose free waits for a busy
    # stream): the dealloc of the last reference (with the GIL) lets the GIL go for that wait.
    a = shoal.Allocator(shoal.host_device(), use_environment=False)
    busy = shoal.Stream(shoal.host_device())
    storage = a.allocate(1 << 20)
    storage.record_stream(busy)
    busy.delay(0.5)
    del storage  # freed once `busy` has run its delay
    allocators = [a]
    del a
    took, ticks = ticks_during(allocators.clear)  # the last reference goes
    assert took >= 0.2, "the allocator's end did not wait for the pending free (the test's premise)"
    assert ticks >= 10, f"another Python thread ran {ticks} times in {took:.2f} s of the drop"


def test_a_bool_is_no_size_and_no_byte():
    # An int to Python, but allocate(True) meaning one byte is a slip: refused by name.
    with pytest.raises(TypeError, match="nbytes must be an int, not a bool"):
        shoal.allocate(True)
    storage = shoal.allocate(16)
    with pytest.raises(TypeError, match="must be an int, not a bool"):
        storage.fill(True)
    # Offsets and counts that may be negative are refused alike (read(nbytes=True) read one byte).
    with pytest.raises(TypeError, match="Storage.read: nbytes must be an int, not a bool"):
        storage.read(nbytes=True)
    with pytest.raises(TypeError, match="Storage.write: offset must be an int, not a bool"):
        storage.write(b"x", offset=True)
    with pytest.raises(TypeError, match="Storage.view: offset must be an int, not a bool"):
        storage.view("uint8", (4,), offset=True)


def test_a_settings_name_or_list_cannot_carry_other_settings():
    # Each keyword is one setting: a name holding ',' or ':', or a value with a ',' outside
    # one [list], would set another one silently.
    with pytest.raises(shoal.InvalidArgumentError, match="no setting's name"):
        shoal.Allocator(**{"debug:true,memory": "pinned_host"})
    with pytest.raises(shoal.InvalidArgumentError, match=r"outside one \[list\]"):
        shoal.Allocator(roundup_power2_divisions="[1],memory:pinned_host")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="counts references to None, immortal from Python 3.12")
def test_an_oom_observer_removed_leaves_nothing_registered():
    # Each registration went on holding a None (its callable dropped) and was copied and called
    # at every out-of-memory: added and removed in a loop, they piled up.
    allocator = shoal.Allocator()

    def observer(report: dict) -> None:
        pass

    before = sys.getrefcount(None)
    for _ in range(2000):
        allocator.add_oom_observer(observer)
        assert allocator.remove_oom_observer(observer)
    assert sys.getrefcount(None) - before < 200, "each removed observer's registration stayed"
