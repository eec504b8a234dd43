"""``g4.layout: canonical``: a block put twice while the first put is still in write-behind counts ``written``
once. CI (2026-12, 2 busy cores): the TP=1 writer of tests/e2e/test_anytp_e2e.py re-saves the shared prefix of
its second prompt while the first prompt's puts of those blocks are still queued; each block's head parts are
separate create-exclusive objects, so the two puts could each create some of one block's parts and both counted
the block written (``g4_put_written_blocks`` 34 for 32 blocks stored, 64 objects)."""
from __future__ import annotations

import os

import numpy as np

from kvbm_backend.config import KvbmBackendConfig
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4.canonical import CanonicalG4

HEADS, D, LAYERS, PAGE = 4, 16, 2, 8
T = 60


def test_a_block_put_again_while_its_put_is_in_flight_counts_written_once(tmp_path):
    ns = Namespace(model="m", layout=KvLayout(LAYERS, 2, PAGE, HEADS * D, "bfloat16"), tp_world_size=1)
    cfg = KvbmBackendConfig(model="m", g3={"enabled": False},
                            g4={"enabled": True, "layout": "canonical", "url": f"file://{tmp_path / 'store'}",
                                "keyring": {"path": str(tmp_path / "keyring.json")}, "max_inflight": 8})
    _, g4 = open_tiers(cfg, ns, HEADS)
    assert isinstance(g4, CanonicalG4)
    seqs = list(range(1000, 1096))
    bpb = ns.layout.bytes_per_block
    blocks = [np.random.default_rng(s).integers(0, 256, bpb, dtype=np.uint8) for s in seqs]
    keys = ns.keys(seqs, "t")
    try:
        # each block twice in a row: the second put's head parts queue right behind the first's, both in flight
        futs = [g4.put([k], [b]) for k, b in zip(keys, blocks) for _ in range(2)]
        rs = [f.result(T) for f in futs]
        assert g4.flush(T)
        assert sum(r.dropped for r in rs) == 0, rs
        assert g4.inner.stats()["written"] == len(seqs) * HEADS  # every part created exactly once
        objs = [f for _, _, fs in os.walk(tmp_path / "store") for f in fs if not f.endswith(".json")]
        assert len(objs) == len(seqs) * HEADS
        per_block = [rs[2 * i].written + rs[2 * i + 1].written for i in range(len(seqs))]
        assert [i for i, n in enumerate(per_block) if n != 1] == [], per_block  # written once per block
        assert sum(r.skipped for r in rs) == len(seqs)  # the other put of each block found it stored
    finally:
        g4.close()
