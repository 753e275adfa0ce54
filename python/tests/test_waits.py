"""Calls that wait on another thread or process end when the object is closed from another
thread (with its closed error, never a crash or a hang) and on Ctrl-C (KeyboardInterrupt):
Peer.receive, Listener.accept, the transfer engine's get and submit, Borrower.revocations."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy
import pytest

import shoal
import shoal.lending
import shoal.transfer

pytestmark = pytest.mark.python

WAIT = 10  # seconds: a close or a signal that is not seen within this has failed
HOST = shoal.Allocator(shoal.host_device())  # CUDA refuses memory exported by the same process


@pytest.fixture
def lender_address():
    """A socket path in a fresh 0700 directory, for a lender."""
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        yield str(pathlib.Path(directory) / "lender.sock")


def connection_pair(listener: shoal.Listener) -> tuple[shoal.Connection, shoal.Connection]:
    """(accepted, dialed): both ends of one connection to `listener`."""
    dialed: list = []
    dialer = threading.Thread(target=lambda: dialed.append(shoal.connect(listener.address)))
    dialer.start()
    accepted = listener.accept(timeout=WAIT)
    dialer.join(WAIT)
    return accepted, dialed[0]


def peer_pair(name: str, dialer_context: shoal.SharingContext | None = None) -> tuple[shoal.Peer, shoal.Peer]:
    """(accepting peer, dialing peer) on the host allocator."""
    with shoal.Listener(f"@{name}-{os.getpid()}") as listener:
        accepted, dialed = connection_pair(listener)
    return (shoal.Peer(shoal.SharingContext(HOST), accepted),
            shoal.Peer(dialer_context or shoal.SharingContext(HOST), dialed))


def ended_by_close(wait, close) -> BaseException:
    """Runs wait() in a thread, then close() in another once wait() is waiting; returns what
    wait() raised. Fails when either call is still running after WAIT seconds."""
    raised: list = []

    def waiting():
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 (the error is the result)
            raised.append(e)

    waiter = threading.Thread(target=waiting, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not raised, f"the call did not wait: {raised}"
    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(WAIT)
    waiter.join(WAIT)
    assert not closer.is_alive(), "close() did not return"
    assert not waiter.is_alive(), "the waiting call did not end when its object was closed"
    assert raised, "the waiting call returned instead of raising"
    return raised[0]


def test_closing_a_peer_ends_a_receive_waiting_in_another_thread():
    receiver, sender = peer_pair("close-receive")
    with sender:
        error = ended_by_close(receiver.receive, receiver.close)
    # "Peer: closed", or the connection's own end when close() had to shut it down (a loaded machine)
    assert isinstance(error, shoal.ConnectionClosedError) and "closed" in str(error)
    assert receiver.closed


def test_closing_a_listener_ends_an_accept_waiting_in_another_thread():
    listener = shoal.Listener(f"@close-accept-{os.getpid()}")
    error = ended_by_close(listener.accept, listener.close)
    assert isinstance(error, shoal.InvalidArgumentError) and "Listener: closed" in str(error)


def test_closing_an_engine_ends_a_get_and_a_submit_waiting_in_other_threads():
    engine = shoal.transfer.Engine(HOST)
    error = ended_by_close(engine.get, engine.close)
    assert isinstance(error, shoal.InvalidArgumentError) and "closed" in str(error)

    full = shoal.transfer.Engine(HOST, max_batches_in_flight=1)
    full.submit([numpy.ones(16, "uint8")])  # not taken: the next submit waits for room
    error = ended_by_close(lambda: full.submit([numpy.ones(16, "uint8")]), full.close)
    assert isinstance(error, shoal.InvalidArgumentError) and "closed" in str(error)


def test_closing_a_borrower_ends_a_wait_for_revocations_in_another_thread(lender_address):
    with shoal.lending.Lender(lender_address, device=shoal.host_device()):
        borrower = shoal.lending.Borrower(lender_address, allocator=HOST)
        error = ended_by_close(lambda: borrower.revocations(wait=60.0), borrower.close)
    assert isinstance(error, shoal.ConnectionClosedError) and "Borrower: closed" in str(error)


def test_close_is_refused_inside_an_out_of_memory_observer(monkeypatch):
    """The observer may run on the object's own thread (a transfer engine's), which its
    destruction would join: the observer's close() raises instead (reported as unraisable)."""
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False, memory_limit_mb=2)
    listener = shoal.Listener(f"@observer-{os.getpid()}")
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(str(u.exc_value)))

    def closing(report):
        listener.close()

    allocator.add_oom_observer(closing)
    with pytest.raises(shoal.OutOfMemoryError):
        allocator.allocate(4 << 20)
    assert not listener.closed
    assert len(unraisable) == 1 and "not inside an out-of-memory observer" in unraisable[0], unraisable
    allocator.remove_oom_observer(closing)
    listener.close()


def test_a_timeout_past_the_clocks_range_waits_like_none():
    listener = shoal.Listener(f"@far-timeout-{os.getpid()}")
    error = ended_by_close(lambda: listener.accept(timeout=1e300), listener.close)
    assert isinstance(error, shoal.InvalidArgumentError)
    engine = shoal.transfer.Engine(HOST)
    error = ended_by_close(lambda: engine.get(timeout=1e12), engine.close)
    assert isinstance(error, shoal.InvalidArgumentError)


def test_closing_a_peer_ends_a_send_stuck_on_a_peer_that_does_not_read():
    context = shoal.SharingContext(HOST, send_timeout_ms=0, ring_bytes=0)  # a send waits for ever
    idle, sender = peer_pair("stuck-send", context)  # idle never reads
    note = b"x" * 60000

    def send_until_stuck():
        while True:
            sender.send_note(note)

    error = ended_by_close(send_until_stuck, sender.close)
    assert isinstance(error, shoal.ConnectionClosedError)
    idle.close()


def test_a_receive_that_times_out_leaves_the_connection_usable():
    receiver, sender = peer_pair("timeout")
    with receiver, sender:
        with pytest.raises(shoal.PeerTimeoutError, match="stays usable"):
            receiver.receive(timeout=0.05)
        sender.send_note(b"after the timeout")
        assert receiver.receive(timeout=WAIT) == (None, b"after the timeout")


CHILD_PREFIX = (
    "import os, signal, sys, threading, numpy, shoal, shoal.lending, shoal.transfer\n"
    # A process started in the background may inherit SIGINT ignored: Python's handler, as in a terminal.
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "HOST = shoal.Allocator(shoal.host_device())\n"
)


def run_child(tmp_path: pathlib.Path, name: str, source: str) -> subprocess.CompletedProcess:
    """Runs CHILD_PREFIX + `source` as the script tmp_path/name, for WAIT seconds at most."""
    script = tmp_path / name
    script.write_text(CHILD_PREFIX + source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT)


WAITS = {
    "Peer.receive": (
        "listener = shoal.Listener(f'@ctrl-c-{os.getpid()}')\n"
        "dialed = []\n"
        "dialer = threading.Thread(target=lambda: dialed.append(shoal.connect(listener.address)))\n"
        "dialer.start()\n"
        "accepted = listener.accept(timeout=10)\n"
        "dialer.join()\n"
        "receiver = shoal.Peer(shoal.SharingContext(HOST), accepted)\n"
        "sender = shoal.Peer(shoal.SharingContext(HOST), dialed[0])\n"
        "print('waiting', flush=True)\n"
        "receiver.receive()\n"
    ),
    "Listener.accept": (
        "listener = shoal.Listener(f'@ctrl-c-{os.getpid()}')\nprint('waiting', flush=True)\nlistener.accept()\n"
    ),
    "Engine.get": "engine = shoal.transfer.Engine(HOST)\nprint('waiting', flush=True)\nengine.get()\n",
    "Engine.submit": (
        "engine = shoal.transfer.Engine(HOST, max_batches_in_flight=1)\n"
        "engine.submit([numpy.ones(4, 'uint8')])\n"
        "print('waiting', flush=True)\n"
        "engine.submit([numpy.ones(4, 'uint8')])\n"
    ),
}


@pytest.mark.parametrize("call", ["Peer.receive", "Listener.accept"])
def test_a_signal_handler_that_closes_the_waiting_object_ends_the_wait(call, tmp_path):
    """close() on the thread whose call holds the object (a SIGTERM handler, a __del__) returns
    at once; the call then ends with the closed error and the object goes with it."""
    target = "receiver" if call == "Peer.receive" else "listener"
    body = WAITS[call].splitlines()
    last = body[-1]  # the waiting call
    lines = body[:-2] + [
        f"signal.signal(signal.SIGALRM, lambda *args: {target}.close())",
        "signal.setitimer(signal.ITIMER_REAL, 0.3)",
        "try:",
        f"    {last}",
        "except shoal.ShoalError as e:",
        "    print(type(e).__name__, e, flush=True)",
        f"print('closed', {target}.closed, flush=True)",
    ]
    done = run_child(tmp_path, "handler.py", "\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    name = "Peer" if call == "Peer.receive" else "Listener"
    kind = "ConnectionClosedError" if call == "Peer.receive" else "InvalidArgumentError"
    assert done.stdout.splitlines() == [f"{kind} {name}: closed", "closed True"], done.stdout + done.stderr


@pytest.mark.parametrize("call", ["Peer.receive", "Listener.accept"])
def test_a_daemon_thread_waiting_at_exit_lets_the_process_end_cleanly(call, tmp_path):
    body = WAITS[call].splitlines()
    if call == "Listener.accept":  # sixteen waits, their slices staggered: one ends in the exit's window
        lines = [
            "import time",
            "listeners = [shoal.Listener(f'@daemon-{os.getpid()}-{i}') for i in range(16)]",
            "for listener in listeners:",
            "    threading.Thread(target=listener.accept, daemon=True).start()",
            "    time.sleep(0.006)",
        ]
    else:
        lines = body[:-2] + [f"threading.Thread(target=lambda: {body[-1]}, daemon=True).start()"]
    lines += ["import time; time.sleep(0.3)", "print('exiting', flush=True)"]
    for _ in range(5):  # the end of a thread caught mid-call is a race: several exits show it
        done = run_child(tmp_path, "daemon.py", "\n".join(lines) + "\n")
        assert done.returncode == 0 and done.stdout == "exiting\n", (done.returncode, done.stdout, done.stderr)


# Daemon threads looping on one kind of call when the process exits. At exit
# such a thread is mostly waiting for the GIL back, or running Python code a
# call started (a parser, a producer's __dlpack__, an observer), or its C++
# thread is (the transfer engine's): the interpreter ends it there.
DAEMON_LOOPS = {
    "Storage.fill": "storage = HOST.allocate(4096)\ndef work():\n    storage.fill(1)\n",
    "Allocator.stats": "def work():\n    HOST.stats()\n",
    "from_dlpack of a Python producer": (
        "class Producer:\n"
        "    def __init__(self):\n"
        "        self.array = numpy.ones(16, 'uint8')\n"
        "    def __dlpack__(self, **kwargs):\n"
        "        sum(range(2000))\n"
        "        return self.array.__dlpack__(**kwargs)\n"
        "def work():\n"
        "    shoal.from_dlpack(Producer(), HOST)\n"
    ),
    "an out-of-memory observer": (
        "small = shoal.Allocator(shoal.host_device(), use_environment=False, memory_limit_mb=2)\n"
        "small.add_oom_observer(lambda report: None)\n"
        "def work():\n"
        "    try:\n"
        "        small.allocate(4 << 20)\n"
        "    except shoal.OutOfMemoryError:\n"
        "        pass\n"
    ),
    "transfer Engine submit and next": (
        "engine = shoal.transfer.Engine(HOST)\n"
        "def work():\n"
        "    engine.submit([numpy.ones(64, 'uint8') for _ in range(8)])\n"
        "    engine.next()\n"
    ),
}


@pytest.mark.parametrize("loop", sorted(DAEMON_LOOPS))
def test_daemon_threads_looping_on_a_call_let_the_process_end_cleanly(loop, tmp_path):
    source = (
        "import time\n" + DAEMON_LOOPS[loop] + "def forever():\n"
        "    while True:\n"
        "        work()\n"
        "for _ in range(4):\n"
        "    threading.Thread(target=forever, daemon=True).start()\n"
        "time.sleep(0.3)\n"
        "print('exiting', flush=True)\n"
    )
    for _ in range(3):
        done = run_child(tmp_path, "loop.py", source)
        assert done.returncode == 0 and done.stdout == "exiting\n", (done.returncode, done.stdout, done.stderr)


def test_an_observer_still_running_when_the_interpreter_finalizes_lets_the_process_end(tmp_path):
    """Past the exit gate's second of waiting, the observer's thread is ended inside its Python code."""
    done = run_child(
        tmp_path, "observer.py",
        "import time\n"
        "small = shoal.Allocator(shoal.host_device(), use_environment=False, memory_limit_mb=2)\n"
        "started = threading.Event()\n"
        "def observer(report):\n"
        "    started.set()\n"
        "    end = time.monotonic() + 2\n"
        "    while time.monotonic() < end:\n"
        "        pass\n"
        "small.add_oom_observer(observer)\n"
        "def work():\n"
        "    while True:\n"
        "        try:\n"
        "            small.allocate(4 << 20)\n"
        "        except shoal.OutOfMemoryError:\n"
        "            pass\n"
        "threading.Thread(target=work, daemon=True).start()\n"
        "started.wait()\n"
        "print('exiting', flush=True)\n"
    )
    assert done.returncode == 0 and done.stdout == "exiting\n", (done.returncode, done.stdout, done.stderr)


def test_an_atexit_handler_that_runs_after_shoals_own_still_has_observers_and_releases():
    """A handler registered before `import shoal` runs after shoal's exit gate closed, on the thread
    that closed it: its observers are called and what it imported goes back to its producer."""
    script = (
        "import atexit, gc, sys\n"
        "def late():\n"
        "    import numpy, shoal\n"
        "    calls = []\n"
        "    small = shoal.Allocator(shoal.host_device(), use_environment=False, memory_limit_mb=2)\n"
        "    small.add_oom_observer(calls.append)\n"
        "    try:\n"
        "        small.allocate(4 << 20)\n"
        "    except shoal.OutOfMemoryError:\n"
        "        pass\n"
        "    array = numpy.ones(16, 'uint8')\n"
        "    before = sys.getrefcount(array)\n"
        "    view = shoal.from_dlpack(array, shoal.Allocator(shoal.host_device()))\n"
        "    del view\n"
        "    gc.collect()\n"
        "    print(len(calls), sys.getrefcount(array) == before, flush=True)\n"
        "atexit.register(late)\n"
        "import shoal\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0 and done.stdout == "1 True\n", (done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize("call", sorted(WAITS))
def test_ctrl_c_ends_a_call_that_waits_without_a_timeout(call, tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(CHILD_PREFIX + WAITS[call])
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "waiting", child.stderr.read()
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=WAIT)
    finally:
        child.kill()
    assert "KeyboardInterrupt" in err, err


def test_the_objects_that_hold_connections_and_memory_print_what_they_are(lender_address):
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    storage = allocator.allocate(4096)
    assert repr(allocator) == "shoal.Allocator(host, 1 allocations, 4096 bytes allocated, 2097152 reserved)"
    assert repr(shoal.Event(shoal.host_device())) == "shoal.Event(host)"
    context = shoal.SharingContext(allocator)
    assert repr(context) == "shoal.SharingContext(host, 0 storages sent, 0 blocks held by other processes)"
    listener = shoal.Listener(f"@repr-{os.getpid()}")
    assert repr(listener) == f"shoal.Listener(@repr-{os.getpid()})"
    accepted, dialed = connection_pair(listener)
    listener.close()
    assert repr(listener) == "shoal.Listener(closed)"
    assert repr(accepted) == f"shoal.Connection(pid {os.getpid()})"
    receiver = shoal.Peer(shoal.SharingContext(HOST), accepted)
    assert repr(accepted) == "shoal.Connection(given to a Peer)"
    assert repr(receiver) == f"shoal.Peer(pid {os.getpid()}, uid {os.getuid()})"
    receiver.close()
    assert repr(receiver) == "shoal.Peer(closed)"
    shoal.Peer(shoal.SharingContext(HOST), dialed).close()
    del storage
    address = lender_address
    lender = shoal.lending.Lender(address, device=shoal.host_device(), capacity_bytes=1 << 30)
    assert repr(lender) == f"shoal.lending.Lender({address!r}, 0 regions lent, 0 of {1 << 30} bytes)"
    with shoal.lending.Borrower(address, allocator=HOST) as borrower:
        region = borrower.borrow(1 << 20, "printed")
        assert repr(borrower) == f"shoal.lending.Borrower({address!r}, 0 kept mappings of 0 bytes)"
        assert repr(lender).startswith(f"shoal.lending.Lender({address!r}, 1 regions lent, ")
        del region
    assert repr(borrower) == f"shoal.lending.Borrower({address!r}, closed)"
    lender.close()
    assert repr(lender) == f"shoal.lending.Lender({address!r}, closed)"


def test_an_oom_observer_may_use_the_storage_whose_write_ran_out_of_memory(tmp_path):
    """A write's copy is allocated with no lock of the storage held: an observer reading that
    storage on the writing thread does not wait for a lock held across the very allocation it
    interrupts (the lock a thread holding the GIL would wait for too: that case, another thread,
    is tests/storage/storage_allocation_unlocked_test.cpp's). In a child: a regression hangs,
    and the child's deadline ends it."""
    done = run_child(
        tmp_path, "observer.py",
        "small = shoal.Allocator(shoal.host_device(), use_environment=False, memory_limit_mb=4)\n"
        "source = small.allocate(3 << 20)\n"  # a segment of 4 MiB: no room for a copy
        "clone = source.lazy_clone()\n"
        "seen = []\n"
        "small.add_oom_observer(lambda report: seen.append((clone.shared_outside_process, clone.is_lazy)))\n"
        "try:\n"
        "    clone.fill(1)\n"
        "except shoal.OutOfMemoryError:\n"
        "    print('refused', seen, flush=True)\n"
    )
    assert done.returncode == 0 and done.stdout == "refused [(False, True)]\n", (done.returncode, done.stdout, done.stderr)


DROP_WITHOUT_THE_GIL_AFTER_A_SUBINTERPRETER = """
import ctypes, faulthandler, threading
import shoal
faulthandler.enable()
try:
    import _interpreters as subinterpreters  # Python 3.13 on
except ImportError:
    import _xxsubinterpreters as subinterpreters
subinterpreters.destroy(subinterpreters.create())  # PyGILState_Check says yes on every thread from now on
get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
set_name = ctypes.pythonapi.PyCapsule_SetName
set_name.restype, set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
stop = threading.Event()

def busy():  # holds the GIL whenever this thread lets it go: another thread's is not this one's
    while not stop.is_set():
        sum(range(100))

spinners = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
for spinner in spinners:
    spinner.start()
for _ in range(100):
    allocator = shoal.Allocator(shoal.host_device(), use_environment=False)
    capsule = allocator.allocate(4096).view("uint8", shape=[4096]).__dlpack__()
    del allocator  # the export holds the storage, and the storage its allocator: the last of each
    tensor = get_pointer(capsule, b"dltensor")
    set_name(capsule, b"used_dltensor")  # consumed: the deleter is the consumer's to call
    deleter = ctypes.c_void_p.from_address(tensor + 56).value  # DLManagedTensor: a 48-byte DLTensor, manager_ctx
    # A consumer's deleter called on a thread without the GIL (a CFUNCTYPE call lets it go) while
    # other threads take it: the allocator's end, which lets the GIL go where this thread holds
    # it, must see that it does not.
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(tensor)
stop.set()
for spinner in spinners:
    spinner.join()
print("dropped", flush=True)
"""


def test_a_drop_on_a_thread_without_the_gil_after_a_subinterpreter_was_made_does_not_release_it_again():
    try:
        import _interpreters  # noqa: F401
    except ImportError:
        pytest.importorskip("_xxsubinterpreters")
    done = subprocess.run([sys.executable, "-c", DROP_WITHOUT_THE_GIL_AFTER_A_SUBINTERPRETER],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "dropped", done.stderr[-2000:]
