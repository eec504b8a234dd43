"""A G4 offload whose create-exclusive PUT met another copy that was deleted before the writer's check is never
counted stored (hunt finding, 2026-12-03).

The race: worker B publishes its copy under the name, this pool's create-exclusive PUT meets it (a file store's
``link`` EEXIST, :func:`kvbm_backend.pool.g4.fs_put.link_exclusive`, after its re-links; S3 ``412``), and a deleter
(gc, or a load dropping a bad copy) removes it before the writer's GET of the frame header. Before, that GET found
nothing and :meth:`~kvbm_backend.pool.g4.writer.G4Writer._serves_existing` answered "serves" for it: the block
counted ``skipped_exists`` and the caller heard "stored" (the tier tells the router) although the name held
nothing. Now the writer publishes again (the name is free: create-exclusive, it tears no copy written meanwhile),
up to ``PUBLISH_ATTEMPTS`` PUTs; a block whose every PUT met a copy deleted before the check is dropped
(``dropped_error``), never counted stored.

Real stores (file, SeaweedFS S3) and a real G4Pool; the only hook orders the race: B's publish right before this
pool's PUT, the delete right after it (as tests/helpers/race_store.py orders gc's), no sleeps."""
from __future__ import annotations

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4 import writer as g4_writer
from kvbm_backend.pool.g4.s3_obstore import ObstoreS3Store
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # a hang guard only
NS = namespace()
BPB = NS.layout.bytes_per_block


class _TakenThenDeleted:
    """A store where each of the next ``rounds`` create-exclusive PUTs of ``target`` meets worker B's copy
    (published by B right before it) and a deleter removes that copy right after the PUT answered (before the
    writer's check): real store operations, in the order of the race; counted in ``raced``."""

    target: str | None = None
    rounds = 0
    raced = 0

    def put_if_absent(self, name, data):
        if name != self.target or self.rounds <= 0:
            return super().put_if_absent(name, data)  # type: ignore[misc]
        self.rounds -= 1
        assert super().put_if_absent(name, b"worker B's copy" * 64)  # type: ignore[misc]
        created = super().put_if_absent(name, data)  # type: ignore[misc]  # this pool's PUT: the name is taken
        self.delete(name)  # type: ignore[attr-defined]  # gc, or another worker's load dropping it
        self.raced += 1
        return created


class _RaceFs(_TakenThenDeleted, FsStore):
    pass


class _RaceS3(_TakenThenDeleted, ObstoreS3Store):
    pass


@pytest.fixture
def racing(request, tmp_path):
    """``(store, G4Config kwargs)`` of a :class:`_TakenThenDeleted` store of kind ``request.param``."""
    kr = {"keyring": {"path": str(tmp_path / "keys" / "kr.json")}, "timeout_s": 30.0}
    if request.param == "file":
        yield _RaceFs(tmp_path / "g4", fsync=False), {"url": f"file://{tmp_path / 'g4'}", "fsync": False, **kr}
        return
    sw, prefix = request.getfixturevalue("seaweed"), request.getfixturevalue("s3_prefix")
    st = _RaceS3(sw.bucket, prefix, endpoint_url=sw.endpoint, timeout_s=30.0)
    yield st, {"url": sw.url(prefix), "endpoint_url": sw.endpoint, **kr}
    st.close()


def _read(p: G4Pool, seq: int) -> bool:
    out = [np.full(BPB, 0xEE, np.uint8)]
    ok = p.get(NS.keys([seq], tenant="t"), out).result(timeout=HANG_S).ok[0]
    assert not ok or np.array_equal(out[0], payload(seq, "t", BPB)), "a hit with wrong bytes"
    return ok


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_a_copy_deleted_before_the_check_has_the_block_published_again(racing):
    """One round of the race: the block is published again and stored (before: ``skipped_exists``, the put
    reported skipped, i.e. stored, and the name held nothing)."""
    store, cfg = racing
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        key = NS.key(7, tenant="t")
        store.target, store.rounds = p.object_name(key), 1
        res = p.put([key], [payload(7, "t", BPB)]).result(timeout=HANG_S)
        st = p.stats()
        assert store.raced == 1, st
        assert st.get("skipped_exists", 0) == 0, f"nothing under the name, counted stored: {res} {st}"
        assert (res.written, res.skipped, res.dropped) == (1, 0, 0), (res, st)
        assert store.head(store.target) is not None and _read(p, 7), "reported written, not stored"


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_a_block_whose_every_put_met_a_copy_deleted_before_the_check_is_dropped(racing):
    """The race at every PUT (``PUBLISH_ATTEMPTS`` of them): the block is dropped (``dropped_error``), not stored,
    never ``skipped_exists``; the next offload of it, unraced, is written."""
    store, cfg = racing
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        key = NS.key(8, tenant="t")
        store.target, store.rounds = p.object_name(key), 100  # every PUT of this offload races
        res = p.put([key], [payload(8, "t", BPB)]).result(timeout=HANG_S)
        st = p.stats()
        assert store.head(store.target) is None, st
        assert st.get("skipped_exists", 0) == 0, f"nothing under the name, counted stored: {res} {st}"
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1) and st["dropped_error"] == 1, (res, st)
        assert store.raced == g4_writer.PUBLISH_ATTEMPTS, st
        assert not _read(p, 8)
        store.rounds = 0
        assert p.put([key], [payload(8, "t", BPB)]).result(timeout=HANG_S).written == 1
        assert _read(p, 8)
