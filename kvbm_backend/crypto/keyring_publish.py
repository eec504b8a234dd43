"""Publishing the keyring file only over the version a change read, and destroying it under its lock.

A keyring change (a worker's implicit tenant creation or rotation, its periodic use-count persist, a
``kvbm-backend keys`` command) holds ``PATH.lock``, reads the file, writes a temp file and renames it over
``PATH``. Deleting the file is the crypto-shred of every tenant (docs/configuration.md, "Replacing the
keyring file"), and a plain ``rm`` takes no lock. Until 2026-12-01 the only check was the read at the start
of a change: a deletion after it was undone by the rename, which put back every tenant's wrapped data key
and the old pseudonym key (a reviewer saw 12 of 20 deletions undone by a worker creating tenants).

* :func:`publish_keyring` checks, immediately before the rename and under the lock, that ``PATH`` is still
  the file the change read (device, inode, size, mtime). Gone: nothing is published (:class:`KeyringError`
  "not found", as a change that finds the file missing at its start). Another file: :class:`KeyringReplaced`
  (the caller re-reads it and applies its change again). A plain ``rm`` landing between this check and the
  rename (microseconds) is still undone: POSIX has no rename conditional on the target.
* :func:`destroy_keyring` (``kvbm-backend keys destroy``) deletes the file holding the lock, so no change is
  in flight, with the temp files killed writers left (they hold every wrapped key too), and fsyncs the
  directory: the race-free crypto-shred of every tenant.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Callable, TypeVar

from .kek import (KEY_BYTES, KEYRING_TMP_MARK, KeyProvider, KeyringError, KeyringReplaced, _b64, _fsync_dir, locked_file,
                  replace_private_json)
from .keyring_file import FORMAT
from .keyring_persist import REPLACED_RETRIES, Stamp

T = TypeVar("T")


def _same_version(st: os.stat_result, read: Stamp) -> bool:
    """``st`` is the version stamped ``read``: device, inode, size and mtime (not ctime: a ``chmod`` or
    ``chown`` of the file changes no key)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (read[4], read[3], read[2], read[0])


def publish_keyring(path: Path, doc: object, read: Stamp | None) -> None:
    """Replace the keyring file ``path`` with ``doc`` (:func:`~.kek.replace_private_json`), only if it is
    still the version stamped ``read`` (None: a new keyring, so no file may be there). The caller holds
    ``PATH.lock``.

    Raises:
        KeyringError: ``path`` vanished since it was read ("not found": deleted, a crypto-shred of every
            tenant; never written back). Nothing was written.
        KeyringReplaced: another file is at ``path`` (or, with ``read`` None, a file appeared). Nothing written.
        OSError: the write failed (:func:`~.kek.replace_private_json`).
    """
    def still_the_one_read() -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if read is None:
                return
            raise KeyringError(f"keyring {path}: not found (deleted during this change, a crypto-shred of every "
                               "tenant: not written back)") from None
        if read is None or not _same_version(st, read):
            raise KeyringReplaced(f"keyring {path}: replaced during this change without its lock "
                                  f"({path}.lock); nothing written")
    replace_private_json(path, doc, before_publish=still_the_one_read)


def create_keyring(path: Path, provider: KeyProvider) -> None:
    """Write a new, empty keyring at ``path`` (a random pseudonym key wrapped under ``provider``'s KEK), caller
    holding ``PATH.lock``; a file that appeared there without the lock meanwhile is left as it is (loaded next).
    Raises OSError (:func:`~.kek.replace_private_json`)."""
    pk = secrets.token_bytes(KEY_BYTES)
    doc = {"format": FORMAT, "kek_id": provider.key_id, "pseudonym_key": _b64(provider.wrap(pk)), "tenants": {},
           "revoked": {}}
    with contextlib.suppress(KeyringReplaced):
        publish_keyring(path, doc, None)


def retry_replaced(attempt: Callable[[], T]) -> T:
    """``attempt()`` (a change: read, apply, :func:`publish_keyring`), again after :class:`KeyringReplaced`,
    at most :data:`REPLACED_RETRIES` more times; the last KeyringReplaced, or any other error, is raised."""
    for _ in range(REPLACED_RETRIES):
        try:
            return attempt()
        except KeyringReplaced:
            continue
    return attempt()


def destroy_keyring(path: str | os.PathLike[str]) -> dict[str, object]:
    """Delete the keyring file ``path`` under ``PATH.lock`` (no change of any process is in flight, and none
    can publish it again), with the temp files of killed writers (``.NAME.kvbm-keyring-tmp.*``), then fsync
    the directory. The KEK and the lock file stay. Returns ``{"keyring": absolute path, "destroyed": True,
    "removed_temp_files": N, "tenants": N}``.

    Raises:
        KeyringError: ``path`` is missing, not a regular file, or not a keyring (JSON with ``"format":
            "kvbm-backend-keyring/1"``), or relative while this process's working directory has been removed
            (:func:`kvbm_backend.fsmodes.abspath`; before 2026-12-03 a bare FileNotFoundError from
            ``os.getcwd()``): nothing is deleted.
        OSError: the unlink or the directory fsync failed.
    """
    from ..fsmodes import WorkdirRemoved, abspath
    try:
        p = Path(abspath(path))
    except WorkdirRemoved as e:
        raise KeyringError(f"keyring: {e}; nothing deleted") from None
    if not os.path.lexists(p):  # checked again under the lock; no lock file made beside a mistyped path
        raise KeyringError(f"keyring {p}: not found (nothing to destroy)")
    with locked_file(f"{p}.lock"):
        if os.path.islink(p) or (os.path.lexists(p) and not os.path.isfile(p)):
            raise KeyringError(f"keyring {p}: not a regular file; nothing deleted")  # a link's target: never
        try:
            doc = json.loads(p.read_bytes())
        except FileNotFoundError:
            raise KeyringError(f"keyring {p}: not found (nothing to destroy)") from None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise KeyringError(f"keyring {p}: not a keyring file (JSON with \"format\": \"{FORMAT}\"); "
                               "nothing deleted")
        prefix = f".{p.name}.{KEYRING_TMP_MARK}."
        with os.scandir(p.parent) as entries:
            stale = [e.path for e in entries if e.name.startswith(prefix)]
        os.unlink(p)
        for s in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(s)
        _fsync_dir(p.parent)
    tenants = doc.get("tenants")
    return {"keyring": str(p), "destroyed": True, "removed_temp_files": len(stale),
            "tenants": len(tenants) if isinstance(tenants, dict) else 0}
