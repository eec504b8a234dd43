"""``kvbm-backend g4 migrate`` and ``gc`` on real file stores: review findings (2026-11-29), each of which lost
blocks or reported success for a run that failed. Blocks are rewritten under format 1 names as the previous
release named them (``legacy_object_name``)."""
from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool

FANOUT = 16


def _cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.output


def _to_legacy(p, ns, seqs, tenant):
    for s in seqs:
        k = ns.key(s, tenant=tenant)
        p.store.put(p.legacy_object_name(k), bytes(p.store.get(p.object_name(k))))
        p.store.delete(p.object_name(k))


def _legacy(p):
    return sum(1 for o in p.store.list("") if (parse_block_name(o.name) or {}).get("legacy"))


def test_migrate_from_a_url_above_the_pool_keeps_its_blocks_in_the_pool(tmp_path):
    """--url one level above the pool's root (a bucket holding several clusters' prefixes): the old code built
    the new name from the namespace down and moved every block to the store's root (6 of 6 unreadable, exit 0,
    reported migrated)."""
    ns, seqs = namespace(), [1000 + i for i in range(6)]
    cfg = G4Config(url=f"file://{tmp_path / 'parent' / 'clusterA'}", keyring={"path": str(tmp_path / 'kr.json')},
                   dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, seqs, "alice").written == 6
        _to_legacy(p, ns, seqs, "alice")
        assert read_checked(p, seqs, "alice") == [False] * 6
    code, out = _cli("g4", "migrate", "--url", f"file://{tmp_path / 'parent'}", "--keyring", str(tmp_path / "kr.json"),
                     "--dir-fanout", str(FANOUT), "--json")
    assert code == 0 and json.loads(out)["migrated"] == 6, out
    with G4Pool(cfg, ns) as p:
        assert read_checked(p, seqs, "alice") == [True] * 6 and _legacy(p) == 0


def test_migrate_needs_keyring_or_unkeyed_and_refuses_before_writing_anything(tmp_path):
    """An unencrypted pool with a keyring names its blocks with the keyring's key: migrated without --keyring the
    old code renamed them under the public key (5 of 5 lost, exit 0). Now one of --keyring / --unkeyed is
    required; and an encrypted block among plaintext ones refuses the run before any rename (the old code had
    renamed 15 of 25 objects when it stopped)."""
    ns, seqs = namespace(), [2000 + i for i in range(5)]
    kr = str(tmp_path / "kr.json")
    plain = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=False, keyring={"path": kr}, dir_fanout=FANOUT,
                     timeout_s=G4_TIMEOUT_S)
    with G4Pool(plain, ns) as p:
        assert put_blocks(p, seqs, "alice").written == 5
        _to_legacy(p, ns, seqs, "alice")
    base = ["g4", "migrate", "--url", plain.url, "--dir-fanout", str(FANOUT), "--json"]
    code, out = _cli(*base)
    assert code == 2 and "--unkeyed" in out and "--keyring" in out, out
    code, out = _cli(*base, "--keyring", kr, "--unkeyed")
    assert code == 2, out
    # one encrypted block beside them
    enc = G4Config(url=plain.url, keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(enc, ns) as p:
        assert put_blocks(p, [3000], "alice").written == 1
        _to_legacy(p, ns, [3000], "alice")
        assert _legacy(p) == 6
    code, out = _cli(*base, "--unkeyed")
    assert code == 2 and "encrypted" in out, out
    with G4Pool(plain, ns) as p:
        assert _legacy(p) == 6  # nothing renamed
    code, out = _cli(*base, "--keyring", kr, "--plaintext", "--dry-run")  # the workers' g4.encrypt: false
    assert code == 0 and json.loads(out)["migrated"] == 6
    code, out = _cli(*base, "--keyring", kr, "--plaintext")
    assert code == 0 and json.loads(out)["migrated"] == 6, out
    with G4Pool(plain, ns) as p:
        assert read_checked(p, seqs, "alice") == [True] * 5 and _legacy(p) == 0
    code, out = _cli(*base, "--keyring", kr, "--dry-run")  # nothing left to rename
    assert code == 0 and json.loads(out)["legacy_objects"] == 0


def test_migrate_asks_the_workers_encrypt_setting_before_renaming_plaintext_blocks_with_a_keyring(tmp_path):
    """A keyring names the blocks of plaintext and encrypted pools alike, so the names cannot say whether the
    workers encrypt. Before: plaintext format 1 objects were renamed into the keyed names of an encrypted pool,
    which never serves them: each held its name against the encrypted copy (offloads skipped_exists, loads
    misses, for good). Now, with --keyring, a plaintext object refuses the run (exit 2, nothing renamed) until
    --encrypted (they are left for gc: skipped_plaintext; encrypted ones are renamed) or --plaintext (renamed)."""
    ns, seqs = namespace(), [4000 + i for i in range(4)]
    kr = str(tmp_path / "kr.json")
    plain = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=False, keyring={"path": kr}, dir_fanout=FANOUT,
                     timeout_s=G4_TIMEOUT_S)
    enc = G4Config(url=plain.url, keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(plain, ns) as p:
        assert put_blocks(p, seqs, "alice").written == 4
        _to_legacy(p, ns, seqs, "alice")
    with G4Pool(enc, ns) as p:
        assert put_blocks(p, [4100], "alice").written == 1
        _to_legacy(p, ns, [4100], "alice")
        assert _legacy(p) == 5
    base = ["g4", "migrate", "--url", plain.url, "--dir-fanout", str(FANOUT), "--json"]
    code, out = _cli(*base, "--keyring", kr)
    assert code == 2 and "--encrypted" in out and "--plaintext" in out, out
    code, out = _cli(*base, "--unkeyed", "--encrypted")  # an encrypted pool has a keyring
    assert code == 2 and "--keyring" in out, out
    with G4Pool(enc, ns) as p:
        assert _legacy(p) == 5  # nothing renamed
    code, out = _cli(*base, "--keyring", kr, "--encrypted")
    res = json.loads(out)
    assert code == 0 and (res["migrated"], res["skipped_plaintext"], res["errors"]) == (1, 4, 0), out
    with G4Pool(enc, ns) as p:
        assert read_checked(p, [4100], "alice") == [True] and _legacy(p) == 4  # plaintext ones left for gc
        assert put_blocks(p, seqs, "alice").written == 4  # the encrypted pool's names are free for its blocks
        assert read_checked(p, seqs, "alice") == [True] * 4 and p.stats().get("miss_unencrypted_object", 0) == 0
    code, out = _cli(*base, "--keyring", kr, "--plaintext")  # had the workers been plaintext: renamed
    res = json.loads(out)
    assert code == 0 and (res["migrated"], res["already_present"]) == (0, 4), out


def test_a_dry_run_counts_blocks_whose_new_name_exists_as_already_present(tmp_path):
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [7, 8], "alice").written == 2
        k = ns.key(7, tenant="alice")  # block 7 under both names
        p.store.put(p.legacy_object_name(k), bytes(p.store.get(p.object_name(k))))
        _to_legacy(p, ns, [8], "alice")
    base = ["g4", "migrate", "--url", cfg.url, "--keyring", kr, "--dir-fanout", str(FANOUT), "--json"]
    dry = json.loads(_cli(*base, "--dry-run")[1])
    real = json.loads(_cli(*base)[1])
    assert (dry["migrated"], dry["already_present"]) == (real["migrated"], real["already_present"]) == (1, 1)


def test_migrate_and_gc_exit_1_when_an_object_failed(tmp_path, monkeypatch):
    """Review finding: both printed errors: 1 and exited 0, so a cron job saw success."""
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [11, 12], "alice").written == 2
        k = ns.key(11, tenant="alice")
        new_name = p.object_name(k)
        _to_legacy(p, ns, [11, 12], "alice")
    os.makedirs(tmp_path / "store" / new_name)  # block 11's new name is taken by a directory
    code, out = _cli("g4", "migrate", "--url", cfg.url, "--keyring", kr, "--dir-fanout", str(FANOUT), "--json")
    res = json.loads(out)
    assert code == 1 and (res["errors"], res["migrated"]) == (1, 1), out
    os.rmdir(tmp_path / "store" / new_name)
    # gc: the store refuses one delete, as a failing disk would (EIO injected into the real file store)
    from kvbm_backend.pool.g4.fs_store import FsStore
    real_delete, real_listed, calls = FsStore.delete, FsStore.delete_if_listed, []

    def fail_first(name):
        if parse_block_name(name) is not None:
            calls.append(name)
        if len(calls) == 1 and calls[0] == name:
            raise OSError(5, "Input/output error (injected)")

    def failing_once(self, name):
        fail_first(name)
        return real_delete(self, name)

    def failing_once_listed(self, info):  # gc's delete of a listed object since 2026-12-01
        fail_first(info.name)
        return real_listed(self, info)

    monkeypatch.setattr(FsStore, "delete", failing_once)
    monkeypatch.setattr(FsStore, "delete_if_listed", failing_once_listed)
    code, out = _cli("gc", "--url", cfg.url, "--max-age-s", "0", "--json")
    res = json.loads(out)
    assert code == 1 and res["errors"] == 1 and res["deleted_objects"] >= 1, out


def test_gc_dry_run_writes_nothing_to_the_store(tmp_path):
    """Review finding: gc --dry-run wrote (and deleted) a clock probe object, leaving gc-clock-probe/ behind."""
    ns = namespace()
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": str(tmp_path / 'kr.json')}, dir_fanout=FANOUT,
                   timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [1, 2], "alice").written == 2
    before = sorted(os.listdir(tmp_path / "store"))
    code, out = _cli("gc", "--url", cfg.url, "--max-age-s", "0", "--dry-run", "--json")
    res = json.loads(out)
    assert code == 0 and res["deleted_by"]["age"] == 2 and res["time_base"] == "local", out
    assert sorted(os.listdir(tmp_path / "store")) == before
