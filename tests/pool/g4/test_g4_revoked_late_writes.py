"""A tenant revoked (``keys revoke``), then re-created (``keys create``: the same pseudonym, a new key id), while
a worker that had not yet re-read the keyring (inside the documented revocation bound: ``reload_interval_s``,
plus the Secret's propagation on Kubernetes) sealed a block under the revoked key after ``revoked_at``
(review finding of 2026-11-30, reproduced by the real CLI on file:// and SeaweedFS stores). gc kept that
block (it reclaimed a re-created tenant's blocks only up to ``revoked_at`` + 1 s) and it held the new
tenant's object name for ever: offloads ``skipped_exists``, lookups present, loads ``miss_no_key``. Now gc
reads the frame header of such blocks and deletes those sealed under a revoked key id: the next offload
writes the block again. Blocks of the tenant's current key, and other tenants' blocks, stay. (A load deletes
nothing: tests/pool/g4/test_g4_pool.py::test_wrong_tenant_key_decrypts_nothing.)"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
STALE_S = 300.0  # reload_interval_s (its maximum) of the worker that has not re-read the keyring yet
LATE, NEW, OTHER = 7, 8, 9  # sequence hashes: the late write, a block of the re-created tenant, bob's block


def _cli(*args: str) -> dict:
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _backdate_revocation(kr: str, seconds: float) -> None:
    """Move every ``revoked_at`` back by ``seconds``, as ``keys revoke`` run that much earlier would have
    written it (same file discipline: 0600, atomic rename): the late write lands well after the revocation,
    as it does when the worker re-reads the keyring seconds or a minute later."""
    doc = json.loads(open(kr).read())
    for rec in doc["revoked"].values():
        rec["revoked_at"] -= seconds
    _write(kr, doc)


def _write(kr: str, doc: dict) -> None:
    tmp = f"{kr}.edit"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, kr)


def _store(kind: str, tmp_path, s3_prefix: str, request) -> tuple[str, str | None]:
    if kind == "fs":
        (tmp_path / "store").mkdir()
        return f"file://{tmp_path / 'store'}", None
    sw = request.getfixturevalue("seaweed")
    return sw.url(s3_prefix), sw.endpoint


def _late_write(url: str, endpoint: str | None, kr: str, *, legacy_record: bool = False) -> None:
    """alice and bob created; a worker reads the keyring; ``keys revoke`` alice and ``gc --keyring`` (as
    docs/configuration.md prescribes); the worker, not having re-read the keyring, offloads LATE for alice
    (sealed under the revoked key); ``keys create`` alice again. ``legacy_record``: the revocation record
    without ``key_ids``, as keyrings revoked before 2026-11-30 hold it."""
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    for t in ("alice", "bob"):
        _cli("keys", "create", "--keyring", kr, "--tenant", t)
    cfg = G4Config(url=url, endpoint_url=endpoint, timeout_s=30.0,
                   keyring={"path": kr, "auto_create_tenants": False, "reload_interval_s": STALE_S})
    with G4Pool(cfg, ns) as stale:
        assert stale.keyring.tenant_state("alice") == "active"  # read now; next check STALE_S away
        assert stale.put(ns.keys([OTHER], tenant="bob"), [payload(OTHER, "bob", bpb)]).result(HANG_S).written == 1
        _cli("keys", "revoke", "--keyring", kr, "--tenant", "alice")
        _backdate_revocation(kr, 30.0)
        if legacy_record:
            doc = json.loads(open(kr).read())
            for rec in doc["revoked"].values():
                rec.pop("key_ids", None)
            _write(kr, doc)
        assert _cli("gc", "--url", url, *(["--endpoint-url", endpoint] if endpoint else []),
                    "--keyring", kr)["deleted_objects"] == 0
        r = stale.put(ns.keys([LATE], tenant="alice"), [payload(LATE, "alice", bpb)]).result(HANG_S)
        assert r.written == 1  # sealed under the revoked key: the worker has not re-read the keyring
        stale.flush(HANG_S)
    _cli("keys", "create", "--keyring", kr, "--tenant", "alice")


def _fresh(url: str, endpoint: str | None, kr: str) -> G4Pool:
    return G4Pool(G4Config(url=url, endpoint_url=endpoint, timeout_s=30.0,
                           keyring={"path": kr, "auto_create_tenants": False}), namespace())


@pytest.mark.parametrize("kind", ["fs", "s3"])
def test_gc_reclaims_a_late_write_under_the_revoked_key_after_re_creation(kind, tmp_path, s3_prefix, request):
    """After ``keys create``, ``gc --keyring`` reads the header of alice's block written after the revocation
    and deletes it (its key id is the revoked one); the re-created alice's own block and bob's stay; then
    alice's offload of that block is written (before: ``skipped_exists``, and every load ``miss_no_key``)."""
    url, endpoint = _store(kind, tmp_path, s3_prefix, request)
    kr = str(tmp_path / "keys" / "kr.json")
    (tmp_path / "keys").mkdir(mode=0o700)
    _late_write(url, endpoint, kr)
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    with _fresh(url, endpoint, kr) as p:  # the re-created alice writes a block of her own first
        assert p.put(ns.keys([NEW], tenant="alice"), [payload(NEW, "alice", bpb)]).result(HANG_S).written == 1
        k = ns.keys([LATE], tenant="alice")  # the late write holds the name: not stored, then a miss
        assert p.put(k, [payload(LATE, "alice", bpb)]).result(HANG_S).dropped == 1  # before: skipped (stored)
        assert p.stats()["skipped_unservable"] == 1 and p.stats()["skipped_exists"] == 0
        assert p.lookup_prefix(k).result(HANG_S) == 1
        assert p.get(k, [np.zeros(bpb, np.uint8)]).result(HANG_S).ok == [False] and p.stats()["miss_no_key"] == 1
    res = _cli("gc", "--url", url, *(["--endpoint-url", endpoint] if endpoint else []), "--keyring", kr)
    assert res["deleted_by"]["revoked"] == 1 and res["deleted_objects"] == 1, res
    assert res["scanned_objects"] == 3 and res["headers_read"] == 2 and res["errors"] == 0, res
    with _fresh(url, endpoint, kr) as p:
        assert p.put(ns.keys([LATE], tenant="alice"), [payload(LATE, "alice", bpb)]).result(HANG_S).written == 1
        for seq, tenant in ((LATE, "alice"), (NEW, "alice"), (OTHER, "bob")):
            out = [np.zeros(bpb, np.uint8)]
            assert p.get(ns.keys([seq], tenant=tenant), out).result(HANG_S).ok == [True], (seq, tenant)
            assert np.array_equal(out[0], payload(seq, tenant, bpb))
    again = _cli("gc", "--url", url, *(["--endpoint-url", endpoint] if endpoint else []), "--keyring", kr)
    assert again["deleted_objects"] == 0 and again["headers_read"] == 2, again  # current key: kept


def test_gc_with_a_revocation_record_from_before_key_ids_were_recorded(tmp_path):
    """A keyring revoked by an older version records no ``key_ids``: gc then deletes a re-created tenant's
    late block whose key id is not the tenant's current one, and keeps the current key's; a load cannot tell
    (a miss, ``miss_no_key``, nothing deleted)."""
    url = f"file://{tmp_path / 'store'}"
    (tmp_path / "store").mkdir()
    (tmp_path / "keys").mkdir(mode=0o700)
    kr = str(tmp_path / "keys" / "kr.json")
    _late_write(url, None, kr, legacy_record=True)
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    with _fresh(url, None, kr) as p:
        assert p.put(ns.keys([NEW], tenant="alice"), [payload(NEW, "alice", bpb)]).result(HANG_S).written == 1
        assert p.get(ns.keys([LATE], tenant="alice"), [np.zeros(bpb, np.uint8)]).result(HANG_S).ok == [False]
        assert p.stats().get("miss_no_key") == 1 and not p.stats().get("deleted_corrupt")
    res = _cli("gc", "--url", url, "--keyring", kr)
    assert res["deleted_by"]["revoked"] == 1 and res["scanned_objects"] == 3 and res["headers_read"] == 2, res
    with _fresh(url, None, kr) as p:
        assert p.put(ns.keys([LATE], tenant="alice"), [payload(LATE, "alice", bpb)]).result(HANG_S).written == 1
        assert p.get(ns.keys([NEW], tenant="alice"), [np.zeros(bpb, np.uint8)]).result(HANG_S).ok == [True]


AHEAD_S = 600.0  # how far the clock of the host that ran `keys revoke` ran ahead of the store's (and gc's)
OLD = 6  # sequence hash of alice's block sealed under her first key, before the revocation


def test_gc_keeps_a_re_created_tenants_blocks_when_the_revoking_host_clock_ran_ahead(tmp_path):
    """`keys revoke` ran on a host whose clock was AHEAD_S ahead of the store's and of gc's host: ``revoked_at``
    lies AHEAD_S in the store's future, so the blocks the re-created alice wrote since (sealed under her
    current key, served by every worker) are stamped before it. Before: gc deleted them unread (every block
    of a re-created tenant modified up to ``revoked_at`` + 1 s), although docs/configuration.md says blocks
    under the tenant's current key are never touched. Now gc reads the frame header of each such block and
    keeps those of the current key; alice's block sealed under the revoked key, and an unparsable object
    under her name, are still reclaimed."""
    url = f"file://{tmp_path / 'store'}"
    (tmp_path / "store").mkdir()
    (tmp_path / "keys").mkdir(mode=0o700)
    kr = str(tmp_path / "keys" / "kr.json")
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    for t in ("alice", "bob"):
        _cli("keys", "create", "--keyring", kr, "--tenant", t)
    with _fresh(url, None, kr) as p:
        assert p.put(ns.keys([OLD], tenant="alice"), [payload(OLD, "alice", bpb)]).result(HANG_S).written == 1
        assert p.put(ns.keys([OTHER], tenant="bob"), [payload(OTHER, "bob", bpb)]).result(HANG_S).written == 1
        alice = p.keyring.pseudonym("alice").hex()
        (old_name,) = [o.name for o in p.store.list("") if (parse_block_name(o.name) or {}).get("tenant") == alice]
    junk = old_name.rsplit("/", 1)[0] + "/" + "0" * 32  # not a frame: unparsable, under alice's name
    (tmp_path / "store" / junk).write_bytes(b"not a frame")
    _cli("keys", "revoke", "--keyring", kr, "--tenant", "alice")
    _backdate_revocation(kr, -AHEAD_S)  # as the revoking host's clock, AHEAD_S ahead, wrote it
    _cli("keys", "create", "--keyring", kr, "--tenant", "alice")
    with _fresh(url, None, kr) as p:  # alice's new blocks: stamped by the store before revoked_at
        assert p.put(ns.keys([NEW], tenant="alice"), [payload(NEW, "alice", bpb)]).result(HANG_S).written == 1
    res = _cli("gc", "--url", url, "--keyring", kr)
    assert res["deleted_objects"] == 2, res  # before 2026-12-01: 3 (NEW too)
    # the unparsable object is junk of the namespace (not its frame size): deleted as such, no block scanned
    # (before 2026-12-03 "revoked" and in scanned_*: tests/pool/g4/test_g4_gc_invalid_deleted.py)
    assert (res["deleted_by"]["revoked"], res["deleted_by"].get("invalid_size"), res["invalid_size"]) == (1, 1, 1), res
    assert res["scanned_objects"] == 3 and res["headers_read"] == 3 and res["errors"] == 0, res
    with _fresh(url, None, kr) as p:
        for seq, tenant in ((NEW, "alice"), (OTHER, "bob")):
            out = [np.zeros(bpb, np.uint8)]
            assert p.get(ns.keys([seq], tenant=tenant), out).result(HANG_S).ok == [True], (seq, tenant)
            assert np.array_equal(out[0], payload(seq, tenant, bpb))
        assert p.put(ns.keys([OLD], tenant="alice"), [payload(OLD, "alice", bpb)]).result(HANG_S).written == 1
    assert not (tmp_path / "store" / junk).exists()
    again = _cli("gc", "--url", url, "--keyring", kr)
    assert again["deleted_objects"] == 0 and again["errors"] == 0, again  # current key: kept
