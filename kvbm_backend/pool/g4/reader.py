"""G4 loads (:class:`G4Reader`, a part of :class:`~kvbm_backend.pool.g4.pool.G4Pool` that owns the bounce
buffers file objects are read through); lookups are :mod:`.lookup`.

* A get batch (:class:`GetBatch`) runs one :meth:`G4Reader._get_one` per block on the I/O threads (up to
  ``g4.max_inflight`` tasks, each taking the batch's next block until none is left; the batch's hit and miss
  counters are counted once, when it goes idle) and resolves when every block is back or at the load bound (``timeout_s * (1 + retries)`` seconds, a
  :class:`~kvbm_backend.deadlines.Deadline` on the pool's timer thread), whichever is first; a
  block not back by then is a miss (``miss_timeout``, marked ``GetResult.timed_out``) and its late reply
  never touches the caller's buffer (per-block lock + ``closed`` flag). An expired batch counts as one store failure
  (breaker) when the store is silent (:mod:`.silence`); blocks queued behind reads that answer are load, not a fault.
* A block is a hit only after :func:`kvbm_backend.model.frame.accept` (header identity, layout, exact length) and the
  GCM tag (or xxh3) verified in a staging buffer the pool owns (the bounce buffer, decrypted in place, or a fresh one
  for a store's read-only bytes); only then are the bytes copied into the caller's buffer, so a miss never touches it.
  A verified frame holding another NONZERO token digest than the key names is another token sequence's good block
  under that name: ``miss_other_digest``, kept (docs/format.md "Token digest"); one holding the zero digest (written
  without one) is ``corrupt_token_digest``.
  An S3 read asks for one frame and a byte more (a ranged GET; before 2026-12-01 the whole object, however large):
  an object longer than a frame is ``corrupt_length``, and costs a load no more than a good one.
  Corrupt objects are misses counted under ``corrupt_<reason>`` and deleted when the reason is in :data:`_DELETE_ON`
  *and* the store confirms it holds exactly the bytes read (:mod:`.bad_objects`: an S3 HEAD's length and MD5
  ETag, a fresh re-read of a file; for an object read only in part, a HEAD's size over a frame's, then a delete
  ``If-Match`` its ETag); otherwise (a lying endpoint or proxy, a bad read) the miss
  is ``miss_unconfirmed_corrupt`` (detail ``unconfirmed_<reason>``) and the object stays; so does a
  ``miss_key_mismatch`` (other key material: docs/format.md). The delete is conditional on the name still
  holding those bytes (:func:`.bad_objects.drop_if_same`: a good copy published meanwhile stays).
  An error answer (an OSError neither outage nor throttle: 403, no bucket, a link at the name) is ``miss_error``,
  logged as the writer's are (:meth:`~.events.OperatorLog.store_error`, ``the store refuses requests``); so is
  any other exception (a bug), logged with its type and traceback (:meth:`~.events.OperatorLog.unexpected`).
* Throttled reads (:class:`~kvbm_backend.pool.g4.store.StoreThrottled`) are retried after a full-jitter backoff
  (:mod:`.throttle`) until the batch's load bound: each throttled answer counts ``throttled_get``; a block still
  throttled at the bound is ``miss_throttled``. A throttle is the store answering: never a breaker failure, and a
  batch that expires while the pool is being throttled (its slots sat in backoff, or queued behind reads that did)
  counts its late blocks ``miss_throttled``, not as a silent store.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import numpy.typing as npt

from ...crypto.aead import TAG_BYTES, AeadError, gcm, key_check_differs, open_into, open_tagged_into, seal_into
from ...crypto.keyring import Keyring
from ...deadlines import Deadlines
from ...memory import BufferPool
from ...model.frame import (FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, NO_DIGEST, FrameError, accept, bound_aad,
                            key_digest, payload_checksum, unbound_digest)
from ...model.layout import KvLayout
from ...model.namespace import BlockKey
from ...threads import CountingExecutor
from ..base import GetResult, InFlight, completed
from .bad_objects import drop_bad
from .breaker import CircuitBreaker
from .silence import StoreCalls
from .events import G4Counters, OperatorLog
from .store import ObjectStore, StoreThrottled, StoreUnavailable
from .naming import TenantNamer
from .tenant_names import TenantNames
from .throttle import ThrottleWatch, call_throttled

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from .store import Blob

__all__ = ["G4Reader", "GetBatch", "bounce_buffers", "bounce_slot_bytes", "tenant_miss"]

# Reasons for which an object is deleted when read (it can never become a hit).
_DELETE_ON = {"magic", "header_check", "identity", "layout", "length", "integrity", "key_owner", "token_digest"}

PAGE = 4096  # bounce buffer sizes are rounded up to this, bytes


def bounce_slot_bytes(object_bytes: int) -> int:
    """Size of one bounce buffer for objects of ``object_bytes``: rounded up to 4 KiB (O_DIRECT), bytes."""
    return -(-object_bytes // PAGE) * PAGE


def bounce_buffers(object_bytes: int, slots: int) -> BufferPool:
    """The bounce buffers G4 reads objects of up to ``object_bytes`` through (stores with ``reads_into``).

    O_DIRECT reads into 4 KiB pages run at less than half speed on the dev/CI VM (measured in
    :mod:`kvbm_backend.memory`) and allocating per read costs page faults and an ``munmap`` per object, so
    this is a :class:`~kvbm_backend.memory.BufferPool` of kind ``"thp"`` with an arena of ``slots``
    pre-faulted buffers of :func:`bounce_slot_bytes` bytes, lent with ``lend(bounce_slot_bytes(...))``.
    When all are lent (more concurrent readers than ``slots``) a fresh buffer is allocated: readers never
    wait; ``stats()["allocated"]`` counts those (the pool's ``bounce_overflow`` stat). Nothing past the
    arena is kept (``keep_bytes`` 0).

    Raises ValueError for ``object_bytes`` or ``slots`` < 1.
    """
    if object_bytes < 1 or slots < 1:
        raise ValueError(f"bounce_buffers: object_bytes ({object_bytes}) and slots ({slots}) must be >= 1")
    return BufferPool("thp", 0, arena=(slots, bounce_slot_bytes(object_bytes)), name="g4-bounce")


class GetBatch:
    """One get batch: per-slot results, guarded so a late reply never writes after close.

    ``future`` gives the :class:`~kvbm_backend.pool.base.GetResult`; ``idle`` is set once no I/O thread
    of the batch touches a row any more (what :meth:`G4Reader.get_staged` callers wait for). A batch whose
    every block came back is idle before its future resolves (callers reuse its rows at once); one the load
    bound expired resolves at the bound and is idle once its late reads return."""

    def __init__(self, n: int, until: float):
        self.until = until  # time.monotonic() of the load bound
        self.future: Future[GetResult] = Future()
        self.mu = threading.Lock()
        self.slot_mu = [threading.Lock() for _ in range(n)]
        self.closed = False
        self.remaining = n
        self.complete = False  # every slot finished before the bound: the future resolves once idle
        self.ok = [False] * n
        self.done = [False] * n
        self.staged = False  # get_staged: ``out`` rows are scratch the pool may fill before verifying
        self.on_hit: Callable[[int], object] | None = None  # get_staged: called with i once block i verified
        self.idle = threading.Event()  # every I/O thread of this batch has left its row
        self.working = n
        self.next = itertools.count()  # the batch's tasks take blocks in order (next() is atomic under the GIL)
        self.tally: dict[str, int] = {}  # hits / miss counters of its slots, counted once it goes idle
        self.sizes = [0] * n  # bytes read for each hit (counted as bytes_read once idle)


def tenant_miss(keyring: Keyring | None, tenant: str) -> str | None:
    """A miss counter, without store I/O, when a pool's ``keyring`` (None for a plaintext pool without one)
    says ``tenant`` is revoked or the keyring file does not load; else None. Plaintext pools with a keyring
    ask it too: a revoked tenant's plaintext blocks stop being served (before 2026-11-30 only encrypted pools
    asked). (An unknown tenant's objects still get read and counted by what they are: absent, plaintext, or
    ``miss_no_key``.)"""
    if keyring is None:
        return None
    state = keyring.tenant_state(tenant)
    if state == "revoked":
        return "miss_revoked_tenant"
    return "miss_keyring_unavailable" if state == "unavailable" else None


class _Split:
    """An object read by one scatter read into a header buffer and a scratch payload row."""

    def __init__(self, target: list[memoryview], size: int):
        self.head, self.row = target
        self.n = min(size, len(self.head) + len(self.row))  # bytes read

    def parts(self) -> tuple[memoryview, memoryview]:
        """``(header, payload)`` views of what was read."""
        h = len(self.head)
        return self.head[:min(self.n, h)], self.row[:max(0, self.n - h)]

    def joined(self) -> bytes:
        """The bytes read, in one piece (only to confirm a bad object with the store: rare)."""
        h, p = self.parts()
        return bytes(h) + bytes(p)


class G4Reader:
    """The load path of a G4 pool: batches bounded by the load bound, verified before delivery. Owns the
    bounce buffers (stores that read into a buffer: ``reads_into``); everything else is handed in.

    Args:
        store: where objects are read (and corrupt ones deleted).
        layout, world, namespace: what a block must be (``frame.accept``); ``namespace`` is the fingerprint.
        names: object names and expected headers per tenant.
        keyring: data keys to open encrypted frames (None: plaintext pool without keyring). encrypt: an encrypted pool
            serves only authenticated blocks.
        frames: reused staging for read-only bodies (S3), buffers of ``HEADER_BYTES + bytes_per_block``.
        breaker, throttle, counters, oplog: the pool's shared collaborators. executor: the read threads
        (``g4.max_inflight``); deadlines: the pool's timer thread.
        load_bound_s: seconds within which a batch resolves. max_inflight: read threads, bounce buffers kept.
        calls: the pool's :class:`~.silence.StoreCalls` (its reads go through it; a batch expiring tells silence).
    """

    def __init__(self, *, store: ObjectStore, layout: KvLayout, world: int, namespace: str, names: TenantNames,
                 keyring: Keyring | None, encrypt: bool, frames: BufferPool, breaker: CircuitBreaker,
                 throttle: ThrottleWatch, counters: G4Counters, oplog: OperatorLog, executor: CountingExecutor,
                 deadlines: Deadlines, load_bound_s: float, max_inflight: int, calls: StoreCalls):
        self.store, self._layout, self._bpb = store, layout, layout.bytes_per_block
        self._world, self._fp, self._names, self._keyring = world, namespace, names, keyring
        self._encrypt = encrypt
        self._tenant_keyring = keyring  # what tenant_miss asks: plaintext pools with a keyring honour it too
        self._frames, self._frame_bytes = frames, HEADER_BYTES + self._bpb
        self._breaker = breaker
        self._throttle = throttle
        self._count, self._oplog, self._exec = counters.count, oplog, executor
        self._call, self._silent = calls.call, calls.silent
        self._deadlines, self._load_bound_s = deadlines, load_bound_s
        self._tasks = max_inflight  # tasks per batch at most (one per I/O thread)
        self._closed = False
        # Stores that read straight into a buffer (file://) get reusable huge-page bounce buffers, one
        # per I/O thread (see bounce_buffers for the measured reason); others return their own bytes. A
        # bounce buffer has room for the GCM tag after the payload (open_tagged_into, staged loads).
        self.bounce_bytes = bounce_slot_bytes(self._frame_bytes + TAG_BYTES)
        self.bounce: BufferPool | None = (bounce_buffers(self._frame_bytes + TAG_BYTES, max_inflight)
                                          if getattr(store, "reads_into", False) else None)
        self._reads_parts = bool(getattr(store, "reads_into_parts", False))
        self._mine = threading.local()  # .buf: this I/O thread's bounce buffer, taken at its first load
        self._open: InFlight[GetBatch] = InFlight()  # batches whose future is not resolved yet (expire_open)
        self._gcm: dict[bytes, AESGCM] = {}  # data key -> its one-shot GCM context (aead.gcm), reused

    def close(self) -> None:
        """From now on loads are misses (``miss_closed``) without store I/O."""
        self._closed = True

    def expire_open(self) -> None:
        """Resolve every batch still open now (the pool is closing and its timer thread stops): blocks not
        back yet are ``miss_closed``. A batch's tasks still queued on the I/O threads then end without I/O
        (``idle`` is set once they have); a read stuck in the kernel keeps its batch's rows busy (not idle)
        until it returns. Without this a batch queued behind busy I/O threads at close never resolved."""
        for b in self._open.snapshot():
            self._expire_get(b, closing=True)

    def get(self, keys: Sequence[BlockKey], out: Sequence[npt.NDArray[np.uint8]]) -> Future[GetResult]:
        """Load ``keys[i]`` into host buffers ``out[i]`` (see :meth:`kvbm_backend.pool.g4.pool.G4Pool.get`).
        Raises ValueError for wrong-sized buffers."""
        for o in out:
            if o.nbytes != self._bpb:
                raise ValueError(f"get: out buffer of {o.nbytes} bytes, layout needs {self._bpb}")
        self._count("gets", len(keys))
        if not keys or self._closed:
            self._count("miss_closed", len(keys) if keys else 0)
            return completed(GetResult([False] * len(keys)))
        if self._breaker.refuse_if_open(self._exec.saturated(), self._silent):
            self._count("miss_breaker", len(keys))
            return completed(GetResult([False] * len(keys)))
        b = GetBatch(len(keys), time.monotonic() + self._load_bound_s)
        self._start_tasks(b, keys, out)
        return b.future

    def get_staged(self, keys: Sequence[BlockKey], rows: Sequence[npt.NDArray[np.uint8]],
                   on_hit: Callable[[int], object] | None = None) -> GetBatch:
        """Load ``keys[i]`` into ``rows[i]`` (writable 1-D uint8 buffers of ``layout.bytes_per_block``
        bytes) that are *scratch*: the pool may read or open a block in its row before it verifies it, so
        a row whose block missed holds garbage (device loads stage here, then copy only verified rows:
        :func:`kvbm_backend.gpu.host_path.load_via_host`). Saves the bounce-to-row copy: plaintext file
        objects are read straight into the row (header into a bounce buffer, one scatter read) and checked
        there; encrypted ones are read into the bounce buffer and opened from it into the row by one
        GIL-free call (``AESGCM.decrypt_into``, the tag put after the ciphertext in the bounce buffer: the
        stored format is unchanged); S3 bodies are opened straight into the row. No payload-sized buffer is
        allocated per block.

        ``on_hit(i)``, if given, is called on an I/O thread once block ``i`` verified in its row (before the
        batch resolves), so callers can start copying it. Returns the batch: ``.future`` gives the
        :class:`GetResult` within the load bound (as :meth:`get`), ``.idle`` (threading.Event) is set once no
        I/O thread of the batch touches a row any more; give the rows' memory back for reuse only then.
        Raises ValueError for mismatched lengths or wrong-sized rows."""
        if len(keys) != len(rows):
            raise ValueError(f"get_staged: {len(keys)} keys but {len(rows)} rows")
        for r in rows:
            if r.nbytes != self._bpb:
                raise ValueError(f"get_staged: row of {r.nbytes} bytes, layout needs {self._bpb}")
        b = GetBatch(len(keys), time.monotonic() + self._load_bound_s)
        b.staged, b.on_hit = True, on_hit
        self._count("gets", len(keys))
        refuse = ("miss_closed" if (not keys or self._closed) else
                  "miss_breaker" if self._breaker.refuse_if_open(self._exec.saturated(), self._silent) else None)
        if refuse:
            self._count(refuse, len(keys))
            b.closed = True
            b.idle.set()
            b.future.set_result(GetResult([False] * len(keys)))
            return b
        self._start_tasks(b, keys, rows)
        return b

    def _start_tasks(self, b: GetBatch, keys: Sequence[BlockKey], out: Sequence[npt.NDArray[np.uint8]]) -> None:
        """Put batch ``b`` on the I/O threads: ``min(n, g4.max_inflight)`` tasks, each a loop taking the
        batch's next block until none is left (:meth:`_get_many`). A task per block cost a future, a queue
        hand-off and a thread wake-up per block, each retaking the GIL (a G4 load is bound by the Python it
        runs per block: docs/gpu.md). ``b`` is held open (:meth:`expire_open`) and expires at its load bound."""
        self._open.add(b, b.future)
        self._deadlines.add(b.until, lambda: self._expire_get(b))
        for _ in range(min(len(keys), self._tasks)):
            try:
                self._exec.submit(self._get_many, b, keys, out)
            except RuntimeError:  # the pool closed meanwhile (its I/O threads stopped): closed, so no I/O here
                self._get_many(b, keys, out)

    def _get_many(self, b: GetBatch, keys: Sequence[BlockKey], out: Sequence[npt.NDArray[np.uint8]]) -> None:
        """One task of batch ``b``: load its next block until every block is taken."""
        n = len(keys)
        while True:
            i = next(b.next)
            if i >= n:
                return
            self._get_one(b, i, keys[i], out[i])

    def _finish_slot(self, b: GetBatch, i: int) -> bool:
        """Mark slot ``i`` done; False when the batch had already expired it (its miss was counted then).
        The last slot closes the batch (``complete``); its future resolves when the batch goes idle."""
        with b.mu:
            if b.closed and not b.done[i]:
                return False
            b.done[i] = True
            b.remaining -= 1
            if b.remaining == 0 and not b.closed:
                b.closed = b.complete = True
        return True

    def _expire_get(self, b: GetBatch, closing: bool = False) -> None:
        """Resolve ``b`` at its load bound (or, ``closing``, at pool close: late blocks are ``miss_closed``)."""
        with b.mu:
            if b.closed:
                return
            b.closed = True
            late = [i for i, d in enumerate(b.done) if not d]
        for i in late:  # wait out a copy in progress; after this no slot is written
            with b.slot_mu[i]:
                pass
        missed = sum(1 for i in late if not b.ok[i])
        if closing:
            self._count("miss_closed", missed)
        elif self._throttle.throttling():  # the store answers "slow down": the late reads waited on that
            self._count("miss_throttled", missed)
        else:
            self._count("miss_timeout", missed)
            if missed and self._silent():  # silence is a failure; queueing behind answering reads is load
                self._breaker.failure(f"{missed} block reads got no reply within {self._load_bound_s:.2f} s")
        timed_out = [False] * len(b.ok)
        if not closing:  # the load bound ran out on these (silent or throttling store): they may be stored
            for i in late:
                timed_out[i] = not b.ok[i]
        b.future.set_result(GetResult(list(b.ok), timed_out))

    def _get_one(self, b: GetBatch, i: int, key: BlockKey, out: npt.NDArray[np.uint8]) -> None:
        miss: str | None = "miss_timeout"
        try:
            if b.closed:
                return
            miss = self._load(b, i, key, out)
        except Exception as e:  # noqa: BLE001 - a read never raises to the caller: a miss, named in the log
            miss = "miss_error"
            self._oplog.unexpected(e, "load")
        finally:
            # a slot the batch expired had its miss counted then (once); a hit copied in time still counts
            counted = self._finish_slot(b, i) or miss is None
            with b.mu:
                if counted:
                    b.tally[miss or "hits"] = b.tally.get(miss or "hits", 0) + 1
                b.working -= 1
                idle = b.working == 0
            if idle:  # the batch's counters once, before it answers (stats then include it)
                for c, v in b.tally.items():
                    self._count(c, v)
                self._count("bytes_read", sum(b.sizes))
                b.idle.set()
                if b.complete:  # every block came back: answer now that no thread touches a row
                    b.future.set_result(GetResult(list(b.ok)))

    def _load(self, b: GetBatch, i: int, key: BlockKey, out: npt.NDArray[np.uint8]) -> str | None:
        """Fetch, check and open one block into ``out``. Returns None on a hit, else a miss counter."""
        if self._closed:  # the pool is closing: the batch's blocks not read yet end here, without I/O
            return "miss_closed"
        if key.namespace != self._fp:
            return "miss_foreign_namespace"
        no_key = tenant_miss(self._tenant_keyring, key.tenant)
        if no_key:
            return no_key
        if not self._breaker.allow():
            return "miss_breaker"
        namer = self._names.namer(key.tenant)  # one for the name and the identity checked (module tenant_names)
        name = self._names.name(key, namer)
        if self.bounce is None:
            return self._load_from(b, i, key, out, name, None, namer)
        # each I/O thread takes one bounce buffer at its first load and keeps it (a thread runs one load at
        # a time): no pool lock and no arena bookkeeping per block, a GIL-held cost paid once per thread
        buf = getattr(self._mine, "buf", None)
        if buf is None:
            buf = self._mine.buf = self.bounce.take(self.bounce_bytes)
        return self._load_from(b, i, key, out, name, buf, namer)

    def _load_from(self, b: GetBatch, i: int, key: BlockKey, out: npt.NDArray[np.uint8], name: str,
                   buf: npt.NDArray[np.uint8] | None, namer: TenantNamer) -> str | None:
        """:meth:`_load` after the breaker: ``buf`` (bounce buffer of at least one object) or None
        for a store that returns its own bytes; ``namer`` named ``name``."""
        dst = out.reshape(-1).view(np.uint8).data  # ndarray.data: its memoryview (as memoryview(...))
        # staged plaintext pools: the payload is read straight into the scratch row and checked there;
        # encrypted pools read the frame into the bounce buffer and open it from there into the row
        split = (b.staged and buf is not None and len(dst) == self._bpb and self._reads_parts
                 and not self._encrypt)
        data: Blob | _Split | None
        try:
            if buf is None:
                data = call_throttled(lambda: self._call(self.store.get, name, 0, self._frame_bytes + 1), b.until,
                                      lambda: self._throttle.note("get"), lambda: b.closed)
                size = None if data is None else len(data)
            elif split:  # staged into a scratch row: the payload is read straight into it (one scatter read)
                parts = [buf.data[:HEADER_BYTES], dst]
                size = call_throttled(lambda: self._call(self.store.get_into, name, parts), b.until,
                                      lambda: self._throttle.note("get"), lambda: b.closed)
                data = None if size is None else _Split(parts, size)
            else:  # the object's true size, may exceed len(buf)
                size = call_throttled(lambda: self._call(self.store.get_into, name, buf), b.until,
                                      lambda: self._throttle.note("get"), lambda: b.closed)
                data = None if size is None else buf.data[:min(size, len(buf))]
        except StoreThrottled:
            return "miss_throttled"  # the store answered: ThrottleWatch.note told the breaker so
        except StoreUnavailable as e:
            if not b.closed:  # one failing after its batch expired was judged then (silence, :mod:`.silence`)
                self._breaker.failure(e)
            return "miss_unavailable"
        except OSError as e:  # an error answer (denied, no bucket, a link refused): named in the log, rate-limited
            self._breaker.success()
            self._oplog.store_error(e, read=True)
            return "miss_error"
        self._breaker.success()
        if data is None:
            return "miss_absent"
        assert size is not None  # None only with data None (absent)
        tag, aad = self._names.expected_identity(key, namer)
        scratch = None
        try:
            if size < HEADER_BYTES:
                raise FrameError("length", f"object of {size} bytes")
            if buf is None and size > self._frame_bytes:  # the GET stopped a byte past a frame: longer than any
                raise FrameError("length", f"object of more than {self._frame_bytes} bytes")
            head, payload = (data.parts() if isinstance(data, _Split) else
                             (memoryview(data)[:HEADER_BYTES], memoryview(data)[HEADER_BYTES:]))
            want = key_digest(key)  # checked once the frame verified: another nonzero one is kept (below)
            hdr = accept(head, key if want is None else BlockKey(*key), self._layout, tag, world=self._world,
                         stored_len=self._layout.bytes_per_block, frame_bytes=size, exact=True)
            if want is not None and hdr.token_digest == NO_DIGEST or unbound_digest(hdr, FLAG_ENCRYPTED):  # deleted
                raise FrameError("token_digest", "a frame written without a token digest, or one its AEAD does not bind")
            aad = bound_aad(hdr, aad)  # version 2: the token digest (checked below), bound by the GCM tag too
            # stage, verify, then copy: nothing unverified reaches ``out``; get_staged's rows are scratch (verified there)
            if hdr.flags & FLAG_ENCRYPTED:
                dkey = (self._keyring.read_key(hdr.key_id, hdr.key_version, tenant=key.tenant)
                        if self._keyring else None)
                if dkey is None:
                    if self._keyring is not None and self._keyring.key_owner(hdr.key_id) not in (None, key.tenant):
                        raise FrameError("key_owner", "sealed under another tenant's data key")
                    # revoked, or the file stopped loading, since _load looked: count it as such
                    return tenant_miss(self._tenant_keyring, key.tenant) or "miss_no_key"
                if key_check_differs(hdr.key_check, dkey):  # sealed under other key material of that (key_id,
                    return "miss_key_mismatch"  # version): a diverged keyring copy; not provably bad, so kept
                if b.staged and buf is not None and not split and len(dst) == len(payload) \
                        and len(buf) >= size + TAG_BYTES:
                    # staged, from our bounce buffer: opened straight into the scratch row in one call, the tag
                    # put after the ciphertext (the bytes read stay as read, to confirm a bad object)
                    buf.data[size:size + TAG_BYTES] = hdr.integrity
                    try:
                        open_tagged_into(self._gcm_of(dkey), hdr.nonce, aad, buf.data[HEADER_BYTES:size + TAG_BYTES],
                                         dst)
                    except AeadError:
                        raise FrameError("integrity", "GCM tag did not verify") from None
                    plain = dst
                else:
                    # in place in our own bounce buffer; a read-only body (S3) into a reused staging buffer
                    if not payload.readonly:
                        plain = payload
                    elif b.staged and len(dst) == len(payload):
                        plain = dst  # a read-only body (S3) opened straight into the scratch row
                    else:
                        scratch = self._frames.take(self._frame_bytes)
                        plain = scratch.data[:len(payload)]
                    try:
                        open_into(dkey, hdr.nonce, aad, hdr.integrity, payload, plain)
                    except AeadError:
                        if plain is payload:  # undo the in-place decryption (GCM's CTR keystream again) so
                            seal_into(dkey, hdr.nonce, b"", plain, payload)  # the bytes read can be confirmed
                        raise FrameError("integrity", "GCM tag did not verify") from None
            elif self._encrypt:  # an encrypted pool serves only authenticated blocks
                return self._drop_unencrypted(name, data.joined() if isinstance(data, _Split) else data, size)
            elif hdr.flags & FLAG_CHECKSUM:
                if payload_checksum(payload) != hdr.integrity:
                    raise FrameError("integrity", "payload checksum mismatch")
                plain = payload
            else:
                raise FrameError("integrity", "frame has neither checksum nor AEAD tag")
            if want is not None and hdr.token_digest != want:
                # a verified frame of another token sequence with this name: someone else's good block, kept (a
                # forged prompt's load must not delete it: docs/format.md "Token digest"); nothing reached ``out``
                return "miss_other_digest"
            with b.slot_mu[i]:
                if b.closed:
                    return "miss_timeout"
                if not (plain is dst or split):
                    dst[:] = plain
                b.ok[i] = True
            if b.on_hit is not None:
                b.on_hit(i)
        except FrameError as e:
            read = data.joined() if isinstance(data, _Split) else data
            cut = self._frame_bytes if buf is None and size > self._frame_bytes else None  # only its start read
            dropped = drop_bad(self.store, name, read, size, cut) if e.reason in _DELETE_ON else False
            if dropped is None:  # the bytes read are bad but the store does not confirm it holds them (a lying
                self._count(f"unconfirmed_{e.reason}")  # endpoint or proxy, a failed read): a miss, the object stays
                return "miss_unconfirmed_corrupt"
            self._count(f"corrupt_{e.reason}")
            if dropped:
                self._count("deleted_corrupt")
            return "miss_corrupt"
        finally:
            if scratch is not None:
                self._frames.give(scratch)
        b.sizes[i] = size  # counted with the batch's hits (bytes_read) once it goes idle
        return None

    def _drop_unencrypted(self, name: str, data: Blob, size: int) -> str:
        """A plaintext frame (``data``: the bytes read of an object of ``size`` bytes) under ``name`` in an
        encrypted pool: never served; deleted once the store confirms it holds those bytes
        (``deleted_unencrypted``, else ``unconfirmed_unencrypted``), else it held the name against the encrypted
        copy for good under create-exclusive (g4.encrypt switched on: docs/configuration.md). Plaintext pools
        never delete encrypted frames they cannot open. Returns ``"miss_unencrypted_object"``."""
        dropped = drop_bad(self.store, name, data, size)  # deleted only while it still holds those bytes
        if dropped is not False:
            self._count("unconfirmed_unencrypted" if dropped is None else "deleted_unencrypted")
        return "miss_unencrypted_object"

    def _gcm_of(self, dkey: bytes) -> AESGCM:
        """The reused one-shot GCM context of data key ``dkey`` (those of the 64 most recent keys are kept)."""
        ctx = self._gcm.get(dkey)
        if ctx is None:
            if len(self._gcm) >= 64:
                self._gcm.clear()
            ctx = self._gcm.setdefault(dkey, gcm(dkey))
        return ctx
