"""A G4 pool of per-rank blocks stored as canonical per-head parts (``g4.layout: canonical``).

:class:`CanonicalG4` is a :class:`~kvbm_backend.pool.base.BlockPool` for the engine's per-rank keys and
blocks over a G4 pool bound to the canonical namespace (:mod:`kvbm_backend.model.canonical`): ``put``
cuts each block into its rank's KV-head parts (a memory copy) and stores the parts; ``get`` reads the
parts of the key's rank and assembles the block only when every part was found and verified (header
identity and AEAD tag, by the G4 pool), else the block is a miss and ``out[i]`` is untouched; a lookup
counts a block present only when the parts of all the key's heads are. Ranks that hold replicated heads
(more TP ranks than KV heads, MLA) write only from the first replica (:meth:`HeadMap.writes`); the others'
offloads count as skipped.

A block put again while an earlier put of it through this pool is still in flight (an engine re-saves a shared
prefix while the first save is in write-behind) is handed to the G4 pool only once that put ended, so it finds the
parts stored (skipped) or stores what the first put dropped. Before (CI, 2026-12, 2 busy cores) both puts' parts
were in flight at once: each part object has exactly one creator, but the two puts could each create some of one
block's parts, and both counted the block ``written`` (``g4_put_written_blocks`` 34 for 32 blocks stored).

A put waiting so holds its copy of the block's parts, so it counts against the G4 pool's write queue bound
(``g4.write_queue_blocks``, in parts) like the parts queued in the pool: this pool admits a block's put (handed to
the G4 pool now, or waiting) only while its parts fit beside the parts of its puts not ended, else the block is
dropped at once (``dropped_queue_full``, counted in parts as the pool's writer does; whole blocks, never some of a
block's parts). Before (review, 2026-12) a waiting put was outside the bound: up to one more block per distinct
block in flight held beyond it. :meth:`CanonicalG4.close` waits (within its bound) for waiting puts too: before,
only the G4 pool's queue was waited for, and a put issued from behind its block's put as the pool closed ended
``dropped_closed``.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ...deadlines import Deadline
from ...model.canonical import HeadMap
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, KeyRun
from ..base import BlockPool, GetResult, PutResult, completed, is_tensor_batch

__all__ = ["CanonicalG4"]

_R = TypeVar("_R")
_T = TypeVar("_T")


def _all_of(futs: list[Future[_R]], combine: Callable[[list[_R]], _T]) -> Future[_T]:
    """A Future of ``combine([f.result() for f in futs])`` once all are done (an exception: the first)."""
    out: Future[_T] = Future()
    left = [len(futs)]
    lock = threading.Lock()

    def one(_f: Future[_R]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result(combine([f.result() for f in futs]))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            out.set_exception(e)
    for f in futs:
        f.add_done_callback(one)
    return out


def _copy(src: Future[_R], dst: Future[_R]) -> None:
    """Resolve ``dst`` as the done ``src`` (its result or its exception; cancelled: CancelledError)."""
    e = CancelledError() if src.cancelled() else src.exception()
    if e is not None:
        dst.set_exception(e)
    else:
        dst.set_result(src.result())


class CanonicalG4:
    """Per-rank view of canonical G4 parts.

    Args:
        inner: the G4 pool, bound to ``heads.canonical`` (closed by :meth:`close`).
        heads: the :class:`HeadMap` of the engine's per-rank namespace.
    Raises:
        ValueError: ``inner`` is bound to another namespace.
    """

    tier = "G4"

    def __init__(self, inner: BlockPool, heads: HeadMap):
        if inner.namespace.fingerprint != heads.canonical.fingerprint:
            raise ValueError(f"g4.layout: canonical: the G4 pool's namespace {inner.namespace.fingerprint} is not "
                             f"the canonical one {heads.canonical.fingerprint}")
        self.inner, self.heads = inner, heads
        self.namespace = heads.per_rank
        self._fp = heads.per_rank.fingerprint
        self._bpb = heads.per_rank.layout.bytes_per_block
        self._per = heads.heads_per_rank
        self._mu = threading.Lock()
        # per-rank key -> its puts not ended, in order: the first is in the G4 pool, at most one waits for it
        self._inflight: dict[BlockKey, deque[tuple[list[BlockKey], list[np.ndarray], Future[PutResult]]]] = {}
        cfg = getattr(inner, "cfg", None)  # a G4Pool's G4Config: its write queue bound, in parts (None: unbounded)
        self._queue_parts: int | None = getattr(cfg, "write_queue_blocks", None)
        self._held = 0  # parts of the puts in _inflight (in the G4 pool or waiting), under _mu

    @property
    def layout(self) -> KvLayout:
        return self.namespace.layout

    def _own(self, keys: Sequence[BlockKey]) -> int:
        """Length of the leading run of ``keys`` of this pool's namespace (a foreign key ends a prefix)."""
        for i, k in enumerate(keys):
            if k.namespace != self._fp:
                return i
        return len(keys)

    def lookup_prefix(self, keys: Sequence[BlockKey], *, request: bool = True) -> Future[int]:
        """Leading ``keys`` whose parts (the key rank's heads) are all present: the minimum of the
        parts' prefixes. A :class:`KeyRun` is probed as one run per head (no per-key objects); only the
        first head's probe counts as the request's lookup (``request``: see :class:`BlockPool`)."""
        if isinstance(keys, KeyRun):
            if keys.namespace != self._fp or not len(keys):
                return completed(0)
            runs: list[Any] = self.heads.part_runs(keys)  # KeyRuns, or lists of BlockKeys below
        else:
            keys = list(keys)[:self._own(keys)]
            if not keys:
                return completed(0)
            heads = sorted({h for r in {k.rank for k in keys} for h in self.heads.heads(r)})
            fp = self.heads.canonical.fingerprint
            runs = [[BlockKey(fp, k.tenant, h, k.seq_hash) for k in keys] for h in heads]
        return _all_of([self.inner.lookup_prefix(r, request=request and i == 0) for i, r in enumerate(runs)], min)

    def count_lookup(self, requested: int, found: int) -> None:
        """Counted as the first head's probe of a lookup is (:meth:`BlockPool.count_lookup`)."""
        self.inner.count_lookup(requested, found)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray]) -> Future[PutResult]:
        """Store each block as its rank's head parts (split now; the caller keeps ``blocks`` until the future
        is done: a one-head part is a view of its block). The result counts blocks, each by its parts' outcomes
        (one inner put per block): dropped if any part was dropped, skipped if every part was already stored
        (or the rank is a non-writing replica), else written. A block whose earlier put through this pool has
        not ended yet is handed to the G4 pool when that put ends (module doc): a block is counted written
        by one put, never by two. A block whose parts do not fit in ``g4.write_queue_blocks`` beside the parts of
        this pool's puts not ended (waiting ones included) is dropped (``dropped_queue_full``). Raises ValueError
        for mismatched lengths, a wrong-sized buffer or a key of another namespace (caller bugs, as G4Pool)."""
        keys, blocks = list(keys), list(blocks)
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        parts: list[tuple[BlockKey, list[BlockKey], list[np.ndarray]]] = []
        skipped = 0
        for k, b in zip(keys, blocks):
            if k.namespace != self._fp:
                raise ValueError(f"put: key namespace {k.namespace} is not this pool's namespace {self._fp}")
            if not self.heads.writes(k.rank):
                skipped += 1
                continue
            parts.append((k, self.heads.part_keys(k), self.heads.split(b)))
        if not parts:
            return completed(PutResult(skipped=skipped))

        def blocks_of(rs: list[PutResult]) -> PutResult:
            out = PutResult(skipped=skipped)
            for r in rs:  # one block's parts
                if r.dropped:
                    out.dropped += 1
                elif r.written:
                    out.written += 1
                else:
                    out.skipped += 1
            return out
        return _all_of([self._put_block(k, pk, pb) for k, pk, pb in parts], blocks_of)

    def _put_block(self, key: BlockKey, pkeys: list[BlockKey], pblocks: list[np.ndarray]) -> Future[PutResult]:
        """One block's inner put: now, or when the put of ``key`` in flight through this pool has ended (one at a
        time per key: the parts of two puts of one block are never in flight together). At most one put of a key
        waits: a put arriving while one waits is skipped at once (the waiting one stores the block, or drops it and
        a later save tries again), so a hot prefix re-saved during a slow store holds two copies, not one per save.
        Either put's parts count against ``g4.write_queue_blocks`` until it ends: past it the block is dropped at
        once (``dropped_queue_full``, its parts counted in the G4 pool's counters), waiting or not."""
        out: Future[PutResult] = Future()
        n = len(pkeys)
        with self._mu:
            queue = self._inflight.get(key)
            if queue is not None and len(queue) >= 2:  # one in flight and one waiting: that one stores the block
                out.set_result(PutResult(skipped=n))  # (or drops it, and a later save tries again)
                return out
            full = self._queue_parts is not None and self._held + n > self._queue_parts
            if not full:
                self._held += n
                if queue is not None:  # a put of the block is in flight: this one waits behind it
                    queue.append((pkeys, pblocks, out))
                    return out
                self._inflight[key] = deque([(pkeys, pblocks, out)])
        if full:  # the queue holds g4.write_queue_blocks parts already (the G4 writer's reason and unit)
            counters = getattr(self.inner, "counters", None)
            if counters is not None:
                counters.count("dropped_queue_full", n)
            out.set_result(PutResult(dropped=n))
            return out
        self._issue(key, pkeys, pblocks, out)
        return out

    def _issue(self, key: BlockKey, pkeys: list[BlockKey], pblocks: list[np.ndarray], out: Future[PutResult]) -> None:
        """Hand ``key``'s put to the G4 pool, then each put queued behind it as the one before ends. A put the pool
        answers at once (closed, breaker open, queue full: a done future) ends here and the next goes in this
        loop: before 2026-12 each was a nested callback, and a long queue hit the recursion limit part way (the
        rest never ended, a caller got RecursionError)."""
        while True:
            try:
                fut = self.inner.put(pkeys, pblocks)
            except Exception as e:  # noqa: BLE001 - handed to the caller (put validated the sizes already)
                fut = Future()
                fut.set_exception(e)
            if not fut.done():
                fut.add_done_callback(functools.partial(self._ended_async, key, out=out))
                return
            nxt = self._ended(key, fut, out)
            if nxt is None:
                return
            pkeys, pblocks, out = nxt

    def _ended_async(self, key: BlockKey, f: Future[PutResult], out: Future[PutResult]) -> None:
        nxt = self._ended(key, f, out)
        if nxt is not None:
            self._issue(key, *nxt)

    def _ended(self, key: BlockKey, f: Future[PutResult],
               out: Future[PutResult]) -> tuple[list[BlockKey], list[np.ndarray], Future[PutResult]] | None:
        """``key``'s put in flight ended as ``f``: resolve its caller's ``out``, then the next put queued behind it
        (to issue), or None (the key is no longer in flight). Its parts leave the queue bound before ``out``
        resolves, so a caller putting again from its callback finds the room (the G4 writer's count is down too)."""
        with self._mu:
            self._held -= len(self._inflight[key][0][0])
        _copy(f, out)  # first: flush, seeing the key gone, finds every put of it done
        with self._mu:
            queue = self._inflight[key]
            queue.popleft()
            if queue:
                return queue[0]
            del self._inflight[key]
            return None

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any] | Any) -> Future[GetResult]:
        """Read the parts of each key's rank heads into host buffers and assemble block ``i`` into
        ``out[i]`` (numpy host buffers, or torch tensors on one device: one copy each) only when all its
        parts verified; ``ok[i]`` False otherwise (``out[i]`` untouched). Raises ValueError for mismatched
        lengths or a wrong-sized buffer."""
        keys, out = list(keys), list(out)
        if len(keys) != len(out):
            raise ValueError(f"get: {len(keys)} keys but {len(out)} buffers")
        for o in out:
            if o.nbytes != self._bpb:
                raise ValueError(f"get: out buffer of {o.nbytes} bytes, layout needs {self._bpb}")
        own = self._own(keys)
        if not own:
            return completed(GetResult([False] * len(keys)))
        pkeys = [pk for k in keys[:own] for pk in self.heads.part_keys(k)]
        pbufs = [np.empty(self.heads.part_bytes, np.uint8) for _ in pkeys]
        tensors = is_tensor_batch(out)

        def assemble(rs: list[GetResult]) -> GetResult:
            pok = list(rs[0].ok)
            ok = [False] * len(keys)
            late = [False] * len(keys)  # a part timed out: the block may be stored (GetResult.timed_out)
            for i in range(own):
                sl = slice(i * self._per, (i + 1) * self._per)
                if len(pok) < sl.stop or not all(pok[sl]):
                    late[i] = any(rs[0].timed_out_at(j) for j in range(sl.start, sl.stop))
                    continue
                if tensors:
                    import torch
                    host = np.empty(self._bpb, np.uint8)
                    self.heads.join(pbufs[sl], host)
                    out[i].view(-1).copy_(torch.from_numpy(host))
                else:
                    self.heads.join(pbufs[sl], out[i].reshape(-1))
                ok[i] = True
            return GetResult(ok, late)
        return _all_of([self.inner.get(pkeys, pbufs)], assemble)

    def delete(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Remove the parts of each key's rank heads; the future gives the parts removed divided by parts
        per block (rounded down)."""
        keys = list(keys)[:self._own(keys)]
        parts = [pk for k in keys for pk in self.heads.part_keys(k)]
        if not parts:
            return completed(0)
        return _all_of([self.inner.delete(parts)], lambda rs: rs[0] // self._per)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every put made so far ended (those waiting for an earlier put of their block too),
        then for the G4 pool's :meth:`flush` (seconds in all; None: no bound). False if the time ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._mu:
            pending = [q[-1][2] for q in self._inflight.values()]  # a key's last put ends after its others
        if futures_wait(pending, timeout).not_done:
            return False
        return self.inner.flush(None if end is None else max(0.0, end - time.monotonic()))

    def stats(self) -> dict[str, Any]:
        """The G4 pool's counters (counted in parts; ``namespace`` is the canonical fingerprint, what the
        store holds) plus ``g4_layout`` and ``parts_per_block``; ``pending_put_blocks`` (parts) counts the puts
        waiting behind an earlier put of their block too (they hold their parts: module doc)."""
        s = dict(self.inner.stats())
        with self._mu:
            waiting = sum(len(q[1][0]) for q in self._inflight.values() if len(q) > 1)
        if "pending_put_blocks" in s:
            s["pending_put_blocks"] += waiting
        s.update(g4_layout=self.heads.canonical.layout_id, parts_per_block=self._per,
                 per_rank_namespace=self._fp)
        return s

    def close(self, timeout: float | None = None) -> None:
        """Wait, at most ``timeout`` seconds in all (None: the G4 pool's close bound, ``2 * g4.timeout_s``), for
        every put made so far (those waiting behind an earlier put of their block too: module doc), then close
        the G4 pool (it drops what is still queued, ``dropped_closed``; a put still waiting here ends so once
        the put ahead of it ends)."""
        if timeout is None:
            cfg = getattr(self.inner, "cfg", None)
            timeout = 2 * cfg.timeout_s if cfg is not None else None
        end = Deadline(timeout)
        self.flush(timeout)
        left = end.left()
        if left is None:  # not a G4Pool (no bound of its own to pass)
            self.inner.close()
        else:
            closer: Callable[..., None] = self.inner.close  # a G4Pool: close(timeout)
            closer(left)

    def __getattr__(self, name: str) -> Any:
        # everything else a caller may read of a G4 pool (breaker, store, where, object_name, ...)
        if name in ("inner", "heads"):
            raise AttributeError(name)
        return getattr(self.inner, name)
