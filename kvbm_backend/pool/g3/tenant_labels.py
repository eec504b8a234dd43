"""Tenant labels of a G3 pool: tenant tag -> an opaque 16-byte label, kept across restarts (``tenants-<fp>``).

G3's journal and slot headers name a block's tenant by its tag only (``tag_of(tenant)``, :mod:`.index`), so after a
restart nothing in G3 says which tenant a restored block is. The integration layer that follows the G4 keyring's
revocations (:mod:`kvbm_backend.integrations.revoked_tenants`) records here the keyring pseudonym of each tenant it
sees (:meth:`TenantLabels.note`); after a restart it matches the keyring's revocation records against these labels
and purges a revoked tenant's restored blocks at once, without waiting for a request of that tenant (before
2026-12 they stayed, refused and unservable, until evicted). G3 gives the labels no meaning of its own.

File (docs/format.md "G3 tenant labels"): ``tenants-<namespace fingerprint>`` in the directory of the pool's journal
(0600, opened with ``O_NOFOLLOW`` relative to the verified directory fd): the 8-byte magic ``KVBMTNT1``, then
40-byte records ``tag (16) || label (16) || xxh3_64(tag || label) (u64 LE)``, appended; the last record of a tag
wins. A record whose check fails (a torn tail, a damaged sector) is ignored, as is a file of another magic (logged).
The file is rewritten (unique temp name, fsync, rename) when :meth:`TenantLabels.compact` keeps only the tags
G3 still holds blocks of, and when appends made it four times the live records. Bounded at :attr:`TenantLabels.
max_labels` tags (:data:`MAX_LABELS`; about 150 bytes each in memory, 40 in the file): a tag noted past it is not
recorded and sets :attr:`TenantLabels.full`, on which the integration compacts against the tags G3 holds and notes
it again (such a tenant's restored blocks are purged at its first request meanwhile, as before 2026-12).
Nothing here raises for storage trouble: each failed read or write is counted (:meth:`TenantLabels.take_errors`)
and logged at most once per kind and file per minute (:class:`~kvbm_backend.log_limits.LimitedLog`); a label not
recorded only delays a purge, and the labels not written are kept for the next :meth:`TenantLabels.persist`.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
import uuid
from typing import Any, Callable

import xxhash

from ...log_limits import LimitedLog, forget
from .dirs import G3PathError

log = logging.getLogger(__name__)
_limited = LimitedLog(log)  # kinds "<what> <labels path>": one line per kind and pool per minute

__all__ = ["MAGIC", "MAX_LABELS", "RECORD_BYTES", "TenantLabels", "labels_name", "labels_of"]

MAGIC = b"KVBMTNT1"
RECORD_BYTES = 40
MAX_LABELS = 1 << 20  # tags recorded (about 150 bytes each in memory: ~150 MiB at the cap; 40 in the file)
_SUM = struct.Struct("<Q")
_ATTR = "_kvbm_tenant_labels"
_make_lock = threading.Lock()


def labels_name(fingerprint: str) -> str:
    return f"tenants-{fingerprint}"


def _record(tag: bytes, label: bytes) -> bytes:
    body = tag + label
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def parse(data: bytes) -> tuple[dict[bytes, bytes], int, int]:
    """``(labels, records read, records ignored)`` of a labels file's bytes; ``({}, 0, 0)`` for an empty one.
    Raises ValueError for another magic."""
    if not data:
        return {}, 0, 0
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError("not a G3 tenant labels file (magic)")
    out: dict[bytes, bytes] = {}
    bad = n = 0
    for off in range(len(MAGIC), len(data) - RECORD_BYTES + 1, RECORD_BYTES):
        rec = data[off:off + RECORD_BYTES]
        n += 1
        if _SUM.unpack_from(rec, 32)[0] != xxhash.xxh3_64_intdigest(rec[:32]):
            bad += 1
            continue
        out[rec[:16]] = rec[16:32]
    return out, n, bad + (1 if (len(data) - len(MAGIC)) % RECORD_BYTES else 0)


class TenantLabels:
    """The labels of one G3 pool (module doc). Thread-safe. Built by :func:`labels_of`.

    Args:
        slabs: the pool's :class:`~.slabs.SlabSet` (its directories' verified fds and safe opens).
        directory: the directory of the pool's journal (one of ``slabs.paths``).
        fingerprint: the namespace fingerprint.
        sync: fdatasync appends and fsync rewrites (the pool's ``g3.fsync``).

    Attributes:
        max_labels: tags kept at most (:data:`MAX_LABELS`).
        full: a tag was refused for :attr:`max_labels` since the last :meth:`compact`.
        failing: the last write failed (:meth:`persist` retries; its labels are kept meanwhile).
    """

    def __init__(self, slabs: Any, directory: str, fingerprint: str, *, sync: bool = True) -> None:
        self.slabs, self.directory, self.name, self.sync = slabs, directory, labels_name(fingerprint), sync
        self.max_labels = MAX_LABELS
        self.full = self.failing = False
        self._mu = threading.Lock()
        self._io = threading.Lock()  # one append or rewrite at a time
        self._map: dict[bytes, bytes] = {}
        self._dirty: dict[bytes, bytes] = {}  # noted, not written yet
        self._writing: dict[bytes, bytes] = {}  # being written (under _io)
        self._fresh: set[bytes] | None = None  # noted since :meth:`mark` (kept by the next compact)
        self._records = 0  # records in the file
        self._errors = 0  # failed reads and writes not taken yet (take_errors)
        forget(self.path)  # this pool's own budget of WARNING lines (a closed one's at this path is not its)
        self._load()

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def _warn(self, what: str, msg: str, *args: Any) -> None:
        """Count a failed read or write and log it (one line per kind and file per minute)."""
        with self._mu:
            self._errors += 1
        _limited.warning(f"tenant-labels-{what} {self.path}", msg, *args)

    def take_errors(self) -> int:
        """Failed reads and writes of the file since the last call (each logged or counted in a WARNING line)."""
        with self._mu:
            n, self._errors = self._errors, 0
        return n

    def _load(self) -> None:
        try:
            fd = self.slabs.open_in(self.directory, self.name, os.O_RDONLY)
        except FileNotFoundError:
            return
        except (OSError, G3PathError, KeyError) as e:  # KeyError: the pool closed; a link, a directory... planted
            self._warn("read", "G3: cannot read the tenant labels %s (%s): restored blocks of revoked tenants are "
                       "purged at their first request only", self.path, e)
            return
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
        except OSError as e:
            self._warn("read", "G3: cannot read the tenant labels %s (%s)", self.path, e)
            return
        finally:
            os.close(fd)
        try:
            self._map, self._records, bad = parse(data)
        except ValueError as e:
            log.warning("G3: tenant labels %s ignored: %s", self.path, e)
            self._records = 1 << 62  # rewritten at the next append
            return
        if bad:
            log.warning("G3: tenant labels %s: %d damaged record(s) ignored", self.path, bad)

    def labels(self) -> dict[bytes, bytes]:
        """A copy of tag -> label (16 bytes each)."""
        with self._mu:
            return dict(self._map)

    def note(self, tag: bytes, label: bytes) -> bool:
        """Record ``label`` for ``tag`` in memory (:meth:`persist` writes it); True when new or changed. False when
        known, or not recorded: :attr:`max_labels` tags held (then :attr:`full` is set). Raises ValueError unless
        both are 16 bytes."""
        if len(tag) != 16 or len(label) != 16:
            raise ValueError(f"tenant label: tag and label must be 16 bytes (got {len(tag)}, {len(label)})")
        with self._mu:
            if self._fresh is not None:
                self._fresh.add(tag)
            if self._map.get(tag) == label:
                return False
            if tag not in self._map and len(self._map) >= self.max_labels:
                self.full = True
                full = len(self._map)
            else:
                self._map[tag] = self._dirty[tag] = label
                return True
        _limited.warning(f"tenant-labels-full {self.path}", "G3: tenant labels %s hold %d tenants: more are not "
                         "recorded until those G3 holds no block of are dropped (a revoked tenant's restored blocks "
                         "are purged at its first request meanwhile)", self.path, full)
        return False

    def unsynced(self, tag: bytes) -> bool:
        """True while ``tag``'s label is noted but not in the file yet (waiting or being written)."""
        with self._mu:
            return tag in self._dirty or tag in self._writing

    def pending(self) -> int:
        """Labels noted and not written yet (kept by a failed write for the next :meth:`persist`)."""
        with self._mu:
            return len(self._dirty)

    def persist(self) -> bool:
        """Append the labels noted since the last write (a rewrite when the file holds 4x the live records).
        False when they could not be written (counted, logged; kept for the next call). Never raises."""
        with self._io:
            with self._mu:
                todo, self._dirty = self._dirty, {}
                self._writing = todo
                rewrite = self._records + len(todo) > 4 * len(self._map) + 1024
            if not todo:
                return True
            ok = False
            try:
                ok = self._rewrite() if rewrite else self._append(todo)
            finally:
                with self._mu:
                    self._writing = {}
                    self.failing = not ok
                    if not ok:
                        self._dirty = {**todo, **self._dirty}
            return ok

    def mark(self) -> None:
        """Tags noted from now on are kept by the next :meth:`compact` (noted while its ``keep`` was computed)."""
        with self._mu:
            self._fresh = set()

    def compact(self, keep: Callable[[bytes], bool]) -> bool:
        """Forget the tags ``keep`` refuses (but those noted since :meth:`mark`) and rewrite the file with the
        others; clears :attr:`full`. Never raises (False: counted, logged; the labels not written yet are kept for
        the next :meth:`persist`)."""
        with self._io:
            with self._mu:
                fresh, self._fresh = self._fresh or set(), None
                drop = [t for t in self._map if t not in fresh and not keep(t)]
                for t in drop:
                    del self._map[t]
                    self._dirty.pop(t, None)
                self.full = False
                if not drop and not self._dirty and self._records == len(self._map):
                    return True
                todo, self._dirty = self._dirty, {}
                self._writing = todo
            ok = False
            try:
                ok = self._rewrite()
            finally:
                with self._mu:
                    self._writing = {}
                    self.failing = not ok
                    if not ok:  # still noted: written by the next persist (a dropped tag's record is harmless)
                        self._dirty = {**{t: lb for t, lb in todo.items() if t in self._map}, **self._dirty}
            return ok

    def _append(self, todo: dict[bytes, bytes]) -> bool:
        data = b"".join(_record(t, lb) for t, lb in todo.items())
        try:
            fd = self.slabs.open_in(self.directory, self.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                st = os.fstat(fd)
                if st.st_size == 0:
                    data = MAGIC + data
                elif (st.st_size - len(MAGIC)) % RECORD_BYTES:  # a torn tail: rewrite from memory instead
                    os.close(fd)
                    fd = -1
                    return self._rewrite()
                if os.write(fd, data) != len(data):
                    raise OSError(errno.EIO, "short write")
                if self.sync:
                    os.fdatasync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
        except (OSError, G3PathError, KeyError) as e:  # KeyError: the pool closed
            self._warn("write", "G3: cannot record tenant labels in %s (%s); retried later", self.path, e)
            return False
        with self._mu:
            self._records += len(todo)
        return True

    def _rewrite(self) -> bool:
        with self._mu:
            items = list(self._map.items())
        data = MAGIC + b"".join(_record(t, lb) for t, lb in items)
        tmp = f".{self.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        dfd = -1
        try:
            dfd = self.slabs.dir_fd(self.directory)
            fd = self.slabs.open_in(self.directory, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.EIO, "short write")
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                st = os.stat(self.name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, f"{self.path} is not a regular file")
            except FileNotFoundError:
                pass
            os.rename(tmp, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            if self.sync:
                os.fsync(dfd)
        except (OSError, G3PathError, KeyError) as e:  # KeyError: the pool closed
            self._warn("write", "G3: cannot rewrite the tenant labels %s (%s); retried later", self.path, e)
            try:
                if dfd >= 0:
                    os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            return False
        with self._mu:
            self._records = len(items)
        return True


def labels_of(pool: Any) -> TenantLabels | None:
    """The tenant labels of a G3 pool (made at the first call, then the same object); None for anything that is not
    an open :class:`~.pool.G3Pool` (a scheduler's mirror of G3, a closed pool)."""
    lb: TenantLabels | None = getattr(pool, _ATTR, None)
    if lb is not None:
        return lb
    cat: Any = getattr(pool, "cat", None)
    home = getattr(cat, "journal_home", None)
    if cat is None or home is None or getattr(cat, "closed", True) or not getattr(cat.slabs, "dirs", None):
        return None
    with _make_lock:
        lb = getattr(pool, _ATTR, None)
        if lb is None:
            lb = TenantLabels(cat.slabs, home.directory, cat.fp, sync=bool(getattr(pool.cfg, "fsync", True)))
            setattr(pool, _ATTR, lb)
            # the pool's close forgets its WARNING kinds (log_limits.forget): these labels' too
            pool._log_subjects = (*getattr(pool, "_log_subjects", ()), lb.path)
    return lb
