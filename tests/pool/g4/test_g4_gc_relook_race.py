"""gc's age pass keeps a block a worker wrote *after* gc listed the name (hunt finding, 2026-12-03).

gc decides age from the listing (``o.mtime``), but an object whose listed size is impossible is looked at again
(:meth:`.gc_sizes.BlockSizes.judge`: ``stat`` / HEAD). Before, when that look found a possible size the pass went
on with the *fresh* ObjectInfo and deleted it with ``delete_if_listed(judged)``: if between the listing and the
look the name changed hands (the old, truncated copy dropped by a worker's load, the block offloaded again), the
conditional delete was conditioned on the new object, so the new, seconds-old block was deleted as "age" although
its own mtime is young (module doc of gc.py, "Deleting what was listed": a copy published since the listing must
be kept). Now a look that finds another object than the one listed (its version: inode/mtime/size, S3 ETag) counts
the listed one ``changed_since_listed``, and the new object is left to the next pass. The same holds where the
object found is no block either ("kept": an impossible size, no layout known): before, deleted as "age".

Real worker processes (tests/helpers/g4_writer.py: a G4Pool over the shared file store and keyring), a real
truncated object, real ``run_gc``; the only hook orders the race: the other workers' load and re-offload run right
before gc's look at the listed name (as test_g4_drop_race.py and tests/helpers/race_store.py order theirs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.s3_store import S3Store
from tests.helpers.paths import HELPERS

WRITER = str(HELPERS / "g4_writer.py")
HANG_S = 600.0  # a hang guard only
T0 = 1_700_000_000.0  # "long ago" (2023)
MAX_AGE_S = 3600.0


def _worker(spec: dict) -> dict:
    out = subprocess.run([sys.executable, WRITER, json.dumps(spec)], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class _RaceAtLook:
    """A store mixin: right before its first ``stat`` of ``target`` (gc's look at an impossible listed size: a file's
    ``stat``, an S3 HEAD), ``run_race`` runs (the other workers' load and re-offload); counted in ``raced``."""

    target: str | None = None
    run_race = None
    raced = 0

    def stat(self, name):
        if name == self.target:
            self.target = None
            self.run_race()
            self.raced += 1
        return super().stat(name)  # type: ignore[misc]


class _LookRaced(_RaceAtLook, FsStore):
    """gc's store: right before its first ``stat`` of ``target`` (the look at an impossible listed size), worker
    B loads the block (finds the truncated copy bad and drops it) and worker C offloads it again."""


def test_gc_age_pass_keeps_a_block_written_again_after_the_listing(tmp_path):
    root = tmp_path / "store"
    cfg = {"url": f"file://{root}", "keyring": {"path": str(tmp_path / "keys" / "keyring.json")}, "timeout_s": 60.0,
           "fsync": False}
    spec = {"cfg": cfg, "seqs": [7], "tenant": "t"}
    assert _worker({**spec, "mode": "write"})["written"] == 1  # worker A

    st = FsStore(root, fsync=False)
    blocks = [o.name for o in st.list() if parse_block_name(o.name)]
    assert len(blocks) == 1, blocks
    name = blocks[0]
    path = root / name
    path.write_bytes(path.read_bytes()[:HEADER_BYTES + 100])  # the stored copy got cut short (old, bad)
    os.utime(path, (T0, T0))

    gc_store = _LookRaced(root, fsync=False)
    gc_store.target = name

    def race() -> None:
        r = _worker({**spec, "mode": "read"})  # worker B: the load finds it bad, drops it (a miss)
        assert r["ok"] == [False], r
        assert not path.exists(), "the truncated copy was not dropped by the load"
        assert _worker({**spec, "mode": "write"})["written"] == 1  # worker C: offloaded again, a fresh block
        assert os.stat(path).st_size > HEADER_BYTES + 100

    gc_store.run_race = race
    res = run_gc(gc_store, max_age_s=MAX_AGE_S)
    assert gc_store.raced == 1, res
    # the block on the store now was written seconds ago: no age pass of max_age_s=3600 may delete it
    assert path.exists(), f"gc deleted a block written after its listing as 'age': {res}"
    assert (res["deleted_by"]["age"], res["deleted_objects"], res["changed_since_listed"]) == (0, 0, 1), res
    assert (res["invalid_size"], res["errors"]) == (0, 0), res
    r = _worker({**spec, "mode": "read"})
    assert r["ok"] == [True] and r["correct"] == [True], r


def test_gc_age_pass_keeps_an_object_of_no_known_size_written_after_the_listing(tmp_path):
    """The "kept" verdict (an impossible size where no ``namespace.json`` gives the layout): the listed object is old,
    the one at its name by gc's look is another (written since, young), of an impossible size too. Before: deleted as
    ``age`` (conditioned on the new object), though its own mtime is seconds old; now kept, ``changed_since_listed``."""
    root = tmp_path / "store"
    name = f"0123456789abcdef/{'ab' * 16}/0/00/{7:032x}"  # a block name; its namespace has no namespace.json
    path = root / name
    FsStore(root, fsync=False).put_if_absent(name, b"")
    os.truncate(path, 1 << 40)  # 1 TiB (sparse): no block of any layout
    os.utime(path, (T0, T0))

    gc_store = _LookRaced(root, fsync=False)
    gc_store.target = name

    def race() -> None:
        path.unlink()  # the listed object is deleted ...
        with open(path, "wb") as f:  # ... and another written at its name since the listing (young)
            os.truncate(f.fileno(), (1 << 40) + 4096)

    gc_store.run_race = race
    res = run_gc(gc_store, max_age_s=MAX_AGE_S)
    assert gc_store.raced == 1, res
    assert path.exists() and os.stat(path).st_size == (1 << 40) + 4096, f"gc deleted the new object as 'age': {res}"
    assert (res["deleted_by"]["age"], res["deleted_objects"], res["changed_since_listed"]) == (0, 0, 1), res


class _LookRacedS3(_RaceAtLook, S3Store):
    """As :class:`_LookRaced`, on SeaweedFS: the HEAD gc sends to look at the listed name comes after the race."""


def test_gc_age_pass_keeps_a_block_written_again_after_the_listing_s3(tmp_path, seaweed, s3_prefix):
    cfg = {"url": seaweed.url(s3_prefix), "endpoint_url": seaweed.endpoint,
           "keyring": {"path": str(tmp_path / "keys" / "keyring.json")}, "timeout_s": 60.0}
    spec = {"cfg": cfg, "seqs": [7], "tenant": "t"}
    assert _worker({**spec, "mode": "write"})["written"] == 1  # worker A
    st = S3Store(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=30.0)
    blocks = [o for o in st.list() if parse_block_name(o.name)]
    assert len(blocks) == 1, blocks
    name = blocks[0].name
    good = bytes(st.get(name))
    st.delete(name)
    assert st.put_if_absent(name, good[:HEADER_BYTES + 100])  # a stored copy cut short
    # S3 cannot backdate LastModified: the age pass here is max_age_s=0 ("every block"), so the point is only
    # which object it deletes: the listed (truncated) one, never the copy written after the listing
    gc_store = _LookRacedS3(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=30.0)
    gc_store.target = name

    def race() -> None:
        r = _worker({**spec, "mode": "read"})  # worker B: drops the bad copy
        assert r["ok"] == [False], r
        assert st.head(name) is None, "the truncated copy was not dropped by the load"
        assert _worker({**spec, "mode": "write"})["written"] == 1  # worker C: written again

    gc_store.run_race = race
    res = run_gc(gc_store, max_age_s=0)
    assert gc_store.raced == 1, res
    assert st.head(name) is not None, f"gc deleted the copy written after its listing: {res}"
    assert (res["deleted_by"]["age"], res["deleted_objects"], res["changed_since_listed"]) == (0, 0, 1), res
    r = _worker({**spec, "mode": "read"})
    assert r["ok"] == [True] and r["correct"] == [True], r
