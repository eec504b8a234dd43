"""A keyring writer killed (SIGKILL) in the middle of its write: the file stays whole, and the temp file it
left, which holds every tenant's wrapped data key, does not outlive the next write.

Review finding (2026-11-30): a writer killed between creating its temp file and renaming it over the
keyring left ``.PATH.<host>.<pid>.<uuid>.tmp`` behind for good. A later ``keys revoke`` removed the
tenant's wrapped keys from the keyring only: the stale copy, with the KEK, still unwrapped the revoked
tenant's data key, so its G4 blocks were not crypto-shredded.

The crash point is placed, not timed: the child stops in the fsync of its temp file (a real fsync
hook that blocks) and the test kills it with SIGKILL there.
"""
from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvbm_backend.crypto.keyring import Keyring, generate_kek_b64, provider_for

HANG_S = 600.0  # a hang guard, not a bound: the child reports as soon as it is in its write

_CRASHING_WRITER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from kvbm_backend.crypto.keyring import Keyring, provider_for
path = sys.argv[1]
kr = Keyring(path, provider_for(path), create=False)
real_fsync, d = os.fsync, os.path.dirname(path)

def fsync(fd):
    name = os.readlink(f"/proc/self/fd/{fd}")
    if os.path.dirname(name) == d and os.path.basename(name).startswith("." + os.path.basename(path) + "."):
        real_fsync(fd)  # the temp file is complete and on disk: only the rename is missing
        print("IN_WRITE", flush=True)
        time.sleep(3600)  # killed here
    real_fsync(fd)

os.fsync = fsync
kr.create("bob")
print("NOT_KILLED", flush=True)
"""


def _kill_writer_mid_write(path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    p = subprocess.Popen([sys.executable, "-c", _CRASHING_WRITER, str(path), root], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()  # blocks until the child is inside its write (or has died)
        assert line == "IN_WRITE\n", (line, p.stderr.read() if p.poll() is not None else "")
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=HANG_S) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=HANG_S)


def test_a_writer_killed_mid_write_leaves_no_copy_of_a_revoked_tenants_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_BACKEND_KEK", generate_kek_b64())
    path = tmp_path / "kr.json"
    kr = Keyring(path, provider_for(path), persist_every_s=3600)
    kr.create("alice")
    wrapped = kr._doc["tenants"]["alice"]["versions"]["1"]["wrapped"]  # what a crypto-shred must leave nowhere
    key = kr.write_key("alice").key

    _kill_writer_mid_write(path)
    # crash consistency: the keyring is the old file, whole; the killed writer's tenant is not in it
    after_crash = Keyring(path, provider_for(path), create=False, persist_every_s=3600)
    assert [r["tenant"] for r in after_crash.info()] == ["alice"]
    assert after_crash.read_key(*_kv(kr, "alice"), "alice") == key

    kr.revoke("alice")  # the next write, by another process's keyring or the CLI: crypto-shred alice
    holders = sorted(f.name for f in tmp_path.iterdir() if wrapped.encode() in f.read_bytes())
    assert holders == [], f"alice's wrapped data key outlived her revocation in {holders}"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["kr.json", "kr.json.lock"]
    assert Keyring(path, provider_for(path), create=False).tenant_state("alice") == "revoked"
    assert base64.b64decode(wrapped)  # (the value checked for above is a real wrapped key)


def _kv(kr: Keyring, tenant: str) -> tuple[int, int]:
    t = kr._doc["tenants"][tenant]
    return int(t["key_id"]), int(t["current"])
