"""Arguments of the wrong type or range are refused by the public call the user wrote, naming
it and the argument (TypeError for a wrong type, InvalidArgumentError for a wrong value), before
anything is done: not by a private helper, nanobind's "incompatible function arguments" or a
raw builtin error. Socket addresses may be a pathlib.Path."""

from __future__ import annotations

import gc
import os
import pathlib
import tempfile

import numpy
import pytest

import shoal
import shoal.lending
import shoal.loading
import shoal.sharing
import shoal.transfer

pytestmark = pytest.mark.python

MIB = 1 << 20

# CUDA refuses to import memory into the process that exported it: the tests whose producer
# and consumer are this one process share host memory.
HOST = shoal.Allocator(shoal.host_device())


@pytest.fixture
def directory():
    """A fresh 0700 directory for sockets."""
    with tempfile.TemporaryDirectory() as path:
        os.chmod(path, 0o700)
        yield pathlib.Path(path)


@pytest.fixture
def borrower(directory):
    with shoal.lending.Lender(str(directory / "lender.sock")), \
            shoal.lending.Borrower(str(directory / "lender.sock")) as b:
        yield b


def in_process_only():
    if shoal.default_device().kind == "cuda":
        pytest.skip("CUDA refuses to import memory in the process that exported it")


class BytesPath:
    """An os.PathLike whose path is bytes."""

    def __fspath__(self) -> bytes:
        return b"/tmp/shoal-bytes.sock"


def test_a_stream_scope_names_its_stream():
    before = shoal.current_stream()
    with pytest.raises(TypeError, match=r"^shoal\.stream: s must be a shoal\.Stream, not NoneType"):
        with shoal.stream(None):  # type: ignore[arg-type]
            pass
    assert shoal.current_stream() == before, "the refused scope changed the current stream"
    s = shoal.Stream()
    with shoal.stream(s):
        assert shoal.current_stream() == s


def test_from_dlpack_names_its_allocator():
    array = numpy.arange(4, dtype="float32")
    with pytest.raises(TypeError, match=r"^shoal\.from_dlpack: allocator must be a shoal\.Allocator or None, not int"):
        shoal.from_dlpack(array, allocator=-1)  # type: ignore[arg-type]
    assert shoal.from_dlpack(array, allocator=HOST).shape == (4,)
    if shoal.default_device().kind == "cuda":
        # A host array for a CUDA allocator is asked for no stream (numpy refuses one) and
        # refused by its device, in shoal's words.
        with pytest.raises(BufferError, match="^shoal\\.from_dlpack: the array lives on DLPack device \\(1, 0\\)"):
            shoal.from_dlpack(array)


def test_borrow_names_its_timeout_and_wait(borrower):
    for timeout in (None, "x"):
        with pytest.raises(TypeError,
                           match=r"^shoal\.lending\.Borrower\.borrow: timeout must be a number of seconds, not"):
            borrower.borrow(MIB, "p", timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^shoal\.lending\.Borrower\.borrow: wait must be a number of seconds or None"):
        borrower.borrow(MIB, "p", wait="x")  # type: ignore[arg-type]
    assert "shoal_lending" in borrower.metrics(), "the borrower was out of step after the refusals"


def test_borrow_shared_names_its_arguments(borrower):
    where = r"^shoal\.lending\.Borrower\.borrow_shared: "
    with pytest.raises(TypeError, match=where + "name must be a str, not NoneType"):
        borrower.borrow_shared(None)  # type: ignore[arg-type]
    # The uid check allowed_uids gets: (uid_t)-1 is no uid.
    for uid, error in ((-1, shoal.InvalidArgumentError), ((1 << 32) - 1, shoal.InvalidArgumentError),
                       (1 << 64, shoal.InvalidArgumentError), ("0", TypeError)):
        with pytest.raises(error, match=where + "expected_writer_uid must be a whole number from 0 to 4294967294"):
            borrower.borrow_shared("model", expected_writer_uid=uid)  # type: ignore[arg-type]
    with pytest.raises(TypeError,
                       match=where + r"expected_hash must be bytes \(or their hex digits as a str\) or None, not int"):
        borrower.borrow_shared("model", expected_hash=5)  # type: ignore[arg-type]
    for wrong in ("zz", "ab", bytes(31)):
        with pytest.raises(shoal.InvalidArgumentError,
                           match=where + r"expected_hash must be 32 bytes \(SHA-256\) or their 64 hex digits"):
            borrower.borrow_shared("model", expected_hash=wrong)
    with pytest.raises(TypeError, match=where + "timeout must be a number of seconds"):
        borrower.borrow_shared("model", timeout="x")  # type: ignore[arg-type]
    # Checked and taken (a numpy uid too): the lender answers.
    with pytest.raises(shoal.InvalidArgumentError, match="no region is published"):
        borrower.borrow_shared("model", expected_writer_uid=numpy.int64(os.geteuid()))


def test_publish_names_each_field_of_the_layout_and_leaves_the_region_as_it_was(borrower):
    in_process_only()
    region = borrower.borrow(MIB, "model P")
    good = shoal.lending.Entry("e", 0, 64, "float32", (16,))
    where = r"^shoal\.lending\.Borrower\.publish: "
    refused = [
        (TypeError, "region must be a shoal.Storage", dict(region=5)),
        (TypeError, "layout must be a sequence of Entry, not int", dict(layout=5)),
        (TypeError, r"layout\[0\] must be an Entry \(or a tuple of its fields\), not int", dict(layout=[5])),
        (shoal.InvalidArgumentError, r"layout\[0\] must have the 5 fields of an Entry", dict(layout=[("f",)])),
        (TypeError, r"layout\[1\]\.name must be a str, not int", dict(layout=[good, good._replace(name=5)])),
        (shoal.InvalidArgumentError, r"layout\[0\]\.offset must be a whole number from 0 to \d+, not -1",
         dict(layout=[good._replace(offset=-1)])),
        (TypeError, r"layout\[0\]\.nbytes must be a whole number from 0 to \d+, not '64'",
         dict(layout=[good._replace(nbytes="64")])),
        (TypeError, r"layout\[0\]\.shape must be a sequence of whole numbers, not NoneType",
         dict(layout=[good._replace(shape=None)])),
        (shoal.InvalidArgumentError, r"layout\[0\]\.shape\[1\] must be a whole number from 0 to \d+, not -1",
         dict(layout=[good._replace(shape=(16, -1))])),
        (TypeError, r"hash must be bytes \(or their hex digits as a str\) or None, not int", dict(hash=5)),
        (shoal.InvalidArgumentError, "hash must be 32 bytes", dict(hash="not hex")),
        (TypeError, "timeout must be a number of seconds, not str", dict(timeout="x")),
    ]
    for error, message, changed in refused:
        arguments = dict(region=region, layout=[good], hash=None, timeout=5.0) | changed
        with pytest.raises(error, match=where + message):
            borrower.publish(**arguments)
    # The dtype's name is checked natively, in the words its other checks use.
    with pytest.raises(shoal.InvalidArgumentError,
                       match=r"^shoal\.lending\.Borrower\.publish: layout entry 'e': 'float99' is not a dtype shoal knows"):
        borrower.publish(region, [good._replace(dtype="float99")])
    assert region.nbytes >= MIB and borrower.region_id(region) is not None, "a refusal took the region"
    published = borrower.publish(region, [good._replace(offset=numpy.int64(0), shape=(numpy.int64(16),))])
    assert published.layout == [good]


def test_region_id_names_its_storage():
    with pytest.raises(TypeError,
                       match=r"^shoal\.lending\.Borrower\.region_id: storage must be a shoal\.Storage, not int"):
        shoal.lending.Borrower.region_id(5)  # type: ignore[arg-type]
    assert shoal.lending.Borrower.region_id(shoal.allocate(8)) is None


def test_plan_groups_names_each_layer_field():
    cost = shoal.loading.CopyCost(1e-5, 1e10)
    where = r"^shoal\.loading\.plan_groups: "
    # int() once took 1.7 as 1 byte and "5" as 5.
    for nbytes, error in ((1.7, TypeError), ("5", TypeError), (None, TypeError), (-1, shoal.InvalidArgumentError)):
        with pytest.raises(error, match=where + "a layer's bytes must be a whole number"):
            shoal.loading.plan_groups([(nbytes, 1e-4)], cost)
    with pytest.raises(TypeError, match=where + "a layer's compute_seconds must be a number, not str"):
        shoal.loading.plan_groups([(5, "1e-4")], cost)
    with pytest.raises(shoal.InvalidArgumentError,
                       match=where + "a layer's compute_seconds must be a finite number >= 0"):
        shoal.loading.plan_groups([(5, float("nan"))], cost)
    for layer in (5, (5, 1e-4, 1)):
        with pytest.raises(TypeError,
                           match=where + r"a layer must be a LayerProfile or a \(bytes, compute_seconds\) pair"):
            shoal.loading.plan_groups([layer], cost)
    with pytest.raises(shoal.InvalidArgumentError, match=where + "layers is empty"):
        shoal.loading.plan_groups([], cost)
    plan = shoal.loading.plan_groups([(numpy.int64(5), numpy.float32(1e-4))], cost)
    assert plan.group_ends == (1,)


def test_plan_groups_names_its_cost_and_grouping():
    layers = [(5, 1e-4)]
    where = r"^shoal\.loading\.plan_groups: "
    with pytest.raises(TypeError, match=where + r"cost must be a shoal\.loading\.CopyCost, not tuple \(CopyCost\("):
        shoal.loading.plan_groups(layers, (1e-5, 1e10))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=where + r"cost\.per_group_seconds must be a number, not str"):
        shoal.loading.plan_groups(layers, shoal.loading.CopyCost("x", 1e10))  # type: ignore[arg-type]
    with pytest.raises(shoal.InvalidArgumentError,
                       match=where + r"cost\.bytes_per_second must be a finite number > 0, not 0"):
        shoal.loading.plan_groups(layers, shoal.loading.CopyCost(1e-5, 0))
    with pytest.raises(TypeError,
                       match=where + r"grouping must be one of \('optimal', 'per_layer', 'whole'\), not NoneType"):
        shoal.loading.plan_groups(layers, shoal.loading.CopyCost(1e-5, 1e10), None)  # type: ignore[arg-type]
    with pytest.raises(shoal.InvalidArgumentError, match=where + "grouping must be 'optimal', 'per_layer' or 'whole'"):
        shoal.loading.plan_groups(layers, shoal.loading.CopyCost(1e-5, 1e10), "best")


def test_evaluate_grouping_names_its_group_ends_and_cost():
    layers = [(5, 1e-4), (7, 1e-4)]
    cost = shoal.loading.CopyCost(1e-5, 1e10)
    where = r"^shoal\.loading\.evaluate_grouping: "
    with pytest.raises(shoal.InvalidArgumentError,
                       match=where + r"group_ends\[1\] must be a whole number from 0 to \d+, not -1"):
        shoal.loading.evaluate_grouping(layers, cost, [1, -1])
    with pytest.raises(TypeError, match=where + "group_ends must be a sequence of whole numbers, not NoneType"):
        shoal.loading.evaluate_grouping(layers, cost, None)  # type: ignore[arg-type]
    # The copy cost's range once came back as the planner's "plan_groups: ...".
    with pytest.raises(shoal.InvalidArgumentError,
                       match=where + r"cost\.per_group_seconds must be a finite number >= 0"):
        shoal.loading.evaluate_grouping(layers, shoal.loading.CopyCost(-1.0, 1e10), [2])
    assert shoal.loading.evaluate_grouping(layers, cost, numpy.array([1, 2])).group_ends == (1, 2)


def test_load_groups_and_measure_copy_cost_name_their_stream():
    with pytest.raises(TypeError,
                       match=r"^shoal\.loading\.load_groups: stream must be a shoal\.Stream or None, not int"):
        shoal.loading.load_groups([], stream=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError,
                       match=r"^shoal\.loading\.measure_copy_cost: stream must be a shoal\.Stream or None, not int"):
        shoal.loading.measure_copy_cost(5)  # type: ignore[arg-type]


def test_load_groups_names_each_group_and_pair_and_reads_a_generator_once():
    where = r"^shoal\.loading\.load_groups: "
    with pytest.raises(TypeError, match=where + r"groups must be a sequence of groups of \(destination, source\) pairs"):
        shoal.loading.load_groups(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=where + r"groups\[0\] must be a sequence of \(destination, source\) pairs"):
        shoal.loading.load_groups([5])  # type: ignore[list-item]
    source = numpy.arange(16, dtype=numpy.uint8)
    with pytest.raises(TypeError, match=where + r"groups\[0\]\[1\] must be a \(destination, source\) pair, not 5"):
        shoal.loading.load_groups([[(shoal.allocate(16), source), 5]])  # type: ignore[list-item]
    destination = shoal.allocate(16)
    load = shoal.loading.load_groups(([(destination, source)] for _ in range(1)))  # a generator of groups
    load.synchronize()
    assert destination.read() == source.tobytes(), "a generator's groups were copied"


@pytest.mark.parametrize("address, said", [(None, "NoneType"), (5, "int"), (b"/tmp/x.sock", "a bytes path"),
                                           (BytesPath(), "a bytes path")])
def test_producer_and_consumer_name_their_address(address, said):
    message = r"address must be a str or a pathlib\.Path \(a socket path, or '@name'\), not " + said
    with pytest.raises(TypeError, match=r"^shoal\.sharing\.Producer: " + message):
        shoal.sharing.Producer(address)
    if address is not None:  # None: the consumer picks a name
        with pytest.raises(TypeError, match=r"^shoal\.sharing\.Consumer: " + message):
            shoal.sharing.Consumer(address=address, allocator=HOST)


def test_lender_and_borrower_name_their_address(directory):
    with pytest.raises(TypeError, match=r"^shoal\.lending\.Lender: address must be a str or a pathlib\.Path"):
        shoal.lending.Lender(5)  # type: ignore[arg-type]
    with shoal.lending.Lender(directory / "lender.sock"):
        with pytest.raises(TypeError, match=r"^shoal\.lending\.Borrower: address must be .*, not a bytes path"):
            shoal.lending.Borrower(os.fsencode(directory / "lender.sock"))  # type: ignore[arg-type]


def test_socket_addresses_may_be_paths(directory):
    with shoal.sharing.Consumer(directory / "consumer.sock", allocator=HOST) as consumer:
        assert consumer.address == str(directory / "consumer.sock")
        with shoal.sharing.Producer(pathlib.Path(consumer.address), allocator=HOST) as producer:
            storage = HOST.allocate(8)
            storage.write(b"12345678")
            producer.put({"x": storage.view("uint8")})
            batch = consumer.get(timeout=30)
            assert bytes(batch["x"].storage.read(0, 8)) == b"12345678"
            del batch
    with shoal.lending.Lender(directory / "lender.sock") as lender:
        assert repr(lender).startswith(f"shoal.lending.Lender({str(directory / 'lender.sock')!r}")
        with shoal.lending.Borrower(directory / "lender.sock") as borrower:
            assert "shoal_lending_borrowers 1" in borrower.metrics()
    gc.collect()


def test_an_engine_names_its_allocator_and_staging_stores():
    where = r"^shoal\.transfer\.Engine: "
    with pytest.raises(TypeError, match=where + r"allocator must be a shoal\.Allocator or None, not int"):
        shoal.transfer.Engine(allocator=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=where + "staging_stores must be 'automatic', 'streaming' or 'cached', not int"):
        shoal.transfer.Engine(staging_stores=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("setting, value", [
    ("peer_timeout", "x"), ("max_wait", None), ("preempt_after", "x"), ("preempt_deadline", [1]), ("reuse", 5),
])
def test_a_lender_names_a_setting_of_the_wrong_type(directory, setting, value):
    with pytest.raises(TypeError, match=rf"^shoal\.lending\.Lender: {setting} must be "):
        shoal.lending.Lender(directory / "typed.sock", **{setting: value})


def test_a_borrowers_waits_and_timeouts_are_named(directory):
    with pytest.raises(TypeError, match=r"^shoal\.lending\.Borrower: timeout must be a number of seconds, not str"):
        shoal.lending.Borrower(directory / "nobody.sock", timeout="5")
    with shoal.lending.Lender(directory / "lender.sock") as lender, \
            shoal.lending.Borrower(directory / "lender.sock") as borrower:
        with pytest.raises(TypeError, match=r"^shoal\.lending\.Borrower\.revocations: wait must be a number"):
            borrower.revocations(wait="1")
        with pytest.raises(TypeError, match=r"^shoal\.lending\.Borrower\.metrics: timeout must be a number"):
            borrower.metrics(timeout=None)
        with pytest.raises(TypeError, match=r"^shoal\.lending\.Borrower\.revoke: deadline must be a number"):
            borrower.revoke(1, deadline="soon")
        with pytest.raises(TypeError, match=r"^shoal\.lending\.Lender\.revoke: deadline must be a number"):
            lender.revoke(1, deadline=None)
        assert borrower.revocations(wait=numpy.float64(0.0)) == [], "the borrower works on, numpy numbers taken"
