"""shoal.lending: a lender in this process and borrowers in this one (host backend) or in
child processes (both backends); regions as storages, typed refusals, reclaim of a killed
borrower, metrics."""

from __future__ import annotations

import gc
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy
import pytest

import shoal
import shoal.lending

pytestmark = pytest.mark.python

MIB = 1 << 20

BORROWER_SCRIPT = """
import sys, shoal, shoal.lending
borrower = shoal.lending.Borrower(sys.argv[1])
region = borrower.borrow(int(sys.argv[2]), "held by a child")
region.fill(7)
shoal.synchronize()
print("held", region.nbytes, flush=True)
sys.stdin.read()  # until the parent closes it or kills this process
"""


@pytest.fixture
def address():
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        yield str(pathlib.Path(directory) / "lender.sock")


def in_process_only():
    if shoal.default_device().kind == "cuda":
        pytest.skip("CUDA refuses to import memory in the process that exported it; see the child-process tests")


def eventually(done, limit: float = 5.0) -> bool:
    until = time.monotonic() + limit
    while not done():
        if time.monotonic() > until:
            return False
        time.sleep(0.01)
    return True


def test_a_region_is_a_storage_given_back_when_its_last_view_is_gone(address):
    in_process_only()
    with shoal.lending.Lender(address) as lender, shoal.lending.Borrower(address) as borrower:
        region = borrower.borrow(3 * MIB, "parameters")
        assert region.nbytes >= 3 * MIB
        view = region.view("float32", (1024,))
        array = numpy.from_dlpack(view)
        array[:] = numpy.arange(1024, dtype="float32")
        assert numpy.array_equal(numpy.frombuffer(region.read(0, 4096), dtype="float32"), numpy.arange(1024))
        status = lender.status()
        assert [(r["purpose"], r["state"], r["pid"]) for r in status["regions"]] == [("parameters", "lent", os.getpid())]
        del region
        gc.collect()
        assert lender.status()["lent_bytes"] > 0, "given back while a view was alive"
        del view, array
        gc.collect()
        assert eventually(lambda: lender.status()["lent_bytes"] == 0)
        assert lender.status()["given_back"] == 1


def test_refusals_are_typed(address):
    in_process_only()
    unit = 2 * MIB
    with shoal.lending.Lender(address, capacity_bytes=4 * unit, quota_bytes=2 * unit) as lender:
        with shoal.lending.Borrower(address) as borrower:
            with pytest.raises(shoal.OutOfMemoryError):
                borrower.borrow(5 * unit, "past the capacity")
            with pytest.raises(shoal.PeerRefusedError):
                borrower.borrow(3 * unit, "past the quota")
            with pytest.raises(shoal.InvalidArgumentError):
                borrower.borrow(MIB, "")
            kept = borrower.borrow(MIB, "after the refusals")
            assert kept.nbytes >= MIB
            assert "shoal_lending_refusals_total 2\n" in borrower.metrics()
            assert borrower.metrics() == lender.metrics()


def test_a_killed_borrower_process_is_reclaimed(address):
    with shoal.lending.Lender(address, capacity_bytes=8 * MIB) as lender:
        child = subprocess.Popen(
            [sys.executable, "-c", BORROWER_SCRIPT, address, str(8 * MIB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().startswith("held ")
            assert lender.status()["lent_bytes"] == 8 * MIB
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            assert eventually(lambda: lender.status()["lent_bytes"] == 0, 2.0), "not reclaimed"
            assert lender.status()["reclaimed"] == 1
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_a_lender_that_is_gone_leaves_regions_valid_and_says_so(address):
    in_process_only()
    lender = shoal.lending.Lender(address)
    borrower = shoal.lending.Borrower(address)
    region = borrower.borrow(MIB, "outlives its lender")
    region.fill(9)
    lender.close()
    assert set(region.read(0, 64)) == {9}
    with pytest.raises(shoal.ConnectionClosedError):
        borrower.borrow(MIB, "no lender")
    borrower.close()
    with pytest.raises(shoal.InvalidArgumentError):
        borrower.borrow(MIB, "closed")


def test_a_revoked_region_is_named_and_given_back_by_dropping_it(address):
    in_process_only()
    with shoal.lending.Lender(address) as lender, shoal.lending.Borrower(address) as borrower:
        region = borrower.borrow(MIB, "model A")
        kept = borrower.borrow(MIB, "model A scratch")
        region_id = borrower.region_id(region)
        assert region_id is not None and region_id != borrower.region_id(kept)
        assert borrower.region_id(shoal.allocate(64)) is None
        assert borrower.revocations() == []
        lender.revoke(region_id, 5.0)
        [(asked, seconds_left)] = borrower.revocations(wait=5.0)
        assert asked == region_id and 3.0 < seconds_left <= 5.0
        assert [r["state"] for r in lender.status()["regions"]] == ["revoking", "lent"]
        del region
        gc.collect()
        assert eventually(lambda: [r["state"] for r in lender.status()["regions"]] == ["lent"])
        assert lender.status()["revocations"] == 1 and lender.status()["revocations_missed"] == 0
        with pytest.raises(shoal.InvalidArgumentError):
            lender.revoke(12345, 1.0)
