"""G4 loads and lookups (:class:`ReaderMixin`, part of :class:`~kvbm_backend.pool.g4.pool.G4Pool`), and
the bounce buffers file objects are read through.

* A get batch (:class:`_Batch`) runs one :meth:`ReaderMixin._get_one` per block on the I/O threads and
  resolves when every block is back or at the load bound (``timeout_s * (1 + retries)`` seconds, a
  :class:`~kvbm_backend.deadlines.Deadline` on the pool's timer thread), whichever is first; a
  block not back by then is a miss (``miss_timeout``) and its late reply never touches the caller's
  buffer (per-block lock + ``closed`` flag). An expired batch counts as one store failure (breaker).
* A block is a hit only after :func:`kvbm_backend.model.frame.accept` (header identity, layout, exact
  length) and the GCM tag (or xxh3) verified in a staging buffer the pool owns (the bounce buffer,
  decrypted in place, or a fresh one for a store's read-only bytes); only then are the bytes copied into
  the caller's buffer, so a miss never touches it. Corrupt objects are misses counted under
  ``corrupt_<reason>`` and deleted when the reason is in :data:`_DELETE_ON` *and* the store confirms it
  holds exactly the bytes read (:meth:`~kvbm_backend.pool.g4.store.ObjectStore.stored_matches`: an S3
  HEAD's length and MD5 ETag, a fresh re-read of a file); otherwise (a lying endpoint or proxy, a bad
  read) the miss is ``miss_unconfirmed_corrupt`` (detail ``unconfirmed_<reason>``) and the object stays.
* Lookups HEAD keys in growing parallel waves (8, 16, ... up to ``max_inflight``), stopping at the first
  absent key; an expired lookup answers the confirmed prefix.
* Throttled reads and HEADs (:class:`~kvbm_backend.pool.g4.store.StoreThrottled`) are retried after a
  full-jitter backoff (:mod:`.throttle`) until the batch's load bound: each throttled answer counts
  ``throttled_get`` / ``throttled_head``; a block still throttled at the bound is ``miss_throttled``, a
  HEAD still throttled ends the lookup there (``lookup_throttled``). A throttle is the store answering:
  never a breaker failure, and a batch that expires while the pool is being throttled (its slots sat in
  backoff, or queued behind reads that did) counts its late blocks ``miss_throttled`` (a lookup:
  ``lookup_throttled``), not as a silent store.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from ...crypto.aead import AeadError, open_into, seal_into
from ...memory import BufferPool
from ...model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameError, accept, payload_checksum
from ...model.namespace import BlockKey
from ..base import GetResult
from ...deadlines import Deadline
from .store import StoreThrottled, StoreUnavailable
from .throttle import call_throttled

# Reasons for which an object is deleted when read (it can never become a hit).
_DELETE_ON = {"magic", "header_check", "identity", "layout", "length", "integrity", "key_owner"}

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


class _Batch:
    """One get/lookup batch: per-slot results, guarded so a late reply never writes after close."""

    def __init__(self, n: int, until: float):
        self.until = until  # time.monotonic() of the load bound
        self.throttled = False  # a HEAD of this lookup stayed throttled to the bound
        self.future: Future = Future()
        self.mu = threading.Lock()
        self.slot_mu = [threading.Lock() for _ in range(n)]
        self.closed = False
        self.remaining = n
        self.ok = [False] * n
        self.done = [False] * n
        self.staged = False  # get_staged: ``out`` rows are scratch the pool may fill before verifying
        self.on_hit = None  # get_staged: called with i once block i verified in its row (an I/O thread)
        self.idle = threading.Event()  # every I/O thread of this batch has left its row
        self.working = n



class _Split:
    """An object read by one scatter read into a header buffer and a scratch payload row."""

    def __init__(self, target: list, size: int):
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


class ReaderMixin:
    """The read and lookup paths of :class:`~kvbm_backend.pool.g4.pool.G4Pool` (uses its store, breaker,
    keyring, bounce buffers, I/O threads and counters)."""

    def get_staged(self, keys: list, rows: list, on_hit=None) -> "_Batch":
        """Load ``keys[i]`` into ``rows[i]`` (writable 1-D uint8 buffers of ``layout.bytes_per_block``
        bytes) that are *scratch*: the pool may read or open a block in its row before it verifies it, so
        a row whose block missed holds garbage (device loads stage here, then copy only verified rows:
        :func:`kvbm_backend.gpu.host_path.load_via_host`). Saves the bounce-to-row copy: file objects are
        read straight into the row (header into a bounce buffer, one scatter read) and verified there, S3
        bodies opened straight into it.

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
        d = Deadline(self._load_bound_s)
        b = _Batch(len(keys), d.at)
        b.staged, b.on_hit = True, on_hit
        self._count("gets", len(keys))
        refuse = "miss_closed" if (not keys or self._closed) else "miss_breaker" if self.breaker.refuse_if_open() else None
        if refuse:
            self._count(refuse, len(keys))
            b.closed = True
            b.idle.set()
            b.future.set_result(GetResult([False] * len(keys)))
            return b
        self._deadlines.add(d.at, lambda: self._expire_get(b))
        for i, (k, o) in enumerate(zip(keys, rows)):
            self._io.submit(self._get_one, b, i, k, o)
        return b

    def _finish_slot(self, b: _Batch, i: int) -> bool:
        """Mark slot ``i`` done; False when the batch had already expired it (its miss was counted then)."""
        with b.mu:
            if b.closed and not b.done[i]:
                return False
            b.done[i] = True
            b.remaining -= 1
            last = b.remaining == 0 and not b.closed
            if last:
                b.closed = True
        if last:
            b.future.set_result(GetResult(list(b.ok)))
        return True

    def _expire_get(self, b: _Batch) -> None:
        with b.mu:
            if b.closed:
                return
            b.closed = True
            late = [i for i, d in enumerate(b.done) if not d]
        for i in late:  # wait out a copy in progress; after this no slot is written
            with b.slot_mu[i]:
                pass
        missed = sum(1 for i in late if not b.ok[i])
        if self._throttling():  # the store answers "slow down": the late reads waited on that, not on silence
            self._count("miss_throttled", missed)
        else:
            self._count("miss_timeout", missed)
            if missed:  # silence is a failure: nothing else reports a read hung in the kernel
                self.breaker.failure(f"{missed} block reads got no reply within {self._load_bound_s:.2f} s")
        b.future.set_result(GetResult(list(b.ok)))

    def _get_one(self, b: _Batch, i: int, key: BlockKey, out: np.ndarray) -> None:
        miss = "miss_timeout"
        try:
            if b.closed:
                return
            miss = self._load(b, i, key, out)
        except Exception:  # noqa: BLE001 - a read never raises to the caller
            miss = "miss_error"
        finally:
            # a slot the batch expired had its miss counted then (once); a hit copied in time still counts
            if self._finish_slot(b, i) or miss is None:
                self._count(miss or "hits")
            with b.mu:
                b.working -= 1
                if b.working == 0:
                    b.idle.set()

    def _tenant_miss(self, tenant: str) -> str | None:
        """A miss counter, without store I/O, when an encrypted pool's keyring says ``tenant`` is
        revoked or the keyring file does not load; else None. (An unknown tenant's objects still get
        read and counted by what they are: absent, plaintext, or ``miss_no_key``.)"""
        if not self.encrypt or self.keyring is None:
            return None
        state = self.keyring.tenant_state(tenant)
        if state == "revoked":
            return "miss_revoked_tenant"
        return "miss_keyring_unavailable" if state == "unavailable" else None

    def _load(self, b: _Batch, i: int, key: BlockKey, out: np.ndarray) -> str | None:
        """Fetch, check and open one block into ``out``. Returns None on a hit, else a miss counter."""
        if key.namespace != self._fp:
            return "miss_foreign_namespace"
        no_key = self._tenant_miss(key.tenant)
        if no_key:
            return no_key
        if not self.breaker.allow():
            return "miss_breaker"
        name = self._name(key)
        if self._bounce is None:
            return self._load_from(b, i, key, out, name, None)
        with self._bounce.lend(self._bounce_bytes) as buf:
            return self._load_from(b, i, key, out, name, buf)

    def _load_from(self, b: _Batch, i: int, key: BlockKey, out: np.ndarray, name: str, buf) -> str | None:
        """:meth:`_load` after the breaker: ``buf`` (bounce buffer of at least one object) or None
        for a store that returns its own bytes."""
        dst = memoryview(out.reshape(-1).view(np.uint8))
        split = (b.staged and buf is not None and len(dst) == self._bpb
                 and getattr(self.store, "reads_into_parts", False))
        try:
            if buf is None:
                data = call_throttled(lambda: self.store.get(name), b.until, lambda: self._note_throttle("get"),
                                      lambda: b.closed)
                size = None if data is None else len(data)
            else:  # the object's true size, may exceed len(buf)
                # staged into a scratch row: the payload is read straight into it (one scatter read)
                target = ([memoryview(buf)[:HEADER_BYTES], dst] if split else buf)
                size = call_throttled(lambda: self.store.get_into(name, target), b.until,
                                      lambda: self._note_throttle("get"), lambda: b.closed)
                data = (None if size is None else _Split(target, size) if split
                        else memoryview(buf)[:min(size, len(buf))])
        except StoreThrottled:
            return "miss_throttled"  # the store answered: _note_throttle told the breaker so
        except StoreUnavailable as e:
            self.breaker.failure(e)
            return "miss_unavailable"
        except OSError:
            self.breaker.success()
            return "miss_error"
        self.breaker.success()
        if data is None:
            return "miss_absent"
        exp = self._expected_header(key)
        scratch = None
        try:
            if size < HEADER_BYTES:
                raise FrameError("length", f"object of {size} bytes")
            head, payload = data.parts() if split else (memoryview(data)[:HEADER_BYTES], memoryview(data)[HEADER_BYTES:])
            hdr = accept(head, key, self._layout, exp.tenant_tag, world=self._world,
                         stored_len=self._layout.bytes_per_block, frame_bytes=size, exact=True)
            # stage, verify, then copy: nothing unverified ever reaches ``out`` (a miss leaves it untouched);
            # get_staged's rows are scratch, so there the payload is verified in (or opened into) the row
            if hdr.flags & FLAG_ENCRYPTED:
                dkey = (self.keyring.read_key(hdr.key_id, hdr.key_version, tenant=key.tenant)
                        if self.keyring else None)
                if dkey is None:
                    if self.keyring is not None and self.keyring.key_owner(hdr.key_id) not in (None, key.tenant):
                        raise FrameError("key_owner", "sealed under another tenant's data key")
                    # revoked, or the file stopped loading, since _tenant_miss looked: count it as such
                    return self._tenant_miss(key.tenant) or "miss_no_key"
                # in place in our own bounce buffer; a read-only body (S3) into a reused staging buffer
                if not payload.readonly:
                    plain = payload
                elif b.staged and len(dst) == len(payload):
                    plain = dst  # a read-only body (S3) opened straight into the scratch row
                else:
                    scratch = self._frames.take(self._frame_bytes)
                    plain = memoryview(scratch)[:len(payload)]
                try:
                    open_into(dkey, hdr.nonce, exp.identity_bytes(), hdr.integrity, payload, plain)
                except AeadError:
                    if plain is payload:  # undo the in-place decryption (GCM's CTR keystream again) so
                        seal_into(dkey, hdr.nonce, b"", plain, payload)  # the bytes read can be confirmed
                    raise FrameError("integrity", "GCM tag did not verify") from None
            elif self.encrypt:
                return "miss_unencrypted_object"  # an encrypted pool serves only authenticated blocks
            elif hdr.flags & FLAG_CHECKSUM:
                if payload_checksum(payload) != hdr.integrity:
                    raise FrameError("integrity", "payload checksum mismatch")
                plain = payload
            else:
                raise FrameError("integrity", "frame has neither checksum nor AEAD tag")
            with b.slot_mu[i]:
                if b.closed:
                    return "miss_timeout"
                if not (plain is dst or split):
                    dst[:] = plain
                b.ok[i] = True
            if b.on_hit is not None:
                b.on_hit(i)
        except FrameError as e:
            if e.reason in _DELETE_ON and not self._stored_is_bad(name, data.joined() if split else data, size):
                # the bytes read are bad but the store does not confirm it holds them (a lying endpoint
                # or proxy, a failed read): a miss, and the object stays
                self._count(f"unconfirmed_{e.reason}")
                return "miss_unconfirmed_corrupt"
            self._count(f"corrupt_{e.reason}")
            if e.reason in _DELETE_ON:
                try:
                    self.store.delete(name)
                    self._count("deleted_corrupt")
                except OSError:
                    pass
            return "miss_corrupt"
        finally:
            if scratch is not None:
                self._frames.give(scratch)
        self._count("bytes_read", size)
        return None

    def _stored_is_bad(self, name: str, data, size: int) -> bool:
        """True only when the store confirms the object under ``name`` is exactly what was read (``data``,
        the first bytes of an object of ``size`` bytes): then dropping it drops the bad copy, not a good
        one a transport garbled (:meth:`~kvbm_backend.pool.g4.store.ObjectStore.stored_matches`)."""
        try:
            return bool(self.store.stored_matches(name, data, size))
        except Exception:  # noqa: BLE001 - unconfirmed: keep the object
            return False

    # lookups: HEAD waves of growing size
    def _lookup_wave(self, b: _Batch, keys: list, start: int, width: int) -> None:
        end = min(len(keys), start + width)
        wave = {"left": end - start}
        mu = threading.Lock()

        def head_one(i: int) -> None:
            present = False
            try:
                k = keys[i]
                if (k.namespace == self._fp and not b.closed and self._tenant_miss(k.tenant) is None
                        and self.breaker.allow()):
                    name = self._name(k)
                    try:
                        present = call_throttled(lambda: self.store.head(name), b.until,
                                                 lambda: self._note_throttle("head"), lambda: b.closed) is not None
                        self.breaker.success()
                    except StoreThrottled:
                        b.throttled = True  # absent for this lookup: it ends here
                    except StoreUnavailable as e:
                        self.breaker.failure(e)
                        self._count("lookup_unavailable")
                    except OSError:
                        self.breaker.success()
            except Exception:  # noqa: BLE001
                present = False
            b.ok[i] = present
            b.done[i] = True
            with mu:
                wave["left"] -= 1
                last = wave["left"] == 0
            if last:
                self._wave_done(b, keys, start, end)

        for i in range(start, end):
            self._io.submit(head_one, i)

    def _wave_done(self, b: _Batch, keys: list, start: int, end: int) -> None:
        with b.mu:
            if b.closed:
                return
            n = start
            while n < end and b.ok[n]:
                n += 1
            b.count = n
            finished = n < end or end == len(keys)
            if finished:
                b.closed = True
        if finished:
            self._count("lookup_hits", n)
            if b.throttled and n < len(keys):
                self._count("lookup_throttled")
            self._lookup_result(len(keys), n)
            b.future.set_result(n)
        else:
            self._lookup_wave(b, keys, end, min(2 * (end - start), self.cfg.max_inflight))

    def _expire_lookup(self, b: _Batch) -> None:
        with b.mu:
            if b.closed:
                return
            b.closed = True
            n = 0
            while n < len(b.ok) and b.done[n] and b.ok[n]:
                n += 1
        self._lookup_result(len(b.ok), n)
        if b.throttled or self._throttling():  # waited on "slow down" answers, not on silence
            self._count("lookup_throttled")
        else:
            self._count("lookup_timeout")
            self.breaker.failure(f"a lookup got no reply within {self._load_bound_s:.2f} s")
        b.future.set_result(n)

