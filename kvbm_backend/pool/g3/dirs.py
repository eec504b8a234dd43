"""One G3 directory: its verified fd, its lock, its namespace files, and safe opens of files in it.

A :class:`G3Dir` is what a pool holds per configured directory (:class:`.slabs.SlabSet` owns one per
path and opens its slab files through it; the journal opens relative to its fd).

Access (G3 holds plaintext KV): the directory is created 0700 and files 0600 (older files found with
wider modes are narrowed to 0600). The directory must be owned by this process's uid and not writable
by group or others, else :class:`G3PathError` names it and the fix (``chmod 700 DIR``). Every file is
opened relative to the directory's verified O_DIRECTORY fd with ``O_NOFOLLOW`` and must be a regular
file of this uid: a symlink (or anything else) planted under a G3 name is refused with
:class:`G3PathError`, never followed, and its target is left untouched.

Lock: an ``flock`` on the directory itself (its verified fd) and on ``.kvbm-g3.lock``: a second process,
or a second pool in this one, opening the directory is refused with :class:`G3LockedError`. Deleting the
lock file while a pool runs does not let a second process in; the lock file keeps the holder's pid for
the message.

A child forked without exec (multiprocessing's fork, a zygote, an engine forking helpers) would share the
lock's open file descriptions (``O_CLOEXEC`` covers exec only, and an ``flock`` belongs to the open file
description): after its parent was killed it kept the directory locked until it ended, and its ``close``
(``LOCK_UN``) released the lock of its still running parent. Now the child closes its copies of every open
directory's descriptors at the fork (:func:`_after_fork_in_child`; the parent's descriptors keep its lock) and
never unlocks; the opens and closes of these descriptors hold :data:`_fork_lock`, which a fork waits for, so no
descriptor is half recorded at a fork. A refusal says whether the pid in the lock file still runs.

Namespace files: ``namespace.json`` and ``namespace-<fingerprint>.json`` (the owner's
:meth:`Namespace.canonical_json`, written under a unique temp name and renamed).

Stale temp files: journal rewrites and namespace-file writes go through uniquely named temp files
(``.journal-<fingerprint>.<pid>.<hex>.tmp``, ``.namespace.json.<pid>.<hex>.tmp``,
``.namespace-<fingerprint>.json.<pid>.<hex>.tmp``; the tenant labels' ``.tenants-<fingerprint>.<pid>.<hex>.tmp``,
:mod:`.tenant_labels`), removed when a write fails but left behind by a process
killed in the middle of one. Once the lock is taken (no other writer can be live in the directory) the ones of
this namespace are removed (:attr:`G3Dir.stale_temps_removed`, logged), and so are the 4 KiB files of an
O_DIRECT or device-path probe (``.kvbm-odirect-probe-<pid>-<random>``, ``.kvbm-gpu-probe-<pid>-<random>``;
:mod:`kvbm_backend.io.probe`, :mod:`kvbm_backend.gpu.probe`) whose pid no longer runs, or that are older than
:data:`PROBE_STALE_S` (a probe takes milliseconds; names without a pid, of versions before 2026-12-01, only so).

Full disk at open: a namespace file or the lock's pid line that cannot be written (ENOSPC/EDQUOT) does
not fail the open; it is listed in :attr:`G3Dir.metadata_errors` and the namespace files are written
again by :meth:`G3Dir.write_pending_namespace`. A lock file that cannot be created on a full filesystem
is skipped (the directory's ``flock`` holds alone).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import threading
import time
import uuid
import weakref

from ...fsmodes import dir_problem, makedirs_private
from ...model.namespace import Namespace

log = logging.getLogger(__name__)

LOCK_NAME = ".kvbm-g3.lock"
NOSPACE = (errno.ENOSPC, errno.EDQUOT)
PROBE_STALE_S = 3600.0  # a probe file older than this (seconds, by its mtime) is stale whatever its pid
_PROBE = re.compile(r"^\.kvbm-(?:odirect|gpu)-probe-(?:(\d+)-)?[a-z0-9_]{8}$")  # tempfile.mkstemp's 8 characters

_fork_lock = threading.Lock()  # held while a G3Dir's descriptors are opened or closed (and by a fork)
_open_dirs: "weakref.WeakSet[G3Dir]" = weakref.WeakSet()  # this process's G3Dirs (a forked child closes their fds)


def _before_fork() -> None:
    _fork_lock.acquire()  # no descriptor opened and not yet recorded (or closed and still recorded) at the fork


def _after_fork_in_parent() -> None:
    _fork_lock.release()


def _after_fork_in_child() -> None:
    """Close the child's copies of every G3Dir's descriptors, without unlocking: the parent's descriptors keep
    its locks (an ``flock`` belongs to the open file description), and the child no longer holds them once its
    parent ended. The child's G3Dirs are then closed (their :meth:`G3Dir.close` does nothing more)."""
    global _fork_lock
    _fork_lock = threading.Lock()  # the parent's is held (by _before_fork) in the child's copy
    for g in list(_open_dirs):
        g._close_fds(unlock=False)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (this pid namespace; a zombie, killed and not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except FileNotFoundError:
        return False  # ended meanwhile
    except OSError:
        return True  # no /proc: kill(0) said it exists
    return state != [b"Z"]


class G3LockedError(RuntimeError):
    """Another process (or pool) has this G3 directory open; G3 is private to one worker."""


class G3PathError(RuntimeError):
    """A G3 directory or file is unsafe or not what G3 expects (wrong owner, writable by others, a
    symbolic link or a non-file under a G3 name); the message names the path and the fix."""


def _kind(mode: int) -> str:
    """What a non-regular file is, for error messages ("a FIFO", "a directory", ...)."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "a special file"


class G3Dir:
    """A G3 directory opened, verified, locked and holding this namespace's files (see the module
    docstring). Not thread-safe (the pool locks).

    Args:
        path: the directory (absolute); created 0700 with its parents when missing.
        namespace: the pool's namespace (its namespace files are written here).

    Raises (constructor; nothing stays open when it raises):
        G3LockedError: the directory is in use by another pool or process.
        G3PathError: the directory is not this uid's or is writable by group/others, or a G3 file
            name (lock, namespace file) holds a symbolic link, a directory or another non-file.
        OSError: the directory cannot be created or written (other than a full disk).
    """

    def __init__(self, path: str, namespace: Namespace):
        self.path = path
        self.namespace = namespace
        self.fd = -1  # verified O_DIRECTORY fd (files open relative to it)
        self.lock_fd = -1  # the flocked lock file (-1: none, e.g. not creatable on a full disk)
        self.metadata_errors: list[str] = []  # metadata writes that failed at open (full disk)
        self.namespace_pending = False  # the namespace files could not be written yet
        self.stale_temps_removed: list[str] = []  # temp and probe files of a killed process removed at open
        self.pid = os.getpid()  # the opener: only it unlocks (a forked child closes its copies: module docstring)
        try:
            with _fork_lock:
                _open_dirs.add(self)
                self.fd = self._open_verified()
                self._lock()
            self._remove_stale_temps()
            self._namespace_or_defer()
        except BaseException:
            self.close()
            raise

    # ---- the directory -----------------------------------------------------------------------
    def _open_verified(self) -> int:
        """Create the directory (0700) if missing, open it and check owner and mode; returns its fd."""
        d = self.path
        makedirs_private(d)  # 0700, parents too, whatever the umask
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            problem = dir_problem(os.fstat(fd))  # the rule the keyring's directory shares (root, sticky: no)
            if problem:
                uid = os.geteuid()
                raise G3PathError(
                    f"G3 directory {d} {problem}: G3 holds plaintext KV and must live in a directory of its own "
                    f"user that no one else can write, else anyone could plant files or links there "
                    f"(fix: chown {uid} {d}; chmod 700 {d}).")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_in(self, name: str, flags: int) -> int:
        """Open ``name`` in this directory relative to its verified fd, never following a symlink
        (``O_NOFOLLOW``); created files are 0600, older files with wider modes are narrowed to 0600.
        Returns the fd (the caller closes it).

        Raises:
            G3PathError: ``name`` is a symbolic link, a directory or another non-file, or another
                user's file.
            OSError: anything else (ENOENT without ``O_CREAT``, ENOSPC, EINVAL for O_DIRECT...).
        """
        path = os.path.join(self.path, name)
        try:  # a special file is named before any open: O_DIRECT on a FIFO fails with a bare EINVAL
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
                raise G3PathError(f"G3 file {path} is {_kind(st.st_mode)}, not a regular file: remove or rename it")
        try:  # O_NONBLOCK: a FIFO planted between the stat and the open must not block it (cleared below)
            fd = os.open(name, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise G3PathError(
                    f"G3 file {path} is a symbolic link: refused (G3 never follows links in its directory; a "
                    f"planted link could redirect its writes). Remove it: rm {path}") from None
            if e.errno == errno.EISDIR:
                raise G3PathError(f"G3 file {path} is a directory, not a file: remove or rename it") from None
            if e.errno in (errno.EINVAL, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
                try:
                    st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                except OSError:
                    raise e from None
                if not stat.S_ISREG(st.st_mode):
                    raise G3PathError(f"G3 file {path} is {_kind(st.st_mode)}, not a regular file: remove or "
                                      "rename it") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise G3PathError(f"G3 file {path} is {_kind(st.st_mode)}, not a regular file: remove or rename it")
            os.set_blocking(fd, True)
            if st.st_uid != os.geteuid():
                raise G3PathError(f"G3 file {path} belongs to uid {st.st_uid}, not to this process "
                                  f"(uid {os.geteuid()}): remove it or fix its owner")
            if st.st_mode & 0o077:
                os.fchmod(fd, 0o600)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def exists(self, name: str) -> bool:
        """Whether anything (a link included, not followed) is named ``name`` in this directory."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    # ---- the lock ----------------------------------------------------------------------------
    def _holder(self) -> str:
        """The holder line of the lock file ("pid N"), or "unknown"."""
        try:
            fd = self.open_in(LOCK_NAME, os.O_RDONLY)
        except (OSError, G3PathError):
            return "unknown"
        try:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        except OSError:
            return "unknown"
        finally:
            os.close(fd)

    def _refuse(self) -> G3LockedError:
        """The refusal (one line): the directory, the holder the lock file names, and whether that pid still
        runs (when not, a process that inherited its descriptors holds the lock: one it forked without exec
        before this version, or a C-level fork; the lock goes once that one ends)."""
        holder = self._holder()
        m = re.fullmatch(r"pid (\d+)", holder)
        if m and pid_alive(int(m.group(1))):
            holder += ", running"
        elif m:
            holder += (", no longer running (in this pid namespace): a process that inherited its descriptors "
                       "(one it forked) holds the lock until it ends")
        return G3LockedError(
            f"G3 directory {self.path} is in use by another pool (holder: {holder}). "
            "G3 is private to one worker: give each worker its own directory.")

    def _lock(self) -> None:
        """Take the lock: ``flock`` on the directory itself (its verified O_DIRECTORY fd: a directory
        cannot be removed while it holds files, so the lock cannot vanish under a running pool, as a
        deleted lock file did), then on ``.kvbm-g3.lock`` (what older versions lock; it also holds the
        holder's pid for the error message). Raises G3LockedError (one line, naming the directory and
        the holder) when either is held by another pool or process."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._refuse() from None
        try:
            fd = self.open_in(LOCK_NAME, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno not in NOSPACE:
                raise
            # full filesystem and no lock file yet: the directory lock alone holds it
            self.metadata_errors.append(f"{os.path.join(self.path, LOCK_NAME)}: {e.strerror}")
            log.warning("G3: cannot create the lock file in %s (%s); the directory lock holds it", self.path,
                        e.strerror)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse() from None
        self.lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        except OSError as e:  # informational only (the flocks are the lock)
            log.warning("G3: cannot write the holder's pid into %s (%s)", os.path.join(self.path, LOCK_NAME),
                        e.strerror)

    def _remove_stale_temps(self) -> None:
        """With the lock held (no live writer here), remove this namespace's temp files a killed process
        left (journal rewrites, namespace files) and stale probe files (see the module docstring). Only regular
        files and links with exactly those names are removed; a failure to remove one is logged, never raised."""
        fp = re.escape(self.namespace.fingerprint)
        pat = re.compile(rf"^\.(?:journal-{fp}|tenants-{fp}|namespace\.json|namespace-{fp}\.json)\.\d+\.[0-9a-f]{{32}}\.tmp$")
        for name in os.listdir(self.fd):
            probe = _PROBE.match(name)
            if not probe and not pat.match(name):
                continue
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if probe and time.time() - st.st_mtime < PROBE_STALE_S and (
                        probe.group(1) is None or pid_alive(int(probe.group(1)))):
                    continue  # recent, of a pid that runs (or a name without one): a probe that may still run
                if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    os.unlink(name, dir_fd=self.fd)
                    self.stale_temps_removed.append(name)
            except OSError as e:
                log.warning("G3: cannot remove the stale temp file %s (%s)", os.path.join(self.path, name), e)
        if self.stale_temps_removed:
            log.info("G3: removed %d temp or probe file(s) a killed process left in %s", len(self.stale_temps_removed),
                     self.path)

    # ---- the namespace files -----------------------------------------------------------------
    def _write_namespace(self) -> None:
        """Write the namespace files unless they already hold this namespace.

        Raises:
            G3PathError: a namespace file is a link, a directory or another non-file.
            OSError: writing failed (ENOSPC...); the temp file is removed.
        """
        body = (self.namespace.canonical_json() + "\n").encode()
        dfd = self.fd
        for name in ("namespace.json", f"namespace-{self.namespace.fingerprint}.json"):
            target = os.path.join(self.path, name)
            try:
                fd = self.open_in(name, os.O_RDONLY)
            except FileNotFoundError:
                old = None
            else:
                try:
                    old = os.read(fd, len(body) + 1)
                finally:
                    os.close(fd)
            if old == body:
                continue
            if old is not None:
                try:
                    old.decode()
                except UnicodeDecodeError:
                    log.warning("G3: %s is not UTF-8 text (not a namespace file of kvbm-backend); replacing it "
                                "with this pool's namespace", target)
            tmp = f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                try:
                    mv = memoryview(body)
                    while mv:
                        mv = mv[os.write(fd, mv):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise

    def _namespace_or_defer(self) -> None:
        try:
            self._write_namespace()
            self.namespace_pending = False
        except OSError as e:
            if e.errno not in NOSPACE:
                raise
            if not self.namespace_pending:
                self.namespace_pending = True
                self.metadata_errors.append(f"{os.path.join(self.path, 'namespace.json')}: {e.strerror}")
                log.warning("G3: cannot write the namespace files in %s (%s); written once space returns",
                            self.path, e.strerror)

    def write_pending_namespace(self) -> None:
        """Write the namespace files if they could not be written at open (no-op otherwise).

        Raises:
            OSError: still failing (ENOSPC...).
        """
        if self.namespace_pending:
            self._write_namespace()
            self.namespace_pending = False

    # ---- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the lock and close the fds (idempotent). In a process forked from the opener only its
        copies are closed (its fds were closed at the fork already): the opener's lock stays held."""
        with _fork_lock:
            self._close_fds(unlock=self.pid == os.getpid())

    def _close_fds(self, unlock: bool) -> None:
        """Close the fds (``_fork_lock`` held, or in a child at the fork); ``unlock``: ``LOCK_UN`` the lock file
        and the directory first (only the opener: it unlocks the open file description, every process's copy)."""
        for fd in (self.lock_fd, self.fd) if unlock else ():
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:
                    pass
        if self.lock_fd >= 0:
            try:
                os.close(self.lock_fd)
            except OSError:
                pass
            self.lock_fd = -1
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
