"""``kvbm-backend gc`` / ``g4 migrate`` operations findings (review of 2026-11-29, reproduced on real file
stores): a directory that cannot be listed, ``--tenant`` pseudonym hex with a keyring, ``remaining_bytes``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm_backend.pool.g4.fs_store import FsStore

NS, TEN = "0123456789abcdef", "ab" * 16
ROOT = Path(__file__).resolve().parents[3]


def _without_dac(cmd: list[str]) -> list[str]:
    """``cmd`` run so that file modes bind: as root, with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped
    (``setpriv``; root ignores a directory's mode otherwise)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory unreadable")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *cmd]


def test_gc_and_migrate_report_a_directory_they_cannot_list(tmp_path):
    """Review finding: ``os.walk`` skipped a directory it could not read (EACCES here; on NFS ESTALE, EIO)
    without a word, so gc and migrate reported success (exit 0, errors 0) over 48 of 64 objects. Now the
    directory is one error, named on stderr and in ``unlisted``, exit 1; the rest is still processed."""
    root = tmp_path / "store"
    st = FsStore(root, fsync=False)
    for s in range(64):  # format 1 (legacy) names: migrate lists them too
        st.put_if_absent(f"{NS}/{TEN}/0/{s % 4:01x}/{s:016x}", b"x" * 1000)
    locked = root / NS / TEN / "0" / "2"
    locked.chmod(0)
    cli = [sys.executable, "-m", "kvbm_backend.apps.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        for args, count in ((["gc", "--max-age-s", "0", "--dry-run"], "scanned_objects"),
                            (["g4", "migrate", "--unkeyed", "--dir-fanout", "4", "--dry-run"], "legacy_objects")):
            r = subprocess.run(_without_dac([*cli, *args, "--url", f"file://{root}", "--json"]), env=env,
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            res = json.loads(r.stdout)
            assert res[count] == 48 and res["errors"] == 1, res
            assert res["unlisted"] == [f"cannot list {locked}: Permission denied"], res
            assert str(locked) in " ".join(r.stderr.split()), r.stderr
    finally:
        locked.chmod(0o700)
    assert len(list(st.list(""))) == 64  # a dry run: nothing deleted, nothing renamed


def _keyring(tmp_path):
    import base64

    from kvbm_backend.crypto.keyring import Keyring, provider_for
    kp = str(tmp_path / "kr.json")
    kek = tmp_path / "kr.json.kek"
    kek.write_bytes(base64.b64encode(b"k" * 32))
    kek.chmod(0o600)
    kr = Keyring(kp, provider_for(kp, "KVBM_TEST_UNSET_KEK", str(kek), create=True), create=True)
    return kp, str(kek), kr


def test_gc_tenant_as_pseudonym_with_a_keyring(tmp_path, monkeypatch):
    """Review finding: ``gc --tenant <pseudonym hex> --keyring F`` hashed the hex again as a tenant id and
    matched nothing (0 scanned; 10 without ``--keyring``), though ``keys list`` shows a revoked tenant by its
    pseudonym only. A tenant id the keyring knows wins, else 32 hex is a pseudonym; a tenant id the keyring
    does not know is a warning on stderr (a typo?)."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    from kvbm_backend.pool.g4.gc import run_gc
    monkeypatch.delenv("KVBM_TEST_UNSET_KEK", raising=False)
    kp, kek, kr = _keyring(tmp_path)
    kr.create("alice")
    kr.create("bob")
    ps = kr.pseudonym("alice").hex()
    st = FsStore(tmp_path / "store", fsync=False)
    for i in range(10):
        st.put_if_absent(f"{NS}/{ps}/0/{i:02x}/{i:032x}", b"x" * 100)
        st.put_if_absent(f"{NS}/{kr.pseudonym('bob').hex()}/0/{i:02x}/{i:032x}", b"y" * 100)
    for t in ("alice", ps):
        res = run_gc(st, keyring=kr, tenant=t, max_age_s=0, dry_run=True)
        assert res["scanned_objects"] == 10 and "warnings" not in res, (t, res)
    runner = CliRunner()
    base = ["gc", "--url", f"file://{tmp_path / 'store'}", "--keyring", kp, "--kek-file", kek]
    assert runner.invoke(app, ["keys", "revoke", "--keyring", kp, "--kek-file", kek, "--tenant", "alice"]).exit_code == 0
    r = runner.invoke(app, [*base, "--tenant", ps, "--json"])  # a revoked tenant, by the name keys list shows
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["deleted_by"]["revoked"] == 10 and "warning" not in r.stderr, r.output
    r = runner.invoke(app, [*base, "--tenant", "bobb", "--max-age-s", "0", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["scanned_objects"] == 0, r.output
    assert "warning: gc: --tenant 'bobb': not a tenant of the keyring" in " ".join(r.stderr.split()), r.stderr
    assert len(list(st.list(""))) == 10  # bob's blocks: the typo deleted nothing
    kr.create(ps)  # a tenant whose id is 32 hex: the keyring's tenant of that name wins over the pseudonym
    assert run_gc(st, keyring=kr, tenant=ps, max_age_s=0, dry_run=True)["scanned_objects"] == 0


def test_gc_remaining_bytes_counts_blocks_only(tmp_path):
    """Review finding: ``remaining_bytes`` was ``scanned_bytes`` (blocks) less ``deleted_bytes`` (blocks and
    temp files): -999000 with a 1000 B block kept and a crashed writer's 1 MB temp file reclaimed."""
    import time

    from kvbm_backend.pool.g4.gc import run_gc
    st = FsStore(tmp_path / "store", fsync=False)
    kept, gone = f"{NS}/{TEN}/0/00/{'0' * 32}", f"{NS}/{TEN}/0/01/{'1' * 32}"
    st.put_if_absent(kept, b"x" * 1000)
    st.put_if_absent(gone, b"x" * 300)
    old = time.time() - 7200
    os.utime(tmp_path / "store" / gone, (old, old))
    tmp = tmp_path / "store" / NS / TEN / "0" / "00" / f".{'1' * 32}.host.1.{'f' * 32}.tmp"
    tmp.write_bytes(b"y" * 1_000_000)
    os.utime(tmp, (old, old))
    res = run_gc(st, max_age_s=3600)
    assert res["deleted_by"] == {"revoked": 0, "age": 1, "capacity": 0, "temp": 1} and not tmp.exists(), res
    assert res["deleted_bytes"] == 1_000_300 and res["remaining_bytes"] == 1000 == sum(o.size for o in st.list(""))


def test_gc_help_and_docs_state_the_time_base_the_code_uses():
    """Review finding: ``gc --help`` and docs/configuration.md still said the newest mtime listed sets the
    time base (true before 2026-11-29); gc uses :func:`~kvbm_backend.pool.g4.gc.store_clock`: the store's
    stated time, else a probe object's mtime, else this host's clock."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    r = CliRunner().invoke(app, ["gc", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    conf = (ROOT / "docs" / "configuration.md").read_text()
    gc_doc = conf[conf.index("- **gc**"):conf.index("- **Object names are keyed**")]
    for text in (" ".join(r.output.replace("│", " ").split()), " ".join(gc_doc.split())):
        assert "newest" not in text and "probe object" in text and "this host's clock" in text, text
