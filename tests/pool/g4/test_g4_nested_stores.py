"""A G4 store whose root holds another fleet's G4 store below it (``file:///mnt/g4`` and
``file:///mnt/g4/staging``; ``s3://b/kv`` and ``s3://b/kv/team-b``): the outer store's ``gc``
never deletes the inner store's blocks (review of 2026-11-30: a block name was recognised by its last five
components, so the outer fleet's ``gc --max-age-s`` / ``--target-gb`` deleted the inner fleet's blocks). Real G4
pools on real ``file://`` stores."""
from __future__ import annotations

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked


def test_gc_of_the_outer_store_keeps_the_inner_fleets_blocks(tmp_path):
    """Reproduced before the fix: the outer fleet's ``gc --max-age-s 0`` (and ``target_bytes`` 0) deleted all
    16 blocks of the fleet stored under ``g4/team-b`` (its loads then all missed). Now gc scans and deletes
    only the outer store's own blocks (8 here), counts the inner ones ``nested_blocks``, and the inner fleet
    reads back all 16."""
    outer, inner = tmp_path / "g4", tmp_path / "g4" / "team-b"
    ns = namespace()
    with G4Pool(G4Config(url=f"file://{inner}", keyring={"path": str(tmp_path / "b.json")}), ns) as b, \
            G4Pool(G4Config(url=f"file://{outer}", keyring={"path": str(tmp_path / "a.json")}), ns) as a:
        assert put_blocks(b, range(1, 17), "bob").written == 16
        assert put_blocks(a, range(1, 9), "alice").written == 8
        for kw in ({"max_age_s": 0.0}, {"target_bytes": 0}):
            res = run_gc(FsStore(outer, fsync=False), **kw)
            assert read_checked(b, range(1, 17), "bob") == [True] * 16, (kw, res)
            assert res["errors"] == 0 and res["nested_blocks"] == 16, res
            assert res["scanned_objects"] == (8 if "max_age_s" in kw else 0), res
        assert read_checked(a, range(1, 9), "alice") == [False] * 8  # the outer fleet's own blocks did go
