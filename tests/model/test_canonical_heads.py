"""Any-TP G4 (issue 25 item 4): per-rank blocks <-> canonical per-head parts, on real engine tensors.

A TP=1 engine's KV is sharded over TP 2 and 4 ranks the way vLLM shards KV heads (contiguous head ranges;
replicated heads when TP exceeds the KV heads); each rank's gathered block must equal the join of the
canonical parts of its heads, cut from the TP=1 block, and the reverse (parts cut from the ranks' blocks
reassemble the TP=1 block). MLA: one part, the latent, the same on every rank."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbm_backend.integrations.vllm.kv_io import EngineKv, numpy_staging, split_blocks
from kvbm_backend.model.canonical import CANONICAL, HeadMap
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import KvGroup, Namespace

NB, BS, D, LAYERS = 6, 4, 8, 3
BLOCKS = [4, 1, 3]


def _engine(total_heads: int, layout: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = {"cpu": (NB, total_heads, BS, 2 * D), "kv_first": (2, NB, BS, total_heads, D)}[layout]
    return [torch.randn(shape, generator=g, dtype=torch.bfloat16) for _ in range(LAYERS)]


def _shard(t: torch.Tensor, layout: str, heads: range) -> torch.Tensor:
    idx = torch.tensor(list(heads))
    return (t.index_select(1, idx) if layout == "cpu" else t.index_select(3, idx)).contiguous()


def _gather(tensors, heads_per_rank: int) -> list[np.ndarray]:
    kv = EngineKv.from_tensors(tensors, NB, BS, heads_per_rank, D)
    arr, host = numpy_staging(len(BLOCKS) * kv.layout.bytes_per_block)
    kv.gather(BLOCKS, host)
    return [b.copy() for b in split_blocks(arr, kv.layout, len(BLOCKS))]


def _ns(tp: int, heads_per_rank: int, outer: int = 2, inner: int | None = None) -> Namespace:
    lay = KvLayout(LAYERS, outer, BS, inner or heads_per_rank * D, "bfloat16")
    return Namespace(model="m", layout=lay, tp_world_size=tp)


@pytest.mark.parametrize("layout", ["cpu", "kv_first"])
@pytest.mark.parametrize("total,tp", [(4, 1), (4, 2), (4, 4), (2, 4), (8, 2), (1, 2)])
def test_rank_blocks_and_canonical_parts_convert_both_ways(layout, total, tp):
    full = _engine(total, layout)
    one = HeadMap(_ns(1, total), total)
    parts = [one.split(b) for b in _gather(full, total)]  # TP=1 writer: every head's part of each block
    assert all(len(p) == total for p in parts)

    hm = HeadMap(_ns(tp, max(1, total // tp)), total)
    assert hm.canonical == one.canonical and hm.canonical.fingerprint == one.canonical.fingerprint
    assert hm.canonical.layout_id == CANONICAL and hm.part_bytes == one.part_bytes
    written: dict[int, list] = {}
    for r in range(tp):
        heads = hm.heads(r)
        rank_blocks = _gather([_shard(t, layout, heads) for t in full], len(heads))
        for i, blk in enumerate(rank_blocks):
            out = np.full_like(blk, 0xEE)
            hm.join([parts[i][h] for h in heads], out)  # a TP=tp reader from TP=1's parts
            assert np.array_equal(out, blk), (r, i)
            if hm.writes(r):  # and the TP=tp writer's parts are TP=1's parts
                for h, p in zip(heads, hm.split(blk)):
                    written.setdefault(i, [None] * total)[h] = p
    # the writing ranks cover every head exactly once (replicas write once)
    assert sum(hm.writes(r) for r in range(tp)) == min(tp, total)
    for i, blk in enumerate(_gather(full, total)):
        out = np.empty_like(blk)
        one.join(written[i], out)
        assert np.array_equal(out, blk)


def test_gqa_replicated_heads_follow_vllm_head_shards():
    hm = HeadMap(_ns(8, 1), 2)  # 2 KV heads over 8 ranks: 4 replicas of each
    assert [hm.heads(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # vLLM: tp_rank // replication
    assert [r for r in range(8) if hm.writes(r)] == [0, 4]
    hm = HeadMap(_ns(2, 4), 8)
    assert list(hm.heads(0)) == [0, 1, 2, 3] and list(hm.heads(1)) == [4, 5, 6, 7]


def test_mla_latent_is_one_part_written_once():
    g = torch.Generator().manual_seed(3)
    lat = [torch.randn((NB, 1, BS, 24), generator=g, dtype=torch.bfloat16) for _ in range(LAYERS)]
    kv = EngineKv.from_tensors(lat, NB, BS, 1, 24, mla=True)
    arr, host = numpy_staging(len(BLOCKS) * kv.layout.bytes_per_block)
    kv.gather(BLOCKS, host)
    blocks = split_blocks(arr, kv.layout, len(BLOCKS))
    hms = [HeadMap(_ns(tp, 1, outer=1, inner=24), 0) for tp in (1, 2, 4)]
    assert len({h.canonical.fingerprint for h in hms}) == 1
    for hm in hms:
        assert hm.parts == 1 and all(list(hm.heads(r)) == [0] for r in range(hm.per_rank.tp_world_size))
        assert [hm.writes(r) for r in range(hm.per_rank.tp_world_size)] == [True] + [False] * (hm.per_rank.tp_world_size - 1)
        for b in blocks:
            (p,) = hm.split(b)
            assert np.array_equal(p, b)
            out = np.empty_like(b)
            hm.join([p], out)
            assert np.array_equal(out, b)


def test_the_layout_id_is_in_the_fingerprint_and_per_rank_names_are_unchanged():
    per_rank = _ns(1, 1)  # one KV head, TP=1: the per-rank block IS one head's part, same geometry
    canon = HeadMap(per_rank, 1).canonical
    assert canon.layout == per_rank.layout and canon.tp_world_size == per_rank.tp_world_size
    assert canon.fingerprint != per_rank.fingerprint  # a per-rank block is never read as a canonical part
    assert "layout_id" not in per_rank.to_dict()  # old namespaces keep their fingerprints
    assert canon.to_dict()["layout_id"] == CANONICAL
    assert Namespace.from_dict(canon.to_dict()) == canon and Namespace.from_dict(per_rank.to_dict()) == per_rank
    with pytest.raises(ValueError, match="namespace.layout_id"):
        Namespace(model="m", layout=per_rank.layout, layout_id="canonical-head/9")


def test_hybrid_groups_and_uneven_heads():
    lay = KvLayout(LAYERS, 2, BS, 2 * D, "bfloat16")
    groups = (KvGroup("full", lay), KvGroup("sliding", KvLayout(2, 2, BS, 2 * D, "bfloat16"), sliding_window=8))
    ns = Namespace(model="m", layout=lay, tp_world_size=2, groups=groups).for_group(1)
    c = HeadMap(ns, 4).canonical
    assert c.group == 1 and c.layout == KvLayout(2, 2, BS, D, "bfloat16") and c.groups[0].layout.inner_dim == D
    with pytest.raises(ValueError, match="g4.layout"):
        HeadMap(_ns(4, 1), 6)  # 6 KV heads cannot be split over 4 ranks
    with pytest.raises(ValueError, match="g4.layout"):
        HeadMap(c, 4)
