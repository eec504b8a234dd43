"""G3's tenant labels (:mod:`kvbm_backend.pool.g3.tenant_labels`) and the restart purge they allow (2026-12).

G3's journal names a block's tenant by its tag only, so after a restart a tenant revoked while the worker was down and
never seen again kept its restored blocks (refused, never servable) until eviction: real capacity for nothing. Now
the revocation gate (:class:`kvbm_backend.integrations.revoked_tenants.RevokedTenants`) records each tenant's keyring
pseudonym beside G3's journal and, as it starts over a restored pool, deletes the restored blocks of every tenant the
keyring records revoked; a re-created tenant's restored blocks (written before its revocation) are found by its id in
the keyring, so it is not refused afterwards.

Real pools on real files (reopened for each restart), a real keyring file.
"""
from __future__ import annotations

import os

import pytest

from kvbm_backend.crypto.kek import provider_for
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.integrations.revoked_tenants import RevokedTenants
from kvbm_backend.pool.g3 import tenant_labels as tl
from kvbm_backend.pool.g3.index import TagKey, tag_of
from tests.helpers.crash_writer import NS, open_pool
from tests.helpers.g3_restart import CFG, HANG_S
from tests.pool.g3.test_g3_unjournaled_dels import _put, _served

NEVER_S = 3600.0  # the gate's own check interval: never reached (the tests call what they need)
A, B = "acme", "globex"


def _keyring(tmp_path) -> Keyring:
    p = tmp_path / "keys" / "keyring.json"
    return Keyring(p, provider_for(p), reload_every_s=0.0)


def _counts() -> tuple[dict, object]:
    got: dict[str, int] = {}

    def add(**kw: int) -> None:
        for k, v in kw.items():
            got[k] = got.get(k, 0) + v
    return got, add


def _tags(pool) -> list[bytes]:
    return [k.tag if type(k) is TagKey else tag_of(k.tenant) for k in pool.keys()]


@pytest.mark.parametrize("recreated", [False, True], ids=["revoked", "recreated"])
def test_restored_blocks_of_a_tenant_revoked_while_down_are_purged_as_the_gate_starts(tmp_path, recreated):
    """acme and globex stored through a gate (it saw both); the pool closes; acme is revoked (and, in the second case,
    re-created) with the worker down; the pool reopens (blocks restored by tag) and a gate starts over it: acme's
    restored blocks are deleted before the constructor returns (counted: 1 purge, 4 blocks), globex's stay and are
    served; a third open restores globex's alone (the space is free). A revoked acme stays refused, a re-created one is
    not (nothing of it is left to refuse). Old code: nothing deleted (0 purges, 8 blocks) until acme's next request."""
    kr = _keyring(tmp_path)
    try:
        for t in (A, B):
            kr.create(t)
        acme, globex = NS.keys(range(1, 5), A), NS.keys(range(1, 5), B)
        g3 = tmp_path / "g3"
        with open_pool(g3, **CFG) as pool:
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
            assert not gate.refused(A) and not gate.refused(B)  # seen: their labels are recorded
            _put(pool, acme + globex)
            gate.close()
        kr.revoke(A)
        if recreated:
            kr.create(A)
        got, add = _counts()
        with open_pool(g3, **CFG) as pool:
            assert pool.stats()["restored_blocks"] == 8 and all(type(k) is TagKey for k in pool.keys())
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, count=add, start=False)
            try:
                assert (got.get("g3_revoked_purges", 0), got.get("g3_revoked_deleted_blocks", 0)) == (1, 4), got
                assert tag_of(A) not in _tags(pool) and pool.stats()["blocks"] == 4
                assert gate.refused(A) is not recreated
                assert _served(pool, acme + globex) == [False] * 4 + [True] * 4
                gate.drain(HANG_S)
                assert got["g3_revoked_purges"] == 1  # acme's sighting: purged in this process already
            finally:
                gate.close()
        with open_pool(g3, **CFG) as pool:
            assert pool.stats()["restored_blocks"] == 4 and tag_of(A) not in _tags(pool)
    finally:
        kr.close()


def test_labels_survive_a_reopen_a_torn_tail_and_are_compacted_to_the_tags_g3_holds(tmp_path):
    """Labels noted and persisted come back at the next open; a torn last record is ignored (the others read); a
    compaction keeps only the tags asked for and rewrites the file (the torn tail gone); a file of another format is
    ignored, not trusted, and rewritten at the next write; a rewrite's temp file a killed process left is removed at
    the next open."""
    t1, t2, t3 = tag_of("a"), tag_of("b"), tag_of("c")
    l1, l2, l3 = b"1" * 16, b"2" * 16, b"3" * 16
    g3 = tmp_path / "g3"
    with open_pool(g3, **CFG) as pool:
        lb = tl.labels_of(pool)
        assert lb is not None and tl.labels_of(pool) is lb and lb.labels() == {}
        assert lb.note(t1, l1) and lb.note(t2, l2) and not lb.note(t1, l1)
        assert lb.persist()
        assert lb.note(t1, l3) and lb.persist()  # changed: the last record wins
        path = lb.path
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path, "ab") as f:
        f.write(b"\x00" * 17)  # a torn append
    with open_pool(g3, **CFG) as pool:
        lb = tl.labels_of(pool)
        assert lb.labels() == {t1: l3, t2: l2}
        assert lb.compact(lambda t: t == t2)
        assert os.path.getsize(path) == len(tl.MAGIC) + tl.RECORD_BYTES
    with open_pool(g3, **CFG) as pool:
        lb = tl.labels_of(pool)
        assert lb.labels() == {t2: l2}
        with pytest.raises(ValueError, match="16 bytes"):
            lb.note(t3, b"short")
    with open(path, "wb") as f:
        f.write(b"NOTOURS!" + b"\x00" * 40)
    with open_pool(g3, **CFG) as pool:
        lb = tl.labels_of(pool)
        assert lb.labels() == {}
        assert lb.note(t3, l3) and lb.persist()
    stale = g3 / f".{os.path.basename(path)}.4242.{'ab' * 16}.tmp"  # a rewrite's temp a killed worker left
    stale.write_bytes(b"x")
    with open_pool(g3, **CFG) as pool:
        assert tl.labels_of(pool).labels() == {t3: l3}
    assert not stale.exists()


def test_a_link_planted_under_the_labels_name_is_never_followed(tmp_path):
    """A symbolic link in place of the labels file: read as no labels, nothing written through it (its target
    untouched), the pool opens and serves as before."""
    g3 = tmp_path / "g3"
    with open_pool(g3, **CFG) as pool:
        path = tl.labels_of(pool).path
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, path)
    with open_pool(g3, **CFG) as pool:
        lb = tl.labels_of(pool)
        assert lb.labels() == {}
        assert lb.note(tag_of("a"), b"1" * 16) and not lb.persist()
        _put(pool, NS.keys(range(1, 3), "a"))
        assert _served(pool, NS.keys(range(1, 3), "a")) == [True, True]
    assert target.read_bytes() == b"keep"
