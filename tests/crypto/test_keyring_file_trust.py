"""The keyring, its KEK file and its lock are trusted only when nobody but the worker's uid (or root) can have
put them there (security review, item 1): a keyring + KEK planted by another uid in a directory it can write
was used (the planter held every data key); a symlink planted at ``PATH.lock`` made the worker create its
target. The rule (kvbm_backend.fsmodes.open_trusted, docs/operations.md "Keyring files"): the directory is
owned by the worker's uid or root and not writable by group/others unless sticky; the files are regular
files of the worker's uid (KEK, keyring: mode 0600/0400), opened without following links except the relative,
root/own-uid links of a Kubernetes Secret volume (``keyring.json -> ..data/keyring.json``).

Runs as root (chown to uid 65534 plays the other user); skipped otherwise."""
from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

from kvbm_backend.apps.doctor_g4 import g4_info
from kvbm_backend.config import KeyringConfig, load_config
from kvbm_backend.crypto.kek import LocalKek, locked_file, provider_for
from kvbm_backend.crypto.keyring import Keyring, KeyringError

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files to another uid")


@pytest.fixture(autouse=True)
def _no_kek_env(monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)


def _make(d: Path, *tenants: str) -> str:
    """A keyring with ``tenants`` and its KEK file ``PATH.kek`` made in ``d`` the normal way."""
    kr = str(d / "keyring.json")
    k = Keyring(kr, provider_for(kr))
    for t in tenants:
        k.create(t)
    k.close()
    return kr


def _open(kr: str, **kw) -> Keyring:
    return Keyring.from_config(KeyringConfig(path=kr, **kw))


def test_own_normal_layout_is_accepted(tmp_path):
    kr = _make(tmp_path / "keys", "acme")
    assert oct(os.stat(tmp_path / "keys").st_mode & 0o777) == "0o700"
    k = _open(kr)
    assert k.tenant_state("acme") == "active"
    k.create("beta")  # writes: the lock file and the keyring replaced
    k.close()
    assert _open(kr).tenant_state("beta") == "active"


def test_planted_keyring_and_kek_of_another_uid_are_refused(tmp_path):
    """The reviewer's t2: keyring.json + keyring.json.kek owned by uid 65534, mode 0600, in a directory."""
    d = tmp_path / "keys"
    kr = _make(d, "acme")
    for f in (kr, f"{kr}.kek", f"{kr}.lock"):
        os.chown(f, NOBODY, NOBODY)
    with pytest.raises(KeyringError, match=rf"KEK file {kr}\.kek is owned by uid {NOBODY}, not by this process "
                                           r"\(uid 0\).*chown 0"):
        _open(kr)
    with pytest.raises(KeyringError, match=f"owned by uid {NOBODY}"):
        LocalKek.from_file(f"{kr}.kek")
    os.chown(f"{kr}.kek", 0, 0)  # the KEK is ours, the keyring still planted
    with pytest.raises(KeyringError, match=rf"keyring {kr} is owned by uid {NOBODY}"):
        _open(kr)


def test_a_directory_others_can_write_is_refused(tmp_path):
    d = tmp_path / "keys"
    kr = _make(d, "acme")
    for mode in (0o777, 0o775, 0o757):
        os.chmod(d, mode)
        with pytest.raises(KeyringError, match=rf"directory {d} of the KEK file is writable by group or others "
                                               rf"\(mode 0{mode:o}, and not sticky\).*chmod 700 {d}"):
            _open(kr)
    os.chmod(d, 0o700)
    os.chown(d, NOBODY, NOBODY)  # another user's directory (mode 0700): it can replace our files
    with pytest.raises(KeyringError, match=rf"directory {d} of the KEK file is owned by uid {NOBODY}"):
        _open(kr)
    os.chown(d, 0, 0)
    os.chmod(d, 0o777)
    with pytest.raises(KeyringError, match=f"directory {d} of the keyring is writable"):  # KEK from the env
        Keyring(kr, _env_kek(kr))


def _env_kek(kr: str) -> LocalKek:
    """The KEK of ``kr`` read as bytes (not through the checks), as from ``$KVBM_BACKEND_KEK``."""
    return LocalKek(base64.b64decode(Path(f"{kr}.kek").read_text().strip()), source="$TEST")


def test_a_new_keyring_is_not_created_in_a_directory_others_can_write(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(KeyringError, match=f"directory {d} of the KEK file is writable"):
        _open(str(d / "keyring.json"))
    assert list(d.iterdir()) == []  # no KEK, no lock, no keyring made


def test_a_sticky_world_writable_directory_holds_own_files_but_not_planted_ones(tmp_path):
    """/tmp-like (01777): others may add entries, never replace ours: our files are used, theirs refused."""
    d = tmp_path / "sticky"
    kr = _make(d, "acme")
    os.chmod(d, 0o1777)
    assert _open(kr).tenant_state("acme") == "active"
    os.chown(kr, NOBODY, NOBODY)
    with pytest.raises(KeyringError, match=f"keyring {kr} is owned by uid {NOBODY}"):
        _open(kr)


def test_a_symlink_at_the_lock_is_refused_and_its_target_not_created(tmp_path):
    """The reviewer's t4, in the worker's own 0700 directory and in a sticky shared one."""
    for mode in (0o700, 0o1777):
        d = tmp_path / f"keys{mode:o}"
        kr = _make(d)
        os.chmod(d, mode)
        target = tmp_path / f"elsewhere-{mode:o}"
        os.unlink(f"{kr}.lock")
        os.symlink(target, f"{kr}.lock")
        os.lchown(f"{kr}.lock", NOBODY, NOBODY)
        k = Keyring(kr, provider_for(kr))
        with pytest.raises(KeyringError, match=rf"keyring lock file {kr}\.lock is a symbolic link: refused"):
            k.create("t1")
        assert not os.path.lexists(target)
        with pytest.raises(KeyringError, match="symbolic link"):
            with locked_file(f"{kr}.lock"):
                pass
        assert not os.path.lexists(target)
        os.unlink(f"{kr}.lock")  # a lock file of another uid: refused too
        Path(f"{kr}.lock").touch()
        os.chown(f"{kr}.lock", NOBODY, NOBODY)
        with pytest.raises(KeyringError, match=rf"lock file {kr}\.lock is owned by uid {NOBODY}"):
            k.create("t1")


def test_symlinked_kek_and_keyring_are_refused(tmp_path):
    d = tmp_path / "keys"
    kr = _make(d, "acme")
    real = tmp_path / "real.kek"
    os.replace(f"{kr}.kek", real)
    os.symlink(real, f"{kr}.kek")  # an absolute link, even to our own file
    with pytest.raises(KeyringError, match=rf"{kr}\.kek is a symbolic link to '{real}': only relative links"):
        _open(kr)
    os.unlink(f"{kr}.kek")
    os.replace(real, d / "kek.real")
    os.symlink("kek.real", f"{kr}.kek")  # relative, but another uid's link
    os.lchown(f"{kr}.kek", NOBODY, NOBODY)
    with pytest.raises(KeyringError, match=f"symbolic link owned by uid {NOBODY}"):
        _open(kr)
    os.unlink(f"{kr}.kek")
    os.symlink("../keys/kek.real", f"{kr}.kek")  # '..': may leave the directory
    with pytest.raises(KeyringError, match="only relative links that stay in their directory"):
        _open(kr)
    os.unlink(f"{kr}.kek")
    os.replace(d / "kek.real", f"{kr}.kek")
    os.replace(kr, d / "kr.real")
    os.symlink(d / "kr.real", kr)
    with pytest.raises(KeyringError, match=rf"{kr} is a symbolic link to"):
        _open(kr)


def _secret_volume(mnt: Path, files: dict[str, bytes], stamp: str) -> None:
    """The layout the kubelet makes for a Secret volume (defaultMode 0400, no fsGroup): root-owned, the mount
    directory 1777 (sticky), each key a link ``NAME -> ..data/NAME``, ``..data`` a link to a timestamped
    directory (0755) holding the 0400 files; an update writes a new timestamped directory and renames a new
    ``..data`` link over the old one."""
    mnt.mkdir(exist_ok=True)
    os.chmod(mnt, 0o1777)
    ts = mnt / stamp
    ts.mkdir()
    os.chmod(ts, 0o755)
    for name, data in files.items():
        (ts / name).write_bytes(data)
        os.chmod(ts / name, 0o400)
    os.symlink(stamp, mnt / "..data_tmp")
    os.replace(mnt / "..data_tmp", mnt / "..data")
    for name in files:
        if not os.path.lexists(mnt / name):
            os.symlink(f"..data/{name}", mnt / name)


def test_kubernetes_secret_volume_layout_is_accepted_read_only(tmp_path, monkeypatch):
    """examples/k8s/worker.yaml: the keyring is a Secret volume mounted read-only, KEK from the env."""
    op = _make(tmp_path / "operator", "alice", "bob")
    monkeypatch.setenv("KVBM_BACKEND_KEK", Path(f"{op}.kek").read_text().strip())
    mnt = tmp_path / "etc-kvbm-keyring"
    _secret_volume(mnt, {"keyring.json": Path(op).read_bytes()}, "..2026_01_01_00_00_00.000000001")
    kr = str(mnt / "keyring.json")
    k = _open(kr, read_only=True, reload_interval_s=0.01)
    assert k.tenant_state("alice") == "active" and k.tenant_state("bob") == "active"
    opk = Keyring(op, provider_for(op))  # the operator revokes bob, then the Secret is updated
    opk.revoke("bob")
    opk.close()
    _secret_volume(mnt, {"keyring.json": Path(op).read_bytes()}, "..2026_01_01_00_01_00.000000002")
    time.sleep(0.05)
    assert k.tenant_state("bob") != "active" and k.tenant_state("alice") == "active"
    # the KEK as a file in the Secret too (KEK file = PATH.kek through the same links)
    monkeypatch.delenv("KVBM_BACKEND_KEK")
    mnt2 = tmp_path / "with-kek"
    _secret_volume(mnt2, {"keyring.json": Path(op).read_bytes(), "keyring.json.kek": Path(f"{op}.kek").read_bytes()},
                   "..2026_01_01_00_00_00.000000003")
    assert _open(str(mnt2 / "keyring.json"), read_only=True).tenant_state("alice") == "active"
    # a group-writable timestamped directory (not the kubelet's) is refused on the way through
    os.chmod(mnt2 / "..2026_01_01_00_00_00.000000003", 0o775)
    with pytest.raises(KeyringError, match="is writable by group or others"):
        _open(str(mnt2 / "keyring.json"), read_only=True)


def test_doctor_reports_the_same_check(tmp_path):
    d = tmp_path / "keys"
    kr = _make(d, "acme")

    def row() -> dict:
        cfg = load_config({"g4": {"enabled": True, "url": f"file://{tmp_path / 'store'}",
                                            "keyring": {"path": kr}}})
        return next(c for c in g4_info(cfg)["checks"] if c["check"] == "keyring")

    assert row()["ok"] is True
    os.chown(f"{kr}.kek", NOBODY, NOBODY)
    r = row()
    assert r["ok"] is False and f"owned by uid {NOBODY}" in r["detail"], r
    os.chown(f"{kr}.kek", 0, 0)
    os.chmod(d, 0o777)
    r = row()
    assert r["ok"] is False and f"directory {d} of the keyring is writable by group or others" in r["detail"], r
    os.unlink(kr)  # absent keyring: the directory is still checked
    r = row()
    assert r["ok"] is False and "writable by group or others" in r["detail"], r


def test_a_secret_volume_update_during_a_read_is_not_a_missing_keyring(tmp_path, monkeypatch):
    """The kubelet updates a Secret volume by renaming a new ``..data`` link over the old one, then
    removing the old timestamped directory. A reader that resolved ``keyring.json`` through the old
    ``..data`` just before, and opens the file just after, found it gone: "not found", so a worker
    starting then failed, and a running one served no G4 key until its next reload (review 2026-11-30:
    ~1% of reads failed while updates ran back to back). The update is placed, not timed: it runs
    inside the reader's open of the resolved file, once per read the test arms it."""
    import shutil
    op = _make(tmp_path / "operator", "alice")
    monkeypatch.setenv("KVBM_BACKEND_KEK", Path(f"{op}.kek").read_text().strip())
    mnt = tmp_path / "etc-kvbm-keyring"
    stamps = iter(f"..2026_01_01_00_00_00.00000000{i}" for i in range(1, 10))
    cur = [next(stamps)]
    _secret_volume(mnt, {"keyring.json": Path(op).read_bytes()}, cur[0])
    real_open, armed, swapped = os.open, [True], []

    def open_during_an_update(path, *a, **kw):  # the kubelet's update lands between resolve and open
        p = os.fspath(path)
        if os.path.dirname(p) == str(mnt / cur[0]) and armed[0]:
            armed[0] = False
            swapped.append(cur[0])
            old, cur[0] = cur[0], next(stamps)
            _secret_volume(mnt, {"keyring.json": Path(op).read_bytes()}, cur[0])
            shutil.rmtree(mnt / old)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", open_during_an_update)
    kr = str(mnt / "keyring.json")
    k = Keyring(kr, provider_for(kr, create=False), read_only=True, reload_every_s=0.0)  # a worker starting
    assert k.tenant_state("alice") == "active"
    opk = Keyring(op, provider_for(op))  # the operator adds bob; the Secret is updated, mid-read again
    opk.create("bob")
    opk.close()
    old, cur[0] = cur[0], next(stamps)
    _secret_volume(mnt, {"keyring.json": Path(op).read_bytes()}, cur[0])
    shutil.rmtree(mnt / old)
    armed[0] = True  # the reload that reads bob's version meets the next update
    assert k.tenant_state("bob") == "active" and k.tenant_state("alice") == "active" and k.error is None
    assert len(swapped) == 2 and not armed[0]  # both reads met an update
