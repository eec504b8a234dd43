"""An encrypted G4 frame whose token digest the store rewrote must not be served (docs/format.md "Token digest":
"a store that changes it (to relabel a block for another prompt of the same name) fails the GCM tag").

A frame sealed as format version 1 (written without a digest: before 2026-12-01, or by any writer whose key names
none) binds no digest in its AAD. The reader checks a version-1 encrypted frame's digest only against the request,
so a store that wrote the wanted digest into bytes 152..167 (outside the header check too) relabelled it and the
reader served it (review finding 2026-12-02, old code: ok [True]). Such a frame is now a ``token_digest`` miss."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvbm_backend.config import G4Config
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4.pool import G4Pool

LAYOUT = KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64, dtype="bfloat16")
NS = Namespace(model="rev/crypto-digest", revision="r1", layout=LAYOUT, tp_world_size=1)
D_FORGED = b"\x07" * 16
HANG_S = 600.0  # a hang guard, not a bound


def _pool(tmp_path):
    store = tmp_path / "g4"
    store.mkdir(exist_ok=True)
    return G4Pool(G4Config(url=f"file://{store}", keyring={"path": str(tmp_path / "k" / "keyring.json")},
                           encrypt=True, timeout_s=10.0, dir_fanout=4), NS)


def _relabel(pool, key, digest):
    p = Path(pool.cfg.url[len("file://"):]) / pool.object_name(key)
    b = bytearray(p.read_bytes())
    b[152:168] = digest  # the token digest: outside header_check (bytes 0..143) and, in version 1, outside the AAD
    p.write_bytes(bytes(b))


def test_encrypted_frame_with_rewritten_digest_is_not_served(tmp_path):
    pool = _pool(tmp_path)
    try:
        blk = np.random.default_rng(1).integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8)
        k = NS.key(42, "tenant-a")  # no digest: sealed as an encrypted version-1 frame
        assert pool.put([k], [blk]).result(timeout=HANG_S).written == 1
        assert pool.flush(60)
        _relabel(pool, k, D_FORGED)
        forged = NS.keys([42], "tenant-a", 0, D_FORGED)  # another prompt of the same name, asking with its digest
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8)]
        ok = pool.get(forged, out).result(timeout=HANG_S).ok
        assert ok == [False], ("an encrypted frame whose token digest the store rewrote was served for that digest "
                               f"(stats {pool.stats().get('misses_by_reason')})")
    finally:
        pool.close()


def test_control_version_2_frame_relabelled_fails_its_tag(tmp_path):
    pool = _pool(tmp_path)
    try:
        blk = np.random.default_rng(2).integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8)
        k = NS.keys([43], "tenant-a", 0, b"\x01" * 16)
        assert pool.put(k, [blk]).result(timeout=HANG_S).written == 1
        assert pool.flush(60)
        _relabel(pool, k[0], D_FORGED)
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8)]
        assert pool.get(NS.keys([43], "tenant-a", 0, D_FORGED), out).result(timeout=HANG_S).ok == [False]
    finally:
        pool.close()
