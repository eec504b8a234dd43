"""Offloads of the worker role: engine blocks staged in ``wait_for_save``, handed to G3 / G4 off the
forward path (a part :class:`~.worker_side.WorkerSide` owns).

Staging (vLLM's thread, :meth:`Offloads.save`): the blocks a :class:`~.metadata.SaveJob` names are gathered
from the engine's paged tensors into one host staging buffer, bounded by ``max_pending_save_bytes``: the
job's leading blocks that fit under it are staged, the rest are dropped and counted (``save_dropped_blocks``,
``save_dropped_full_blocks``: docs/invariants.md #3). The leading ones, because a prefix's blocks are found
only as a prefix; and a job is one request's blocks of one step, so a long prefill chunk (a 4,096-token
chunk of a 256 KiB/token model is the whole default bound) would otherwise never be offloaded. A staging
that fails (a transient ``torch.OutOfMemoryError`` of the device buffer, pinned memory exhausted) drops its
blocks too, counted (``save_dropped_error_blocks``) and logged at most once a minute: an offload never
fails the engine's step. Engine block ids out of range are a caller's bug, raised (IndexError) before
anything is staged.

Under vLLM's ``external_launcher`` with TP > 1 the bound would decide per rank (each rank's earlier puts end at
their own pace), so one rank could stage a block slice another drops: stored on some ranks only, never a hit. There
the room is agreed once per step with the load results (:class:`.tp_agree.TpLoadAgree`): every rank stages within
the least room any rank had (:func:`set_staging_budgets`), so every rank keeps and drops the same blocks (a G4-only
job that one rank writes alone, MLA's, is charged on every rank; closed workers offer no room).

On a CUDA engine nothing here waits for the GPU. The gather (``index_select`` into a device buffer), the
device checksums (:func:`~kvbm_backend.gpu.checksum.device_limb_sums`) and both copies into pinned host
memory are queued on the **current stream**, behind the forward that wrote the KV, and an event is
recorded after them. The blocks thus leave the engine in stream order, before any later kernel on that
stream can overwrite them (vLLM's forward writes the KV on its current stream). The ``kvbm-save`` thread
waits for the event, then hands the blocks to the pools. Before, ``wait_for_save`` fetched the checksums
(``.cpu()``) and copied into pageable memory: vLLM's thread waited there until the step's forward had
finished on the GPU, which under async scheduling stalls the next step's CPU work (invariant #3, never
stall decode).

On the CPU engine the gather is a memory copy, done at once, and the hand-off runs inline; ``defer`` sends
it through the same thread (what a CUDA engine does; tests set it on the CPU). :meth:`Offloads.flush`
waits for the hand-offs queued so far: after it, the pools' ``flush`` covers every save made before.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from ...gpu.checksum import combine_limb_sums, device_limb_sums
from ...gpu.layer_copy import check_ids
from ...memory import BufferPool
from ...model.namespace import BlockKey, Namespace
from ...pool.base import BlockPool, PutResult
from ..revoked_tenants import RevokedTenants
from . import stats
from .kv_io import EngineKv, numpy_staging, split_blocks
from ...log_limits import LimitedLog
from .metadata import SaveJob
from ...threads import executor

log = logging.getLogger("kvbm_backend.connector")
#: failed stagings / hand-offs: one WARNING per kind per minute, not one per step (:mod:`kvbm_backend.log_limits`)
LOG = LimitedLog(log)

#: bytes of free save staging buffers kept for reuse (at most ``max_pending_save_bytes``). Reuse skips the
#: page faults of a fresh buffer in the gather copy: measured on the 2-core dev VM, copying into a fresh
#: aligned buffer vs one taken again from the pool: 256 KiB 1.07 vs 0.15 ms, 2 MiB 0.57 vs 0.37 ms,
#: 16 MiB 8.3 vs 5.6 ms. A CUDA engine's are pinned (torch's caching host allocator), so the copy is a DMA.
SAVE_STAGING_KEEP_BYTES = 64 << 20


@dataclass
class _Staged:
    """Blocks staged for the pools: ``n`` blocks in host ``arr`` (``keep`` holds the memory: ``arr`` or the
    tensor under it); ``nbytes`` of :attr:`Offloads.pending_bytes` they hold; their keys (or the save job
    that names them); ``sums``: host int64 ``[n, 4]`` device-checksum limb sums (or None); ``ready``: the CUDA
    event after the copies (None: the bytes are there now); where they go."""
    n: int
    nbytes: int
    arr: np.ndarray
    keep: Any
    sums: torch.Tensor | None
    ready: Any
    job: SaveJob | None = None
    keys: list[BlockKey] | None = None
    g4: bool = True
    promote: bool = False
    recycle: bool = True


_LIVE: "weakref.WeakSet[Offloads]" = weakref.WeakSet()  # this process's, for flush_all


def flush_all(timeout: float | None = None) -> bool:
    """:meth:`Offloads.flush` of every worker in this process (``timeout`` seconds each): what a caller
    that flushes the pools runs first (``engine_run`` before it reads their stats). False if one timed out."""
    return all([o.flush(timeout) for o in list(_LIVE)])


def staging_rooms() -> dict[str, int]:
    """This process's save staging room (bytes, ``max_pending_save_bytes`` less what saves not yet written hold) per
    namespace fingerprint (a KV cache group's; the least of the workers with that fingerprint): what one TP rank
    offers :func:`set_staging_budgets` of every rank (:class:`.tp_agree.TpLoadAgree`, ``external_launcher``). A closed
    worker's is not (before 2026-12-03 one not yet garbage-collected shrank every rank's budget by its bound and the
    bytes its last puts held)."""
    out: dict[str, int] = {}
    for o in list(_LIVE):
        if o.closed:
            continue
        with o._lock:
            room = max(0, o.max_pending_bytes - o.pending_bytes)
        out[o.ns.fingerprint] = min(out.get(o.ns.fingerprint, room), room)
    return out


def set_staging_budgets(rooms: dict[str, int]) -> None:
    """Every TP rank's least staging room per namespace fingerprint (bytes; :func:`staging_rooms`, agreed): until
    the next call, this process's workers of that fingerprint stage at most that many bytes (:attr:`Offloads.budget`).
    Every rank then stages the same blocks of the same save jobs, whichever rank's earlier puts are still being
    written; each rank's own bound still holds (its room is at least the budget: only its staging, which the budget
    counts too, takes room)."""
    for o in list(_LIVE):
        if o.ns.fingerprint in rooms and not o.closed:
            with o._lock:
                o.budget = max(0, int(rooms[o.ns.fingerprint]))


CLOSE_LOOKUP_WAIT_S = 30.0  # close: at most this long (seconds) for G4-only saves' lookups (each has G4's own bound)


class Offloads:
    """Save staging, its bound and the hand-off to the pools for one :class:`~.worker_side.WorkerSide`.

    Args:
        namespace, rank: name the saved blocks (``namespace.keys(seq_hashes, tenant, rank)``).
        g3, g4: the pools blocks go to (either may be None).
        max_pending_bytes: staging bytes held by saves not yet written (bytes, >= 0).
        save_to_g4: offload to G4 too (a replicated block goes from the rank whose key names it).
        g3_written: called with the keys of each completed G3 put (the worker's G3 report), or None.
        revoked: the tenants G3 refuses (:class:`~kvbm_backend.integrations.revoked_tenants.RevokedTenants`): their
            blocks are not put into G3 (counted ``save_g3_revoked_blocks``); None: every tenant's are.
    """

    def __init__(self, namespace: Namespace, rank: int, g3: BlockPool | None, g4: BlockPool | None, *,
                 max_pending_bytes: int, save_to_g4: bool = True,
                 g3_written: Callable[[list[BlockKey]], None] | None = None,
                 revoked: RevokedTenants | None = None) -> None:
        self.ns, self.rank, self.g3, self.g4, self.revoked = namespace, rank, g3, g4, revoked
        self.max_pending_bytes, self.save_to_g4, self.g3_written = max_pending_bytes, save_to_g4, g3_written
        self.defer = False  # hand-offs on the kvbm-save thread (set by register on a CUDA engine)
        self.pending_bytes = 0
        self.budget: int | None = None  # bytes this step may stage, as on every TP rank (set_staging_budgets)
        self.closed = False  # close() ran: no longer one of this process's workers to the TP ranks' staging rooms
        self._lock = threading.Lock()
        self._lookups: set[Future] = set()  # G4-only saves whose put waits for their lookup (_put_missing)
        self._staging = BufferPool("host", self._keep(), name="vllm-save-staging")
        self._thread = executor(1, "kvbm-save")
        _LIVE.add(self)

    def _keep(self) -> int:
        return min(SAVE_STAGING_KEEP_BYTES, max(0, self.max_pending_bytes))

    def register(self, kv: EngineKv) -> None:
        """A CUDA engine's saves stage into pinned memory and are handed off on the ``kvbm-save`` thread."""
        if kv.device.type == "cuda":
            self._staging = BufferPool("pinned", self._keep(), name="vllm-save-staging")
            self.defer = True

    # ---- staging (vLLM's thread) ------------------------------------------------------------------
    def save(self, job: SaveJob, kv: EngineKv, dev_checks: bool) -> None:
        """Stage ``job``'s blocks (``dev_checks``: with their device checksums) and hand them to the pools,
        now or on the ``kvbm-save`` thread (:attr:`defer`); never waits for the GPU. Only the job's leading
        blocks that fit under ``max_pending_bytes`` are staged (a ``g4_only`` handoff job: under half the room
        left, :meth:`.worker_side.WorkerSide.save` stages it after the step's computed blocks); the rest, and
        every block of a staging that fails, are dropped and counted (never raised: an offload does not fail
        the engine's step). A ``g4_only`` job on a rank that does not write G4 (MLA: another rank's key names the
        block) stages nothing, but its share of the TP ranks' agreed budget (:attr:`budget`) is charged as on the
        rank that writes it, so every rank enters the step's next job with the same budget (before 2026-12-03 it was
        not: the next computed job's blocks were staged on one rank and dropped on another).

        Raises:
            IndexError: an engine block id outside the engine's blocks (a caller's bug; nothing staged).
        """
        n = len(job.block_ids)
        # A replicated block (MLA) goes to G4 once, from the rank whose key names it.
        g4 = self.save_to_g4 and self.ns.shared_rank(self.rank) == self.rank
        skip = job.g4_only and (not g4 or self.g4 is None)  # not written here (another rank's, or no G4)
        if n == 0 or (skip and self.budget is None):
            return
        if not skip:
            check_ids(job.block_ids, kv.num_blocks)
        bpb = kv.layout.bytes_per_block
        with self._lock:
            room = max(0, self.max_pending_bytes - self.pending_bytes)
            if self.budget is not None:  # external_launcher TP > 1: the ranks' least room (set_staging_budgets)
                room = min(room, self.budget)
            # a handoff job's blocks (not computed here; G4 is asked which it lacks only once they are staged)
            # take at most half the room left: the next steps' computed blocks, which G4 lacks, keep the rest
            fit = min(n, (room // 2 if job.g4_only else room) // bpb)
            if self.budget is not None:  # charged on every rank alike, whether or not this one writes the job
                self.budget -= fit * bpb
            if skip:
                return
            self.pending_bytes += fit * bpb
        if fit < n:
            if job.g4_only:  # blocks G4 may hold already: not the staging-full drops of computed blocks
                stats.add(save_dropped_blocks=n - fit, handoff_g4_dropped_blocks=n - fit)
            else:
                stats.add(save_dropped_blocks=n - fit, save_dropped_full_blocks=n - fit)
            if fit == 0:
                return
            job = replace(job, block_ids=job.block_ids[:fit], seq_hashes=job.seq_hashes[:fit],
                          digests=job.digests[:16 * fit])
        n, nbytes = fit, fit * bpb
        t0 = time.perf_counter()
        try:
            if kv.device.type == "cuda":
                dev = torch.empty(nbytes, dtype=torch.uint8, device=kv.device)
                kv.gather(job.block_ids, dev)
                arr, sums, ready = self._stage_device(dev.view(n, bpb), dev_checks)
            else:
                arr, host = numpy_staging(nbytes, self._staging)
                kv.gather(job.block_ids, host)
                sums = device_limb_sums(host.view(n, bpb), 0, bpb) if dev_checks else None
                ready = None
        except Exception as e:  # noqa: BLE001 - a failed offload is a dropped offload, never the engine's error
            self._release(nbytes)
            stats.add(save_dropped_blocks=n, save_dropped_error_blocks=n)
            LOG.warning("save_staging", "kvbm_backend: save of %d blocks dropped: staging failed: %s: %s",
                        n, type(e).__name__, e)
            return
        except BaseException:
            self._release(nbytes)
            raise
        stats.add(save_jobs=1, save_blocks=n, save_gather_s=time.perf_counter() - t0)
        self._submit(_Staged(n, nbytes, arr, arr, sums, ready, job=job, g4=g4))

    def promote(self, keys: list[BlockKey], rows: torch.Tensor, dev_checks: bool) -> None:
        """Put blocks loaded from G4 into G3 past its admission filter (a block asked for again is a repeat
        sighting). ``rows``: their verified staging rows, uint8 ``[m, bytes_per_block]`` on the engine's
        device; on CUDA copied to pinned staging on the current stream (never waited for here), on the CPU
        read in place (the caller must not reuse them). Not counted against ``max_pending_save_bytes``."""
        m, bpb = int(rows.shape[0]), int(rows.shape[1])
        keep: Any
        if rows.device.type == "cuda":
            arr, sums, ready = self._stage_device(rows, dev_checks)
            keep, recycle = arr, True
        else:
            arr, keep, recycle, ready = rows.numpy().reshape(-1), rows, False, None
            sums = device_limb_sums(rows, 0, bpb) if dev_checks else None
        stats.add(promote_blocks=m)
        self._submit(_Staged(m, 0, arr, keep, sums, ready, keys=keys, g4=False, promote=True, recycle=recycle))

    def _stage_device(self, rows: torch.Tensor, dev_checks: bool) -> tuple[np.ndarray, torch.Tensor | None, Any]:
        """Queue on the current stream the copy of device ``rows`` (``[n, bytes]``) into pinned staging and,
        with ``dev_checks``, their device checksums' limb sums into pinned memory; record an event after them.
        Returns (staging as numpy, sums, event); nothing here waits for the device."""
        n, bpb = int(rows.shape[0]), int(rows.shape[1])
        arr, host = numpy_staging(n * bpb, self._staging)
        sums = None
        if dev_checks:
            d = device_limb_sums(rows, 0, bpb)
            sums = torch.empty(d.shape, dtype=d.dtype, pin_memory=True)
            sums.copy_(d, non_blocking=True)
        host.copy_(rows.reshape(-1), non_blocking=True)  # pinned: a DMA queued behind the gather / the load
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(rows.device))
        return arr, sums, ready

    def _submit(self, staged: _Staged) -> None:
        """Hand ``staged`` off now, or queue it on the ``kvbm-save`` thread (:attr:`defer`)."""
        if not self.defer:
            self._hand_off(staged)
            return
        try:
            self._thread.submit(self._hand_off, staged)
        except RuntimeError:  # closed (the connector shut down): dropped, counted
            stats.add(save_dropped_blocks=staged.n, save_dropped_closed_blocks=staged.n)
            self._release(staged.nbytes)

    def _hand_off(self, s: _Staged) -> None:
        """Wait for the staged bytes (their event), then put them into the pools."""
        try:
            if s.ready is not None:
                s.ready.synchronize()
            checks = None if s.sums is None else [int(x) for x in combine_limb_sums(s.sums.numpy())]
            keys = s.keys
            if keys is None:
                assert s.job is not None  # a save names its blocks by its job
                keys = self.ns.keys(s.job.seq_hashes, s.job.tenant, self.rank, s.job.digests or None)
            blocks = split_blocks(s.arr, self.ns.layout, s.n)
        except Exception as e:  # noqa: BLE001 - a failed offload is a dropped offload
            LOG.warning("hand_off", "kvbm_backend: %s of %d blocks dropped: %s: %s",
                        "promotion" if s.promote else "save", s.n, type(e).__name__, e)
            stats.add(save_dropped_blocks=s.n, save_dropped_error_blocks=s.n)
            self._release(s.nbytes)
            return
        g4_only = s.job is not None and s.job.g4_only
        self.put_all(keys, blocks, s.keep, s.nbytes, g3=not g4_only, g4=s.g4, dev_checks=checks, promote=s.promote,
                     recycle=s.recycle, g4_missing_only=g4_only)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.pending_bytes -= nbytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save staged so far was handed to the pools (seconds; None: no bound), G4-only saves
        past their lookup (:meth:`_put_missing`). Returns False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            self._thread.submit(lambda: None).result(timeout)  # one thread: it runs after those queued before
        except FutureTimeout:
            return False
        except RuntimeError:  # closed: every hand-off already ran
            pass
        with self._lock:
            pending = list(self._lookups)
        left = None if end is None else max(0.0, end - time.monotonic())
        return not futures_wait(pending, left).not_done

    def close(self) -> None:
        """Hand off the saves staged so far (G4-only ones past their lookup), then stop the thread. Idempotent."""
        self.closed = True
        self._thread.shutdown(wait=True)
        with self._lock:
            pending = list(self._lookups)
        futures_wait(pending, CLOSE_LOOKUP_WAIT_S)

    # ---- hand-off ---------------------------------------------------------------------------------
    def g4_keys(self, keys: list) -> list:
        """``keys`` as named in G4 (:meth:`Namespace.shared_rank`)."""
        r = self.ns.shared_rank(self.rank)
        return keys if r == self.rank else [k._replace(rank=r) for k in keys]

    def put_all(self, keys, blocks, arr, nbytes: int, g3: bool = True, g4: bool = True,
                dev_checks: list | None = None, promote: bool = False, recycle: bool = False,
                g4_missing_only: bool = False) -> None:
        """Hand ``blocks`` (views of ``arr``) to the pools; ``nbytes`` of :attr:`pending_bytes` are released
        when every put completed. ``g4_missing_only``: G4 is asked first which leading blocks it holds
        (:meth:`_put_missing`), and only the others are put. ``recycle``: ``arr`` came from the save staging and goes back to it when
        every put completed without an error (after an error a pool may still read it: it is then left to
        the garbage collector, never reused)."""
        futs: list[tuple[str, Future]] = []
        if g3 and self.g3 is not None:
            kw: dict[str, Any] = {}
            if dev_checks is not None:
                kw["dev_checks"] = dev_checks
            if promote:
                kw["bypass_admission"] = True
            put3 = partial(self._safe_put, self.g3, keys, blocks, **kw)
            f3 = put3() if self.revoked is None or not keys else self.revoked.put_g3(keys[0].tenant, put3, len(keys))
            if f3 is not None:
                futs.append(("g3", f3))
        if g4 and self.g4 is not None:
            put = self._put_missing if g4_missing_only else self._safe_put
            futs.append(("g4", put(self.g4, self.g4_keys(keys), blocks)))
        if not futs:
            self._release(nbytes)
            if recycle:
                self._staging.give(arr)
            return
        remaining = [len(futs)]
        failed = [False]
        rlock = threading.Lock()

        def done(tier: str, f: Future, _arr=arr) -> None:  # _arr keeps the staging alive
            try:
                r: PutResult = f.result()
                if tier == "g3" and self.g3_written is not None:
                    self.g3_written(keys)
                stats.add(**{f"{tier}_put_written_blocks": r.written, f"{tier}_put_skipped_blocks": r.skipped,
                             f"{tier}_put_dropped_blocks": r.dropped,
                             f"{tier}_put_written_bytes": r.written * self.ns.layout.bytes_per_block})
            except Exception as e:  # noqa: BLE001 - a failed offload is a dropped offload
                log.warning("kvbm_backend: %s put failed: %s", tier, e)
                stats.add(**{f"{tier}_put_errors": 1, f"{tier}_put_dropped_blocks": len(keys)})
                failed[0] = True
            with rlock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._release(nbytes)
                if recycle and not failed[0]:
                    self._staging.give(_arr)

        for tier, f in futs:
            f.add_done_callback(partial(done, tier))

    def _put_missing(self, pool: BlockPool, keys, blocks) -> Future:
        """Put the blocks from the first one ``pool`` lacks on (one ``lookup_prefix``, not counted as a request's
        lookup; blocks chain, so a prefix is what a reader loads). The ones it holds count as skipped; a lookup
        that fails puts them all (the pool skips those it holds). The put is handed to the pool when the lookup
        ends (on its thread, never the engine's): :meth:`flush` waits for that hand-off."""
        out: Future = Future()
        handed: Future = Future()
        with self._lock:
            self._lookups.add(handed)
        handed.add_done_callback(self._lookup_ended)
        try:
            look = pool.lookup_prefix(keys, request=False)
        except Exception:  # noqa: BLE001 - unknown: put them all
            look = Future()
            look.set_result(0)

        def after(f: Future) -> None:
            try:
                k = min(max(int(f.result()), 0), len(keys))
            except Exception:  # noqa: BLE001 - unknown: put them all
                k = 0
            if k == len(keys):
                handed.set_result(None)
                out.set_result(PutResult(skipped=k))
                return

            def done(p: Future) -> None:
                try:
                    r = p.result()
                    out.set_result(PutResult(r.written, r.skipped + k, r.dropped))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    out.set_exception(e)
            put = self._safe_put(pool, keys[k:], blocks[k:])
            handed.set_result(None)
            put.add_done_callback(done)
        look.add_done_callback(after)
        return out

    def _lookup_ended(self, f: Future) -> None:
        with self._lock:
            self._lookups.discard(f)

    @staticmethod
    def _safe_put(pool: BlockPool, keys, blocks, **kw) -> Future:
        try:
            return pool.put(keys, blocks, **kw)
        except Exception as e:  # noqa: BLE001 - storage trouble never reaches the engine
            f: Future = Future()
            f.set_exception(e)
            return f
