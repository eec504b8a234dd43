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
