"""The keyring's use counts not yet in its file, and their periodic persist on a thread of its own
(:class:`UseCounts`, a part :class:`~kvbm_backend.crypto.keyring.Keyring` owns).

Every encryption counts one use of the tenant's current data key (rotation at ``rotate_after_uses``, NIST
SP 800-38D's limit on random-nonce GCM encryptions under one key). The counts are merged into the keyring
file every ``persist_every_s`` seconds; that merge rewrites the file with fsyncs, which on a loaded disk
took 3 s, and was done inline by the encryption that found the period over while it held the keyring's
mutex: every G4 writer of the process waited for it. Here no encryption waits for a persist.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Callable, ContextManager

from .kek import KeyringError, KeyringReplaced
from ..threads import start_thread

Doc = dict[str, Any]  # the keyring file's JSON document
Stamp = tuple[int, int, int, int, int]  # one version of the keyring file: kek._stamp (mtime, ctime, size, inode, dev)
REPLACED_RETRIES = 3  # a change re-read and applied again at most this many times after KeyringReplaced


class UseCounts:
    """Uses per (tenant, key version) not yet merged into the keyring document, and the background
    persist of them. The keyring passes what the persist needs explicitly.

    Args:
        mu: the keyring's mutex (guards its document and these counts; callers of :meth:`count`,
            :meth:`pending` and :meth:`merge_into` hold it).
        file_lock: a context manager factory: the keyring file's inter-process lock.
        reload: re-reads the keyring file and returns the keyring's document and the stamp of the version
            read (may raise :class:`KeyringError`); called with ``mu`` and the file lock held.
        write: ``write(doc, stamp)`` writes a document to the keyring file only over the version stamped
            (fsyncs; may raise OSError, KeyringError: the file vanished since read, a crypto-shred, so nothing
            is written back, or :class:`KeyringReplaced`: another file there, read again); called with the
            file lock held and ``mu`` not held.
        warn_once: logs a message once (the keyring's bounded set of logged errors).
        every_s: the persist period in seconds.
        writable: False for a read-only keyring: counts are kept in memory, never persisted.
        where: the keyring file, for messages.
    """

    def __init__(self, *, mu: threading.RLock, file_lock: Callable[[], ContextManager[None]],
                 reload: Callable[[], tuple[Doc, Stamp]], write: Callable[[Doc, Stamp], None], warn_once: Callable[[str], None],
                 every_s: float, writable: bool, where: str) -> None:
        self._mu, self._file_lock, self._reload, self._write = mu, file_lock, reload, write
        self._warn_once, self._every_s, self._writable, self._where = warn_once, every_s, writable, where
        self._delta: dict[tuple[str, int], int] = {}  # (tenant, version) -> uses not yet persisted
        self._last = time.monotonic()  # the last merge (a persist attempt or a mutation of the file)
        self._persisting = False  # a background persist runs
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        """(tenant, version) pairs with uses not yet merged."""
        return len(self._delta)

    def pending(self, tenant: str, version: int) -> int:
        """Uses of ``tenant``'s key ``version`` not yet merged into the document."""
        return self._delta.get((tenant, version), 0)

    def count(self, tenant: str, version: int) -> None:
        """Count one use; start a background persist when ``every_s`` passed since the last merge (one
        attempt per period, failed or not; none for a read-only keyring). Caller holds ``mu``."""
        self._delta[(tenant, version)] = self._delta.get((tenant, version), 0) + 1
        if self._writable and not self._persisting and time.monotonic() - self._last > self._every_s:
            self._persisting = True
            self._last = time.monotonic()
            th = start_thread(self._persist, name="kvbm-keyring-persist", start=False)
            self._thread = th
            th.start()

    def merge_into(self, doc: Doc) -> dict[tuple[str, int], int]:
        """Add the counts to ``doc``'s versions (those still in it) and clear them; returns them (for
        :meth:`restore` when ``doc`` is not written after all). Caller holds ``mu``."""
        merged = self._delta
        for (tenant, ver), n in merged.items():
            t = doc["tenants"].get(tenant)
            if t and str(ver) in t["versions"]:
                t["versions"][str(ver)]["uses"] = int(t["versions"][str(ver)].get("uses", 0)) + n
        self._delta = {}
        self._last = time.monotonic()
        return merged

    def restore(self, counts: dict[tuple[str, int], int]) -> None:
        """Put ``counts`` (from :meth:`merge_into`) back: the document they went into was not written.
        Caller holds ``mu``."""
        for k, n in counts.items():
            self._delta[k] = self._delta.get(k, 0) + n

    def wait(self) -> None:
        """Wait for a background persist in flight to finish (it took its counts out of memory: a flush
        returning before its write would let ``close`` and a process exit lose them)."""
        th = self._thread
        if th is not None and th is not threading.current_thread():
            th.join()  # it waits for the file lock at most as long as the caller's merge would

    def _persist(self) -> None:
        """The periodic persist, on its own thread so that no seal waits for it. The file lock is taken
        without ``mu`` (another process holding it, e.g. a worker sharing this keyring during its own
        fsync, costs only this thread); ``mu`` is then tried briefly for the reload and merge (the keyring's
        lock order is the file lock, then ``mu``, and no one holds ``mu`` waiting for the file lock; should
        one, this thread lets go and retries, so no deadlock), and the write (the fsyncs) runs under the
        file lock alone, as the keyring's own mutations do. A failed write puts the counts back (nothing
        is lost; the next period retries) and is logged once per reason."""
        snap: dict[tuple[str, int], int] = {}
        replaced = 0  # writes refused because the file was replaced without the lock (re-read, at most 3 times)
        try:
            while True:
                with self._file_lock():
                    if self._mu.acquire(timeout=0.05):
                        try:
                            if not self._delta:
                                return
                            doc, stamp = self._reload()
                            snap = self.merge_into(doc)  # the document counts them from now on: rotation sees every use
                            copy = json.loads(json.dumps(doc))
                        finally:
                            self._mu.release()
                        try:
                            self._write(copy, stamp)  # deleted since the reload: KeyringError, never written back
                        except KeyringReplaced:
                            replaced += 1
                            if replaced > REPLACED_RETRIES:
                                raise
                            with self._mu:
                                self.restore(snap)  # merged again into the file read next
                            snap = {}
                            continue
                        snap = {}
                        return
                time.sleep(0.01)  # a mutation of this process holds mu and waits for the file lock: it goes first
        except (OSError, KeyringError) as e:
            self._warn_once(f"keyring {self._where}: use counts not persisted ({e}); kept in memory, "
                            f"retried in {self._every_s:g} s")
        finally:
            with self._mu:
                if snap:  # the write failed: the file lacks them, and the next load drops them from the doc
                    with contextlib.suppress(KeyringError):
                        self._reload()
                    self.restore(snap)
                self._persisting = False
