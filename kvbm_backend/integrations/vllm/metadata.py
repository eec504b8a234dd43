"""What the scheduler-side connector tells the worker side each engine step (picklable dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # the worker-side I/O (and its GPU check) runs without vLLM installed
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class LoadJob:
    """Load ``len(block_ids)`` consecutive blocks of one request from G3/G4 into engine blocks.

    Attributes:
        req_id: vLLM request id (reported in ``finished_recving`` once done, failed or not).
        block_ids: destination engine block ids, in sequence order.
        seq_hashes: KVBM sequence hash of each block (u64).
        tiers: ``"G3"`` or ``"G4"`` per block: where the scheduler's lookup found it.
        tenant: the request's tenant (its ``cache_salt``, else the configured default).
        group: vLLM KV cache group index of ``block_ids`` (hybrid models: one job per group; a
            sliding-window group's job holds only the blocks of the window the engine will read).
        layerwise: the scheduler offered this hit synchronously (``g3.layerwise_load``, G3 blocks only):
            the worker loads it layer by layer inside the step (:mod:`.layerwise`) and never reports it
            in ``finished_recving``.
        digests: token digest of each block, 16 bytes each in order (:mod:`.identity`): a frame is served only
            when it holds its block's (empty: not checked).
    """

    req_id: str
    block_ids: list[int]
    seq_hashes: list[int]
    tiers: list[str]
    tenant: str
    group: int = 0
    layerwise: bool = False
    digests: bytes = b""

    def __post_init__(self) -> None:
        _check_digests(self.digests, self.seq_hashes)

    def digest_of(self, i: int) -> bytes | None:
        """Token digest of block ``i`` of the job (16 bytes), None when the job names none."""
        return self.digests[16 * i:16 * i + 16] if self.digests else None


@dataclass
class SaveJob:
    """Offload engine blocks ``block_ids`` (full blocks computed this step) of KV cache group ``group``
    under ``seq_hashes``. ``g4_only``: blocks a handed-off prefill request did not compute (its G3 or its
    engine's prefix cache has them): written to G4 alone, and only those G4 does not hold yet. ``digests``: the
    blocks' token digests, 16 bytes each (:mod:`.identity`), written in their frames (empty: none)."""

    req_id: str
    block_ids: list[int]
    seq_hashes: list[int]
    tenant: str
    group: int = 0
    g4_only: bool = False
    digests: bytes = b""

    def __post_init__(self) -> None:
        _check_digests(self.digests, self.seq_hashes)


def _check_digests(digests: bytes, seq_hashes: list[int]) -> None:
    """A job's ``digests``: none, or 16 bytes per block (ValueError otherwise: a wiring bug caught where the job is
    made, never a worker loading blocks of some digests unchecked)."""
    if digests and len(digests) != 16 * len(seq_hashes):
        raise ValueError(f"digests: {len(digests)} bytes for {len(seq_hashes)} blocks (16 bytes each, or none)")


@dataclass
class KvbmConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every engine step: the step's load and save jobs, and ``channel``: the scheduler's
    report channel token (:func:`.report_channel.channel_key`; ``""``: no token, the worker reports in the step
    output); ``reinvalidate``: engine block ids a failed layer-wise load left unloaded that a request reads this step
    before any recomputed them (:class:`~.failed_blocks.Unrecomputed`): the workers report them in the step's
    ``get_block_ids_with_load_errors``."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    channel: str = ""
    reinvalidate: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FailedLoad:
    """A load job of request ``req_id`` that did not deliver all its blocks (worker -> scheduler).

    Attributes:
        req_id: vLLM request id.
        tenant: the job's tenant.
        first_failed: KVBM sequence hash of the first block that was not loaded.
        reason: ``"miss"`` (the pool did not serve a verified block: absent, unreadable, corrupt,
            foreign), ``"timeout"`` (the load outlived the connector's load timeout) or ``"unwaited"`` (a
            layer-wise load some layer of which vLLM never waited for in the forward: the blocks are good and not
            cooled, the step ran on stale KV and is recomputed; :mod:`.layerwise`).
        digest: the job's token digest of that block (16 bytes; None: the job named none). The scheduler cools
            the block only for requests of this digest (:class:`~.failed_blocks.FailedBlocks`), also when the
            request is gone by then (aborted during its load: before 2026-12-01 the entry then cooled the block
            for every request of the tenant, a tenant-mate's forged prompt aborted at once included).
    """

    req_id: str
    tenant: str
    first_failed: int
    reason: str
    digest: bytes | None = None


@dataclass
class KvbmWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, when they run in different processes (vLLM's ``mp`` executor): changes to
    the worker's G3 index, so the scheduler's :class:`~.scheduler_side.G3Mirror` can answer prefix
    lookups without opening the (process-private) G3 directory.

    Entries are ``(tenant tag, rank, seq_hash)`` (:func:`mirror_id`): the tenant's 16-byte tag, not its
    name, because G3's journal keeps only the tag (tenant ids are pseudonymised at rest), so a block
    restored after a restart is known by tag until its tenant asks for it again. ``snapshot`` marks the
    first report, whose ``added`` is the whole index the worker found at start (G3 warm restart).

    Hybrid models keep one G3 pool per KV cache group: this report is group 0's and ``others`` maps
    every other group index to its own report.

    ``failed`` (every mode, the shared-pool one included): loads that did not deliver every block since the
    last report (:class:`FailedLoad`), so the scheduler neither offers the same hit to that request again
    (vLLM reschedules a request whose load failed and asks for its match again: offering the same blocks
    would loop) nor offers those blocks to other requests for a while.
    """

    added: list[tuple[bytes, int, int]] = field(default_factory=list)
    removed: list[tuple[bytes, int, int]] = field(default_factory=list)
    snapshot: bool = False
    others: dict[int, "KvbmWorkerMeta"] = field(default_factory=dict)
    failed: list[FailedLoad] = field(default_factory=list)
    #: TP ranks whose whole index this snapshot carries (each worker names its own; aggregated by vLLM): the
    #: scheduler replaces those ranks' entries with it when they reported before (a report the channel lost)
    snap_ranks: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvbmWorkerMeta":
        assert isinstance(other, KvbmWorkerMeta)  # vLLM aggregates the metadata of this connector's workers
        others = dict(self.others)
        for g, m in other.others.items():
            others[g] = others[g].aggregate(m) if g in others else m
        return KvbmWorkerMeta(self.added + other.added, self.removed + other.removed, self.snapshot or other.snapshot,
                              others, self.failed + other.failed, self.snap_ranks + other.snap_ranks)

    def for_group(self, group: int) -> "KvbmWorkerMeta | None":
        """The report of KV cache group ``group`` (``self`` for 0), None when that group sent none."""
        return self if group == 0 else self.others.get(group)


def snapshot_ranks(meta: KvbmWorkerMeta, rank: int | None = None) -> list[int]:
    """The TP ranks whose whole G3 index ``meta`` carries: none unless ``meta.snapshot``; ``[rank]`` for one
    rank's report (the report channel), else the ranks the workers named (``meta.snap_ranks``; a step's
    output, every rank's aggregated)."""
    if not meta.snapshot:
        return []
    return [rank] if rank is not None else list(dict.fromkeys(meta.snap_ranks))


def mirror_id(key) -> tuple[bytes, int, int]:
    """``(tenant tag, rank, seq_hash)`` of a G3 key: a :class:`~kvbm_backend.model.namespace.BlockKey`
    (tag of its tenant) or a restored tag-only key (``.tag``, see ``pool/g3/index.py``)."""
    tag = getattr(key, "tag", None)
    if tag is None:
        from ...pool.g3.index import tag_of
        tag = tag_of(key.tenant)
    return (tag, key.rank, key.seq_hash)
