"""The keyring's periodic persist of use counts (:class:`PersistMixin`, part of
:class:`~kvbm_backend.crypto.keyring.Keyring`), on its own thread.

Every encryption counts one use of the tenant's current data key (rotation at ``rotate_after_uses``, NIST
SP 800-38D's limit on random-nonce GCM encryptions under one key). The counts are merged into the keyring
file every ``persist_every_s`` seconds; that merge rewrites the file with fsyncs, which on a loaded disk
took 3 s, and was done inline by the encryption that found the period over while it held the keyring's
mutex: every G4 writer of the process waited for it. Here no encryption waits for a persist.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time

from .kek import KeyringError

log = logging.getLogger("kvbm_backend.crypto.keyring")


class PersistMixin:
    """Uses the keyring's ``_mu``, ``_locked``, ``_load``, ``_merge_delta``, ``_write``, ``_delta``,
    ``_persisting`` and ``_logged_errors``."""

    def _persist_counts(self) -> None:
        """The periodic persist of use counts, on its own thread so that no seal waits for it. The file
        lock is taken without ``_mu`` (another process holding it, e.g. a worker sharing this keyring
        during its own fsync, costs only this thread); ``_mu`` is then tried briefly for the reload and
        merge (a mutation of this process holding ``_mu`` and waiting for the file lock makes this thread
        let go and retry, so the two lock orders never deadlock), and the write (the fsyncs) runs under the
        file lock alone. A failed write puts the counts back (nothing is lost; the next period retries)
        and is logged once per reason."""
        snap: dict = {}
        try:
            while True:
                with self._locked():
                    if self._mu.acquire(timeout=0.05):
                        try:
                            if not self._delta or self.read_only:
                                return
                            if self.path.exists():
                                self._load()
                            snap = dict(self._delta)
                            self._merge_delta()  # self._doc counts them from now on: rotation sees every use
                            doc = json.loads(json.dumps(self._doc))
                        finally:
                            self._mu.release()
                        self._write(doc)
                        snap = {}
                        return
                time.sleep(0.01)  # a mutation of this process holds _mu and waits for the file lock: it goes first
        except (OSError, KeyringError) as e:
            msg = f"keyring {self.path}: use counts not persisted ({e}); kept in memory, retried in {self.persist_every_s:g} s"
            if msg not in self._logged_errors and len(self._logged_errors) < 64:
                self._logged_errors.add(msg)
                log.warning("%s", msg)
        finally:
            with self._mu:
                if snap:  # the write failed: the file lacks them, and the next load drops them from _doc
                    with contextlib.suppress(KeyringError):
                        self._load()
                    for k, n in snap.items():
                        self._delta[k] = self._delta.get(k, 0) + n
                self._persisting = False
