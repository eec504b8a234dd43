"""A G4 store whose root holds another fleet's G4 store below it (``file:///mnt/g4`` and
``file:///mnt/g4/staging``; ``s3://b/kv`` and ``s3://b/kv/team-b``): the outer store's ``gc``
never deletes the inner store's blocks (review of 2026-11-30: a block name was recognised by its last five
components, so the outer fleet's ``gc --max-age-s`` / ``--target-gb`` deleted the inner fleet's blocks). Real G4
pools on real ``file://`` stores."""
from __future__ import annotations

import os
import time
import uuid

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S


def _cfg(root, keyring) -> G4Config:
    """A ``file://`` store at ``root`` with its keyring; its load bound is no subject here (G4_TIMEOUT_S x 2)."""
    return G4Config(url=f"file://{root}", keyring={"path": str(keyring)}, timeout_s=G4_TIMEOUT_S)


def test_gc_of_the_outer_store_keeps_the_inner_fleets_blocks(tmp_path):
    """Reproduced before the fix: the outer fleet's ``gc --max-age-s 0`` (and ``target_bytes`` 0) deleted all
    16 blocks of the fleet stored under ``g4/team-b`` (its loads then all missed). Now gc scans and deletes
    only the outer store's own blocks (8 here), counts the inner ones ``nested_blocks``, and the inner fleet
    reads back all 16."""
    outer, inner = tmp_path / "g4", tmp_path / "g4" / "team-b"
    ns = namespace()
    with G4Pool(_cfg(inner, tmp_path / "b.json"), ns) as b, G4Pool(_cfg(outer, tmp_path / "a.json"), ns) as a:
        assert put_blocks(b, range(1, 17), "bob").written == 16
        assert put_blocks(a, range(1, 9), "alice").written == 8
        for kw in ({"max_age_s": 0.0}, {"target_bytes": 0}):
            res = run_gc(FsStore(outer, fsync=False), **kw)
            assert read_checked(b, range(1, 17), "bob") == [True] * 16, (kw, res)
            assert res["errors"] == 0 and res["nested_blocks"] == 16, res
            assert res["scanned_objects"] == (8 if "max_age_s" in kw else 0), res
        assert read_checked(a, range(1, 9), "alice") == [False] * 8  # the outer fleet's own blocks did go


def _stale_temp(store_root, obj_name: str) -> str:
    """A crashed writer's temp file beside ``obj_name`` (FsStore's ``.{base}.{host}.{pid}.{uuid}.tmp``), its
    mtime two hours back; returns its store-relative name."""
    d, base = obj_name.rsplit("/", 1)
    rel = f"{d}/.{base}.crashed-host.4242.{uuid.uuid4().hex}.tmp"
    p = store_root / rel
    p.write_bytes(b"x" * 1000)
    old = time.time() - 7200
    os.utime(p, (old, old))
    return rel


def test_gc_of_the_outer_store_keeps_the_inner_fleets_temp_files(tmp_path):
    """Reproduced before the fix: the outer fleet's gc removed the inner fleet's writer temp files older than
    ``temp_grace_s`` (its temp listing walked the whole tree below its root). Now only temp files in the outer
    store's own directories (a block directory, the namespace directory) are removed; the inner store's are
    counted ``nested_temps`` and left for the inner fleet's own gc, which removes them."""
    outer, inner = tmp_path / "g4", tmp_path / "g4" / "team-b"
    ns = namespace()
    with G4Pool(_cfg(inner, tmp_path / "b.json"), ns) as b, G4Pool(_cfg(outer, tmp_path / "a.json"), ns) as a:
        assert put_blocks(b, range(1, 5), "bob").written == 4
        assert put_blocks(a, range(1, 5), "alice").written == 4
    mine = sorted(o.name for o in FsStore(outer, fsync=False).list("") if "/" in o.name and "team-b" not in o.name)
    theirs = sorted(o.name for o in FsStore(inner, fsync=False).list(""))
    ns_json = next(n for n in mine if n.endswith("/namespace.json"))
    outer_temps = [_stale_temp(outer, mine[0] if mine[0] != ns_json else mine[1]), _stale_temp(outer, ns_json)]
    inner_temps = [_stale_temp(inner, next(n for n in theirs if not n.endswith(".json"))),
                   _stale_temp(inner, next(n for n in theirs if n.endswith("/namespace.json")))]
    res = run_gc(FsStore(outer, fsync=False), temp_grace_s=3600.0)
    assert [(inner / t).exists() for t in inner_temps] == [True, True], res
    assert [(outer / t).exists() for t in outer_temps] == [False, False], res
    assert res["deleted_by"]["temp"] == 2 and res["nested_temps"] == 2 and res["errors"] == 0, res
    res = run_gc(FsStore(inner, fsync=False), temp_grace_s=3600.0)  # the inner fleet's own gc: its temps go
    assert res["deleted_by"]["temp"] == 2 and res["nested_temps"] == 0, res
    assert [(inner / t).exists() for t in inner_temps] == [False, False]
