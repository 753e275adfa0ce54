# Type stubs of the extension module: the exception classes are written by hand; from
# the Device class on, python/generate_stubs.py regenerates it (nanobind's stubgen), and a
# test checks it is current.

import os
from collections.abc import Callable, Sequence
from typing import Any, Self, overload

from typing_extensions import Buffer, CapsuleType

class ShoalError(RuntimeError):
    """Base of every error shoal raises."""

class InvalidArgumentError(ShoalError, ValueError):
    """The call got something it cannot accept; nothing was changed."""

class ProtocolError(InvalidArgumentError):
    """Another process sent something the protocol does not allow."""

class OutOfMemoryError(ShoalError, MemoryError):
    """The device (or the configured limit) cannot provide the memory asked for."""

    requested_bytes: int
    #: Why a lender refused a borrow: 'capacity', 'wait_expired', 'others_waiting',
    #: 'cannot_fit' or 'stopped_waiting'; None for this process's own device or limit.
    reason: str | None

class DeviceUnavailableError(ShoalError):
    """The requested backend or device does not exist here."""

class BackendError(ShoalError):
    """A device runtime or operating-system call failed."""

    call: str
    detail: str

class SystemCallError(OSError, BackendError):
    """An operating-system call failed (an address already in use, a directory that does not
    exist, a descriptor limit reached): an OSError made as OSError(errno, message) is, and a
    BackendError (`call`, `detail`). Not the per-errno subclasses (FileNotFoundError...):
    compare `errno`."""

class StreamError(ShoalError):
    """Work enqueued on a stream failed after the call returned. On CUDA a kernel
    fault is raised by every later call of the process, which must restart."""

class OrderingViolationError(ShoalError):
    """Memory was about to be handed out while a stream could still use it (debug mode)."""

class InvariantViolationError(ShoalError):
    """An invariant of shoal's own state does not hold (a bug in shoal)."""

    invariant: str

class ConnectionClosedError(ShoalError, ConnectionError):
    """The process at the other end of a connection closed it or died."""

    #: True when a connect found no one listening at the address (nothing was
    #: ever connected), False for a connection its peer closed.
    no_listener: bool

class PeerRefusedError(ShoalError, ConnectionRefusedError):
    """A peer process was refused (credentials not allowed, a peer revoked), or refused this one (a lender
    turning a borrower away, or a borrow past its quota)."""

class PeerTimeoutError(ShoalError, TimeoutError):
    """A wait ran past its deadline, whether on another process or within this one: for a peer's
    message, a lender's answer, a batch (shoal.sharing.Consumer.get, shoal.transfer.Engine.get), room
    to submit (Engine.submit), another call of the same Borrower to end. The operation says whether
    its connection, where it has one, is still usable."""

class ContentMismatchError(ShoalError):
    """Memory's content is not what the caller expected: a published region's content hash is not the one asked for."""

class CancelledError(ShoalError):
    """A wait was ended by its caller's cancel event (e.g. shoal.lending.Borrower.borrow(cancel=...)); nothing it asked for is held."""

# The package's own helpers (functions with a leading underscore below, and
# this attribute) are not part of the API.
_capsule_type: type



class Device:
    """
    A device: the host backend or a CUDA GPU. Lives for the whole process. Pickles as its kind and ordinal: unpickled, it is that device of the receiving process (another GPU there under another CUDA_VISIBLE_DEVICES; DeviceUnavailableError where it has none).
    """

    @property
    def kind(self) -> str:
        """'host' or 'cuda'."""

    @property
    def ordinal(self) -> int:
        """Index among devices of its kind (0 for host)."""

    @property
    def name(self) -> str:
        """Human-readable name."""

    def memory(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) as the device reports them."""

    @overload
    def __eq__(self, arg: Device, /) -> bool: ...

    @overload
    def __eq__(self, other: object | None) -> bool: ...

    def __hash__(self) -> int: ...

    def __reduce__(self) -> tuple: ...

    def __repr__(self) -> str: ...

def default_device() -> Device:
    """
    CUDA device 0 when one exists, else the host device. SHOAL_BACKEND=host or cuda forces the choice ('cuda' raises DeviceUnavailableError where there is none).
    """

def host_device() -> Device:
    """The host device: host memory, executor threads as streams."""

def cuda_device(ordinal: int = 0) -> Device:
    """
    CUDA device `ordinal` (>= 0); raises DeviceUnavailableError when there is none.
    """

def cuda_device_count() -> int:
    """Number of usable CUDA devices (0 without driver or GPU)."""

class Stream:
    """
    An in-order queue of device work. Stream(device) creates a new stream; Stream.default(device) names the device's default stream. Usable from several threads at once: work runs in the order the threads enqueue it. A stream lives while this object or a storage used on it does; a new stream per request is fine when the request's storages go with it: once its work has run, the Allocator lets it go and the next new stream takes over the memory it cached; so is one per receive. A storage sent to another process, adopted or of a transfer batch keeps its streams for the Allocator's life.
    """

    def __init__(self, device: Device | None = None) -> None:
        """A new stream on `device` (default: default_device())."""

    @staticmethod
    def default(device: Device | None = None) -> Stream:
        """The default stream of `device`."""

    @staticmethod
    def from_handle(handle: int, device: Device | None = None) -> Stream:
        """
        A stream another library made, by its native handle (e.g. ``torch.cuda.current_stream().cuda_stream``): usable wherever a shoal stream is. shoal never destroys it; the library that made it keeps it alive while shoal may use it. InvalidArgumentError when the handle is not a stream of `device` (the host backend has none).
        """

    @property
    def device(self) -> Device: ...

    @property
    def handle(self) -> int:
        """
        The native stream handle as an integer (0 for the default stream, cudaStream_t's null). As a DLPack `stream=` the array API names the default stream 1 (legacy) or 2 (per-thread) and refuses 0: pass ``handle or 1``.
        """

    def synchronize(self) -> None:
        """
        Blocks until all work enqueued so far has run (GIL released). It waits as the device does, with no deadline: Ctrl-C is seen once the work has run (poll query() to stay interruptible).
        """

    def query(self) -> bool:
        """True when all work enqueued so far has run."""

    def wait_event(self, event: Event) -> None:
        """
        Work enqueued from now on waits for `event` (device-side; the caller does not block).
        """

    def delay(self, seconds: float) -> None:
        """Keeps the stream busy for `seconds` (stands in for a long kernel)."""

    @overload
    def __eq__(self, arg: Stream, /) -> bool: ...

    @overload
    def __eq__(self, other: object | None) -> bool: ...

    def __hash__(self) -> int: ...

    def __repr__(self) -> str: ...

class Event:
    """
    A marker recorded into a stream; complete once the stream has passed it. Usable from several threads at once: a query or wait sees the last record() made before it.
    """

    def __init__(self, device: Device | None = None) -> None:
        """
        An event of `device` (default: the default device), not yet recorded: until its first record(), query() is True and synchronize() returns at once.
        """

    def record(self, stream: Stream | None = None) -> None:
        """
        Marks the point after all work enqueued so far on `stream` (default: the current stream).
        """

    def query(self) -> bool:
        """True when the event is complete."""

    def synchronize(self) -> None:
        """Blocks until the event is complete (GIL released)."""

    def __repr__(self) -> str: ...

def current_stream(device: Device | None = None) -> Stream:
    """
    This thread's current stream on `device`: the innermost `with shoal.stream(s)` scope, else the default stream.
    """

def _push_stream(stream: Stream) -> int:
    """
    Enters a stream scope (use `with shoal.stream(s)`); returns its token for _pop_stream.
    """

def _pop_stream(token: int) -> None:
    """
    Leaves the stream scope `token` entered, in order or not (the scopes entered after it stay).
    """

def synchronize(stream: Stream | None = None) -> None:
    """
    Blocks until all work enqueued on `stream` (default: the current stream of the default device) has run. The GIL is released meanwhile.
    """

class Allocator:
    """
    The stream-ordered caching allocator of one device. A freed block is handed out again only once every stream that may touch it has passed its last use. Thread-safe.
    """

    def __init__(self, device: Device | None = None, *, conf: str | None = None, use_environment: bool = True, **settings) -> None:
        """
        An allocator on `device` (default: default_device()). Settings come from SHOAL_ALLOC_CONF (unless use_environment is False), then `conf` (the same 'key:value,...' text), then keyword arguments with the same keys, e.g. Allocator(max_split_size_mb=256, expandable_segments=True, trace_entries=1000). An unknown key or a bad value raises InvalidArgumentError.
        """

    @overload
    def __eq__(self, arg: Allocator, /) -> bool:
        """
        True for two objects of one allocator (SharingContext.allocator gives a new object each time).
        """

    @overload
    def __eq__(self, other: object | None) -> bool: ...

    def __hash__(self) -> int: ...

    def allocate(self, nbytes: int, stream: Stream | None = None) -> Storage:
        """
        A Storage of `nbytes` (> 0) for use on `stream` (default: the current stream). Short of memory it may wait on the host for pending frees (blocks freed while another stream still used them) and give the cache back before it raises OutOfMemoryError, when neither the cache nor the device can provide it. The GIL is released meanwhile.
        """

    @property
    def device(self) -> Device: ...

    @property
    def config(self) -> str:
        """The settings in force, as SHOAL_ALLOC_CONF text."""

    def stats(self) -> dict[str, Any]:
        """
        Counters as a dict: allocations, segments, active, allocated_bytes, reserved_bytes, ... each with current/peak/allocated/freed per pool, plus num_alloc_retries, num_ooms, num_device_alloc, num_device_free, vmm_calls (the growable segments' device calls: creates, releases, maps, unmaps, access_grants), and expandable_segments_fallback (True when expandable_segments was asked for but the device has no growable segments, so plain ones serve and config says false).
        """

    def snapshot(self) -> dict[str, Any]:
        """Every segment and block as a dict."""

    def trace(self) -> list[dict[str, Any]]:
        """The trace ring, oldest first (empty unless trace_entries > 0)."""

    def empty_cache(self) -> None:
        """
        Waits for pending frees, then returns every cached segment to the device (GIL released).
        """

    def reset_peak_stats(self) -> None:
        """Sets every peak to its current value."""

    def add_oom_observer(self, observer: Callable) -> None:
        """
        Calls observer(report: dict) before OutOfMemoryError is raised (on the allocating thread, holding none of the allocator's locks, nor that of a storage whose write or clone asked for the memory: it may use both). The report: requested_bytes, device_free_bytes, reserved_bytes, allocated_bytes, largest_free_block (bytes), limit_bytes (the configured limit on reserved bytes, None when none) and stream (the native handle of the allocation's stream). The allocation may still succeed without an error: a storage whose write found no memory for its copy uses the copy another thread's write made meanwhile. An exception it raises is reported as unraisable and does not replace the OutOfMemoryError. The allocator holds the observer until remove_oom_observer. A cycle through it (an object that holds this Allocator and observes with a method of its own) is collected by the garbage collector while this Allocator object is the allocator's one holder; a Storage of it, a view or export of one, or another object of the allocator alive keeps the cycle until remove_oom_observer.
        """

    def remove_oom_observer(self, observer: object | None) -> bool:
        """
        Stops calling `observer` (the object given to add_oom_observer, once per time it was added) and lets it go; False when it is not an observer of this allocator.
        """

    def __repr__(self) -> str: ...

class Storage:
    """
    A reference-counted block of device memory from an Allocator. Copies of this object alias; lazy_clone() makes a copy-on-write clone that copies nothing until written. Usable from several threads at once: each call takes its own reference to the memory with the GIL held, and lets the GIL go for what may wait long (allocation, copies, synchronization, the storage's own lock, which another thread materializing or cloning it holds); order the threads' writes with streams and events.
    """

    @property
    def nbytes(self) -> int:
        """Size in bytes."""

    def __len__(self) -> int: ...

    @property
    def device(self) -> Device: ...

    @property
    def ptr(self) -> int:
        """
        Address of the data for reading (never copies; a lazy clone shows the shared data).
        """

    def same_allocator(self, allocator: Allocator) -> bool:
        """
        Whether this storage's memory is `allocator`'s: allocated by it, or adopted by it (received from another process, imported through DLPack). Compares the allocators themselves, not addresses: reads nothing of either.
        """

    @property
    def is_lazy(self) -> bool:
        """
        True while the storage reads data shared copy-on-write: until its first write, which copies it (or takes it over when no other storage shares it any more).
        """

    @property
    def shared_outside_process(self) -> bool:
        """
        True once the data was exported (DLPack, IPC): it is never lazily shared from then on.
        """

    def mutable_ptr(self, stream: Stream | None = None) -> int:
        """
        Address of the data for writing on `stream`: materializes a lazy clone first (in stream order). An address taken before a lazy_clone() or a read-only export (a readonly view's DLPack) must not be written after it: they share that data; take a new address, which gives this storage a copy of its own. InvalidArgumentError for read-only memory.
        """

    def lazy_clone(self, stream: Stream | None = None) -> Storage:
        """
        A new storage sharing this one's data copy-on-write, in O(1), for use on `stream` (default: the current stream); its data is what this storage holds once `stream` and every stream it was used on have passed the work enqueued so far (`stream` waits for those other streams on the GPU, so reads of the clone on it see this storage's earlier writes). The first write of either storage moves the writer to a copy while the other still shares the data; once the other storage is gone, the one left takes the data over and writes in place. Data exported writable through DLPack is copied at once instead. A read-only export does not stop sharing: it is a snapshot of the data the storage had when exported, kept alive and unchanged while the consumer holds it, whatever either storage writes later (export again after writing to see the new data).
        """

    def record_stream(self, stream: Stream) -> None:
        """
        The memory is also used on `stream`: its free (for imported memory, its release to the producer) waits for the work enqueued there until then. The GIL is released meanwhile (it takes the storage's lock).
        """

    def aliases(self, other: Storage) -> bool:
        """True iff both name the same storage object."""

    def write(self, data: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        """
        Copies a bytes-like object into the storage at `offset`, on `stream` (default: the current stream), materializing a lazy clone first; returns once the copy has run (GIL released meanwhile). InvalidArgumentError for read-only memory.
        """

    def read(self, offset: int = 0, nbytes: int | None = None, stream: Stream | None = None) -> bytes:
        """
        The bytes at [offset, offset + nbytes) (default: to the end), copied on `stream` after the work enqueued there; never materializes a lazy clone. Blocks until `stream` has run the copy (GIL released meanwhile).
        """

    def fill(self, value: int, stream: Stream | None = None) -> None:
        """
        Sets every byte to `value` in stream order (enqueued; does not wait), materializing a lazy clone first. InvalidArgumentError for read-only memory.
        """

    def view(self, dtype: object | None = 'uint8', shape: Sequence[int] | None = None, strides: Sequence[int] | None = None, offset: int = 0, readonly: bool | None = None) -> ArrayView:
        """
        A typed ArrayView of the storage without copying: `dtype` a name ('float32', 'int64', 'bool', ...: shoal.view_dtypes()), numpy's spelling of one ('f4', '<i8', 'u1', '?', 'single'), a numpy dtype or scalar type (numpy.float32), in this machine's byte order (None: 'uint8'; anything else is a TypeError naming those taken); `shape` (default: as many elements as fit after `offset`); `strides` in elements (default: C order); `offset` in bytes. The view must lie inside the storage. A readonly view is exported without materializing a lazy clone (to DLPack 1.x consumers only), as a snapshot: the consumer sees the data the storage has at export, kept alive and unchanged while it holds it (a later write moves the writing storage to a copy, see lazy_clone), except for memory that is never lazily shared (exported writable, shared with another process, imported, a region, a part of one block such as a transfer batch's storages), which the export shows itself, later writes included; `readonly` defaults to whether the storage's memory is read-only, and a writable view of read-only memory is refused.
        """

    def __array__(self, dtype: object | None = None, copy: bool | None = None) -> object:
        """
        numpy.asarray(storage) on the host backend: its bytes as a uint8 array over the same memory, no copy (unless `dtype` or `copy` asks for one; copy=False with a `dtype` other than uint8 raises ValueError), as numpy.asarray(storage.view()) gives. The export is that of a writable view (a read-only one for read-only memory): it materializes a lazy clone and marks the storage shared outside the process for good (a later lazy_clone() copies at once); numpy.from_dlpack(storage.view(readonly=True)) reads a snapshot instead. TypeError for device memory, which numpy cannot read: storage.read() copies its bytes to the host (torch.from_dlpack(storage.view()) or cupy.from_dlpack(storage.view()) takes it in place). TypeError too for pinned host memory (an Allocator with memory='pinned_host'), on either backend, though the CPU reads it: DLPack names CUDA's pinned memory kDLCUDAHost, which numpy would take, but shoal's DLPack export refuses staging memory (BufferError), so storage.read() copies its bytes.
        """

    def __eq__(self, other: object, /) -> bool:
        """
        Identity, as for any Python object: True only for this very Storage object. Two objects of one storage (view.storage taken twice, say) compare unequal; aliases() says whether they name the same storage, which is what sharing memory means.
        """

    def __hash__(self) -> int:
        """Identity's hash, as for any Python object (see __eq__)."""

    def __reduce__(self) -> tuple:
        """
        Refused (TypeError): a Storage's memory belongs to this process; shoal.sharing sends it to another.
        """

    def __repr__(self) -> str: ...

def view_dtypes() -> tuple[str, ...]:
    """The element types a view (Storage.view, ArrayView) can have, by name."""

class ArrayView:
    """
    A typed view (shape, dtype, strides, offset) of a Storage, made by Storage.view(); exported zero-copy through DLPack, e.g. numpy.from_dlpack(view). Immutable: usable (read, exported) from several threads at once.
    """

    @property
    def dtype(self) -> str:
        """The element type's name."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Extents, one per dimension."""

    @property
    def ndim(self) -> int:
        """The number of dimensions."""

    @property
    def nbytes(self) -> int:
        """The bytes of its elements (itemsize times their number)."""

    def __len__(self) -> int:
        """The first extent, as a sequence's length (TypeError for a 0-d view)."""

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""

    @property
    def offset(self) -> int:
        """Offset in bytes into the storage."""

    @property
    def readonly(self) -> bool:
        """True when it is exported read-only (DLPack's read-only flag)."""

    @property
    def itemsize(self) -> int:
        """Bytes per element."""

    @property
    def storage(self) -> Storage:
        """The storage viewed (aliases it)."""

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> CapsuleType:
        """
        A DLPack capsule of this view (array API). `stream`: the consumer's stream (None: the host reads it on the host backend, 1 or 2: the default stream, a stream handle, or -1: no synchronization; 0 is refused); the consumer's stream waits for the work enqueued on the current stream, and the memory's release waits for the consumer's stream, so a stream handle must stay a live stream until the storage's memory is released. A versioned capsule ('dltensor_versioned') when max_version >= (1, 0); strides are always set.
        """

    def __array__(self, dtype: object | None = None, copy: bool | None = None) -> object:
        """
        numpy.asarray(view) on the host backend: the same memory, no copy (unless `dtype` or `copy` asks for one). TypeError for device memory, which numpy cannot read (view.storage.read() copies the storage's bytes to the host; torch.from_dlpack(view) or cupy.from_dlpack(view) takes it in place), and for pinned host memory (an Allocator with memory='pinned_host'), as Storage.__array__ says.
        """

    def __dlpack_device__(self) -> tuple[int, int]:
        """
        (device type, device id): (1, 0) for the host backend (kDLCPU), (2, ordinal) for CUDA.
        """

    def __reduce__(self) -> tuple:
        """
        Refused (TypeError): a view's memory belongs to this process; shoal.sharing sends it to another.
        """

    def __repr__(self) -> str: ...

def _from_dlpack(allocator: Allocator, capsule: object) -> ArrayView:
    """
    An ArrayView over a DLPack capsule's array, zero-copy (the capsule is consumed).
    """

def _dlpack_consumer_stream(allocator: Allocator) -> int | None:
    """
    The stream argument for a producer's __dlpack__: None on the host backend, else the current stream.
    """

def runtime_dir_address(name: str) -> str:
    """
    The recommended socket path for a channel named `name`: in $XDG_RUNTIME_DIR (this user's 0700 directory), else /tmp/shoal-<uid>. An address is that path, any absolute socket path, or '@name' for an abstract socket name (no file; the access policy alone decides who connects).
    """

def _check_sharing_options(**kwargs) -> None:
    """
    Raises what SharingContext(allocator, **options) would for these options, making nothing: shoal.sharing.Producer checks its options when made, though its context is made at its first put.
    """

class Connection:
    """
    A checked connection to another process (from Listener.accept or connect); give it to Peer to share storages over it. A context manager: leaving the block (or close()) closes a connection not given to a Peer; one given to a Peer is the Peer's. Its calls hold the GIL and never wait, so several threads may use it.
    """

    @property
    def peer_pid(self) -> int: ...

    def close(self) -> None:
        """
        Closes the connection, unless it was given to a Peer (then the Peer's close() does). Closing twice is harmless.
        """

    @property
    def closed(self) -> bool:
        """True once close() closed it (not when it was given to a Peer)."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *args) -> None: ...

    def __repr__(self) -> str: ...

class Listener:
    """
    Listens for connections at an address (see runtime_dir_address). A socket path's directory is created with mode 0700 or must be one. Only processes of this user, and of `allowed_uids`, are admitted. Closes (and removes its socket file) on close() or when collected; a context manager. Usable from several threads at once: each connection goes to one accept() call, and close() from another thread ends their waits.
    """

    def __init__(self, address: str | os.PathLike[str], allowed_uids: Sequence[int] = []) -> None: ...

    def accept(self, timeout: float | None = None) -> Connection | None:
        """
        The next connection, its peer's uid checked; None when `timeout` seconds pass first. A client whose process ended before it could be identified (another Listener's check that this address is in use, say) is dropped and the wait goes on. Raises PeerRefusedError for a peer of another user (the listener keeps working). The wait ends on Ctrl-C (KeyboardInterrupt) and on close() from another thread (InvalidArgumentError).
        """

    def remove_abandoned_sockets(self, prefix: str) -> int:
        """
        Removes from this listener's directory the socket files that killed servers naming their sockets `<prefix><pid>-<rest>.sock` left: named for a pid that no longer runs, sockets of this user (links are not followed), at least 10 s old (a younger one may be a listener's between bind and listen), with no one listening. Anything else is left. Returns how many it removed; 0 for an abstract name.
        """

    @property
    def address(self) -> str: ...

    def fileno(self) -> int:
        """The listening socket, for selectors: readable when a connection waits."""

    def close(self) -> None:
        """
        Stops listening and removes the socket file; an accept() waiting in another thread ends first.
        """

    @property
    def closed(self) -> bool:
        """True once close() has begun."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *args) -> None: ...

    def __repr__(self) -> str: ...

def connect(address: str | os.PathLike[str], allowed_uids: Sequence[int] = [], timeout: float | None = 60.0) -> Connection:
    """
    Connects to the Listener at `address`; the listening process must run as this user or one of `allowed_uids` (PeerRefusedError otherwise). ConnectionClosedError when no one listens there; PeerTimeoutError when the listener takes no connection within `timeout` seconds (a server that stopped accepting; None waits without a deadline).
    """

class SharingContext:
    """
    What sharing storages with other processes needs, for one Allocator: reference counters, the limbo of blocks other processes still hold, and a collector that frees them and reclaims the references of processes that died. Belongs to the process that made it. Thread-safe.
    """

    def __init__(self, allocator: Allocator, **options) -> None:
        """
        Options (keywords): collect_interval_ms (100), send_timeout_ms (10000), teardown_timeout_ms (100), receive_spin_us (50), import_answer_spin_us (200: how long the first receive after a send that brought the peer memory new to it polls for the answer), max_metadata_bytes (65536), slots_per_file (4096), ring_bytes (65536; 0: the socket alone), max_peer_ring_bytes (4194304: the largest ring taken from a peer; a peer of another user could leave its pages unallocated for this process's reads to allocate; raise it on both sides to at least ring_bytes rounded up to a power of two), max_peer_mapped_bytes (1099511627776: the bytes of one producer's segments mapped here at once, and its largest segment; mappings no received storage uses are closed to make room, past it a storage is refused), max_mapped_bytes (35184372088832: the same for all producers together), max_producer_resources (32768: descriptors and memory mappings held for all producers together: segments and counter files announced, event sources, segment chunks mapped; past it an announcement or a storage is refused).
        """

    @property
    def allocator(self) -> Allocator: ...

    def collect(self) -> int:
        """
        Reclaims dead holders' references and frees every limbo block no one holds; returns how many.
        """

    def stats(self) -> dict:
        """
        Counters as a dict: limbo_blocks/bytes, held_slots, counter_files, exported_segments, storages_sent, limbo_freed, slots_reclaimed; and what it holds for the producers it receives from, all together: producers_mapped_bytes (within max_mapped_bytes) and producer_resources (descriptors and mappings, within max_producer_resources).
        """

    def holders(self) -> list:
        """
        Per process holding references to this context's memory or connected to it: pid, references, pinned_bytes, limbo_blocks, limbo_bytes, connections, revoked.
        """

    def __repr__(self) -> str: ...

class Peer:
    """
    One connection to another process, for sharing storages both ways. send() may be called from several threads; receive() from one at a time (a second thread receiving may sleep up to 0.1 s past a message the first left, while the first spins). A context manager; close() tears the connection down (waiting at most the context's teardown timeout), once the calls other threads make on it have ended (a receive ends within 0.1 s; a send still waiting after 0.2 s is ended by shutting the connection down).
    """

    def __init__(self, context: SharingContext, connection: Connection) -> None: ...

    def send(self, data: object | None, metadata: bytes = ..., stream: Stream | None = None) -> None:
        """
        Shares a Storage (or an ArrayView's storage) of this context's allocator with the other process, with `metadata` attached; it waits for the work enqueued on `stream` (default: the current stream) before using it. The memory is freed only when every process has dropped it. A storage belongs to the first SharingContext that sends it: another context refuses it (InvalidArgumentError), as it refuses one received from another process or adopted; send a copy.
        """

    def send_note(self, metadata: bytes) -> None:
        """Sends metadata alone."""

    def receive(self, timeout: float | None = None, stream: Stream | None = None) -> tuple[Storage | None, bytes]:
        """
        The next (storage, metadata) from the other process — storage None for a note — ready for work enqueued on `stream` (default: the current stream). Raises PeerTimeoutError after `timeout` seconds (what came of a message is kept for the next call), ConnectionClosedError when the peer has gone or close() was called from another thread, ProtocolError on a malformed message. The wait ends on Ctrl-C (KeyboardInterrupt).
        """

    def try_receive(self, stream: Stream | None = None) -> tuple[Storage | None, bytes] | None:
        """
        The next (storage, metadata) if it has come whole, without waiting; None when it has not (what came of it is kept). For a selector loop: once fileno() is readable, call this until it returns None. Raises ConnectionClosedError when the peer has gone, ProtocolError on a malformed message.
        """

    def check_greeting(self) -> None:
        """
        Reads the peer's protocol hello if it has come, without waiting and never past it: ProtocolError naming both protocols when the other end speaks another (a lender greets as it accepts). How a Peer that only sends finds out it reached the wrong endpoint.
        """

    def wait_taken(self, timeout: float | None = None, at_most: int = 0) -> bool:
        """
        Waits until the other process has taken every storage sent on this connection: received it (its memory mapped there, from then on outliving this process) or let it go. True then; False when it hung up first, or this connection was revoked, with some neither. Raises PeerTimeoutError when `timeout` seconds pass first (None: no limit; 0: looks once). Call it before a producer process ends, after the work the sends wait on has run (Stream.synchronize): what was not taken goes with the process (a connection not yet accepted cannot even be identified; on CUDA the memory goes). Notes are not waited for. With `at_most`, content once no more than that many are untaken. The wait ends on Ctrl-C (KeyboardInterrupt).
        """

    def untaken(self) -> int:
        """
        Storages sent on this connection that the other process has neither received nor let go yet.
        """

    def pending(self) -> int:
        """
        Not zero while frames that came wait to be taken (in a batch already read, or in the peer's shared ring): try_receive() may then return more though fileno() is not readable.
        """

    def revoke(self) -> None:
        """
        Stops trusting the other process: the connection closes and the context sends it nothing more; what it holds stays pinned until it releases it or dies.
        """

    @property
    def peer_pid(self) -> int: ...

    @property
    def peer_uid(self) -> int: ...

    def stats(self) -> dict:
        """
        This side's view of the other process: open_mappings, counter_files, event_sources, held_storages.
        """

    def fileno(self) -> int:
        """
        The connection's socket, for selectors: readable when a message (or its start) waits; one readable socket may stand for several messages, or for none left: call try_receive() until None.
        """

    def close(self) -> None:
        """
        Tears the connection down; received storages stay usable. A receive() waiting in another thread ends first (ConnectionClosedError), and a send() in flight finishes (one stuck on a peer that stopped reading is ended after 0.2 s).
        """

    @property
    def closed(self) -> bool:
        """True once close() has begun."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *args) -> None: ...

    def __repr__(self) -> str: ...

def _torch_configure(conf: str | None = None, use_environment: bool = True, **settings) -> None:
    """
    Settings of the allocators PyTorch will allocate from (shoal.torch.enable): expandable_segments:true (not with memory:pinned_host), then SHOAL_ALLOC_CONF, conf and keyword settings.
    """

def _torch_config_text(conf: str | None = None, use_environment: bool = True, **settings) -> str:
    """
    The SHOAL_ALLOC_CONF text of these settings (what _torch_settings reports once configured).
    """

def _torch_settings() -> str | None:
    """
    The settings given to _torch_configure, as SHOAL_ALLOC_CONF text, or None.
    """

def _torch_table_on_host() -> None:
    """
    Tests only: the table's allocators (made from now on) are the host backend's, so that its entries run where no GPU is. Refused once one exists.
    """

def _torch_api() -> int:
    """
    The address of the C table (python/src/torch_api.h) the PyTorch plugin calls.
    """

def _torch_share(ptr: int, nbytes: int, device: int, stream: int) -> Storage:
    """
    A Storage over the block at `ptr` (a tensor's storage, `nbytes` long) of PyTorch's shoal allocator on CUDA device `device`, for use on `stream` (a cudaStream_t): the block is taken over on the first call, and PyTorch's free of it then drops a handle instead (shoal.torch.share).
    """

def _torch_allocator(device: int) -> Allocator:
    """
    The Allocator PyTorch allocates from on CUDA device `device` (made on first use).
    """

def _refuse_transfer_results(results: int, appends: int) -> None:
    """
    Test hook: the next `results` (batch, layout) results shoal.transfer.Engine's next() makes, and the next `appends` appends of one to its list, fail with MemoryError, as when Python has no memory left.
    """

class TransferredBatch:
    """
    One batch whose host-to-device copies are enqueued: a Storage per buffer submitted. wait() before using them on a stream.
    """

    @property
    def sequence(self) -> int:
        """The batch's place in submission order, from 0."""

    @property
    def storages(self) -> list[Storage]:
        """The device storages, in the order of the buffers submitted."""

    def wait(self, stream: Stream | None = None) -> None:
        """
        Work enqueued on ``stream`` (default: the current stream) from now on sees the batch's bytes (a GPU-side wait), and the storages' memory is reused only after that stream passes what was enqueued on it before they are dropped.
        """

    def synchronize(self) -> None:
        """Blocks until the batch's copies have run."""

    def ready(self) -> bool:
        """True once the batch's copies have run."""

    def __repr__(self) -> str: ...

class TransferEngine:
    """
    Background host-to-device transfer: a thread and a stream of its own copy submitted host buffers into device storages (shoal.transfer.Engine is the batch API).
    """

    def __init__(self, allocator: Allocator, max_batches_in_flight: int = 32, max_pinned_bytes: int = 33554432, staging_chunk_bytes: int = 4194304, staging_helpers: int | None = None, staging_stores: str = 'automatic', max_coalesced_bytes: int = 4194304, max_bytes_in_flight: int = 67108864) -> None: ...

    def submit(self, buffers: Sequence[tuple[int, int, bool, object]], timeout: float | None = None, layout: object | None = None) -> int:
        """
        Queues a batch of (address, nbytes, pinned, owner) host buffers; ``owner`` is kept alive while the engine reads the memory, ``layout`` until the batch is taken (next() hands it back with the batch). Returns the batch's sequence number. A Ctrl-C that comes as the batch is queued is raised after: the batch stays queued. Blocks while the batch does not fit within max_batches_in_flight and max_bytes_in_flight; past max_bytes_in_flight a batch still goes while at most one other batch is in flight (so two are always allowed, whatever their bytes). PeerTimeoutError after ``timeout`` seconds. The wait ends on Ctrl-C (KeyboardInterrupt) and on close() from another thread (InvalidArgumentError).
        """

    def next(self, into: list, timeout: float | None = None) -> None:
        """
        Appends (batch, layout) to ``into``: the next batch in submission order once its copies are enqueued, and the layout submit gave with it — first any batch put back (put_back), also one put back by another thread while this call waits (seen within one wait slice, 0.1 s) — and returns None. Raises the batch's own error when it failed (the batch is taken all the same; before a batch put back by another thread during the call), PeerTimeoutError after ``timeout`` seconds (no batch taken). The wait ends on Ctrl-C (KeyboardInterrupt) and on close() from another thread (InvalidArgumentError). A Ctrl-C that comes as a batch is taken is raised after the call: the batch is in ``into`` then.
        """

    def put_back(self, item: tuple) -> None:
        """
        Gives back a (batch, layout) that next() appended and the caller could not deliver: the next next() hands it out first (batches put back go in sequence order), and a next() already waiting in another thread within one wait slice (0.1 s). Dropped once closed.
        """

    @property
    def waiting(self) -> int:
        """
        Batches submitted and not yet delivered: in flight in the engine, and put back (a snapshot: while another thread's next() moves a batch from one to the other it may count it twice).
        """

    def stats(self) -> dict:
        """
        Counters as a dict: batches submitted, transferred, failed and taken, coalesced_groups (the groups of batches the engine's thread took together, each sharing one ready event and one device block; failed ones count), bytes copied and staged, copies (host-to-device copies enqueued: a run of small pageable buffers packed together is one), batches and their bytes in flight (now and at the peak), pinned staging memory (now and at the peak).
        """

    def close(self) -> None:
        """
        Ends the waits of other threads' submit() and next() (InvalidArgumentError), finishes the batches submitted, waits for their copies and stops the thread. Idempotent.
        """

    @property
    def closed(self) -> bool:
        """True once close() has begun."""

    def __repr__(self) -> str: ...

class GroupedLoad:
    """
    Groups of host-to-device copies enqueued on a copy stream, an event after each group. A stream waits for group k (and so for every group before it) with wait(k, stream).
    """

    @property
    def groups(self) -> int:
        """Number of groups."""

    def wait(self, group: int, stream: Stream | None = None) -> None:
        """
        Work enqueued on ``stream`` (default: the current stream) from now on sees groups 0..group: a GPU-side wait, the caller does not block.
        """

    def is_ready(self, group: int) -> bool:
        """True once groups 0..group have been copied."""

    def synchronize_group(self, group: int) -> None:
        """Blocks until groups 0..group have been copied (GIL released)."""

    def synchronize(self) -> None:
        """Blocks until every group has been copied (GIL released)."""

    def __repr__(self) -> str: ...

def _load_groups(groups: Sequence[tuple[Sequence[tuple[int, int, int]], object]], stream: Stream) -> GroupedLoad:
    """
    Enqueues groups of (destination, source, nbytes) copies on ``stream``, each group with an owner kept alive until the load is gone (which waits for its copies). Raw addresses: use shoal.loading.load_groups.
    """

def _measure_copy_cost(stream: Stream) -> tuple[float, float]:
    """(per_group_seconds, bytes_per_second) measured on the stream's device."""

def _plan_groups(layers: Sequence[tuple[int, float]], per_group_seconds: float, bytes_per_second: float, grouping: str) -> tuple[list[int], float, float]:
    """
    (group_ends, first_layer_start, last_layer_end) for layers of (bytes, compute_seconds).
    """

def _evaluate_grouping(layers: Sequence[tuple[int, float]], per_group_seconds: float, bytes_per_second: float, group_ends: Sequence[int]) -> tuple[list[int], float, float]:
    """
    The predicted (group_ends, first_layer_start, last_layer_end) of a given grouping.
    """

class Lender:
    """
    Lends regions of this process's device memory to borrower processes over a UNIX socket (the memory daemon's core, serving on its own thread). Usable from several threads at once: status(), metrics() and revoke() answer at once, close() from any thread.
    """

    def __init__(self, address: str | os.PathLike[str], device: Device | None = None, capacity_bytes: int = 1073741824, quota_bytes: int = 1073741824, max_borrowers: int = 64, max_regions_per_borrower: int = 1024, peer_timeout: float = 1.0, allowed_uids: Sequence[int] = [], reuse: str = 'same_uid', prepared_chunks: Sequence[int] = [], max_wait: float = 300.0, preempt_after: float | None = None, preempt_deadline: float = 10.0, max_observers: int = 4, max_connections_per_uid: int = 0) -> None:
        """
        Listens at ``address`` (a path in a 0700 directory, or '@name'); lends at most ``capacity_bytes`` in all and ``quota_bytes`` per borrower. ``reuse``: 'same_uid' lends given-back memory again to borrowers of the same uid (borrowers keep their mappings); 'never' makes every region fresh memory. ``prepared_chunks``: sizes in bytes of chunks made now (each rounded up to the device's granularity, their sum at most ``capacity_bytes``); a region of one of those sizes is lent from one with no device call at borrow time (``shoal daemon --prepare``). ``max_wait``: the longest a borrow may wait for memory; ``preempt_after``: seconds the borrow first in line waits before the lender revokes other borrowers' regions for it (None: never), each to be given back within ``preempt_deadline`` seconds (see shoal.lending.Lender). ``max_connections_per_uid``: connections at once of any one uid other than this process's and root (0: no cap). Raises the device's error (``OutOfMemoryError``) when they cannot be made.
        """

    def status(self) -> dict:
        """
        Regions lent (``regions``: id, memory, bytes, purpose, mode, state, pid, uid, age_seconds, and a shared region's holders), spare chunks (``spares``: memory, bytes, uid, kept_by, age_seconds), borrows waiting for memory in the order they are served (``waiting``: bytes, purpose, pid, uid, waited_seconds, left_seconds) and counters (requests, refusals, revocations, revocations_missed, preemptions, waits, waits_expired, ...), as a dict.
        """

    def revoke(self, region: int, deadline: float) -> None:
        """
        Asks the region's borrower to give it back within ``deadline`` seconds; returns at once.
        """

    def metrics(self) -> str:
        """The status in the Prometheus text format."""

    def close(self) -> None:
        """Stops serving and closes every connection. Idempotent."""

    @property
    def closed(self) -> bool:
        """True once close() has begun."""

def _region_id(storage: Storage) -> int | None:
    """The id of the borrowed region behind ``storage``, or None."""

def _region_layout(storage: Storage) -> tuple[list[tuple[str, int, int, str, list[int]]], bytes] | None:
    """
    The layout (entries, content hash) of the shared region behind ``storage``, or None.
    """

def _content_hash(storage: Storage, entries: Sequence[tuple[str, int, int, object, Sequence[int]]]) -> bytes:
    """
    SHA-256 of the entries' bytes in offset order, read from ``storage`` (device memory included).
    """

class _StopFlag:
    """
    A flag set once, read without the GIL by a revocations() wait it is the cancel of (shoal.lending.RevocationWatcher's).
    """

    def __init__(self) -> None: ...

    def set(self, reference: object | None = None) -> None:
        """
        Sets it. Takes an argument it ignores: the weak reference whose callback it is (a C call, which no Ctrl-C interrupts).
        """

    def is_set(self) -> bool:
        """Whether it is set."""

class Borrower:
    """
    A connection to a lender, through which regions are borrowed. Usable from several threads: its requests go one at a time, each call waiting behind the one in progress up to its own timeout (revocations() waits without a turn), and close() from another thread ends a waiting call.
    """

    def __init__(self, address: str | os.PathLike[str], device: Device | None = None, allowed_uids: Sequence[int] = [], timeout: float = 5.0, keep_mappings: bool = True, kept_mapping_bytes: int = 17179869184, observer: bool = False) -> None: ...

    def kept(self) -> tuple[int, int]:
        """
        (count, bytes) of the mappings of given-back regions this borrower keeps for a later lend.
        """

    def _borrow(self, allocator: Allocator, nbytes: int, purpose: str, timeout: float, wait: float, cancel: object | None) -> Storage: ...

    def _publish(self, allocator: Allocator, storage: Storage, entries: Sequence[tuple[str, int, int, object, Sequence[int]]], hash: bytes | None, timeout: float) -> Storage: ...

    def _borrow_shared(self, allocator: Allocator, name: str, expected: bytes | None, writer_uid: int | None, timeout: float) -> Storage: ...

    def revocations(self, wait: float = 0.0, cancel: object | None = None) -> list[tuple[int, float]]:
        """
        The lender's requests to give regions back: (region id, seconds left), waiting up to ``wait`` seconds for a first one, or until ``cancel`` (an object with is_set()) is set.
        """

    def return_revocations(self, unhandled: Sequence[tuple[int, float]]) -> None:
        """
        Puts back (region id, seconds left) pairs that revocations() returned and were not handled: the next revocations() returns them first (those given back meanwhile left out).
        """

    def metrics(self, timeout: float = 5.0) -> str:
        """The lender's status in the Prometheus text format."""

    def revoke(self, region: int, deadline: float, timeout: float = 5.0) -> None:
        """
        Asks the lender to revoke ``region`` (any borrower's: its id as the status and the metrics name it), giving its borrower ``deadline`` seconds; returns once the lender accepted. The lender's operator only: PeerRefusedError unless this process runs as the lender's uid or root; InvalidArgumentError for a region not lent to a connected borrower, or a shared one.
        """

    def close(self) -> None:
        """
        Closes the connection; regions already borrowed stay mapped until their storages are gone.
        """

    @property
    def closed(self) -> bool:
        """True once close() has begun."""

def _segment_source_new_binding() -> int:
    """
    A number no opening of a slot has had: what shoal.torch.RegionPool opens its slot under, known before the opening (a Ctrl-C as _segment_source_open returns loses the slot's number, not the binding).
    """

def _segment_source_open(storage: Storage, binding: int | None = None) -> int:
    """
    Binds a free slot to `storage`'s memory as a segment source, under `binding` (from _segment_source_new_binding; a new one when None); returns the slot.
    """

def _segment_source_functions(slot: int) -> tuple[int, int]:
    """
    The addresses of the slot's allocate(size, device, stream) and free(ptr, size, device, stream) functions, for torch._C._cuda_customAllocator.
    """

def _segment_source_stats(slot: int) -> dict:
    """
    What the slot's source has carved out, and its `binding`: which opening of the slot (a slot serves another pool once unbound).
    """

def _segment_source_abandon(binding: int) -> None:
    """
    Ends opening `binding` of whichever slot it bound, as closing it and dropping its MemPool do (a RegionPool that failed as it was made, perhaps before it learnt its slot); nothing if none.
    """

def _segment_source_close(slot: int, binding: int | None = None, reference: object | None = None) -> None:
    """
    No more segments from the slot (from its opening `binding`, when given); it is unbound (its storage dropped) once every segment is back and its MemPool is gone.
    """

def _segment_source_mem_pool_gone(slot: int, binding: int | None = None, reference: object | None = None) -> None:
    """
    The slot's MemPool object is gone (a weak reference's callback calls this): nothing calls the slot's functions any more.
    """

def _close_exit_gate() -> None: ...
