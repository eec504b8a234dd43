"""The BlockPool protocol shared by G3 and G4 (and anything the integrations talk to).

Every pool is bound to one :class:`~kvbm_backend.model.namespace.Namespace`; a key of another
namespace is a miss. All data-moving calls return ``concurrent.futures.Future`` at once: storage never
blocks the caller's thread. Host block buffers are 1-D ``uint8`` numpy arrays of exactly
``layout.bytes_per_block`` bytes (FullyContiguous ``[layer, outer, page, inner]``); 4 KiB-aligned
buffers (:func:`kvbm_backend.memory.aligned_empty`) take the zero-copy O_DIRECT path.

Device destinations (the one seam for loads into HBM): ``get(keys, out)`` also takes ``out`` as one torch
tensor ``[n, layout.bytes_per_block]`` bytes whose row i is block i's destination (the form loads should use,
:mod:`kvbm_backend.gpu.rows`), or as contiguous torch tensors of ``layout.bytes_per_block`` bytes each, all on
one device (``cuda:N``, or ``cpu``, which runs the same code in host mode). The pool then moves and verifies the bytes itself
(G3: slots read straight into device staging by kvikio/GDS or a pinned bounce, verified on the device,
see :class:`kvbm_backend.pool.g3.read.device.DeviceLoader`; G4: decrypted and verified on the host, one H2D
copy, :func:`kvbm_backend.gpu.host_path.load_via_host`). ``ok[i]`` keeps its meaning: True only where
block i verified where it landed; a miss leaves ``out[i]`` untouched.

Readers outside a pool (the device loader) read G3 slots through the typed :class:`SlotLeaseSource`
protocol: ``lease`` pins slots and ``release`` unpins them, both owned by the pool. What else only G3
offers (index snapshots, device readers, layer-wise loads, put options) is the :class:`G3Extensions`
protocol; callers check it once where they are wired (:func:`require_g3_extensions`), not by duck typing
at each use.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Generic, Mapping, Protocol, Sequence, TypeVar, Union,
                    runtime_checkable)

import numpy as np
import numpy.typing as npt

from ..model.layout import KvLayout
from ..model.namespace import BlockKey, Namespace

if TYPE_CHECKING:  # torch is optional at run time (the ``torch`` extra)
    import torch

_T = TypeVar("_T")

#: a host block buffer: 1-D ``uint8``, ``layout.bytes_per_block`` bytes
BlockBuffer = npt.NDArray[np.uint8]
#: where ``get`` puts blocks: host buffers, or torch tensors on one device (see the module docstring)
GetDestinations = Union[Sequence[BlockBuffer], Sequence["torch.Tensor"], "torch.Tensor"]


@dataclass
class PutResult:
    """Outcome of one put batch (counts of blocks)."""

    written: int = 0  # durable and published
    skipped: int = 0  # already stored, or not admitted (admission filter)
    dropped: int = 0  # queue full, no space, store down: not stored, counted


@dataclass
class GetResult:
    """Outcome of one get batch: ``ok[i]`` is True only if block i was found, its header identity
    matched and its integrity value verified in the caller's buffer. False is a miss (recompute).

    ``timed_out[i]`` is True where block i is a miss only because the get's time bound ran out before its
    read came back verified (G3: ``g3.load_timeout_s``; G4: the load bound, its late blocks counted
    ``timeout`` or ``throttled``): the block may well still be stored, so callers must not take it for
    absent or corrupt (no cooling, no removal from a mirror). Every pool fills it when a get times out;
    an empty list (the default) or a shorter one means no (other) block timed out. Never True where
    ``ok[i]`` is."""

    ok: list[bool] = field(default_factory=list)
    timed_out: list[bool] = field(default_factory=list)

    @property
    def prefix_hits(self) -> int:
        """Leading blocks loaded: the usable prefix."""
        n = 0
        for x in self.ok:
            if not x:
                break
            n += 1
        return n

    def timed_out_at(self, i: int) -> bool:
        """Whether block ``i`` missed because the get's time bound ran out (see the class doc)."""
        return i < len(self.timed_out) and bool(self.timed_out[i])


STATS_CONTRACT = {
    "tier": "'G3' or 'G4'",
    "namespace": "the pool's namespace fingerprint",
    "hits": "blocks a get verified and delivered",
    "misses": "blocks a get did not deliver (absent, foreign, corrupt, late, failed)",
    "corrupt": "blocks found corrupt (dropped, never served)",
    "written": "blocks a put made durable and published",
    "skipped": "blocks a put did not write: already stored, not admitted, or deleted while queued",
    "dropped": "blocks a put could not store (queue full, no space, store down)",
    "bytes_read": "payload bytes read from storage",
    "bytes_written": "payload bytes written to storage",
}
"""The ``stats()`` keys every pool reports (tests/pool/test_pool_conformance.py checks G3, G4-file, G4-S3 and G4-mem)."""


@runtime_checkable
class BlockPool(Protocol):
    tier: str  # "G3" or "G4"
    namespace: Namespace

    @property
    def layout(self) -> KvLayout: ...

    def lookup_prefix(self, keys: Sequence[BlockKey], *, request: bool = True) -> Future[int]:
        """Number of leading ``keys`` the pool holds (index/metadata only, no payload I/O). ``keys`` is any
        sequence of BlockKeys; every pool also takes a :class:`~kvbm_backend.model.namespace.KeyRun` (one
        namespace, tenant and rank, the seq hashes as a uint64 array: the scheduler's lookups), which
        indexes that can probe arrays use without making per-key objects. ``request`` False: not counted in
        the pool's lookup counters, ``kvbm_matched_tokens`` or the hit rate (a request's other TP ranks,
        KV cache groups and repeated asks: those describe each request's lookup once)."""

    def count_lookup(self, requested: int, found: int) -> None:
        """Count one request's lookup of ``requested`` blocks (>= 0) that found ``found`` leading ones (<=
        ``requested``) as :meth:`lookup_prefix` with ``request`` True counts its own (the pool's lookup counters,
        ``kvbm_matched_tokens``, the hit rate); no I/O, never raises. For a request whose looks ran uncounted
        and whose result is settled elsewhere: a prefill -> decode hand-off's wait is counted once, from the
        look that ended it (:mod:`kvbm_backend.integrations.vllm.handoff`)."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[BlockBuffer]) -> Future[PutResult]:
        """Offload: store ``blocks[i]`` under ``keys[i]``, asynchronously and bounded. The pool reads the
        buffers until the future completes. Never raises for storage trouble: drops and counts."""

    def get(self, keys: Sequence[BlockKey], out: GetDestinations) -> Future[GetResult]:
        """Onboard: read ``keys[i]`` into ``out[i]`` (numpy host buffers, or torch tensors on one
        device: see the module docstring). Failed, short, corrupt, foreign or late reads are misses
        (``ok[i] = False``, ``out[i]`` untouched); corrupt slots/objects are dropped and counted. Late reads
        (the pool's time bound ran out) are also marked ``timed_out[i] = True`` (:class:`GetResult`)."""

    def delete(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Remove blocks; the future gives how many were present."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload queued so far has finished (written, skipped or dropped). Returns
        False when ``timeout`` seconds passed first; never raises for storage trouble."""

    def stats(self) -> dict[str, Any]:
        """Counters and gauges. Every pool reports at least :data:`STATS_CONTRACT` under those names
        (block counts since open, bytes, the tier and the namespace fingerprint); more keys are the
        tier's own (G3: slots, files, evictions; G4: breaker, keyring)."""

    def close(self) -> None:
        """Flush or drop pending offloads (bounded), release files and threads."""


@dataclass(frozen=True)
class SlotLease:
    """A pinned G3 slot that a reader outside the pool may read until it hands the lease back.

    Attributes:
        key: the block the slot holds (the reader still checks the frame header names it).
        path: slab file path.
        offset: byte offset of the frame header in the file (a 4 KiB multiple).
        slot_len: bytes of the frame (header + payload padded to 4 KiB: ``frame.slot_bytes``).
        token: the pool's pin handle; opaque to the reader.
    """

    key: BlockKey
    path: str
    offset: int
    slot_len: int
    token: object = None


@runtime_checkable
class SlotLeaseSource(Protocol):
    """A pool whose blocks sit in fixed file slots that another reader may read in place (G3).

    Contract: every lease returned by :meth:`lease` is handed back exactly once with :meth:`release`;
    until then the slot is neither evicted nor rewritten. Nothing in a slot is trusted: the reader
    checks header identity and integrity itself (:mod:`kvbm_backend.model.frame`) and reports bad
    slots with :meth:`drop_corrupt`. None of the three calls does I/O; :meth:`lease` waits for storage at most
    its ``timeout_s`` (another thread's journal I/O holding G3's lock, docs/invariants.md #3).
    """

    def lease(self, keys: Sequence[BlockKey], timeout_s: float | None = None) -> list[SlotLease | None]:
        """Pin the slots of ``keys``; None for absent or foreign keys (misses, counted by the pool). Waits at most
        ``timeout_s`` seconds (None: no bound) for the pool's own bookkeeping (G3: its lock, held by other
        threads across journal I/O). Raises TimeoutError past it: nothing leased, the keys counted ``timeout``
        misses by the pool."""

    def release(self, leases: Sequence[SlotLease]) -> None:
        """Unpin leases from :meth:`lease` (a slot evicted meanwhile is freed now)."""

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        """The slot of ``key`` failed verification (``reason``: a FrameError reason): remove it."""


class DeviceReading(Protocol):
    """What :meth:`G3Extensions.device_reader` gives callers: the device path its probe chose."""

    @property
    def mode(self) -> str:
        """The device path (:data:`kvbm_backend.gpu.probe.MODES`: ``gds``, ``kvikio-compat``,
        ``pinned-bounce``, ``host``)."""

    @property
    def mode_reason(self) -> str:
        """Why the probe chose :attr:`mode` (one line, for logs and stats)."""


class LayerwiseLoading(Protocol):
    """One layer-wise load in flight (:meth:`G3Extensions.layerwise_load`; G3's
    :class:`~kvbm_backend.pool.g3.read.layerwise.LayerwiseLoad`): layer ``l`` of every block is usable while
    later layers are still being read. ``n`` is the number of keys."""

    @property
    def counters(self) -> Mapping[str, float]:
        """Counts (``reads``, ``unaligned_loads``, reasons, ...) and seconds (``read_wait_s``, ``verify_s``)."""

    def wait_layer(self, layer: int) -> tuple[list[int], torch.Tensor]:
        """Wait (until the deadline) for layer ``layer``: ``(good, t)``, the rows whose reads and headers are
        good so far (payloads not yet verified: only :meth:`finish` says a row is good) and layer ``layer``
        of every row as a ``[n, layer_bytes]`` uint8 tensor on the load's device. IndexError out of range."""

    def finish(self) -> list[str | None]:
        """Wait for every read, verify every payload, drop slots proven bad, release the leases; one reason
        per row, None for a verified row. Idempotent."""


@runtime_checkable
class G3Extensions(BlockPool, SlotLeaseSource, Protocol):
    """A G3 pool: a :class:`BlockPool` (and :class:`SlotLeaseSource`) plus what only G3 offers: the index as
    the connector's worker reports it to a scheduler in another process, the device reader it probes at
    start-up, layer-wise loads, and the put options of offloads and promotions. None of these calls but
    ``layerwise_load`` (which starts reads and returns) does storage I/O."""

    def contains(self, key: BlockKey) -> bool:
        """True when ``key`` is known published in the index (no I/O; the payload is verified only by ``get``).
        G3 answers False when its lock stays busy (another thread's journal I/O) past a short bound: a caller that
        takes False for "gone" asks ``holds`` where the pool has it (None: unknown)."""

    def keys(self) -> list[BlockKey]:
        """Snapshot of every published key (index only, no I/O)."""

    def device_reader(self, device: str | torch.device) -> DeviceReading:
        """The pool's reader of slots into ``device`` (a ``torch.device`` or its name), created and probed on
        first use. Raises RuntimeError when the pool is closed, ImportError without torch."""

    def layerwise_load(self, keys: Sequence[BlockKey], device: str | torch.device, *,
                       timeout_s: float | None = None, min_read: int | None = None) -> LayerwiseLoading:
        """Start a layer-wise load of ``keys`` into ``device`` (slots leased, reads ordered by layer on the
        pool's reader threads; returns at once): see :class:`LayerwiseLoading`. ``timeout_s``: the load's
        deadline (default ``g3.load_timeout_s``); ``min_read``: bytes per read at least (default
        :data:`kvbm_backend.transfer.layers.DEFAULT_MIN_READ`). Raises RuntimeError when the pool is closed,
        ImportError without torch, ValueError for a layout whose block is not whole layers."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[BlockBuffer], *,
            dev_checks: Sequence[int] | None = None, bypass_admission: bool = False) -> Future[PutResult]:
        """:meth:`BlockPool.put`, plus ``dev_checks`` (each block's device checksum: its frame then carries
        ``FLAG_DEVCHECK``) and ``bypass_admission`` (store past the admission filter: promotions)."""


#: the methods :class:`G3Extensions` requires (``runtime_checkable`` checks only that they exist)
G3_EXTENSION_METHODS = ("lease", "release", "drop_corrupt", "contains", "keys", "device_reader", "layerwise_load",
                        "put")


def require_g3_extensions(pool: object, what: str = "g3") -> G3Extensions | None:
    """``pool`` itself when it is None or satisfies :class:`G3Extensions`.

    Raises:
        TypeError: naming ``what``, the pool's type and the missing methods (e.g. a G4 pool given as G3).
    """
    if pool is None or isinstance(pool, G3Extensions):
        return pool
    missing = [m for m in G3_EXTENSION_METHODS if not callable(getattr(pool, m, None))]
    if not missing:  # the G3 methods are there: a BlockPool member is not
        missing = [m for m in ("tier", "namespace", "layout", "lookup_prefix", "get", "delete", "flush", "stats",
                               "close") if not hasattr(pool, m)]
    raise TypeError(f"{what}: {type(pool).__name__} is not a G3 pool (G3Extensions lacks {', '.join(missing)}); "
                    "the connector's worker needs the G3 extensions of kvbm_backend.pool.base")


def is_tensor_batch(bufs: Sequence[object] | Any) -> bool:
    """True when ``bufs`` are torch tensors (the device-destination form of ``get``: one ``[n, bytes_per_block]``
    tensor, :mod:`kvbm_backend.gpu.rows`, or a list whose first item is a tensor), without importing torch;
    False for numpy buffers or an empty list."""
    if type(bufs).__module__.startswith("torch"):
        return True
    return bool(len(bufs)) and type(bufs[0]).__module__.startswith("torch")


def completed(value: _T) -> Future[_T]:
    """A Future already resolved with ``value``."""
    f: Future[_T] = Future()
    f.set_result(value)
    return f


class InFlight(Generic[_T]):
    """Items (batches, put futures) whose future has not resolved yet, for a pool's ``flush`` or ``close``
    (thread-safe): :meth:`add` holds an item until its future resolves, :meth:`snapshot` lists those held."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._items: set[_T] = set()

    def add(self, item: _T, future: Future[Any]) -> None:
        with self._mu:
            self._items.add(item)
        future.add_done_callback(lambda _f: self._discard(item))

    def _discard(self, item: _T) -> None:
        with self._mu:
            self._items.discard(item)

    def snapshot(self) -> list[_T]:
        with self._mu:
            return list(self._items)
