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
pool's PUT, the delete right after it (tests/helpers/g4_put_race.py; as tests/helpers/race_store.py orders gc's),
no sleeps."""
from __future__ import annotations

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4 import writer as g4_writer
from tests.helpers import g4_put_race
from tests.helpers.g4_put_race import BPB, HANG_S, NS, read_hit as _read
from tests.helpers.g4_writer import payload


@pytest.fixture
def racing(request, tmp_path):
    """``(store, G4Config kwargs)`` of a :class:`~tests.helpers.g4_put_race.TakenThenGone` store of kind
    ``request.param``, whose next ``gone`` create-exclusive PUTs of ``target`` each meet worker B's copy (published
    by B right before it) and a deleter removes that copy right after the PUT answered (before the writer's check)."""
    yield from g4_put_race.racing(request, tmp_path, timeout_s=30.0)


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_a_copy_deleted_before_the_check_has_the_block_published_again(racing):
    """One round of the race: the block is published again and stored (before: ``skipped_exists``, the put
    reported skipped, i.e. stored, and the name held nothing)."""
    store, cfg = racing
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        key = NS.key(7, tenant="t")
        store.target, store.gone = p.object_name(key), 1
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
        store.target, store.gone = p.object_name(key), 100  # every PUT of this offload races
        res = p.put([key], [payload(8, "t", BPB)]).result(timeout=HANG_S)
        st = p.stats()
        assert store.head(store.target) is None, st
        assert st.get("skipped_exists", 0) == 0, f"nothing under the name, counted stored: {res} {st}"
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1) and st["dropped_error"] == 1, (res, st)
        assert store.raced == g4_writer.PUBLISH_ATTEMPTS, st
        assert not _read(p, 8)
        store.gone = 0
        assert p.put([key], [payload(8, "t", BPB)]).result(timeout=HANG_S).written == 1
        assert _read(p, 8)
