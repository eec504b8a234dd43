"""A load or lookup that fails with an exception no store, I/O or frame error explains (a bug: a TypeError, a
store plugin raising something it should not) is named in the log. Review finding (2026-11-30): the reader's and
the lookups' catch-all turned it into a silent ``miss_error`` / absent key, so an operator saw misses and no line
said why. It stays a miss (never served, the engine never sees the exception), logged rate-limited with its type,
message and traceback. Real file:// pool; the fault enters at the store boundary (a real FsStore subclass)."""
from __future__ import annotations

import logging

import numpy as np

from tests.helpers.g4_writer import namespace, payload
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
NS = namespace()
BPB = NS.layout.bytes_per_block


class _BuggyStore(FsStore):
    """A real file store with a plugin bug for the names in ``bad``: its reads answer the object's size as a
    string (the reader's own code then raises a TypeError), its HEADs raise a ValueError."""

    def __init__(self, root):
        super().__init__(root)
        self.bad: set[str] = set()

    def get_into(self, name, buf):
        n = super().get_into(name, buf)
        return str(n) if name in self.bad and n is not None else n

    def head(self, name):
        if name in self.bad:
            raise ValueError(f"plugin bug: cannot head {name}")
        return super().head(name)


def _unexpected(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and "failed unexpectedly" in r.getMessage()]


def _pool(tmp_path):
    store = _BuggyStore(tmp_path / "store")
    cfg = G4Config(url=store.url, keyring={"path": str(tmp_path / "kr.json")}, timeout_s=G4_TIMEOUT_S)
    return store, G4Pool(cfg, NS, store=store)


def test_a_load_that_fails_unexpectedly_is_a_miss_named_in_the_log(tmp_path, caplog):
    store, pool = _pool(tmp_path)
    with pool:
        k, good = NS.key(7, tenant="t"), NS.key(8, tenant="t")
        assert pool.put([k, good], [payload(7, "t", BPB), payload(8, "t", BPB)]).result(HANG_S).written == 2
        store.bad.add(pool.object_name(k))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbm_backend"):
            out = [np.full(BPB, 0xEE, np.uint8)]
            assert pool.get([k], out).result(HANG_S).ok == [False]
            assert (out[0] == 0xEE).all() and pool.stats()["miss_error"] == 1
            recs = _unexpected(caplog)
            assert len(recs) == 1, [r.getMessage() for r in caplog.records]
            msg = recs[0].getMessage()
            assert "load" in msg and "TypeError" in msg and "'<'" in msg and "never served" in msg, msg
            assert recs[0].exc_info is not None and recs[0].exc_info[0] is TypeError  # the traceback, once
            assert "_load_from" in caplog.text  # it names where the bug is
            # rate-limited: a second failing load adds no line; the pool keeps serving the rest
            assert pool.get([k], out).result(HANG_S).ok == [False]
            ok_out = [np.zeros(BPB, np.uint8)]
            assert pool.get([good], ok_out).result(HANG_S).ok == [True]
        assert (ok_out[0] == payload(8, "t", BPB)).all()
        assert (out[0] == 0xEE).all() and pool.stats()["miss_error"] == 2
        assert len(_unexpected(caplog)) == 1


def test_a_lookup_that_fails_unexpectedly_is_absent_and_named_in_the_log(tmp_path, caplog):
    store, pool = _pool(tmp_path)
    with pool:
        k = NS.key(7, tenant="t")
        assert pool.put([k], [payload(7, "t", BPB)]).result(HANG_S).written == 1
        assert pool.lookup_prefix([k]).result(HANG_S) == 1
        store.bad.add(pool.object_name(k))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbm_backend"):
            assert pool.lookup_prefix([k]).result(HANG_S) == 0
            assert pool.lookup_prefix([k]).result(HANG_S) == 0
        recs = _unexpected(caplog)
        assert len(recs) == 1, [r.getMessage() for r in caplog.records]
        msg = recs[0].getMessage()
        assert "lookup" in msg and "ValueError" in msg and "plugin bug" in msg, msg
        assert recs[0].exc_info is not None and recs[0].exc_info[0] is ValueError
