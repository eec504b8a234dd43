"""G4 offloads: seal one block (AES-256-GCM under the tenant's data key, or xxh3 plaintext) and publish it
create-exclusive (:class:`G4Writer`, a part of :class:`~kvbm_backend.pool.g4.pool.G4Pool` that owns the
offload queue: pending blocks, the futures :meth:`G4Writer.flush` waits on, whether ``namespace.json`` is
written).

Each queued block runs :meth:`G4Writer._put_one` on an offload thread and ends in exactly one of
``written`` / ``skipped`` / ``dropped`` (counted by reason: ``dropped_breaker``, ``dropped_unavailable``,
``dropped_throttled``, ``dropped_full``, ``dropped_error``, ``dropped_revoked_tenant``, ``dropped_unknown_tenant``, ``dropped_keyring``,
``dropped_unsettled``, ``skipped_exists``, ``skipped_foreign``, ``skipped_unservable``); it never raises.
A create-exclusive PUT that finds an object under the name asks, with one ranged GET of its frame header, whether
this pool would serve it (:meth:`G4Writer._found_serves`: the reader's header checks, plaintext in an encrypted
pool, a data key this keyring no longer holds for the tenant): if so the block is ``skipped_exists`` (skipped);
if not, ``skipped_unservable`` and reported to the caller as ``dropped`` (not stored: the tier neither counts
nor publishes it); a failed GET counts ``skipped_exists`` as before. The object stays (the reader deletes what it
can confirm bad on load; ``kvbm-backend gc`` a revoked key's blocks). A GET that finds nothing (the object was
deleted between the PUT and it: gc, a load dropping a bad copy) has the block published again, up to
:data:`PUBLISH_ATTEMPTS` PUTs, then dropped (``dropped_error``): nothing there is never counted stored (before
2026-12-03 it was ``skipped_exists``, the block reported stored and, by the tier, to the router). A PUT the store
could not settle (no answer, and the HEAD asking whether it landed failed too: :class:`~.store.PutUnsettled`) stays
pending and is settled later by :class:`~.settle.LateSettler`, off the offload threads' time; when it finds other
bytes there it asks :meth:`G4Writer._settle_found` (a callback: the settler does not import the writer), so a
late-settled block ends ``skipped_exists`` or ``skipped_unservable`` (dropped) as above, and one whose found object
is gone by the check is sealed again from the caller's buffer (only while the settler holds the block: never after
its future resolved) and published as above (before 2026-12-03 it counted ``skipped_exists``, nothing there), if the
breaker allows it and each PUT within the settle bound (:meth:`G4Writer._settle_found`). A
store outage counts towards the breaker; a store that answers with an error (403, missing bucket) does not, and is
logged (:meth:`~kvbm_backend.pool.g4.events.OperatorLog.store_error`); nor does one that answers "no room" (a full,
over-quota or read-only mount: :class:`~.store.StoreFull`): ``dropped_full``, logged
(:meth:`~kvbm_backend.pool.g4.events.OperatorLog.store_full`), loads still served. A throttled PUT
(:class:`~.store.StoreThrottled`) is retried after a full-jitter backoff (:mod:`.throttle`) until
``timeout_s * (1 + retries)`` seconds after its first request, then dropped (``dropped_throttled``); never
a breaker failure. The backoff holds the I/O thread, so offloads queued behind it wait, and past
``write_queue_blocks`` pending blocks new ones are dropped (never waited for).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

from ...crypto.aead import key_check, key_check_differs, new_nonce, seal_into
from ...crypto.keyring import Keyring, KeyringError, TenantRevoked, UnknownTenant
from ...memory import BufferPool
from ...model.frame import DIGEST_AAD_VERSION, FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, NO_DIGEST, FrameError, accept, \
    payload_checksum, unbound_digest
from ...model.namespace import BlockKey, Namespace
from ..base import InFlight, PutResult, completed
from ...deadlines import Deadline, Deadlines
from .breaker import CircuitBreaker
from .drop_text import keyring_drop_text
from .events import G4Counters, OperatorLog
from .naming import NAMESPACE_JSON_MAX, TenantNamer, namespace_doc, namespace_name
from .settle import Hold, LateSettler
from .store import ObjectStore, PutUnsettled, StoreFull, StoreThrottled, StoreUnavailable
from .tenant_names import TenantNames
from .throttle import ThrottleWatch, call_throttled

__all__ = ["G4Writer", "SETTLE_BOUNDS"]

#: An unsettled PUT (:mod:`.settle`) ends ``dropped_unsettled`` this many put bounds after it became so.
SETTLE_BOUNDS = 4
#: Create-exclusive PUTs of one block while each finds the name taken and the check after it finds it gone
#: (:meth:`G4Writer._publish_found`); then the block is dropped (``dropped_error``), never counted stored.
PUBLISH_ATTEMPTS = 3


class G4Writer:
    """The write path of a G4 pool: the offload queue, sealing, create-exclusive publishing and
    ``namespace.json``. Owns its queue state; everything else is handed in.

    Args:
        store: where frames are published.
        namespace: what the blocks mean (keys of other namespaces are skipped).
        names: object names and expected headers per tenant.
        keyring: the tenants' data keys when ``encrypt`` (None only for plaintext pools); a plaintext pool's
            keyring is asked for the tenant's state (revoked tenants' offloads dropped, as when encrypted).
        encrypt: seal with AES-256-GCM (else xxh3-checksummed plaintext).
        frames: reused frame buffers of at least ``HEADER_BYTES + bytes_per_block`` bytes.
        breaker, throttle, counters, oplog: the pool's shared collaborators.
        executor: the offload threads (``g4.max_inflight`` of them).
        deadlines: the pool's timer thread (re-checks of unsettled PUTs, :mod:`.settle`).
        write_queue_blocks: pending blocks past which new offloads are dropped (``dropped_queue_full``).
        put_bound_s: seconds from a block's first PUT within which throttled PUTs are retried; an unsettled
            PUT is re-checked after ``put_bound_s / 4`` (doubling) for up to ``SETTLE_BOUNDS * put_bound_s``.
        load_bound_s: seconds within which the start-up ``namespace.json`` write retries throttles.
        default_tenant: the configured default tenant (the ``tenant`` setting: the tenant of every request that
            names none of its own); only compared with, never logged (see :meth:`_drop_text`)."""

    def __init__(self, *, store: ObjectStore, namespace: Namespace, names: TenantNames, keyring: Keyring | None,
                 encrypt: bool, frames: BufferPool, breaker: CircuitBreaker, throttle: ThrottleWatch,
                 counters: G4Counters, oplog: OperatorLog, executor: ThreadPoolExecutor, deadlines: Deadlines,
                 write_queue_blocks: int, put_bound_s: float, load_bound_s: float, default_tenant: str = ""):
        self.store = store
        self.namespace = namespace
        self._fp = namespace.fingerprint
        self._bpb = namespace.layout.bytes_per_block
        self._frame_bytes = HEADER_BYTES + self._bpb
        self._names = names
        self._default_tenant = default_tenant
        self._keyring = keyring
        self._encrypt = encrypt
        self._frames = frames
        self._breaker = breaker
        self._throttle = throttle
        self._counters = counters
        self._count = counters.count
        self._oplog = oplog
        self._exec = executor
        self._queue_blocks = write_queue_blocks
        self._put_bound_s = put_bound_s
        self._load_bound_s = load_bound_s
        self._mu = threading.Lock()
        self._pending_blocks = 0
        self._futures: InFlight[Future[PutResult]] = InFlight()  # puts not ended yet (flush)
        self._ns_writes: InFlight[Future[None]] = InFlight()  # namespace.json writes queued (flush waits too)
        self._closed = False
        self._settler = LateSettler(store=store, executor=executor, deadlines=deadlines, breaker=breaker,
                                    count=counters.count, first_delay_s=put_bound_s / 4,
                                    bound_s=SETTLE_BOUNDS * put_bound_s)
        self.namespace_written = False  # {ns_fp}/namespace.json is known to be in the store

    # ---- the queue -----------------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[npt.NDArray[np.uint8]]) -> Future[PutResult]:
        """Queue offloads (see :meth:`kvbm_backend.pool.g4.pool.G4Pool.put`). Raises ValueError at once
        for mismatched lengths, wrong-sized buffers or a key of another namespace."""
        keys, blocks = list(keys), list(blocks)
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        for k in keys:
            if k.namespace != self._fp:
                raise ValueError(f"put: key namespace {k.namespace} is not this pool's namespace {self._fp}")
        for blk in blocks:
            if blk.nbytes != self._bpb:
                raise ValueError(f"put: block buffer of {blk.nbytes} bytes, layout needs {self._bpb}")
        res = PutResult()
        if not keys:
            return completed(res)
        if self._closed:
            res.dropped = len(keys)
            self._count("dropped_closed", len(keys))
            return completed(res)
        if self._breaker.refuse_if_open():
            res.dropped = len(keys)
            self._count("dropped_breaker", len(keys))
            return completed(res)
        with self._mu:
            room = max(0, self._queue_blocks - self._pending_blocks)
            take = min(room, len(keys))
            self._pending_blocks += take
        if take < len(keys):
            res.dropped += len(keys) - take
            self._count("dropped_queue_full", len(keys) - take)
        if take == 0:
            return completed(res)
        fut: Future[PutResult] = Future()
        state = {"left": take}
        mu = threading.Lock()

        def one_done(kind: str) -> None:
            with mu:
                setattr(res, kind, getattr(res, kind) + 1)
                state["left"] -= 1
                last = state["left"] == 0
            with self._mu:
                self._pending_blocks -= 1
            if last:
                fut.set_result(res)

        queued = time.monotonic()
        for k, blk in zip(keys[:take], blocks[:take]):
            try:
                self._exec.submit(self._put_one, k, blk, one_done, queued)
            except RuntimeError:  # the pool closed meanwhile (its threads stopped): closed, so dropped here
                self._put_one(k, blk, one_done, queued)
        self._futures.add(fut, fut)
        return fut

    def pending_blocks(self) -> int:
        """Blocks queued and not yet ended (written, skipped or dropped)."""
        with self._mu:
            return self._pending_blocks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload queued so far has finished (written, skipped or dropped), and every
        queued ``namespace.json`` write (so none lands after the pool closed: the file store makes its
        directories again for it). Returns False if ``timeout`` seconds passed first."""
        end = Deadline(timeout)
        pending: list[Future[Any]] = [*self._futures.snapshot(), *self._ns_writes.snapshot()]
        for f in pending:
            try:
                f.result(end.left())
            except Exception:  # noqa: BLE001 - TimeoutError
                return False
        return True

    def unsettled_blocks(self) -> int:
        """Blocks whose PUT waits to be settled (:mod:`.settle`; part of :meth:`pending_blocks`)."""
        return self._settler.pending()

    def close(self) -> None:
        """From now on offloads are dropped (``dropped_closed``), those still queued too when their turn comes
        (without I/O: their futures resolve), and ``namespace.json`` is not retried; blocks still unsettled
        end now (``dropped_unsettled``), but for one a late settle is re-sealing and publishing again (waited for,
        at most until its settle bound: :meth:`.settle.LateSettler.close`; it starts no PUT but the one in flight)."""
        self._closed = True
        self._settler.close()

    # ---- one block -----------------------------------------------------------------------
    def _seal(self, key: BlockKey, block: npt.NDArray[np.uint8],
              buf: npt.NDArray[np.uint8]) -> tuple[memoryview, str, TenantNamer]:
        """Frame ``block`` into ``buf`` (a reused uint8 buffer of at least ``HEADER_BYTES + bpb`` bytes,
        from the frame buffers): AES-256-GCM straight from the caller's block into the payload (or one copy
        and xxh3 for plaintext), header in front. Returns the frame's memoryview (no copy), the object
        name and the namer, name and header both from that one namer taken after the keyring was asked (a look-up may reload it: a replaced
        pseudonym key then names and tags the block too). Raises KeyringError when the tenant has no data
        key to write with (revoked, unknown, keyring down); a plaintext pool with a keyring raises it for a
        revoked tenant and while the keyring file does not load (an unknown tenant needs no data key there:
        written)."""
        dk = None
        if self._encrypt:
            assert self._keyring is not None  # G4Pool: an encrypted pool always has a keyring
            dk = self._keyring.write_key(key.tenant)
        elif self._keyring is not None:  # a plaintext pool with a keyring honours its tenant state too
            state = self._keyring.tenant_state(key.tenant)
            if state == "revoked":
                raise TenantRevoked("the tenant was revoked")
            if state == "unavailable":
                raise KeyringError("the keyring file does not load")
        namer = self._names.namer(key.tenant)
        hdr = self._names.expected_header(key, namer)
        frame = buf.data.cast("B")[:HEADER_BYTES + self._bpb]  # ndarray.data: its memoryview, no copy
        payload = frame[HEADER_BYTES:]
        src = np.ascontiguousarray(block).reshape(-1).view(np.uint8).data
        if dk is not None:
            hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, dk.key_id, dk.version, new_nonce()
            hdr.key_check = key_check(dk.key)
            hdr.version = DIGEST_AAD_VERSION if hdr.token_digest != NO_DIGEST else hdr.version  # AAD binds it
            hdr.integrity = seal_into(dk.key, hdr.nonce, hdr.identity_bytes(), src, payload)
        else:
            payload[:] = src
            hdr.flags, hdr.integrity = FLAG_CHECKSUM, payload_checksum(src)
        frame[:HEADER_BYTES] = hdr.pack()
        return frame, self._names.name(key, namer), namer

    def _drop_text(self, reason: str, tenant: str | None = None) -> str:
        """What the operator log says about a tenant's offload dropped for ``reason`` (a keyring refusal): a fixed
        text with the keyring's settings, never the tenant id (the rule: :func:`.drop_text.keyring_drop_text`)."""
        return keyring_drop_text(self._keyring, self._default_tenant, reason, tenant)

    def _put_one(self, key: BlockKey, block: npt.NDArray[np.uint8], done: Callable[[str], None],
                 queued: float) -> None:
        """One queued offload (``queued``: its ``time.monotonic()`` when queued, for the
        ``kvbm_backend_g4_offload_seconds`` histogram). ``done(kind)`` is called once the block ended: here,
        or by the :class:`~.settle.LateSettler` when its PUT is unsettled."""
        kind = "dropped"
        handed_off = False
        try:
            if self._closed:  # queued when the pool closed: ends now, dropped, without I/O
                self._count("dropped_closed")
                return
            if key.namespace != self._fp:
                self._count("skipped_foreign")
                kind = "skipped"
                return
            if not self._breaker.allow():
                self._count("dropped_breaker")
                return
            with self._frames.lend(self._frame_bytes) as fbuf:  # reused: no allocation, no page faults
                try:
                    buf, name, namer = self._seal(key, block, fbuf)
                except KeyringError as e:
                    self._breaker.release()  # nothing went to the store: a probe it held goes back
                    self._count(self._keyring_drop(key, e))
                    return
                try:
                    created, found = self._publish_found(key, name, namer, buf)
                except PutUnsettled as e:  # may have landed; the store could not say: settle it later
                    handed_off = True

                    def end(kind: str) -> None:
                        self._counters.offload_ended(time.monotonic() - queued)
                        done(kind)
                    self._settler.start(name, e.md5_hex, len(buf), end,
                                        lambda hold: self._settle_found(key, block, name, namer, hold))
                    return
            if created is None:
                return
            if created:
                kind = "written"
                self._count("written")
                self._count("bytes_written", len(buf))
            elif found is None:  # taken at each PUT, gone by each check (PUBLISH_ATTEMPTS): nothing stored
                self._count("dropped_error")
            elif found:
                kind = "skipped"
                self._count("skipped_exists")
            else:  # an object this pool will not serve holds the name: not stored (the caller must not count it)
                self._count("skipped_unservable")
        except Exception:  # noqa: BLE001 - never let an offload raise
            self._count("dropped_error")
            kind = "dropped"
        finally:
            if not handed_off:
                self._counters.offload_ended(time.monotonic() - queued)
                done(kind)

    def _keyring_drop(self, key: BlockKey, e: KeyringError) -> str:
        """The ``dropped_*`` reason (not counted here) of ``key``'s offload refused by the keyring (``e``), logged."""
        reason = ("dropped_revoked_tenant" if isinstance(e, TenantRevoked) else
                  "dropped_unknown_tenant" if isinstance(e, UnknownTenant) else "dropped_keyring")
        # the operator log names the tenant by its pseudonym only, with a fixed text per reason (never
        # the keyring's message: a tenant id replaced in it showed where it occurred, e.g. "7")
        self._oplog.tenant_once(reason, self._names.tag(key.tenant), self._drop_text(reason, key.tenant))
        return reason

    def _publish(self, name: str, buf: memoryview, count: Callable[[str], None] | None = None) -> bool | None:
        """Create-exclusive PUT of one frame (throttles backed off within the offload bound). True:
        written; False: another writer's copy was there; None: dropped (its ``dropped_*`` reason given to
        ``count``, default the pool's counters). Raises :class:`~.store.PutUnsettled` (counted as a breaker
        failure here) when the store cannot say."""
        count = count or self._count
        try:
            return call_throttled(lambda: self.store.put_if_absent(name, buf),
                                  time.monotonic() + self._put_bound_s,
                                  lambda: self._throttle.note("put"), lambda: self._closed)
        except StoreThrottled:
            count("dropped_throttled")  # the store answered: ThrottleWatch.note told the breaker so
        except PutUnsettled as e:  # no answer: an outage; the caller settles the block later
            self._breaker.failure(e)
            raise
        except StoreUnavailable as e:
            self._breaker.failure(e)
            count("dropped_unavailable")
        except StoreFull as e:  # no space / quota / read-only: the store answered, reads go on (no breaker failure)
            self._breaker.success()
            count("dropped_full")
            self._oplog.store_full(e)
        except OSError as e:
            self._breaker.success()  # the store answered (e.g. 403): not an outage
            count("dropped_error")
            self._oplog.store_error(e)
        return None

    def _publish_found(self, key: BlockKey, name: str, namer: TenantNamer, buf: memoryview,
                       count: Callable[[str], None] | None = None,
                       until: float | None = None) -> tuple[bool | None, bool | None]:
        """Publish ``buf`` as ``name`` (:meth:`_publish`) and, when another object held the name, ask whether this
        pool serves it (:meth:`_found_serves`). Returns ``(created, found)``: ``created`` as :meth:`_publish` (None:
        dropped, counted there); ``found`` only matters when ``created`` is False: True (served, or cannot tell),
        False (unservable), None (the name was taken at each of :data:`PUBLISH_ATTEMPTS` PUTs and gone by each
        check: nothing stored). A name found gone is published again: it was deleted between the PUT and the check
        (gc, a load dropping a bad copy), and the create-exclusive PUT never tears a copy written meanwhile.
        Before 2026-12-03 the block then counted ``skipped_exists`` (stored) although nothing was. ``count`` and
        raises (:class:`~.store.PutUnsettled`) as :meth:`_publish`. ``until``: a late settle's bound
        (:meth:`_settle_found`): a PUT after the first starts only while ``put_bound_s`` is left of it and the pool is
        open, else ``(None, None)``, ``dropped_unsettled`` given to ``count`` (nothing stored)."""
        found: bool | None = None
        for attempt in range(PUBLISH_ATTEMPTS):
            if until is not None and attempt and (self._closed or until - time.monotonic() < self._put_bound_s):
                (count or self._count)("dropped_unsettled")
                return None, None
            created = self._publish(name, buf, count)
            if created is None:
                return None, None
            self._breaker.success()
            self._oplog.store_ok()
            if not self.namespace_written:  # namespace.json stayed throttled at start: the store takes writes now
                self.write_namespace_json()
            if created:
                return True, None
            found = self._found_serves(key, name, namer)
            if found is not None:
                break
        return False, found

    def _settle_found(self, key: BlockKey, block: npt.NDArray[np.uint8], name: str, namer: TenantNamer,
                      hold: Hold) -> str:
        """A late settle (:mod:`.settle`) found other bytes under ``name``: the counter ``key``'s block ends with (not
        counted here): ``skipped_exists`` / ``skipped_unservable`` as :meth:`_found_serves` judges them; gone by its
        GET (deleted since), ``block`` (the caller's: read only inside ``hold()``; ended or past the settle bound:
        ``dropped_unsettled``, unread) sealed again and published as a direct offload: ``written`` or a ``dropped_*``
        reason (before 2026-12-03: ``skipped_exists``). Its PUTs keep to the settle bound: each starts only while one
        PUT's bound (``put_bound_s``) is left of it, none but the first once the pool closes (else
        ``dropped_unsettled``); and to the breaker, as a direct offload (``dropped_breaker``, nothing sent). Before
        2026-12-04 a republish started with any time left (its PUTs ran past the bound, a close waiting for them) and
        never asked the breaker. Raises :class:`~.store.PutUnsettled` as :meth:`_publish`."""
        found = self._found_serves(key, name, namer)
        if found is not None:
            return "skipped_exists" if found else "skipped_unservable"
        dropped: list[str] = []
        with self._frames.lend(self._frame_bytes) as fbuf:
            with hold() as until:  # before 2026-12-03 a close resolved the future under this read: wrong KV published
                if until is None or until - time.monotonic() < self._put_bound_s:
                    return "dropped_unsettled"  # ended, or too little of the bound left for a PUT: unread
                if not self._breaker.allow():  # opened since the settle's HEAD (other offloads failing)
                    return "dropped_breaker"
                try:
                    buf, name, namer = self._seal(key, block, fbuf)
                except KeyringError as e:
                    self._breaker.release()  # nothing went to the store: a probe it held goes back
                    return self._keyring_drop(key, e)
                if self._closed:  # closed while sealing: nothing published (close() waits for the hold, then ends it)
                    self._breaker.release()
                    return "dropped_unsettled"
                created, found = self._publish_found(key, name, namer, buf, dropped.append, until)  # held: close waits
        if created is None:
            return dropped[0] if dropped else "dropped_error"
        return ("written" if created else "dropped_error" if found is None else
                "skipped_exists" if found else "skipped_unservable")

    def _found_serves(self, key: BlockKey, name: str, namer: TenantNamer) -> bool | None:
        """Whether this pool would serve the object a create-exclusive PUT of ``key`` found under ``name`` (or
        that a late settle, :mod:`.settle`, found holding other bytes than the unsettled PUT's), as
        far as its frame header (one ranged GET of ``HEADER_BYTES``) tells: the reader's header checks
        (:func:`~kvbm_backend.model.frame.accept`: format, block identity with ``namer``'s tenant tag, layout,
        TP world, length), an encrypted frame's data key still held by the keyring for this tenant (and, where the
        frame names it, the same key material: its ``key_check``), a plaintext
        frame only in a plaintext pool. Payload integrity is not checked (that needs the whole object). True
        too when it cannot tell (the GET failed): today's ``skipped_exists``. None when the object is gone since
        (nothing there: never counted as stored, :meth:`_publish_found`). Never raises."""
        try:
            head = self.store.get(name, 0, HEADER_BYTES)
        except Exception:  # noqa: BLE001 - unknown: counted as before (skipped_exists)
            return True
        if head is None:
            return None
        try:
            hdr = accept(head, key, self.namespace.layout, namer.pseudonym, world=self.namespace.tp_world_size,
                         stored_len=self._bpb)
        except FrameError:
            return False
        if unbound_digest(hdr, FLAG_ENCRYPTED):  # a digest relabelled in the store: the reader refuses it
            return False
        if hdr.flags & FLAG_ENCRYPTED:
            if self._keyring is None:
                return False
            try:
                dkey = self._keyring.read_key(hdr.key_id, hdr.key_version, tenant=key.tenant)
            except Exception:  # noqa: BLE001 - unknown: as before
                return True
            return dkey is not None and not key_check_differs(hdr.key_check, dkey)  # other key material: unservable
        return not self._encrypt and bool(hdr.flags & FLAG_CHECKSUM)

    # ---- namespace.json ------------------------------------------------------------------
    def start(self) -> None:
        """Queue the start-up check and ``namespace.json`` write on an offload thread."""
        self._queue_namespace_json()

    def _queue_namespace_json(self) -> None:
        fut = self._exec.submit(self.write_namespace_json)
        self._ns_writes.add(fut, fut)

    def store_back(self) -> None:
        """The breaker closed: if ``namespace.json`` could not be written at start (store down), queue it
        now, so the namespace an operator finds in the store always says what it holds."""
        if self.namespace_written or self._closed:
            return
        try:
            self._queue_namespace_json()
        except RuntimeError:  # closing: the I/O threads are gone
            pass

    def write_namespace_json(self) -> None:
        """Start-up check and ``{ns_fp}/namespace.json`` (once; throttled answers backed off within the load
        bound; an unavailable store trips the breaker, whose closing writes it again). The file records the
        ``dir_fanout`` block names use: written with this pool's when absent; when present (or another worker's
        won the create-exclusive write) the pool names blocks with the fan-out it records
        (:meth:`~.tenant_names.TenantNames.follow_store`, logged when it differs from ``g4.dir_fanout``). Taken at
        each of :data:`PUBLISH_ATTEMPTS` PUTs and gone by the GET after it: ``namespace_json_errors``, not written
        (the next offload written tries again; before 2026-12-03 counted written with nothing there)."""
        if self.namespace_written:
            return

        def write() -> bool:
            self.store.probe()  # start-up check: an unavailable store or missing bucket is logged now
            name, written = namespace_name(self._fp), False
            body = self.store.get(name, 0, NAMESPACE_JSON_MAX)
            for _ in range(PUBLISH_ATTEMPTS):
                if body is not None or (written := self.store.put_if_absent(
                        name, namespace_doc(self.namespace, self._names.dir_fanout))):
                    break
                body = self.store.get(name, 0, NAMESPACE_JSON_MAX)  # another worker's, written just now; or gone
            if body is not None:  # the store's: its blocks are named with the dir_fanout it records
                self._names.follow_store(bytes(body))
            return written or body is not None
        try:
            if not call_throttled(write, time.monotonic() + self._load_bound_s, lambda: self._throttle.note("put")):
                self._count("namespace_json_errors")  # taken and gone at each PUT: not there, tried again later
                return
            self.namespace_written = True
        except StoreThrottled:  # still throttled: the next offload that is written tries again
            self._count("namespace_json_errors")
        except StoreFull as e:  # a full / read-only store at start: an answer, never a trip (reads go on)
            self._count("namespace_json_errors")
            self._oplog.store_full(e)
        except StoreUnavailable as e:
            self._count("namespace_json_errors")
            self._breaker.trip(e)  # logs "unavailable at start"; probes every breaker_reset_s from now on
        except OSError as e:
            self._count("namespace_json_errors")
            self._oplog.store_error(e)
