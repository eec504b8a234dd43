"""Deleting the keyring file (the crypto-shred of every tenant) while a worker process is in the middle of a
change of it: the worker never writes the deleted file back.

Review finding (2026-12-01): a change (an implicit tenant creation, the periodic use-count persist) checked for
the file only when it read it, under ``PATH.lock``; a plain ``rm`` takes no lock, and a deletion after the read
was undone by the change's rename, which published the old document again (every tenant's wrapped data key and
the same pseudonym key): the shredded tenants' G4 blocks were readable again (12 of 20 deletions undone).

The deletion is placed, not timed: the worker process stops in the fsync of its temp file (after its read,
before its rename: a real fsync hook that waits for a line on stdin) and this process, the operator, deletes
the file with ``os.unlink`` (what ``rm`` does) before letting it go on.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbm_backend.crypto.keyring import Keyring, generate_kek_b64, provider_for
from tests.helpers.keyring_writer import PausedKeyringWriter


def _run_worker_and(path: Path, mode: str, operator) -> dict:
    """:class:`PausedKeyringWriter` ``mode``: ``operator()`` while it is inside its write; its report."""
    w = PausedKeyringWriter(path, mode)
    try:
        operator()
        return w.finish()
    finally:
        w.kill()


def _keyring(path: Path) -> Keyring:
    kr = Keyring(path, provider_for(path), persist_every_s=3600)
    kr.create("acme")
    kr.create("victim")
    return kr


def _left_over(path: Path) -> list[str]:
    """Files in ``path``'s directory besides the KEK and the lock file."""
    return sorted(f.name for f in path.parent.iterdir() if f.name not in (f"{path.name}.kek", f"{path.name}.lock"))


def test_a_keyring_deleted_during_a_tenant_creation_is_not_written_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_BACKEND_KEK", generate_kek_b64())
    path = tmp_path / "kr.json"
    _keyring(path)
    rep = _run_worker_and(path, "create", lambda: os.unlink(path))  # the operator's `rm`: a crypto-shred
    assert rep["paused"]
    assert not path.exists(), "the worker wrote the deleted keyring back: every shredded tenant's key is back"
    assert _left_over(path) == []  # its temp file (every wrapped key) is gone too
    assert rep["result"].startswith("KeyringError") and "not found" in rep["result"], rep


def test_a_keyring_deleted_during_a_use_count_persist_is_not_written_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_BACKEND_KEK", generate_kek_b64())
    path = tmp_path / "kr.json"
    _keyring(path)
    rep = _run_worker_and(path, "persist", lambda: os.unlink(path))
    assert rep["paused"]
    assert not path.exists(), "the use-count persist wrote the deleted keyring back"
    assert _left_over(path) == []
    assert rep["result"] == "ok" and "use counts not persisted" in rep["stderr"] and "not found" in rep["stderr"]
    assert rep["serves_key_after"] is False  # the worker fails closed: the deletion is seen


def test_a_keyring_replaced_during_a_change_gets_the_change_applied_to_the_new_file(tmp_path, monkeypatch):
    """A file put at the path without the lock during a change (a copy restored with ``mv``) is not overwritten
    by a document made from the old one: the change is applied again to the new file."""
    monkeypatch.setenv("KVBM_BACKEND_KEK", generate_kek_b64())
    path = tmp_path / "kr.json"
    _keyring(path)
    other = tmp_path / "other" / "kr.json"
    o = Keyring(other, provider_for(other), persist_every_s=3600)  # the same KEK ($KVBM_BACKEND_KEK)
    o.create("restored")
    rep = _run_worker_and(path, "create", lambda: os.replace(other, path))
    assert rep["paused"] and rep["result"] == "ok", rep
    now = Keyring(path, provider_for(path), create=False)
    assert sorted(r["tenant"] for r in now.info()) == ["newcomer", "restored"]  # the replacement kept, plus the change
    assert now.pseudonym("acme") == o.pseudonym("acme")  # its pseudonym key, not the old file's
    assert _left_over(path) == ["kr.json", "other"]


def test_a_keyring_that_vanishes_before_a_change_publishes_is_refused_in_process(tmp_path, monkeypatch):
    """The same check in one process, without a child: a publish over a path that no longer names the version
    read raises, nothing is written."""
    from kvbm_backend.crypto.kek import KeyringError, KeyringReplaced
    from kvbm_backend.crypto.keyring_publish import publish_keyring
    monkeypatch.setenv("KVBM_BACKEND_KEK", generate_kek_b64())
    path, other = tmp_path / "kr.json", tmp_path / "other" / "kr.json"
    kr = Keyring(path, provider_for(path), persist_every_s=3600)
    Keyring(other, provider_for(other), persist_every_s=3600)  # made while the first exists: another inode
    read = kr._stamp
    assert read is not None
    os.unlink(path)
    with pytest.raises(KeyringError, match="not found"):
        publish_keyring(path, kr._doc, read)
    assert not path.exists() and _left_over(path) == ["other"]
    os.replace(other, path)  # another keyring put there
    with pytest.raises(KeyringReplaced, match="replaced during this change"):
        publish_keyring(path, kr._doc, read)
    assert Keyring(path, provider_for(path), create=False).pseudonym("a") != kr.pseudonym("a")  # left as it was


def test_a_keyring_replaced_during_a_rewrap_is_rewrapped_not_overwritten(tmp_path, monkeypatch):
    """``keys rewrap`` (KEK rotation) with another keyring put at the path (``mv``, no lock) between its read and
    its rename: the new file is read again and rewrapped; before, the old document overwrote it."""
    from kvbm_backend.crypto.keyring import LocalKek
    old_kek, new_kek = LocalKek(os.urandom(32)), LocalKek(os.urandom(32))
    path, other = tmp_path / "kr.json", tmp_path / "other" / "kr.json"
    kr = Keyring(path, old_kek, persist_every_s=3600)
    kr.create("acme")
    Keyring(other, old_kek, persist_every_s=3600).create("restored")
    real_fsync, moved = os.fsync, []

    def fsync(fd: int) -> None:  # the rewrap's temp file is on disk: the operator's `mv` lands now
        real_fsync(fd)
        if not moved and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(f".{path.name}."):
            moved.append(1)
            os.replace(other, path)
    monkeypatch.setattr(os, "fsync", fsync)
    assert kr.rewrap(new_kek) == 1  # the restored file's one key
    assert moved and [r["tenant"] for r in Keyring(path, new_kek, create=False).info()] == ["restored"]
