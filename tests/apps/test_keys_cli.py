"""``kvbm-backend keys`` through the real entry point (a subprocess, stdout and stderr apart), issue 22
item 7: every command's report is on stdout (errors alone on stderr), ``keys create`` says where the KEK
is and that it belongs in a secret store, ``keys list`` shows a revoked tenant as revoked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["COLUMNS"] = "200"
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], capture_output=True, text=True,
                          timeout=HANG_S, cwd=str(REPO), env=e)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.strip() == "", r.stderr  # the report is on stdout
    return r.stdout


def test_keys_reports_on_stdout_and_list_shows_revoked(tmp_path):
    kr = str(tmp_path / "keys" / "kr.json")
    # create, table form: the KEK file made now, and where it belongs
    out = _ok(_cli("keys", "create", "--keyring", kr, "--tenant", "alice"))
    flat = " ".join(out.split())
    assert f"KEK file {kr}.kek (created now, mode 0600)" in flat
    assert "secret store" in flat and '"tenant": "alice"' in flat
    # create, JSON form: an existing KEK file is named, not "created now"
    res = json.loads(_ok(_cli("keys", "create", "--keyring", kr, "--tenant", "bob", "--json")))
    assert res["tenant"] == "bob" and res["state"] == "active" and res["keyring"] == kr
    assert res["kek"] == f"KEK file {kr}.kek" and "secret store" in res["kek_note"]
    # the KEK from the environment: named as such
    r = _cli("keys", "create", "--keyring", str(tmp_path / "kr3.json"), "--tenant", "t", "--json",
             "--kek-env", "MY_KEK", env={"MY_KEK": "A" * 43 + "="})
    assert json.loads(_ok(r))["kek"] == "from $MY_KEK (the environment)"
    assert not (tmp_path / "kr3.json.kek").exists()
    # revoke: its report on stdout
    res = json.loads(_ok(_cli("keys", "revoke", "--keyring", kr, "--tenant", "bob", "--json")))
    assert res["revoked"] is True and res["tenant"] == "bob"
    out = _ok(_cli("keys", "revoke", "--keyring", kr, "--tenant", "alice"))
    assert '"revoked": true' in out
    _ok(_cli("keys", "create", "--keyring", kr, "--tenant", "carol"))
    # list: carol active, alice and bob revoked (by pseudonym: the keyring keeps no name of them)
    rows = json.loads(_ok(_cli("keys", "list", "--keyring", kr, "--json")))
    assert [r["state"] for r in rows] == ["active", "revoked", "revoked"]
    assert rows[0]["tenant"] == "carol" and all(r["revoked_at"] for r in rows[1:])
    table = _ok(_cli("keys", "list", "--keyring", kr))
    assert table.count("revoked") >= 2 and "carol" in table and "active" in table
    # by name: a revoked tenant is shown revoked, not "no tenant"
    rows = json.loads(_ok(_cli("keys", "list", "--keyring", kr, "--tenant", "bob", "--json")))
    assert len(rows) == 1 and rows[0]["state"] == "revoked" and rows[0]["tenant"] == "bob"
    r = _cli("keys", "list", "--keyring", kr, "--tenant", "nobody")
    assert r.returncode == 2 and "no tenant 'nobody'" in r.stderr and r.stdout == ""


def test_gc_report_on_stdout(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    out = _ok(_cli("gc", "--url", f"file://{store}", "--max-age-s", "0"))
    assert json.loads(out)["deleted_objects"] == 0
    r = _cli("gc", "--url", f"file://{tmp_path / 'typo'}", "--max-age-s", "0")
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "typo").exists()
    assert r.stderr.strip().splitlines() == [f"error: --url: {tmp_path / 'typo'}: no such directory (this command "
                                             "works on an existing G4 store and creates none)"]


def test_re_creating_a_revoked_tenant_says_to_run_gc_first(tmp_path, monkeypatch):
    """``keys create`` of a revoked tenant (same pseudonym: its shredded blocks hold the names its new blocks
    take until gc reclaims them) says to run ``gc --keyring``; a tenant never revoked gets no such note.
    In-process (typer's CliRunner): the subprocess path is the test above."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kr = str(tmp_path / "kr.json")

    def create(tenant: str) -> dict:
        r = CliRunner().invoke(app, ["keys", "create", "--keyring", kr, "--tenant", tenant, "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    assert "note" not in create("alice")
    assert CliRunner().invoke(app, ["keys", "revoke", "--keyring", kr, "--tenant", "alice"]).exit_code == 0
    assert "gc --keyring" in create("alice")["note"]
    assert "note" not in create("alice")  # active now: a no-op create says nothing


def test_keys_destroy_needs_yes_and_deletes_the_keyring_and_writer_temp_files(tmp_path):
    """``keys destroy`` (the crypto-shred of every tenant, 2026-12-01): refused without ``--yes``; deletes the
    keyring and any temp file a killed writer left (they hold every wrapped key), keeps the KEK; ``keys create``
    then makes a new keyring with a new pseudonym key. A missing keyring or a file that is no keyring: exit 2."""
    from kvbm_backend.crypto.keyring import Keyring, provider_for
    kr = str(tmp_path / "keys" / "kr.json")
    k = Keyring(kr, provider_for(kr))  # what `keys create` makes (tests above): keyring and KEK file
    k.create("alice")
    old_ps = k.create("bob")["pseudonym"]
    stale = tmp_path / "keys" / ".kr.json.kvbm-keyring-tmp.host.1.0123abcd"
    stale.write_bytes(Path(kr).read_bytes())
    r = _cli("keys", "destroy", "--keyring", kr)
    assert r.returncode == 2 and "--yes" in r.stderr and r.stdout == "", r.stdout + r.stderr
    assert Path(kr).exists() and stale.exists()
    res = json.loads(_ok(_cli("keys", "destroy", "--keyring", kr, "--yes", "--json")))
    assert res["destroyed"] is True and res["tenants"] == 2 and res["removed_temp_files"] == 1
    assert res["keyring"] == kr and "keys create" in res["note"] and "G3" in res["note"]
    assert sorted(f.name for f in (tmp_path / "keys").iterdir()) == ["kr.json.kek", "kr.json.lock"]
    new = Keyring(kr, provider_for(kr)).create("bob")  # what `keys create` does: a new keyring
    assert new["pseudonym"] != old_ps  # a new pseudonym key: the old blocks' names are never used again
    r = _cli("keys", "destroy", "--keyring", str(tmp_path / "keys" / "nope.json"), "--yes")
    assert r.returncode == 2 and "not found" in r.stderr
    assert not (tmp_path / "keys" / "nope.json.lock").exists()
    other = tmp_path / "notes.json"
    other.write_text('{"format": "something else"}')
    r = _cli("keys", "destroy", "--keyring", str(other), "--yes")
    assert r.returncode == 2 and "not a keyring file" in r.stderr and other.exists()


def _waits_for_flock(pid: int, lock: Path) -> bool:
    """``pid`` is blocked in flock() on ``lock`` (/proc/locks: a ``->`` line of that pid and inode)."""
    st = os.stat(lock)
    ino = f":{st.st_ino} "
    return any(line.split()[1] == "->" and line.split()[5] == str(pid) and ino in line
               for line in Path("/proc/locks").read_text().splitlines() if "->" in line)


def test_keys_destroy_waits_for_a_workers_change_in_flight_and_deletes_after_it(tmp_path, monkeypatch):
    """The deletion ``keys destroy`` makes takes ``PATH.lock``: a worker process in the middle of a change (stopped
    inside its write) finishes it, and the keyring is deleted after it, never written back."""
    import time

    from kvbm_backend.crypto.keyring import Keyring, generate_kek_b64, provider_for
    from tests.helpers.keyring_writer import PausedKeyringWriter
    kek = generate_kek_b64()
    monkeypatch.setenv("KVBM_BACKEND_KEK", kek)
    path = tmp_path / "kr.json"
    Keyring(path, provider_for(path)).create("acme")
    w = PausedKeyringWriter(path, "create")
    try:
        d = subprocess.Popen([sys.executable, "-m", "kvbm_backend.apps.cli", "keys", "destroy", "--keyring", str(path),
                              "--yes", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
        guard = time.monotonic() + HANG_S  # a hang guard: returns as soon as destroy waits for the lock
        while not _waits_for_flock(d.pid, Path(f"{path}.lock")):
            assert d.poll() is None, d.communicate()
            assert time.monotonic() < guard, "hang guard: keys destroy never waited for the keyring lock"
            time.sleep(0.01)
        assert path.exists()  # not deleted while the worker's change is in flight
        rep = w.finish()
        # the change went through (destroy's count below: it deleted the file the worker wrote); the worker's re-read
        # right after its publish (reload_every_s 0) finds the keyring already destroyed when destroy's lock wait
        # ends first, as on a busy host (CI 2026-12-02): then write_key fails closed, "not found"
        assert rep["paused"] and (rep["result"] == "ok" or rep["result"].endswith("kr.json: not found")), rep
        out, err = d.communicate(timeout=HANG_S)
    finally:
        w.kill()
    assert d.returncode == 0, err
    assert json.loads(out)["tenants"] == 2  # it deleted the file the worker wrote: acme and newcomer
    assert not path.exists()


def test_a_named_kek_env_that_is_unset_is_refused_and_creates_nothing(tmp_path):
    """Review finding (2026-12-03): ``keys create|list|revoke ... --kek-env FLEET_KEK`` with that variable unset fell
    back to the KEK file (``create``: a new KEK file and keyring, the report saying ``created now``), a keyring
    the fleet's workers (``g4.keyring.kek_env: FLEET_KEK``) cannot open. The operator named the variable: now one
    ``error:`` line naming ``--kek-env`` and the variable, exit 2, nothing created or changed. The default
    ``--kek-env KVBM_BACKEND_KEK`` keeps the KEK file."""
    var = "KVBM_TEST_FLEET_KEK"
    kdir = tmp_path / "keys"
    kr = str(kdir / "kr.json")
    refused = f"error: --kek-env: ${var} is not set"
    unset = {var: ""}  # set but empty counts as unset (as for g4.keyring.kek_env); _cli's env otherwise lacks it
    for args in (("create", "--tenant", "alice"), ("list",), ("revoke", "--tenant", "alice")):
        r = _cli("keys", *args, "--keyring", kr, "--kek-env", var, env=unset)
        assert r.returncode == 2 and r.stdout == "", (args, r.stdout, r.stderr)
        assert r.stderr.startswith(refused) and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert not kdir.exists()  # no keyring, no KEK file, no lock, no directory
    e = {k: v for k, v in os.environ.items() if k != var}  # truly absent, not empty
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "keys", "create", "--keyring", kr, "--tenant",
                        "alice", "--kek-env", var], capture_output=True, text=True, timeout=HANG_S, cwd=str(REPO),
                       env={**{k: v for k, v in e.items() if not k.startswith("KVBM_BACKEND")},
                            "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    assert r.returncode == 2 and r.stderr.startswith(refused), r.stderr
    assert not kdir.exists()
    # an existing keyring and KEK file (made with the default): a named variable unset is still refused
    _ok(_cli("keys", "create", "--keyring", kr, "--tenant", "alice", "--kek-env", "KVBM_BACKEND_KEK"))
    before = {p.name: p.read_bytes() for p in kdir.iterdir()}
    for args in (("list",), ("revoke", "--tenant", "alice"), ("create", "--tenant", "bob")):
        r = _cli("keys", *args, "--keyring", kr, "--kek-env", var, env=unset)
        assert r.returncode == 2 and r.stderr.startswith(refused), (args, r.stderr)
    assert {p.name: p.read_bytes() for p in kdir.iterdir()} == before  # nothing revoked or created
    # the default, given or not, keeps the KEK file; the named variable, set, is used
    assert [t["tenant"] for t in json.loads(_ok(_cli("keys", "list", "--keyring", kr, "--json")))] == ["alice"]
    r = _cli("keys", "create", "--keyring", str(tmp_path / "kr2.json"), "--tenant", "t", "--json", "--kek-env", var,
             env={var: "A" * 43 + "="})
    assert json.loads(_ok(r))["kek"] == f"from ${var} (the environment)"
