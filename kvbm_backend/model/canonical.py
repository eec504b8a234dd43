"""TP-independent ("canonical") G4 blocks: one part per KV head, readable by any TP size of one model.

A per-rank block (:mod:`.layout`) of TP rank ``r`` is FullyContiguous ``[layer, outer, page, h * head_dim]``
holding ``h = total_kv_heads // tp`` KV heads of the model, heads ``[r*h, (r+1)*h)`` in the model's head
order (vLLM's ``QKVParallelLinear`` shards KV heads contiguously; vLLM 0.32's canonical page mapping,
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py``, places rank ``r``'s heads
at ``head_shard = tp_rank // replication``). With fewer KV heads than TP ranks vLLM replicates: rank ``r``
holds the one head ``r // (tp // total_kv_heads)``, and as vLLM's ``num_writers`` only one rank of the
replicas writes it (here the first, ``r % replicas == 0``).

The canonical namespace (``layout_id`` ``canonical-head/1``) stores KV head ``k`` of a block as its own
part ``[layer, outer, page, head_dim]`` (the columns of head ``k`` of the rank block), named by
``BlockKey(canonical fingerprint, tenant, rank=k, seq_hash)``: the parts of all KV heads, in head order,
are the canonical block ``[head, layer, outer, page, head_dim]`` (every KV head of the model, no TP).
A rank of any TP size reads exactly the parts of its heads, and a block counts as loaded only when every
one of them was found and verified. MLA (``outer_dim == 1``): the latent is the same on every rank, so the
block is one part, written by rank 0, read by all.

Why parts and not one object per block: each rank holds only its heads, so one object would need a
cross-rank gather on the save path (a collective in ``wait_for_save``) and a reader of another TP size
would fetch heads it does not hold. Per-head parts are written by the ranks that hold them with no
coordination, name nothing about the writer's TP, and each part is sealed on its own (its AAD binds the
head index, so a part moved to another head fails to open). The cost is ``total_kv_heads`` objects per
block instead of ``tp``.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .layout import KvLayout
from .frame import key_digest
from .namespace import BlockKey, DigestKey, KeyRun, Namespace

CANONICAL = "canonical-head/1"
__all__ = ["CANONICAL", "HeadMap"]


@dataclass(frozen=True)
class HeadMap:
    """How the per-rank blocks of one namespace map onto canonical per-head parts.

    Attributes:
        per_rank: the engine's per-rank namespace (``layout_id`` ``per-rank``; ``tp_world_size`` = TP).
        total_kv_heads: KV heads of the model before TP (vLLM ``ModelConfig.get_total_num_kv_heads()``);
            ignored for MLA (one latent: one part).
    Raises:
        ValueError naming ``g4.layout`` when the heads cannot be split evenly over the TP ranks (neither
        divides the other), or the per-rank layout's width is not ``heads_per_rank * head_dim``.
    """

    per_rank: Namespace
    total_kv_heads: int

    def __post_init__(self) -> None:
        ns = self.per_rank
        if ns.layout_id != "per-rank":
            raise ValueError(f"g4.layout: canonical parts are cut from per-rank blocks, got a {ns.layout_id} namespace")
        tp, total = ns.tp_world_size, 1 if self.mla else int(self.total_kv_heads)
        if total < 1 or (total % tp if total >= tp else tp % total):
            raise ValueError(f"g4.layout: canonical needs the KV heads ({self.total_kv_heads}) and the TP size "
                             f"({tp}) to divide one another (vLLM shards or replicates heads evenly)")
        for lay in [g.layout for g in ns.groups] or [ns.layout]:
            if lay.inner_dim % self.heads_per_rank:
                raise ValueError(f"g4.layout: canonical: per-rank width {lay.inner_dim} is not {self.heads_per_rank} "
                                 f"KV heads of equal size (total_kv_heads={total}, TP={tp})")

    @property
    def mla(self) -> bool:
        return self.per_rank.layout.outer_dim == 1

    @property
    def parts(self) -> int:
        """Parts of one canonical block: the model's KV heads (1 for MLA)."""
        return 1 if self.mla else int(self.total_kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.mla else max(1, self.parts // self.per_rank.tp_world_size)

    @property
    def replicas(self) -> int:
        """Ranks holding the same heads: ``tp // total_kv_heads`` when heads are replicated, TP for MLA, else 1."""
        tp = self.per_rank.tp_world_size
        return tp if self.mla else max(1, tp // self.parts)

    def heads(self, rank: int) -> range:
        """The KV heads (part indices) TP rank ``rank`` holds, in the order of its block's columns."""
        if not 0 <= rank < self.per_rank.tp_world_size:
            raise ValueError(f"rank: {rank} outside TP world size {self.per_rank.tp_world_size}")
        first = (rank // self.replicas) * self.heads_per_rank
        return range(first, first + self.heads_per_rank)

    def writes(self, rank: int) -> bool:
        """Whether rank ``rank`` stores its heads' parts (the first of the ranks holding the same heads)."""
        return rank % self.replicas == 0

    @staticmethod
    def _part_layout(lay: KvLayout, heads_per_rank: int) -> KvLayout:
        return dataclasses.replace(lay, inner_dim=lay.inner_dim // heads_per_rank)

    @functools.cached_property
    def canonical(self) -> Namespace:
        """The G4 namespace of the parts: same model, revision, dtype, page, hash scheme and group
        structure; ``layout`` one head's part; ``tp_world_size`` the number of parts; ``layout_id``
        :data:`CANONICAL`. Equal for every TP size of the model."""
        ns, h = self.per_rank, self.heads_per_rank
        groups = tuple(dataclasses.replace(g, layout=self._part_layout(g.layout, h)) for g in ns.groups)
        return Namespace(model=ns.model, layout=self._part_layout(ns.layout, h), revision=ns.revision,
                         tp_world_size=self.parts, hash_scheme=ns.hash_scheme, groups=groups, group=ns.group,
                         layout_id=CANONICAL, kv_version=ns.kv_version)

    @property
    def part_bytes(self) -> int:
        return self.canonical.layout.bytes_per_block

    def part_keys(self, key: BlockKey) -> list[BlockKey]:
        """The parts' keys of per-rank ``key`` (its rank's heads)."""
        fp = self.canonical.fingerprint
        d = key_digest(key)  # a DigestKey's parts name its token digest too
        if d is not None:
            return [DigestKey(fp, key.tenant, h, key.seq_hash, d) for h in self.heads(key.rank)]
        return [BlockKey(fp, key.tenant, h, key.seq_hash) for h in self.heads(key.rank)]

    def part_runs(self, run: KeyRun) -> list[KeyRun]:
        """One :class:`KeyRun` per head of ``run.rank`` over the same sequence hashes (nothing copied)."""
        return [KeyRun(self.canonical.fingerprint, run.tenant, h, run.hashes) for h in self.heads(run.rank)]

    def _columns(self, buf: np.ndarray) -> np.ndarray:
        lay = self.per_rank.layout
        rows = lay.num_layers * lay.outer_dim * lay.page_size
        return buf.reshape(-1).view(np.uint8).reshape(rows, self.heads_per_rank, self.part_bytes // rows)

    def split(self, block: np.ndarray) -> list[np.ndarray]:
        """A per-rank block (1-D uint8, ``per_rank.layout.bytes_per_block``) as its heads' parts, in the
        order of :meth:`heads` (new contiguous 1-D uint8 arrays of :attr:`part_bytes`). Raises ValueError
        for a buffer of another size."""
        if block.nbytes != self.per_rank.layout.bytes_per_block:
            raise ValueError(f"block buffer: {block.nbytes} bytes, layout needs {self.per_rank.layout.bytes_per_block}")
        cols = self._columns(block)
        return [np.ascontiguousarray(cols[:, j, :]).reshape(-1) for j in range(self.heads_per_rank)]

    def join(self, parts: Sequence[np.ndarray], out: np.ndarray) -> None:
        """Inverse of :meth:`split`: write the heads' parts (in :meth:`heads` order) into the per-rank
        block ``out`` (1-D uint8). Raises ValueError for a wrong count or size."""
        if len(parts) != self.heads_per_rank or any(p.nbytes != self.part_bytes for p in parts):
            raise ValueError(f"parts: {self.heads_per_rank} of {self.part_bytes} bytes are needed, got "
                             f"{[p.nbytes for p in parts]}")
        if out.nbytes != self.per_rank.layout.bytes_per_block:
            raise ValueError(f"block buffer: {out.nbytes} bytes, layout needs {self.per_rank.layout.bytes_per_block}")
        cols = self._columns(out)
        for j, p in enumerate(parts):
            cols[:, j, :] = p.reshape(cols.shape[0], cols.shape[2])
