"""A store that answers reads and lookups with an error names it in the log. Review finding (2026-11-30): the
load path turned an error answer (an OSError that is neither an outage nor a throttle: 403 AccessDenied, a
missing bucket, a link planted at an object name of a file:// store) into ``miss_error`` and the lookup path
into "absent", and neither logged anything: only the writer reported such errors (``the store refuses
requests``, rate-limited), so a worker that only reads G4 (a decode worker, ``save_to_g4`` off, GET denied
while PUT is allowed) missed every block with no line saying why. Reads and lookups now report them the same
way. Real file:// pool, a real symbolic link at the object's name."""
from __future__ import annotations

import logging
import os

import numpy as np

from tests.helpers.g4_writer import namespace, payload
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
NS = namespace()
BPB = NS.layout.bytes_per_block


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "refuses requests" in r.getMessage()]


def _linked_object(tmp_path, pool: G4Pool):
    k = NS.key(7, tenant="t")
    assert pool.put([k], [payload(7, "t", BPB)]).result(HANG_S).written == 1
    obj = pool.store.root / pool.object_name(k)
    target = tmp_path / "outside" / "obj"
    target.parent.mkdir()
    os.rename(obj, target)
    os.symlink(target, obj)  # the object's name is now a link: the store refuses it (never followed)
    return k


def test_a_read_the_store_refuses_is_logged_naming_why(tmp_path, caplog):
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": str(tmp_path / "kr.json")})
    with G4Pool(cfg, NS) as pool:
        k = _linked_object(tmp_path, pool)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbm_backend"):
            out = [np.full(BPB, 0xEE, np.uint8)]
            assert pool.get([k], out).result(HANG_S).ok == [False]
            assert (out[0] == 0xEE).all() and pool.stats()["miss_error"] == 1
            msgs = _refusals(caplog)
            assert len(msgs) == 1 and "symbolic link" in msgs[0] and pool.object_name(k) in msgs[0], msgs
            # rate-limited as the writer's lines are, and a write that succeeds meanwhile does not reset it
            assert pool.put([NS.key(8, tenant="t")], [payload(8, "t", BPB)]).result(HANG_S).written == 1
            assert pool.get([k], out).result(HANG_S).ok == [False]
        assert (out[0] == 0xEE).all() and pool.stats()["miss_error"] == 2
        assert len(_refusals(caplog)) == 1


def test_a_lookup_the_store_refuses_is_logged_naming_why(tmp_path, caplog):
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": str(tmp_path / "kr.json")})
    with G4Pool(cfg, NS) as pool:
        k = _linked_object(tmp_path, pool)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbm_backend"):
            assert pool.lookup_prefix([k]).result(HANG_S) == 0
        msgs = _refusals(caplog)
        assert len(msgs) == 1 and "not a regular file" in msgs[0] and pool.object_name(k) in msgs[0], msgs
