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
import threading
import time

from .kek import KeyringError

log = logging.getLogger("kvbm_backend.crypto.keyring")


class PersistMixin:
    """Uses the keyring's ``_mu``, ``_locked``, ``_load``, ``_mutate``, ``_write``, ``_doc``, ``_delta``,
    ``_persisting``, ``_persist_thread``, ``read_only`` and ``_logged_errors``."""

    def _merge_delta(self) -> None:
        """Add the in-memory use counts to ``_doc`` and clear them. Caller holds ``_mu``."""
        for (tenant, ver), n in self._delta.items():
            t = self._doc["tenants"].get(tenant)
            if t and str(ver) in t["versions"]:
                t["versions"][str(ver)]["uses"] = int(t["versions"][str(ver)].get("uses", 0)) + n
        self._delta = {}
        self._last_persist = time.monotonic()

    def flush(self) -> None:
        """Merge in-memory use counts into the file (under the lock), after a background persist in
        flight has written its share (it took those counts out of memory: returning before its write would
        let ``close`` and a process exit lose them). Read-only keyrings keep them in memory (this
        process's counts)."""
        th = self._persist_thread
        if th is not None and th is not threading.current_thread():
            th.join()  # it waits for the file lock at most as long as the merge below would
        with self._mu:
            if self._delta and not self.read_only:
                self._mutate(lambda doc: None)

    def close(self) -> None:
        """Persist use counts (:meth:`flush`)."""
        self.flush()

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
