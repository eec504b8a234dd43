"""Two more "nothing there, counted stored" cases of the G4 writer (review of edb75b0, 2026-12-03).

1. The late settle (:class:`~kvbm_backend.pool.g4.settle.LateSettler`). This pool's create-exclusive PUT met worker
   B's copy and its answer was lost (:class:`~kvbm_backend.pool.g4.store.PutUnsettled`); the settle HEAD later finds
   other bytes (B's), and a deleter (gc, a load dropping a bad copy) removes them before the writer's frame-header
   GET. Before, that GET finding nothing answered "serves" (``G4Writer._serves_existing``): the block counted
   ``skipped_exists`` and the caller heard "stored" with nothing under the name. Now the writer seals the block
   again from the caller's buffer and publishes it create-exclusive as a direct offload (``written``), or drops it
   with the direct path's reason (``dropped_error`` when each of its ``PUBLISH_ATTEMPTS`` PUTs met a copy gone by
   the check); a new PUT whose answer is lost too is settled in turn.
2. ``namespace.json`` (``G4Writer.write_namespace_json``): a create-exclusive PUT that found the name taken and a
   GET after it that found nothing set ``namespace_written`` although no file was there, so no later offload wrote
   it. Now it is written again (bounded); a name taken and gone at each PUT leaves it unset
   (``namespace_json_errors``), and the next offload written writes it.

Real stores (file, SeaweedFS S3) and a real G4Pool; the only hooks order the race in the store (B's publish right
before this pool's PUT, the delete right after the settle's look or the PUT: tests/helpers/g4_put_race.py, shared
with tests/pool/g4/test_g4_put_gone_race.py); no sleeps. A file store never leaves a PUT unsettled: its test subclass
raises PutUnsettled after the real PUT and settles by the MD5 of the file, as an S3 store does by the ETag."""
from __future__ import annotations

import json

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4 import writer as g4_writer
from kvbm_backend.pool.g4.naming import namespace_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers import g4_put_race
from tests.helpers.g4_put_race import BPB, HANG_S, NS, TakenThenGone, read_hit as _read
from tests.helpers.g4_writer import payload


@pytest.fixture
def racing(request, tmp_path, monkeypatch):
    """``(store, G4Config kwargs)`` of a :class:`~tests.helpers.g4_put_race.TakenThenGone` store of kind
    ``request.param``. ``timeout_s`` 2, no retries: an unsettled PUT is re-checked from 0.5 s on, for up to 80 s
    (:data:`~tests.helpers.g4_put_race.WIDE_SETTLE_BOUNDS` puts' bounds; the bound is no subject here: with the
    product's 8 s a check the busy CI VM froze for 5.5 s ended the block ``dropped_unsettled``)."""
    g4_put_race.wide_settle_bound(monkeypatch)
    yield from g4_put_race.racing(request, tmp_path, timeout_s=2.0, retries=0)


def _put(p: G4Pool, store: TakenThenGone, seq: int, **race: int):
    key = NS.key(seq, tenant="t")
    store.target = p.object_name(key)
    for k, v in race.items():
        setattr(store, k, v)
    res = p.put([key], [payload(seq, "t", BPB)]).result(timeout=HANG_S)
    return res, p.stats()


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_a_late_settle_whose_found_copy_is_gone_publishes_the_block_again(racing):
    """Before: ``skipped_exists`` 1, PutResult(written=0, skipped=1), nothing under the name."""
    store, cfg = racing
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        res, st = _put(p, store, 7, unsettled=1, delete_at_settle=1)
        assert store.delete_at_settle == 0 and store.raced == 1, st  # settled, deleted, published again
        assert st.get("skipped_exists", 0) == 0, f"nothing under the name, counted stored: {res} {st}"
        assert (res.written, res.skipped, res.dropped) == (1, 0, 0), (res, st)
        assert (st["unsettled_puts"], st["written"], st.get("settled_late", 0)) == (1, 1, 0), st
        assert store.head(store.target) is not None and _read(p, 7), "reported written, not stored"


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_a_late_settle_whose_republished_puts_each_meet_a_copy_gone_drops_the_block(racing):
    """The block published again after the settle, and each of its PUTs (``PUBLISH_ATTEMPTS``) meets a copy deleted
    before the check: ``dropped_error`` as on the direct path, nothing stored; the next offload, unraced, is written.
    Before: ``skipped_exists`` at the settle."""
    store, cfg = racing
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        res, st = _put(p, store, 8, unsettled=1, delete_at_settle=1, gone=100)
        assert st.get("skipped_exists", 0) == 0, f"nothing under the name, counted stored: {res} {st}"
        assert store.raced == 1 + g4_writer.PUBLISH_ATTEMPTS, st
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1) and st["dropped_error"] == 1, (res, st)
        assert store.head(store.target) is None and not _read(p, 8)
        store.gone = 0
        assert p.put([NS.key(8, tenant="t")], [payload(8, "t", BPB)]).result(timeout=HANG_S).written == 1
        assert _read(p, 8)


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_a_republished_put_whose_answer_is_lost_too_is_settled_in_turn(racing):
    """The republished PUT lands and its answer is lost as well: settled by its own MD5, ``written`` and
    ``settled_late``. Before: ``skipped_exists`` at the first settle."""
    store, cfg = racing
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        res, st = _put(p, store, 9, unsettled=1, delete_at_settle=1, lost_answers=1)
        assert st.get("skipped_exists", 0) == 0, f"nothing under the name, counted stored: {res} {st}"
        assert store.raced == 2 and store.lost_answers == 0, st
        assert (res.written, res.skipped, res.dropped) == (1, 0, 0), (res, st)
        assert (st["unsettled_puts"], st["written"], st["settled_late"]) == (1, 1, 1), st
        assert _read(p, 9)


def _ns_doc(store) -> dict | None:
    body = store.get(namespace_name(NS.fingerprint))
    return None if body is None else json.loads(bytes(body))


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_namespace_json_taken_and_gone_is_written_again(racing):
    """Before: ``namespace_written`` True with no ``namespace.json`` in the store (and never written after)."""
    store, cfg = racing
    store.target, store.gone = namespace_name(NS.fingerprint), 1
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        assert p.flush(HANG_S)
        st = p.stats()
        assert store.raced == 1, st
        assert _ns_doc(store) is not None, f"namespace_written={p.writer.namespace_written}, nothing there: {st}"
        assert p.writer.namespace_written and st.get("namespace_json_errors", 0) == 0, st


@pytest.mark.parametrize("racing", ["file", "s3"], indirect=True)
def test_namespace_json_taken_and_gone_at_each_put_is_left_to_the_next_offload(racing):
    """Each of ``PUBLISH_ATTEMPTS`` PUTs meets a copy gone by the GET after it: not written, counted
    ``namespace_json_errors``; the next offload written writes it. Before: marked written, never written."""
    store, cfg = racing
    store.target, store.gone = namespace_name(NS.fingerprint), 100
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        assert p.flush(HANG_S)
        st = p.stats()
        assert not p.writer.namespace_written, f"marked written with no namespace.json there: {st}"
        assert store.raced == g4_writer.PUBLISH_ATTEMPTS and _ns_doc(store) is None, st
        assert st["namespace_json_errors"] == 1, st
        store.gone = 0
        assert p.put([NS.key(3, tenant="t")], [payload(3, "t", BPB)]).result(timeout=HANG_S).written == 1
        assert p.writer.namespace_written and _ns_doc(store) is not None, p.stats()
        assert _read(p, 3)
