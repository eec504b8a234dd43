"""The shared plumbing of our vLLM secondary tiers (:mod:`.tiering` documents them and their keys).

:class:`KvbmSecondaryTier` implements vLLM's ``SecondaryTierManager`` on a
:class:`kvbm_backend.pool.base.BlockPool`: store and load jobs on the tier's I/O threads (the primary's chunks
permuted to and from FullyContiguous blocks, :class:`~.geometry.PrimaryGeometry`), the async index lookups
(:mod:`.tier_lookup`), failed-load cool-downs (:mod:`.failed_blocks`), KV events and removals
(:mod:`.tier_removals`), counters. :class:`~.tiering.G3Tier` and :class:`~.tiering.G4Tier` choose the pool;
a tier that follows the keyring's revocations (G3Tier, :mod:`.tier_revoked`) sets :attr:`KvbmSecondaryTier._revoked`.
Log lines go to the ``kvbm_backend.integrations.vllm.tiering`` logger, as they did before this module was split
out of :mod:`.tiering` (operators' filters and tests name it).
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xxhash
from vllm.v1.kv_offload.base import (LookupResult, Medium, OffloadingEvent, OffloadKey, ReqContext,
                                     RequestOffloadingContext, ScheduleEndContext)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from ...config import KvbmBackendConfig
from ...deadlines import Deadline
from ...log_limits import LimitedLog
from ...model.namespace import BlockKey, DigestKey, KvGroup, Namespace
from ... import metrics
from .. import load_priority
from ..tiers import announce_tiers
from .extra_config import tier_config
from .failed_blocks import FailedChunks, drop_blocks
from .geometry import PrimaryGeometry
from .namespaces import namespace_model, namespace_revision, refuse_parallel_layouts
from .tier_gaps import failed_load
from .tier_lookup import TenantLookup
from .tier_options import check_options
from .tier_removals import HeldChunks, held_now
from .tier_jobs import Job, NotAsked, TierJobs
from .tier_threads import staging_pool

if TYPE_CHECKING:
    from .tier_revoked import TierRevocation

log = logging.getLogger("kvbm_backend.integrations.vllm.tiering")  # the tiers' logger, whatever module logs

__all__ = ["OFFLOAD_KEY_PERSON", "KvbmSecondaryTier", "offload_key_digest", "offload_key_hash"]

#: BLAKE2b personalisation of :func:`offload_key_digest`: no connector token digest (``kvbm-digest-root``,
#: ``kvbm-digest-blk``, keyed) is ever computed under it
OFFLOAD_KEY_PERSON = b"kvbm-offload-key"


def offload_key_hash(key: bytes) -> int:
    """Stable 64-bit sequence hash of a vLLM ``OffloadKey`` (block hash bytes + 4-byte group index):
    ``xxh3_64(key)``, seed 0. Independent of ``PYTHONHASHSEED`` and of the process."""
    return xxhash.xxh3_64_intdigest(bytes(key))


def offload_key_digest(key: bytes) -> bytes:
    """The 16-byte token digest the native tiers' keys name for a vLLM ``OffloadKey`` (36 bytes: block hash +
    4-byte group index; any length accepted): ``BLAKE2b(key, digest_size=16, person=OFFLOAD_KEY_PERSON)``. It binds
    the whole key, so two keys sharing :func:`offload_key_hash` (64 bits, no collision resistance) never read each
    other's frames (docs/format.md "Token digest"). About 1 us per chunk."""
    return hashlib.blake2b(bytes(key), digest_size=16, person=OFFLOAD_KEY_PERSON).digest()


class KvbmSecondaryTier(SecondaryTierManager):
    """A kvbm-backend BlockPool as a vLLM secondary tier. Subclasses set ``pool_tier`` and ``_make_pool``.

    All SecondaryTierManager methods are non-blocking except ``drain_jobs`` (by contract) and
    ``shutdown``. Jobs run on ``io_threads`` threads for loads and as many for stores (:mod:`.tier_jobs`: loads
    never wait behind stores; a store's thread is free once its puts are out). Raises ValueError/ConfigError at construction for bad settings (naming the field),
    and ValueError for pipeline or decode/prefill context parallelism > 1 (:func:`.namespaces.refuse_parallel_layouts`).
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    pool_tier: ClassVar[str] = ""
    default_locality: ClassVar[str] = "LOCAL"
    #: bytes of chunks (all ranks) per pool call inside one job: a job's pieces are pipelined (permute
    #: piece k while piece k-1 is on the wire). 8 MiB: 4 llama-3.1-8b chunks; big enough for full-size
    #: I/O ops, small enough that the copy left after the last read is ~1 ms.
    piece_bytes: ClassVar[int] = 8 << 20
    #: seconds between checks of the published chunks against the pool's index (KV events on, G3)
    reconcile_interval_s: ClassVar[float] = 1.0
    #: delete a chunk whose load failed other than by a timeout (a read error G3 kept the slot for), so the
    #: recomputed chunk's store writes it again (G3; a shared G4 store keeps its objects)
    drop_unreadable: ClassVar[bool] = False
    #: chunks after any chunk the tier lacks are looked up (G3; G4 only past one a tier above holds): tier_lookup
    look_past_gaps: ClassVar[bool] = False

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, *,
                 config: str | dict | None = None, g3: dict | None = None, g4: dict | None = None,
                 tenant: str | None = None, revision: str | None = None, num_kv_heads: int | None = None,
                 head_dim: int | None = None, mla: bool | None = None, layout: str | None = None,
                 kv_cache_layout: str | None = None, enable_kv_events: bool = False,
                 locality: str | None = None, io_threads: int = 8, job_timeout_s: float = 60.0,
                 staging_mb: float = 256, backpressure_detector: Any = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        opts = check_options(default_locality=self.default_locality, locality=locality,
                             enable_kv_events=enable_kv_events, io_threads=io_threads, job_timeout_s=job_timeout_s,
                             staging_mb=staging_mb, config=config, tenant=tenant, revision=revision,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, mla=mla, layout=layout,
                             kv_cache_layout=kv_cache_layout)  # every key by type and range, before anything opens
        par = offloading_spec.config.parallel  # vLLM's OffloadingParallelConfig (the engine's parallel_config)
        refuse_parallel_layouts(type(self).__name__, pipeline_parallel_size=getattr(par, "pp_size", 1),
                                decode_context_parallel_size=getattr(par, "dcp_size", 1),
                                prefill_context_parallel_size=getattr(par, "pcp_size", 1))  # as the connector does
        self.locality = opts.locality
        self.geometry = PrimaryGeometry.from_spec(offloading_spec, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                  mla=mla, layout=layout, kv_cache_layout=kv_cache_layout)
        # the tier's own section must be on (g3.enabled / g4.enabled), checked before anything opens
        self.config = tier_config(config, g3=g3, g4=g4, tier=self.pool_tier or None)
        self._tenant = self.config.tenant if tenant is None else str(tenant)
        self._job_timeout_s = opts.job_timeout_s
        groups: tuple[KvGroup, ...] = ()
        if len(offloading_spec.config.groups) > 1:
            groups = tuple(KvGroup("vllm-offload", self.geometry.kv_layout, layers=tuple(g.layer_names))
                           for g in offloading_spec.config.groups)
        # one namespace for every group (the OffloadKey carries the group index); model: the config's, else vLLM's
        # name, as the connector decides (before 2026-11-30 fine-tunes at one path with other ``model`` shared blocks)
        self.namespace = Namespace(model=namespace_model(self.config, offloading_spec.config.model.name),
                                   revision=namespace_revision(self.config, override=revision),
                                   layout=self.geometry.kv_layout,
                                   tp_world_size=self.geometry.copies, hash_scheme="vllm-block-hash",
                                   groups=groups, kv_heads=self.geometry.num_kv_heads,
                                   kv_version=self.geometry.kv_version)  # 2: a CPU engine's K/V, read right
        view = primary_kv_view
        assert view.strides is not None
        self._row_stride = int(view.strides[0])
        if self.geometry.copies * self.geometry.rank_bytes > self._row_stride:
            raise ValueError(f"primary row: {self._row_stride} B < {self.geometry.copies} ranks x "
                             f"{self.geometry.rank_bytes} B")
        self._primary = np.asarray(view).view(np.uint8).reshape(-1, self._row_stride)
        metrics.prepare(self.config.metrics.serve_port)  # before the pool creates its series: one endpoint per pod
        self.pool = self._make_pool(self.config, self.namespace)
        try:  # nothing stays open if the rest fails: the pool (its G3 lock, threads) and vLLM's buffer export
            self._start(offloading_spec, tier_type, opts.enable_kv_events, opts.io_threads, opts.staging_mb)
        except BaseException:
            del self._primary
            self.pool.close()
            raise

    def _start(self, offloading_spec: Any, tier_type: str, enable_kv_events: bool, io_threads: int,
               staging_mb: float) -> None:
        """The rest of the constructor once the pool is open."""
        announce_tiers(self.config, namespace=self.namespace,  # start-up line (the namespace in use), metrics
                       **{self.pool_tier.lower(): self.pool})
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning("enable_kv_events set on tier %s but KV cache events are disabled globally", tier_type)
        # chunks published stored, for removal events (events on and a pool that lists its index)
        self._removals = self._events is not None and callable(getattr(self.pool, "keys", None))
        self._failed = FailedChunks(offload_key_hash)  # (tenant, chunk) whose load failed: a miss for a while
        self._held = HeldChunks(self.pool, self.namespace.fingerprint, self.geometry.copies, offload_key_hash,
                                self.reconcile_interval_s, self._block_keys)
        self._store_cursor: dict[JobId, int] = {}  # store job -> the pool's removal cursor before its first put
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[JobId, tuple[list[OffloadKey], bool, str, Any]] = {}  # job -> (keys, store, tenant, ctx)
        self._not_asked: set[JobId] = set()  # failed while queued (the pool not asked): its chunks are not cooled
        # store job -> its chunks the pool holds (published when the job is reported finished)
        self._store_held: dict[JobId, list[OffloadKey]] = {}
        self._outstanding = 0
        self._cv = threading.Condition()
        self._closed = False
        # never more staging than the primary tier can hand us at once (every chunk, every rank)
        self._staging = staging_pool(self.geometry.rank_bytes,
                                     min(int(staging_mb * 2**20) // self.geometry.rank_bytes,
                                         self._primary.shape[0] * self.geometry.copies))
        self._warn = LimitedLog(log)  # a failed job's WARNING: one per kind (op, reason) a minute, every job counted
        self._tasks = TierJobs(io_threads, f"kvbm_{tier_type}", self._finish, self._failed_job)
        self._executor = self._tasks.stores  # the store threads (the load threads: self._tasks.loads)
        self._revoked: TierRevocation | None = None  # the keyring's revocations this tier follows (G3Tier)
        try:
            self._lookup = TenantLookup(self, tier_type, offloading_spec)  # counts as vLLM asks
        except BaseException:
            self._tasks.shutdown()
            raise
        self._counters = {"stores": 0, "stores_failed": 0, "loads": 0, "loads_failed": 0,
                          "chunks_stored": 0, "chunks_skipped": 0, "chunks_loaded": 0, "chunks_load_failed": 0,
                          "blocks_dropped": 0}

    # ---- construction helpers ------------------------------------------------------------------
    def _make_pool(self, cfg: KvbmBackendConfig, namespace: Namespace):
        raise NotImplementedError

    def follow_keyring(self, keyring: Any, *, owned: bool, source: str) -> bool:
        """Follow ``keyring``'s revocations (:mod:`.tier_revoked`); True if this tier now does. Only G3Tier does."""
        return False

    def _count(self, name: str, n: int) -> None:
        with self._cv:
            self._counters[name] += n

    # ---- keys ----------------------------------------------------------------------------------
    def _tenant_of(self, req_context: ReqContext | None) -> str:
        params = getattr(req_context, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get("kvbm_tenant") is not None:
            return str(params["kvbm_tenant"])
        return self._tenant

    def _block_keys(self, key: OffloadKey, tenant: str) -> list[BlockKey]:
        """Every rank's :class:`DigestKey` of chunk ``key``: sequence hash :func:`offload_key_hash` (the name: G3's
        index, G4's object), token digest :func:`offload_key_digest` (what a frame served for it must hold)."""
        h, d, fp = offload_key_hash(key), offload_key_digest(key), self.namespace.fingerprint
        return [DigestKey(fp, tenant, r, h, d) for r in range(self.geometry.copies)]

    def _serves(self, tenant: str) -> bool:
        """False while the tier refuses ``tenant`` (revoked in the keyring it follows: :mod:`.tier_revoked`); no
        I/O, any thread. The tiers below ask it too: a refused tenant's chunks here fill no gap of theirs."""
        return self._revoked is None or not self._revoked.refused(tenant)

    def _put(self, tenant: str, bkeys: list[BlockKey], bufs: list) -> Any:
        """``pool.put(bkeys, bufs)``'s future; None when the tier refuses ``tenant`` (nothing put, counted
        ``save_g3_revoked_blocks``: :meth:`.tier_revoked.TierRevocation.put`)."""
        if self._revoked is None:
            return self.pool.put(bkeys, bufs)
        return self._revoked.put(tenant, lambda: self.pool.put(bkeys, bufs), len(bkeys))

    def _slice(self, chunk_id: int, rank: int) -> np.ndarray:
        p = self.geometry.rank_bytes
        return self._primary[int(chunk_id), rank * p:(rank + 1) * p]

    # ---- SecondaryTierManager ------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT if every rank's block is in the pool index, MISS if not, RETRY while the async index
        lookup (posted at the end of this step) has not answered. MISS without asking the pool for a tenant the
        tier refuses (revoked: :mod:`.tier_revoked`), whatever verdict was cached before, and for a chunk whose load
        failed within the cool-down (:class:`.failed_blocks.FailedChunks`; counted: :meth:`.TenantLookup.cooled`)."""
        tenant = self._tenant_of(req_context)
        if self._revoked is not None and self._revoked.lookup_refused(tenant, req_context.req_id):
            self._lookup.refused(key, req_context)  # counted in no pool (.tier_ledger)
            return LookupResult.MISS
        r = (self._lookup.cooled(key, req_context) if self._failed.cooling(tenant, key)
             else self._lookup.lookup(key, req_context))
        if r is None:
            return LookupResult.RETRY
        return LookupResult.HIT if r else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, True, self._run_store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, False, self._run_load)
        self._lookup.loading(job_metadata)  # its chunks' counts wait for the load (.tier_ledger)

    def _submit(self, job: TransferJob, store: bool, fn) -> None:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(job.chunk_ids)} chunk_ids")
        self._jobs[job.job_id] = (keys, store, self._tenant_of(job.req_context), job.req_context)
        with self._cv:
            self._outstanding += 1
        # its deadline runs from vLLM's submission and is enforced while it waits for a thread (tier_jobs)
        self._tasks.submit(Job(job, keys, store, self._job_timeout_s), fn)

    def _finish(self, result: JobResult) -> None:
        self._results.put(result)
        with self._cv:
            self._outstanding -= 1
            self._cv.notify_all()

    def _failed_job(self, j: Job, why: str | BaseException) -> JobResult:
        """Log and count job ``j`` failed (``why``: a message, or what it raised); its result (:mod:`.tier_jobs`). Logged
        at most once a minute per op and reason (before 2026-12-04 once per job: a stall grew the log at the job rate)."""
        kind = "queued" if isinstance(why, NotAsked) else type(why).__name__ if isinstance(why, BaseException) else why
        if isinstance(why, NotAsked):  # queued past its deadline: load, not a verdict on its chunks (not cooled)
            self._not_asked.add(j.meta.job_id)
            why = str(why)
        elif isinstance(why, BaseException):
            why = (f"no answer from the pool within job_timeout_s ({self._job_timeout_s:g} s)"
                   if isinstance(why, TimeoutError) else f"{type(why).__name__}: {why}")
        self._warn.warning(f"{'store' if j.store else 'load'} {kind}", "%s job %s (%s of %d chunks) failed: %s",
                           self.tier_type, j.meta.job_id, "store" if j.store else "load", len(j.keys), why)
        # counted like a job that ended with failed blocks (before 2026-11-29 a raised job was not counted)
        if j.store:
            self._count("stores", 1)
            self._count("stores_failed", 1)
        else:
            self._count("loads", 1)
            self._count("loads_failed", 1)
            self._count("chunks_load_failed", len(j.keys))
        return JobResult(job_id=j.meta.job_id, success=False)

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        """``[c0, c1)`` chunk ranges of about :attr:`piece_bytes` each (at least one chunk)."""
        per = max(1, self.piece_bytes // (self.geometry.copies * self.geometry.rank_bytes))
        return [(c0, min(n, c0 + per)) for c0 in range(0, n, per)]

    def _give_back(self, bufs: list) -> None:
        for b in bufs:
            self._staging.give(b)

    def _give_when_done(self, fut: Any, bufs: list) -> None:
        """Give ``bufs`` back to staging once the pool is done with them (``fut`` resolved: a pool neither reads
        nor writes a buffer after that), whether the job waited for it or not (before 2026-12-01 a job past its
        deadline never gave them back: the pre-faulted arena shrank for good after every stall)."""
        if fut is None:
            self._give_back(bufs)
        else:
            fut.add_done_callback(lambda _f: self._give_back(bufs))

    def _run_store(self, j: Job) -> JobResult | None:
        """Permute the job's chunks into staging piece by piece, handing each piece to ``pool.put`` as
        soon as it is ready (the pool's writer merges queued puts into one batch, one fdatasync per
        file), so the first bytes are on the wire after one piece, not after the whole job. A piece of a tenant
        the tier refuses is not put (:meth:`_put`): its chunks count skipped and are not published. Then the
        thread is free: the job finishes once every put resolved (:meth:`.tier_jobs.TierJobs.wait`), or fails at
        its deadline."""
        job, keys = j.meta, j.keys
        g = self.geometry
        tenant = self._tenant_of(job.req_context)
        c = g.copies
        bufs = [self._staging.take(g.rank_bytes) for _ in range(len(keys) * c)]
        if self._removals:  # before the first put: a removal logged once a block is published is after it
            self._store_cursor[job.job_id] = self._held.cursor()
        futs: list[tuple[int, int, int, Any]] = []
        try:
            for c0, c1 in self._pieces(len(keys)):
                bkeys: list[BlockKey] = []
                for i in range(c0, c1):
                    for r, bk in enumerate(self._block_keys(keys[i], tenant)):
                        g.engine_to_block(self._slice(job.chunk_ids[i], r), bufs[i * c + r])
                        bkeys.append(bk)
                f = self._put(tenant, bkeys, bufs[c0 * c:c1 * c])
                futs.append((c0, c1, len(bkeys), f))
                self._give_when_done(f, bufs[c0 * c:c1 * c])  # the pool reads them until its future resolves
        finally:  # the pieces never handed to the pool
            self._give_back(bufs[(futs[-1][1] if futs else 0) * c:])

        def complete() -> JobResult:
            return self._stored(job, keys, tenant, [(c0, c1, n, None if f is None else f.result())
                                                    for c0, c1, n, f in futs])
        pending = [f for _, _, _, f in futs if f is not None]
        if not pending:
            return complete()
        self._tasks.wait(j, pending, complete)
        return None

    def _stored(self, job: TransferJob, keys: list[OffloadKey], tenant: str, results: list) -> JobResult:
        """A store job's result once every put resolved (``results``: ``(c0, c1, blocks, PutResult | None)``)."""
        g = self.geometry
        ok = all(res is None or (res.dropped == 0 and res.written + res.skipped == n) for _, _, n, res in results)
        self._count("stores", 1)
        if ok:
            put_keys = [k for c0, c1, _, res in results if res is not None for k in keys[c0:c1]]  # not refused
            held = (held_now(self.pool, put_keys, lambda k: self._block_keys(k, tenant))
                    if any(res is not None and res.skipped for _, _, _, res in results) else put_keys)
            held = self._failed.not_cooling(tenant, held)  # a copy that failed to load is no held chunk
            self._store_held[job.job_id] = held
            self._count("chunks_stored", len(held))
            self._count("chunks_skipped", len(keys) - len(held))
        else:
            self._count("stores_failed", 1)
        return JobResult(job_id=job.job_id, success=ok, transfer_bytes=len(keys) * g.copies * g.rank_bytes)

    def _run_load(self, j: Job) -> JobResult:
        """Read every piece of the job at once (one ``pool.get`` each) and copy each piece's verified
        chunks into the primary as soon as that piece lands, overlapping the permutation with the
        later pieces' reads. A chunk reaches the primary only if every rank's block verified. The GIL
        comes back to the reading threads sooner meanwhile (``load_gil_switch_ms``). A tenant the tier refuses
        (revoked: :mod:`.tier_revoked`) reads nothing: the job fails, every chunk a miss the engine recomputes."""
        with load_priority.loading():
            return self._run_load_held(j.meta, j.keys, j.deadline)

    def _run_load_held(self, job: TransferJob, keys: list[OffloadKey], deadline: Deadline) -> JobResult:
        g = self.geometry
        tenant = self._tenant_of(job.req_context)
        c = g.copies
        if self._revoked is not None and self._revoked.load_refused(tenant, len(keys) * c):
            self._count("loads", 1)
            self._count("loads_failed", 1)
            self._count("chunks_load_failed", len(keys))
            return JobResult(job_id=job.job_id, success=False)
        bufs = [self._staging.take(g.rank_bytes) for _ in range(len(keys) * c)]
        futs = []
        good: list[OffloadKey] = []
        unreadable: list[BlockKey] = []  # blocks of chunks that failed other than by a timeout
        late = 0  # chunks of pieces the pool had not answered by the job's deadline
        try:
            for c0, c1 in self._pieces(len(keys)):
                bkeys = [bk for key in keys[c0:c1] for bk in self._block_keys(key, tenant)]
                futs.append((c0, c1, self.pool.get(bkeys, bufs[c0 * c:c1 * c])))
            for c0, c1, fut in futs:
                try:  # on a timeout the pool may still write the buffers: they go back once it is done (finally)
                    res = fut.result(timeout=deadline.left())
                except TimeoutError:  # late chunks fail (cooled, not dropped); those verified before stay loaded
                    late += c1 - c0  # (before 2026-12-04 the job failed whole: they were dropped and cooled)
                    continue
                if len(res.ok) != (c1 - c0) * c:
                    raise RuntimeError(f"pool returned {len(res.ok)} results for {(c1 - c0) * c} blocks")
                for i in range(c0, c1):
                    if all(res.ok[(i - c0) * c:(i - c0 + 1) * c]):
                        for r in range(c):
                            g.block_to_engine(bufs[i * c + r], self._slice(job.chunk_ids[i], r))
                        good.append(keys[i])
                    elif not any(res.timed_out_at(j) for j in range((i - c0) * c, (i - c0 + 1) * c)):
                        unreadable += self._block_keys(keys[i], tenant)
        finally:  # every piece back to staging once the pool is done with it; those never asked for now
            for c0, c1, fut in futs:
                self._give_when_done(fut, bufs[c0 * c:c1 * c])
            self._give_back(bufs[(futs[-1][1] if futs else 0) * c:])
        if late:
            self._warn.warning("load late", "%s job %s (load of %d chunks) failed: no answer from the pool within "
                               "job_timeout_s (%g s) for %d of them", self.tier_type, job.job_id, len(keys),
                               self._job_timeout_s, late)
        self._count("loads", 1)
        self._count("chunks_loaded", len(good))
        if len(good) == len(keys):
            return JobResult(job_id=job.job_id, success=True, transfer_bytes=len(keys) * c * g.rank_bytes)
        self._count("loads_failed", 1)
        self._count("chunks_load_failed", len(keys) - len(good))
        if unreadable and self.drop_unreadable:
            drop_blocks(self.pool, unreadable, deadline, self.tier_type, lambda n: self._count("blocks_dropped", n))
        return JobResult(job_id=job.job_id, success=False, successful_keys=tuple(good) if good else None,
                         transfer_bytes=len(good) * c * g.rank_bytes)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        while True:
            try:
                res: JobResult = self._results.get_nowait()
            except queue.Empty:
                break
            keys, is_store, tenant, ctx = self._jobs.pop(res.job_id, ([], False, self._tenant, None))
            held = self._store_held.pop(res.job_id, [])
            out.append(res)
            if not is_store:
                self._lookup.loaded(res.job_id, keys if res.success else res.successful_keys or ())
            if res.success and is_store and held:  # a live request's cached miss of them is asked again
                self._lookup.stored(held, tenant)
            not_asked = res.job_id in self._not_asked
            self._not_asked.discard(res.job_id)
            if not res.success and not is_store:  # a miss now; cooling, unless the pool never saw the job
                good = set(res.successful_keys or ())
                failed_load(self, [k for k in keys if k not in good], tenant, ctx, cool=not not_asked)
            elif res.success and is_store and self._events is not None and held:
                self._events.append(OffloadingEvent(keys=list(held), medium=self.medium, removed=False,
                                                    locality=self.locality, removal_expected=self._removals))
                if self._removals:
                    self._held.published(list(held), self._store_cursor.pop(res.job_id, 0), tenant)
            self._store_cursor.pop(res.job_id, None)
        return out

    def _reconcile(self) -> None:
        """Queue one removal event for the published chunks the pool dropped since (any rank's block gone):
        :class:`~.tier_removals.HeldChunks`."""
        gone = self._held.removed()
        if gone and self._events is not None:  # always: chunks are held only while events are on
            self._events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True, locality=self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._removals:
            self._reconcile()
        if self._events:
            ev, self._events = self._events, []
            yield from ev

    def has_pending_work(self) -> bool:
        with self._cv:
            return self._outstanding > 0 or not self._results.empty()

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (results stay queued for get_finished_jobs)."""
        with self._cv:
            self._cv.wait_for(lambda: self._outstanding == 0)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)
        if self._revoked is not None:
            self._revoked.request_finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext):
        return

    def shutdown(self) -> None:
        """Stop lookups, wait for jobs in flight, stop the keyring checks (a purge running ends first), close the
        pool, release the primary buffer."""
        if self._closed:
            return
        self._closed = True
        self._lookup.shutdown()
        self.drain_jobs()
        self._tasks.shutdown()
        try:
            if self._revoked is not None:
                self._revoked.close()
            self.pool.close()
        finally:  # closed, never read again: drop our export of vLLM's memoryview so its mmap can close
            self._primary = None  # type: ignore[assignment]

    def kvbm_stats(self) -> dict:
        """Tier counters (jobs; chunks stored, skipped (not admitted by the pool, written by another job, cooling
        after a failed load, or of a tenant the tier refuses), loaded, failed to load; blocks deleted after a failed
        read; G3Tier: the keyring's revocations, :data:`.tier_revoked.COUNTERS`) plus the pool's own ``stats()``."""
        with self._cv:
            tier = dict(self._counters)
        tier.update(self._lookup.counts())  # lookups_timed_out, lookups_not_asked, lookup_cooling_chunks
        return {"tier": tier, "pool": self.pool.stats()}
