"""Worker role of the connector: gather computed blocks for saves, load + verify + scatter for loads.

Saves (:mod:`.offloads`): in ``wait_for_save`` (after the step's forward wrote its KV) the blocks named by
the step's :class:`SaveJob` s are staged into host memory (bounded by ``max_pending_save_bytes``; over it
new saves are dropped and counted, docs/invariants.md #3) and handed to ``G3.put`` and ``G4.put``, which
return at once; storage never runs on the forward path, and on a CUDA engine the staging copies are queued
on the stream, never waited for on vLLM's thread.

Loads: ``start_load_kv`` runs, on a background thread, ``G3.get`` / ``G4.get`` with the rows of one
staging tensor on the engine's KV device as destinations: the pools' seam for device loads
(:mod:`kvbm_backend.pool.base`). The same code runs on a CUDA engine (G3: slots read into HBM with
kvikio/GDS or a pinned bounce and verified on the GPU; G4: decrypted on the host, one H2D copy) and on
the CPU engine (the same device reader in host mode), so the CPU tests exercise the GPU wiring. A block
counts as loaded only when the pool verified it (``GetResult.ok``); the verified prefix is scattered
into the engine blocks, and every block from the first failure on is reported by
``get_block_ids_with_load_errors`` so vLLM recomputes it (never wrong KV). A load still running after
``load_timeout_s`` is reported finished with all its unscattered blocks failed; its late bytes land
only in the abandoned staging buffer. A load past its deadline (or already reported finished) issues no
further pool reads. A load whose first failed block ran out of time (the load's deadline, or the pool's own
bound: ``GetResult.timed_out``) is a timeout (``FailedLoad`` reason ``timeout``, counted ``load_timeouts``),
not a miss: the scheduler does not cool the block, and a G3 block is reported removed to the scheduler's
mirror only when the pool's index no longer holds it. A G3 block whose read failed otherwise (absent, corrupt, a
read error) is a miss, and one G3 still holds is deleted (:meth:`WorkerSide.drop_unreadable`) when a fresh re-read
of its slot proves its bytes bad, or once it stayed unreadable over several failed loads and minutes
(``G3Pool.drop_unreadable``: a read error keeps a good block, docs/invariants.md #1), so the recompute's save
stores it again. Blocks loaded from G4 are promoted into G3 (``promote_to_g3``;
staged by :mod:`.offloads` as saves are, so a CUDA engine's load thread never waits for the device there),
past G3's admission filter: a block asked for again is by definition a repeat sighting.

Frames written for device loads carry the device-verifiable checksum (``device_checksum``: ``auto`` =
on a CUDA engine, computed on the GPU where the blocks were gathered).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch

from ...gpu.rows import device_index
from ...memory import BufferPool
from ...model.namespace import Namespace
from ...pool.base import BlockPool, G3Extensions, GetResult, require_g3_extensions
from ...deadlines import Deadline
from .. import load_priority
from . import stats
from ..revoked_tenants import RevokedTenants
from .failed_blocks import drop_blocks
from .g3_report import ReportedBlocks
from .kv_io import EngineKv, numpy_staging
from .offloads import Offloads
from .metadata import FailedLoad, KvbmWorkerMeta, LoadJob, SaveJob, mirror_id
from .tier_removals import index_keys
from ...threads import executor

log = logging.getLogger("kvbm_backend.connector")

#: bytes of free load staging buffers a CPU engine's worker keeps for reuse (a CUDA engine's staging is HBM
#: from torch's caching allocator, reused without faults). Sizes are rounded up to a power of two blocks so
#: loads of different lengths share buffers. Measured on the 2-core dev VM, 512 Llama-3.1-8B blocks (1 GiB)
#: from a tmpfs G3 through :class:`WorkerSide`: a fresh staging tensor per load faulted 262,144 pages
#: (1 GiB of 4 KiB pages) per load.
LOAD_STAGING_KEEP_BYTES = 1 << 30


@dataclass
class _Load:
    job: LoadJob
    deadline: Deadline
    state: str = "pending"           # pending -> done | timed_out
    ok_prefix: int = 0               # blocks scattered into the engine
    lock: threading.Lock = field(default_factory=threading.Lock)
    t0: float = field(default_factory=time.monotonic)


class G3WorkerPool(G3Extensions, BlockPool, Protocol):
    """A G3 pool as the worker uses it: a :class:`BlockPool` with the :class:`G3Extensions`."""


class WorkerSide:
    """State of the worker-role connector for one KV cache group (one per group and worker / TP rank; the
    connector drives them through :class:`~.workers.GroupedWorkers`).

    ``g3`` must satisfy :class:`~kvbm_backend.pool.base.G3Extensions` (a G3 pool; else TypeError naming it).
    ``revoked``: the tenants G3 refuses (revoked in G4's keyring: :mod:`kvbm_backend.integrations.revoked_tenants`):
    their G3 blocks are neither loaded (a miss, counted ``load_g3_revoked_blocks``) nor stored; None: no keyring.
    """

    def __init__(self, namespace: Namespace, rank: int, g3: BlockPool | None, g4: BlockPool | None, *,
                 load_timeout_s: float = 5.0, promote_to_g3: bool = True,
                 max_pending_save_bytes: int = 1 << 30, save_to_g4: bool = True, report_g3: bool = False,
                 device_checksum: str = "auto", revoked: RevokedTenants | None = None):
        if device_checksum not in ("auto", "on", "off"):
            raise ValueError(f"device_checksum: expected auto, on or off, got {device_checksum!r}")
        self.ns, self.rank, self.g4 = namespace, rank, g4
        # a BlockPool (the argument) that require_g3_extensions found to have the G3 extensions too
        self.g3 = cast("G3WorkerPool | None", require_g3_extensions(g3, "g3"))
        self.device_checksum = device_checksum
        self.load_timeout_s = load_timeout_s
        self.promote_to_g3 = promote_to_g3
        self.save_to_g4 = save_to_g4
        self.max_pending_save_bytes = max_pending_save_bytes
        self.kv: EngineKv | None = None
        self._loads: dict[str, _Load] = {}
        self._finished_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load had a failed block (hybrid: failed_recving)
        self._failed_loads: list[FailedLoad] = []  # reported to the scheduler with the next worker_meta
        self._lock = threading.Lock()
        self._exec = executor(2, "kvbm-load")
        # host staging of a CPU engine's loads (LOAD_STAGING_KEEP_BYTES), given back after the scatter
        self._load_staging = BufferPool("host", LOAD_STAGING_KEEP_BYTES, name="vllm-load-staging")
        # report_g3: the scheduler runs in another process and mirrors our G3 index (KvbmWorkerMeta)
        self.report_g3 = report_g3 and g3 is not None
        self.revoked = revoked
        self.offloads = Offloads(namespace, rank, g3, g4, max_pending_bytes=max_pending_save_bytes,
                                 save_to_g4=save_to_g4, g3_written=self._g3_written if self.report_g3 else None,
                                 revoked=revoked)
        self._snapshot_sent = False
        self._added: list[tuple[bytes, int, int]] = []  # (tenant tag, rank, seq_hash): see KvbmWorkerMeta
        self._removed: list[tuple[bytes, int, int]] = []
        self._written: list = []  # keys of completed G3 puts, checked against the index at the next report
        # what the scheduler was told is present; blocks G3 dropped by itself (evicted, corrupt) are found
        # from G3's removal log at each report, O(removals) (.g3_report)
        self._present = ReportedBlocks(g3, namespace.fingerprint) if self.report_g3 else None
        # G3 index changes go to the scheduler by report_channel (set by the connector), not with steps
        self.report_by_channel = False
        self._report_lock = threading.Lock()  # one report at a time (the channel's pump, or a step)

    # ---- registration --------------------------------------------------------------------------
    def register(self, kv: EngineKv) -> None:
        if kv.layout != self.ns.layout:
            raise ValueError(f"kv caches: engine block layout {kv.layout} differs from the namespace layout "
                             f"{self.ns.layout}")
        self.kv = kv
        self.offloads.register(kv)
        # kv.move_mode: checks the one-launch block mover against the torch ops now (one device sync), not
        # on the first save in vLLM's thread
        log.info("kvbm_backend: registered %d layers, engine layout %s, %d bytes per block, device %s, "
                 "block moves: %s", kv.layout.num_layers, kv.engine_layout, kv.layout.bytes_per_block, kv.device,
                 kv.move_mode)
        if self.g3 is not None:
            # probe the G3 -> device path now (logged once by the pool), not on the first request
            rd: Any = self.g3.device_reader(kv.device)  # has mode and mode_reason (G3Extensions)
            stats.set_info(g3_device_path=rd.mode, g3_device_path_reason=rd.mode_reason)
        log.info("kvbm_backend: device checksum on saved frames: %s (device_checksum=%s)",
                 self.dev_checks_on, self.device_checksum)

    @property
    def dev_checks_on(self) -> bool:
        """Whether saved G3 frames carry ``FLAG_DEVCHECK`` (see ``g3.device_checksum``)."""
        return self.device_checksum == "on" or (self.device_checksum == "auto" and self.on_cuda)

    @property
    def on_cuda(self) -> bool:
        return self.kv is not None and self.kv.device.type == "cuda"

    # ---- saves ----------------------------------------------------------------------------------
    def save(self, jobs: list[SaveJob]) -> None:
        """Stage ``jobs``' blocks now (queued copies; see :mod:`.offloads`), store them in the background. The
        step's computed blocks first: handoff jobs of blocks a prefill request did not compute (``g4_only``,
        which G4 may already hold) take what staging room is left (:meth:`.offloads.Offloads.save`)."""
        if not jobs or self.kv is None or (self.g3 is None and self.g4 is None):
            return
        dev_checks = self.dev_checks_on and self.g3 is not None
        for job in sorted(jobs, key=lambda j: j.g4_only):  # stable: the order of each kind is kept
            self.offloads.save(job, self.kv, dev_checks)

    def flush_saves(self, timeout: float | None = None) -> bool:
        """Wait until every save made so far was handed to the pools (:meth:`.offloads.Offloads.flush`)."""
        return self.offloads.flush(timeout)

    def _g3_written(self, keys: list) -> None:
        with self._lock:  # those G3 holds are reported added (ReportedBlocks.held, at the next report)
            self._written.extend(keys)

    # ---- loads ----------------------------------------------------------------------------------
    def start_loads(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            ld = _Load(job, Deadline(self.load_timeout_s))
            with self._lock:
                self._loads[job.req_id] = ld
            stats.add(load_jobs=1, load_blocks_requested=len(job.block_ids))
            self._exec.submit(self._run_load, ld)

    def _get(self, pool: BlockPool, keys, out, timeout: float | None) -> tuple[list[bool], list[bool], bool]:
        """``(ok, late, ended)``: per-key hits; per-key misses for lack of time (the pool's bound ran out,
        ``GetResult.timed_out``, or the load's: every key when its answer did not come within ``timeout``);
        and whether the pool's get ended (False: it failed or was late, so its reads may still land in
        ``out``)."""
        n = len(keys)
        try:
            r: GetResult = pool.get(keys, out).result(timeout=timeout)
        except FuturesTimeout:  # the load's deadline passed first: a timeout, not a miss
            log.warning("kvbm_backend: %s get of %d blocks got no answer within the load timeout", pool.tier, n)
            stats.add(load_get_errors=1)
            return [False] * n, [True] * n, False
        except Exception as e:  # noqa: BLE001 - failed read: a miss
            log.warning("kvbm_backend: %s get of %d blocks failed: %s", pool.tier, n, e)
            stats.add(load_get_errors=1)
            return [False] * n, [False] * n, False
        ok = list(r.ok)
        ok += [False] * (n - len(ok))
        return ok, [r.timed_out_at(i) and not ok[i] for i in range(n)], True

    def _take_load_staging(self, n: int, bpb: int) -> tuple[np.ndarray | None, torch.Tensor]:
        """``(buf, staging)``: ``[n, bpb]`` uint8 staging on the engine's KV device. A CPU engine's comes
        from the load staging pool (``buf``: give it back once nothing writes it; its size rounded up to a
        power of two blocks so loads of other lengths reuse it, unless that is more than the pool keeps:
        then exactly ``n`` blocks); a CUDA engine's is HBM (``buf`` None)."""
        assert self.kv is not None
        if self.kv.device.type != "cpu":
            return None, torch.empty((n, bpb), dtype=torch.uint8, device=self.kv.device)
        nbytes = (1 << (n - 1).bit_length()) * bpb
        arr, host = numpy_staging(nbytes if nbytes <= LOAD_STAGING_KEEP_BYTES else n * bpb, self._load_staging)
        return arr, host[:n * bpb].view(n, bpb)

    def _run_load(self, ld: _Load) -> None:
        with load_priority.loading():  # the GIL comes back to the reading threads sooner (load_gil_switch_ms)
            self._run_load_held(ld)

    def _late(self, ld: _Load) -> bool:
        """True when ``ld`` must issue no more reads: its deadline passed or :meth:`get_finished` already
        reported it. A pending load is marked timed out here (counted as :meth:`get_finished` counts it)."""
        with ld.lock:
            if ld.state == "pending" and ld.deadline.expired():
                ld.state = "timed_out"
                ld.ok_prefix = 0
                stats.add(load_timeouts=1, load_blocks_failed=len(ld.job.block_ids))
            return ld.state != "pending"

    def _run_load_held(self, ld: _Load) -> None:
        job, kv = ld.job, self.kv
        n = len(job.block_ids)
        ok = [False] * n
        late = [False] * n  # missed for lack of time (a tier's get timed out, or was never issued)
        try:
            assert kv is not None, "load before register_kv_caches"
            if self._late(ld):  # queued past its deadline: no read for a load nobody waits for
                return
            bpb = kv.layout.bytes_per_block
            keys = self.ns.keys(job.seq_hashes, job.tenant, self.rank, job.digests or None)
            i3 = [i for i, t in enumerate(job.tiers) if t == "G3"]
            i4 = [i for i, t in enumerate(job.tiers) if t != "G3"]
            # One staging tensor on the engine's KV device; its rows are the pools' destinations (the
            # pool seam for device loads: G3 verifies in place on the device, G4 on the host + one H2D).
            # A tier's rows go to its pool as one [m, bpb] slice when they are consecutive (they are, but for
            # a G3/G4 mix): a tensor object per block costs GIL hand-offs (kvbm_backend.gpu.rows).
            buf, staging = self._take_load_staging(n, bpb)
            g3_answered = False  # G3's get answered per block (not raised, not late): its misses are its verdicts
            for tier_idx, pool in ((i3, None if self.g3_refused(job.tenant, len(i3)) else self.g3), (i4, self.g4)):
                if not tier_idx or pool is None:
                    continue
                if self._late(ld):  # a slow tier gets no reads for a load that is over (finding 6)
                    if buf is not None:  # no read of this load is in flight: the staging is free
                        self._load_staging.give(buf)
                    return
                tkeys = [keys[i] for i in tier_idx]
                a = tier_idx[0]
                out = staging[a:a + len(tier_idx)] if tier_idx[-1] - a == len(tier_idx) - 1 else \
                    [staging[i] for i in tier_idx]
                res, res_late, ended = self._get(pool, tkeys if pool is self.g3 else self.offloads.g4_keys(tkeys),
                                                 out, ld.deadline.left())
                if not ended:
                    buf = None  # a late read may still land in the staging: never handed out again
                g3_answered = g3_answered or (ended and pool is self.g3)
                for i, good, lt in zip(tier_idx, res, res_late):
                    ok[i], late[i] = bool(good), bool(lt)
                if not all(res):
                    break  # the prefix ends here; later tiers would not be used
            prefix = 0
            while prefix < n and ok[prefix]:
                prefix += 1
            # the first block not loaded ran out of time (here or in its pool), or the load did: a timeout,
            # not a miss (FailedLoad "timeout": the block is not cooled; counted in load_timeouts)
            timed_out = prefix < n and (late[prefix] or ld.deadline.expired())
            if g3_answered and prefix < n:  # before the load ends: the recompute's save comes after the delete
                self.drop_unreadable([keys[i] for i in i3 if not ok[i] and not late[i]])
            n3 = sum(1 for i in range(prefix) if job.tiers[i] == "G3")
            promote = self.promote_to_g3 and self.g3 is not None and prefix > n3
            t0 = time.perf_counter()
            with ld.lock:
                if ld.state != "pending":
                    return  # timed out: nothing goes into the engine
                if prefix:
                    kv.scatter(staging.view(-1)[:prefix * bpb], job.block_ids[:prefix])
                ld.ok_prefix = prefix
                if buf is not None and not promote:
                    # a CPU engine's scatter is done (synchronous) and no read is in flight: the staging goes
                    # back before get_finished can report the load, so the next load (started on that report)
                    # reuses it rather than faulting in fresh pages
                    self._load_staging.give(buf)
                    buf = None
                ld.state = "timed_out" if timed_out else "done"
            if self.report_g3:
                self._report_load_misses([keys[i] for i in i3 if not ok[i] and not late[i]])
            if timed_out:
                stats.add(load_timeouts=1)
            stats.add(load_blocks_ok=prefix, load_g3_blocks_ok=n3, load_g4_blocks_ok=prefix - n3,
                      load_blocks_failed=n - prefix, load_bytes=prefix * bpb,
                      load_scatter_s=time.perf_counter() - t0, load_wall_s=time.monotonic() - ld.t0)
            if promote:
                g4rows = [i for i in range(prefix) if job.tiers[i] != "G3"]
                rows = staging[g4rows[0]:g4rows[-1] + 1] if g4rows[-1] - g4rows[0] == len(g4rows) - 1 else \
                    staging.index_select(0, device_index(g4rows, staging.device))
                # G3's put of the promoted rows reads them after this returns (CPU: in place): buf is not given back
                self.offloads.promote([keys[i] for i in g4rows], rows, self.dev_checks_on)
        except Exception as e:  # noqa: BLE001 - any failure is a miss, never wrong KV
            log.exception("kvbm_backend: load for %s failed: %s", job.req_id, e)
            stats.add(load_errors=1)
            with ld.lock:
                if ld.state == "pending":
                    ld.state = "done"
                    ld.ok_prefix = 0
                    stats.add(load_blocks_failed=n)

    def g3_refused(self, tenant: str, n: int) -> bool:
        """True when G3 must not serve ``tenant`` (revoked: ``revoked``); its ``n`` blocks are then counted
        ``load_g3_revoked_blocks`` (misses: the engine recomputes them)."""
        if n <= 0 or self.revoked is None or not self.revoked.refused(tenant):
            return False
        stats.add(load_g3_revoked_blocks=n)
        return True

    def drop_unreadable(self, missed: list) -> None:
        """Delete from G3 the blocks of ``missed`` (G3 keys whose load failed other than by a timeout) it still
        holds: a read error G3 could not prove bad keeps the slot, and before 2026-11-30 the block was offered
        again after every cool-down (:mod:`.failed_blocks`), failed again, and the recomputed block's save was
        skipped as held, for good. Deleted, the recompute's save writes it again. G3 deletes only on a proof of
        bad bytes, or once the block stayed unreadable (``G3Pool.drop_unreadable``: a block whose slot re-reads
        and verifies, or cannot be re-read for now, stays). Counted
        ``load_g3_dropped_blocks``; a failed delete is logged (the block then only cools). Never raises. Every key
        goes to G3, which skips those it does not hold: before 2026-12-02 they were filtered by ``contains``, which
        answers False for a lock busy over ~20 ms, and a block due for deletion was kept then."""
        g3p = self.g3
        if missed and g3p is not None:
            drop_blocks(g3p, missed, Deadline(self.load_timeout_s), "G3", lambda n: stats.add(load_g3_dropped_blocks=n))

    def _report_load_misses(self, missed: list) -> None:
        """G3 blocks a load missed that the pool proved gone (no longer in its index: absent, or dropped as
        corrupt, or deleted by :meth:`drop_unreadable`) are reported removed to the scheduler's mirror; a block
        missed for a timeout stays in G3 and stays reported."""
        g3p = self.g3
        if g3p is None or not missed:
            return
        # G3 cannot tell while its lock is busy (journal I/O): then none is reported (a block it dropped is in
        # its removal log, which the next reports read)
        holds = getattr(g3p, "holds", None)
        got = holds(missed) if holds is not None else [g3p.contains(k) for k in missed]
        bad = [mirror_id(k) for k, held in zip(missed, got or [True] * len(missed)) if not held]
        if bad:
            with self._lock:
                self._removed.extend(bad)

    def get_finished(self) -> set[str]:
        """Request ids whose loads are over (done, failed or timed out); their failed block ids are
        added to :meth:`load_errors` in the same call."""
        out: set[str] = set()
        with self._lock:
            items = list(self._loads.items())
        for rid, ld in items:
            with ld.lock:
                if ld.state == "pending" and ld.deadline.expired():
                    ld.state = "timed_out"
                    ld.ok_prefix = 0
                    stats.add(load_timeouts=1, load_blocks_failed=len(ld.job.block_ids))
                if ld.state == "pending":
                    continue
                failed = ld.job.block_ids[ld.ok_prefix:]
                if failed:
                    self._failed_loads.append(FailedLoad(rid, ld.job.tenant, int(ld.job.seq_hashes[ld.ok_prefix]),
                                                         "timeout" if ld.state == "timed_out" else "miss",
                                                         ld.job.digest_of(ld.ok_prefix)))
            self._load_errors.update(failed)
            if failed:
                self._failed_reqs.add(rid)
            out.add(rid)
            with self._lock:
                self._loads.pop(rid, None)
        return out

    def take_failed_loads(self) -> list[FailedLoad]:
        """Loads found failed by :meth:`get_finished` since the last call (:class:`FailedLoad`)."""
        out, self._failed_loads = self._failed_loads, []
        return out

    def worker_meta(self) -> KvbmWorkerMeta | None:
        """Failed loads (always) and G3 index changes since the last call (first call: the whole restored
        index; only when reporting: the scheduler runs in another process or publishes KV events); None
        when there is nothing to report."""
        failed = self.take_failed_loads()
        if not self.report_g3 or self.report_by_channel:
            return KvbmWorkerMeta(failed=failed) if failed else None
        meta = self._g3_report()
        if failed:
            meta = meta or KvbmWorkerMeta()
            meta.failed = failed
        return meta

    def resend_snapshot(self) -> None:
        """The next report is a whole snapshot again (the report channel lost one: the mirror is rebuilt)."""
        with self._report_lock:
            self._snapshot_sent = False
            with self._lock:
                self._added, self._removed, self._written = [], [], []
            if self._present is not None:
                self._present.clear()

    def take_g3_report(self) -> tuple[list, list, bool] | None:
        """The G3 index changes since the last report as ``(added, removed, snapshot)`` (see
        :meth:`worker_meta`), for the report channel; None when nothing changed."""
        m = self._g3_report()
        return None if m is None else (m.added, m.removed, m.snapshot)

    def _g3_report(self) -> KvbmWorkerMeta | None:
        with self._report_lock:
            return self._g3_report_locked()

    def _g3_report_locked(self) -> KvbmWorkerMeta | None:
        present = self._present
        assert present is not None and self.g3 is not None  # reports (report_g3) need a G3 pool
        present.poll()  # first (before the index snapshot and the writes are taken): see ReportedBlocks.poll
        snap = not self._snapshot_sent
        if snap:
            fp = self.ns.fingerprint
            # restored entries of tenants not seen since the restart are keyed by tag only: the mirror is
            # keyed by tag, so they are reported too (and hits after a restart). A pool whose lock stays busy
            # (journal I/O) is not waited for on the forward thread: the snapshot goes with a later report
            index = index_keys(self.g3)
            snap = index is not None
            if index is not None:
                self._snapshot_sent = True
                ids = present.ids(k for k in index if k.namespace == fp)
                with self._lock:
                    self._added.extend(ids)
        with self._lock:
            added, removed, written = self._added, self._removed, self._written
            self._added, self._removed, self._written = [], [], []
        added.extend(present.held(written))
        present.update(removed, added)
        gone = present.gone()
        if gone:  # the scheduler applies removals first: a block gone since it was added is not re-added
            gs = set(gone)
            added = [k for k in added if k not in gs]
            removed.extend(gone)
            stats.add(g3_reported_dropped=len(gone))
        if not (snap or added or removed):
            return None
        stats.add(g3_reported_added=len(added), g3_reported_removed=len(removed))
        return KvbmWorkerMeta(added, removed, snap, snap_ranks=[self.rank] if snap else [])

    @property
    def reconcile_interval_s(self) -> float:
        """Seconds between reads of the whole G3 index for the report, when its removal log cannot tell
        (overflowed, or a pool without one): :class:`~.g3_report.ReportedBlocks`."""
        return self._present.watch.interval_s if self._present is not None else 0.5

    @reconcile_interval_s.setter
    def reconcile_interval_s(self, v: float) -> None:
        if self._present is not None:
            self._present.watch.interval_s = v

    def load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def failed_requests(self) -> set[str]:
        """Request ids reported by :meth:`get_finished` (this call or earlier) whose load failed in part
        or whole, since the last call."""
        out, self._failed_reqs = self._failed_reqs, set()
        return out

    def shutdown(self) -> None:
        self.offloads.close()
        self._exec.shutdown(wait=True, cancel_futures=False)


from .workers import GroupedWorkers  # noqa: E402,F401 - the N-group worker role, importable from here
