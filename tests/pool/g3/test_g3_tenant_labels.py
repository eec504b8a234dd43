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

import logging
import os
import threading

import pytest

from kvbm_backend.crypto.kek import provider_for
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.integrations.revoked_tenants import RevokedTenants
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g3 import tenant_labels as tl
from kvbm_backend.pool.g3.index import TagKey, tag_of
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.g3_restart import CFG, HANG_S
from tests.pool.g3.test_g3_unjournaled_dels import _lines, _put, _served

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


def _on_disk(path) -> dict[bytes, bytes]:
    """The labels the file at ``path`` holds (none when it is not there)."""
    try:
        with open(path, "rb") as f:
            return tl.parse(f.read())[0]
    except FileNotFoundError:
        return {}


def _restart_purges(kr, g3, tenant: str, blocks: int) -> None:
    """``tenant`` revoked while the worker is down: the next gate over the reopened pool deletes its ``blocks``
    restored blocks as it starts (found by its label)."""
    kr.revoke(tenant)
    got, add = _counts()
    with open_pool(g3, **CFG) as pool:
        gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, count=add, start=False)
        try:
            assert (got.get("g3_revoked_purges", 0), got.get("g3_revoked_deleted_blocks", 0)) == (1, blocks), got
            assert tag_of(tenant) not in _tags(pool)
        finally:
            gate.close()


def test_a_save_handed_off_after_the_gate_closed_is_labelled_for_the_restart_purge(tmp_path):
    """Review of 3f27fa9: the vLLM connector closed its gate before the worker (``ConnectorParts.close``), and the
    worker's shutdown hands off the saves still staged (``Offloads.close`` -> ``put_g3``). A new tenant's first save
    is then its first sighting: its label was noted in memory and its write submitted to the gate's executor, shut
    down already (dropped silently), after ``close`` had run its last write. The blocks were published and restored at
    the next start with no label, so a revocation while the worker was down was not purged as the gate started. Now
    ``put_g3`` writes a tenant's label before handing its first blocks to G3, closed or not (and the connector closes
    the gate after the worker). Old code: the restored acme blocks had no label (``{}``)."""
    kr = _keyring(tmp_path)
    try:
        kr.create(A)
        keys = NS.keys(range(1, 5), A)
        g3 = tmp_path / "g3"
        with open_pool(g3, **CFG) as pool:
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
            gate.close()  # the gate first, then a save of a tenant not seen yet is handed off
            f = gate.put_g3(A, lambda: pool.put(keys, [payload(k.seq_hash) for k in keys]), len(keys))
            assert f is not None and f.result(timeout=HANG_S).written == 4
            assert pool.flush(HANG_S)
        with open_pool(g3, **CFG) as pool:
            assert pool.stats()["restored_blocks"] == 4
            assert tag_of(A) in tl.labels_of(pool).labels(), "acme's blocks were restored, but its label never written"
        _restart_purges(kr, g3, A, 4)
    finally:
        kr.close()


def test_a_new_tenants_label_is_in_its_file_before_its_first_blocks_are_handed_to_g3(tmp_path):
    """Before 2026-12-03 a new tenant's label was written on the ``kvbm-revoke`` thread some time after its first
    sighting, while its first blocks were already on their way to G3: a worker killed in between restarted with
    the blocks journaled and no label. Now ``put_g3`` writes it first: here the ``kvbm-revoke`` thread is held busy,
    and the label is in the file when the put is handed over. Old code: the file held no label then."""
    kr = _keyring(tmp_path)
    hold = threading.Event()
    try:
        kr.create(A)
        keys = NS.keys(range(1, 5), A)
        with open_pool(tmp_path / "g3", **CFG) as pool:
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
            busy = gate._work.submit(hold.wait, HANG_S)  # the gate's thread busy (a long purge, say)
            try:
                path = tl.labels_of(pool).path
                on_disk: list[dict] = []

                def put():
                    on_disk.append(_on_disk(path))
                    return pool.put(keys, [payload(k.seq_hash) for k in keys])
                f = gate.put_g3(A, put, len(keys))
                assert f is not None and f.result(timeout=HANG_S).written == 4
                assert on_disk == [{tag_of(A): kr.pseudonym(A)}], on_disk
            finally:
                hold.set()
                busy.result(HANG_S)
                gate.close()
    finally:
        kr.close()


def test_full_labels_are_compacted_against_the_tags_g3_holds_and_a_new_tenant_is_labelled(tmp_path, monkeypatch):
    """The labels keep at most ``MAX_LABELS`` tags (4 here) and were compacted only as a gate started: a long-running
    worker that met that many ``cache_salt`` values labelled no new tenant again, even once G3 held none of their
    blocks. Now a tenant refused for room makes the gate compact the labels against the tags G3 holds (and the
    tenants seen) and label it then: its restored blocks are purged at a restart after its revocation. Old code:
    acme never labelled (0 purges)."""
    monkeypatch.setattr(tl, "MAX_LABELS", 4)
    kr = _keyring(tmp_path)
    try:
        kr.create(A)
        olds = [f"old{i}" for i in range(4)]
        g3 = tmp_path / "g3"
        with open_pool(g3, **CFG) as pool:
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
            for i, t in enumerate(olds):
                keys = NS.keys(range(10 * i + 1, 10 * i + 3), t)
                assert gate.put_g3(t, lambda k=keys: pool.put(k, [payload(x.seq_hash) for x in k]), 2) is not None
            assert pool.flush(HANG_S)
            gate.close()
        with open_pool(g3, **CFG) as pool:
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)  # their blocks held: labels kept
            try:
                lb = tl.labels_of(pool)
                assert len(lb.labels()) == 4
                pool.delete(list(pool.keys())).result(timeout=HANG_S)  # evicted (G3 holds none of theirs now)
                keys = NS.keys(range(100, 104), A)
                f = gate.put_g3(A, lambda: pool.put(keys, [payload(k.seq_hash) for k in keys]), 4)
                assert f is not None and f.result(timeout=HANG_S).written == 4
                gate.drain(HANG_S)
                assert lb.labels() == {tag_of(A): kr.pseudonym(A)}, "the full labels never made room for acme"
                assert _on_disk(lb.path) == {tag_of(A): kr.pseudonym(A)}
            finally:
                gate.close()
        _restart_purges(kr, g3, A, 4)
    finally:
        kr.close()


def test_a_failed_label_write_is_kept_counted_logged_once_a_minute_and_retried_at_the_next_check(tmp_path, caplog):
    """A label write that failed (here a directory planted where the labels file goes) was retried only with the next
    new tenant or at close, its WARNING logged at every attempt, and nothing counted it. Now every failure is counted
    (``g3_tenant_label_errors``), the WARNING is one per kind and pool per minute, the blocks are stored anyway (a
    label only serves a later purge), and each keyring check writes the labels kept: once the drive is back the
    label is there and the restart purge finds it. Old code: no counter, a WARNING per attempt, the label never
    written (``{}``) after the checks."""
    kr = _keyring(tmp_path)
    try:
        kr.create(A)
        keys = NS.keys(range(1, 5), A)
        g3 = tmp_path / "g3"
        got, add = _counts()
        with open_pool(g3, **CFG) as pool:
            path = tl.labels_of(pool).path
            os.mkdir(path)
            gate = RevokedTenants(kr, [pool], interval_s=NEVER_S, count=add, start=False)
            try:
                with caplog.at_level(logging.WARNING, logger="kvbm_backend.pool.g3"):
                    f = gate.put_g3(A, lambda: pool.put(keys, [payload(k.seq_hash) for k in keys]), len(keys))
                    assert f is not None and f.result(timeout=HANG_S).written == 4
                    gate.check_now(HANG_S)
                    gate.check_now(HANG_S)
                assert got.get("g3_tenant_label_errors", 0) >= 3, got
                assert len(_lines(caplog, "tenant labels")) == 1, _lines(caplog, "tenant labels")
                os.rmdir(path)
                errors = got["g3_tenant_label_errors"]
                gate.check_now(HANG_S)
                assert _on_disk(path) == {tag_of(A): kr.pseudonym(A)}
                assert got["g3_tenant_label_errors"] == errors
            finally:
                gate.close()
            assert pool.flush(HANG_S)
        _restart_purges(kr, g3, A, 4)
    finally:
        kr.close()


def test_a_failed_compaction_keeps_the_labels_it_had_not_written(tmp_path):
    """``compact`` took the labels noted and not written yet and dropped them when its rewrite failed: the next
    ``persist`` found nothing to write and the label was lost for good. Now they are kept. Old code: ``{}`` after
    the next write."""
    t1, l1 = tag_of("a"), b"1" * 16
    g3 = tmp_path / "g3"
    with open_pool(g3, **CFG) as pool:
        lb = tl.labels_of(pool)
        assert lb.note(t1, l1)
        os.mkdir(lb.path)
        assert not lb.compact(lambda t: True)
        os.rmdir(lb.path)
        assert lb.persist()
    assert _on_disk(lb.path) == {t1: l1}
    with open_pool(g3, **CFG) as pool:
        assert tl.labels_of(pool).labels() == {t1: l1}


def test_the_foreign_namespace_warning_names_the_tenant_labels_file(tmp_path, caplog):
    """The WARNING about another namespace's files told the operator to remove them with their
    ``namespace-<fingerprint>.json``, but not their ``tenants-<fingerprint>`` (left behind for good). Old code: the
    line did not name it."""
    with open_pool(tmp_path, **CFG) as pool:
        _put(pool, NS.keys(range(1, 3)))
        lb = tl.labels_of(pool)
        assert lb.note(tag_of("a"), b"1" * 16) and lb.persist()
    other = Namespace(model="test/g3", layout=KvLayout(num_layers=2, outer_dim=2, page_size=32, inner_dim=64,
                                                       dtype="bfloat16"))
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.pool.g3"):
        with open_pool(tmp_path, ns=other, **CFG):
            pass
    lines = _lines(caplog, "of another namespace")
    assert len(lines) == 1 and "tenants-<fingerprint>" in lines[0], lines
    assert os.path.exists(tmp_path / f"tenants-{NS.fingerprint}")
