"""Shared POSIX store (NFS, Lustre, VAST, Weka, local disk) under ``file:///root``.

Publish protocol (invariant 2), safe with many writers on many nodes:

1. write to a unique temp name in the object's own directory,
   ``.{name}.{hostname}.{pid}.{uuid4}.tmp`` (never a fixed ``.tmp``), ``fsync`` it;
2. ``link(temp, final)``: create-exclusive, atomic on local filesystems and NFSv3/v4
   (EEXIST means another writer published first, which is success);
3. unlink the temp, ``fsync`` the directory.

A directory created on the way is fsynced into its parent (before 2026-11-30 it was not: a power cut
after a publish could lose the directory holding the object).

Readers only ever open final names, so they see complete objects or nothing. A corrupt object is deleted by way
of a quarantine name shaped as a temp file (:mod:`.fs_quarantine`: never a good copy published meanwhile). Directories are
created on demand (0700, an existing one is fine), which is race-free; gc removes those its deletions left
empty (:meth:`FsStore.prune_dirs`, ``rmdir`` only), and a writer whose directory went between its
``mkdir`` and step 1 makes it again. No path component under the root is ever followed if it is a symbolic link.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, overload
from urllib.parse import ParseResult

import numpy as np

from ...fsmodes import DIR_MODE, FILE_MODE, makedirs_private
from ...io import openat2
from ...io.files import open_for_read, refuses_direct
from ...io.openat2 import Unsupported, clear_nonblock, open_no_symlinks, preadv_clearing
from ...memory import aligned_empty
from .fs_confirm import reread_matches
from .fs_list import is_temp_name as is_temp_name, stat_version, walk  # is_temp_name: re-exported
from .fs_prune import prune_empty_dirs
from .fs_put import FULL_ERRNOS, link_exclusive, mount_point
from .fs_quarantine import delete_if_listed, delete_if_matches, unlink_quiet
from .store import ObjectInfo, ObjectStore, StoreFull, StoreUnavailable

if TYPE_CHECKING:
    from .factory import StoreOptions
    from .store import DataIn

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_HOST = socket.gethostname().replace("/", "_").replace(".", "_")
# no answer: an outage (the breaker counts it). ENOSPC, EDQUOT, EROFS are answers: StoreFull (fs_put.FULL_ERRNOS)
_UNAVAILABLE = {errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH}
_DIR_ATTEMPTS = 3  # a put whose directory gc removed meanwhile makes it again (FsStore._open_and_write)


class _DirectRefused(Exception):
    """An O_DIRECT read the filesystem refused (EINVAL): read it again buffered (never an OSError)."""


class FsStore(ObjectStore):
    """Objects as files under ``root``. ``fsync=False`` only for throwaway benchmarks.

    Hostile trees (issue 26): every path is resolved from the root one component at a time with
    ``O_NOFOLLOW`` directory fds, so a symbolic link (or anything but a directory) at any component under
    the root is refused (an OSError naming it: a miss or a dropped offload, never I/O outside the root);
    objects are opened ``O_NONBLOCK | O_NOFOLLOW`` and refused unless ``fstat`` says regular file, so a
    FIFO or socket planted at an object name cannot block an I/O thread. Everything created is 0600
    (files) or 0700 (directories) whatever the umask (:mod:`kvbm_backend.fsmodes`).
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True):
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.fsync = fsync
        self._direct: bool | None = None  # O_DIRECT reads: None = not probed yet
        self._direct_write: bool | None = None  # O_DIRECT writes: None = not tried yet, False = refused
        self._fast_root: bytes | None = None  # reads: one openat2 of root + name (io.openat2); None: walk
        self._mount: str | None = None  # the root's mount point, found at the first StoreFull
        try:
            makedirs_private(self.root)
        except OSError as e:
            raise ValueError(f"g4.url {self.url}: cannot create directory: {e}") from None
        if openat2.available() and self.root.is_absolute() and os.path.realpath(self.root) == str(self.root):
            self._fast_root = os.fsencode(self.root) + b"/"

    @classmethod
    def from_url(cls, url: str, parsed: ParseResult, opts: StoreOptions) -> "FsStore":
        """``file:///abs/path`` (or ``file://localhost/abs/path``) with ``opts.fsync``. Raises ValueError
        naming ``g4.url`` for a relative path or another host."""
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(f"g4.url {url!r}: file URLs must be absolute, file:///path")
        return cls(parsed.path, fsync=opts.fsync)

    def _path(self, name: str) -> Path:
        self._split(name)
        return self.root / name

    @staticmethod
    def _split(name: str) -> tuple[list[str], str]:
        parts = name.split("/")
        if name.startswith("/") or ".." in parts or "" in parts or "." in parts:  # list scans in C: per block
            raise ValueError(f"object name {name!r}: must be relative without '..'")
        return parts[:-1], parts[-1]

    def _wrap(self, op: str, name: str, e: OSError) -> OSError:
        """``e`` as the store's error: StoreUnavailable (no answer: EIO, ESTALE...), StoreFull (no room: ENOSPC,
        EDQUOT, EROFS; names the root's mount point), else ``e`` itself."""
        if e.errno in _UNAVAILABLE:
            return StoreUnavailable(f"{op} {self.url}/{name}: {e}")
        if e.errno in FULL_ERRNOS:
            if self._mount is None:
                self._mount = mount_point(self.root)
            return StoreFull(e, f"{op} {self.url}/{name}", self._mount)
        return e

    def _refused(self, rel: str, what: str) -> OSError:
        return OSError(errno.ELOOP, f"{self.url}/{rel}: {what}: refused (never followed under the store root)")

    @overload
    def _open_dir(self, dirs: list[str], create: Literal[True]) -> int: ...

    @overload
    def _open_dir(self, dirs: list[str], create: bool) -> int | None: ...

    def _open_dir(self, dirs: list[str], create: bool) -> int | None:
        """fd of the directory ``root/dirs...`` opened component by component without following links
        (created 0700 when ``create``); None when a component is absent and not ``create``. Raises
        OSError (ELOOP) naming a component that is a link or not a directory."""
        fd = os.open(self.root, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the root itself may be a link (operator's choice)
        try:
            for i, c in enumerate(dirs):
                try:
                    nfd = os.open(c, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    try:
                        os.mkdir(c, DIR_MODE, dir_fd=fd)
                    except FileExistsError:
                        pass
                    if self.fsync:  # the new entry durable in its parent (module docstring)
                        os.fsync(fd)
                    nfd = os.open(c, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise self._refused("/".join(dirs[:i + 1]), "a symbolic link or not a directory") from None
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_file(self, name: str, direct: bool, blocking: bool = True) -> tuple[int, bool, int] | None:
        """``(fd, is_direct, size in bytes)`` of the regular file ``name`` opened read-only, or None if absent.
        O_DIRECT when ``direct`` and the filesystem takes it, by the project's one O_DIRECT open rule
        (:func:`kvbm_backend.io.files.open_for_read`: a refusal at open gives a buffered fd, and this
        store reads buffered from then on). Raises OSError for links, FIFOs, sockets, devices and
        directories (checked by ``fstat`` after an ``O_NONBLOCK | O_NOFOLLOW`` open, so nothing blocks).
        ``blocking`` False leaves O_NONBLOCK set (see :func:`~kvbm_backend.io.openat2.preadv_clearing`). Opened by one ``openat2``
        refusing links (1 GIL-retaking call, not ~11) where the root's path has no link, else by the walk."""
        root = self._fast_root  # (set to None by another thread where openat2 turns out unsupported)
        fast = self._open_fast(root, name, direct) if root is not None else None
        opened = fast or self._open_walk(name, direct)
        if opened is None:
            return None
        fd, is_direct = opened
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refused(name, f"not a regular file (mode {st.st_mode:o})")
            if blocking:
                clear_nonblock(fd, is_direct)
        except BaseException:
            os.close(fd)
            raise
        if direct and not is_direct:
            self._direct = False
        return fd, is_direct, st.st_size

    def _open_fast(self, root: bytes, name: str, direct: bool) -> tuple[int, bool] | None:
        """``(fd, direct)`` by one ``openat2`` (names checked by :meth:`_split` first: no '..'); None: walk."""
        self._split(name)
        try:
            return open_no_symlinks(root + os.fsencode(name), _READ_FLAGS, direct), direct
        except Unsupported:
            self._fast_root = None
        except OSError:
            pass
        return None

    def _open_walk(self, name: str, direct: bool) -> tuple[int, bool] | None:
        """``(fd, is_direct)`` of ``name`` opened component by component (links refused, the root followed)."""
        dirs, base = self._split(name)
        dfd = self._open_dir(dirs, create=False)
        if dfd is None:
            return None
        try:
            try:
                return open_for_read(base, direct, flags=_READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                return None
            except BlockingIOError:
                # an open that must wait (a lease being broken, a slow mount): reopen the very inode, checked
                # regular, without O_NONBLOCK (the load deadline bounds it)
                return self._open_waiting(dfd, base, name, direct)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise self._refused(name, "a symbolic link") from None
                raise
        finally:
            os.close(dfd)

    def _open_waiting(self, dfd: int, base: str, name: str, direct: bool) -> tuple[int, bool] | None:
        try:
            pfd = os.open(base, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refused(name, f"not a regular file (mode {st.st_mode:o})")
            return open_for_read(f"/proc/self/fd/{pfd}", direct, flags=os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(pfd)

    def _write_temp(self, dfd: int, base: str, data: DataIn) -> str:
        """Write ``data`` to a fresh temp file in ``dfd`` (fsynced when ``self.fsync``); returns its name.

        O_DIRECT when ``data`` is 4 KiB aligned in address and length (G4 frames from the pool's buffers)
        and the filesystem takes it: no copy into the page cache (on the dev VM's ext4: 0.13 vs 0.42 CPU-s
        per GB written, fsync included; tmpfs: the same either way). Durability is unchanged: the file and
        its directory are still fsynced before the object is published. A refusal (EINVAL) falls back to
        buffered writes for this store from then on."""
        mv = _bytes_of(data)
        direct = (self._direct_write is not False and len(mv) and len(mv) % 4096 == 0
                  and _address(mv) % 4096 == 0)
        if direct:
            try:
                tmp = self._write_temp_once(dfd, base, mv, os.O_DIRECT)
                self._direct_write = True
                return tmp
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_write = False
        return self._write_temp_once(dfd, base, mv, 0)

    def _write_temp_once(self, dfd: int, base: str, mv: memoryview, flags: int) -> str:
        tmp = f".{base}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags, FILE_MODE,
                     dir_fd=dfd)
        try:
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off:])
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp, dfd)
            raise
        os.close(fd)
        return tmp

    def _open_and_write(self, dirs: list[str], base: str, data: DataIn) -> tuple[int, str]:
        """``(fd of the object's directory, made as needed, temp file written in it)``. gc removes directories
        left empty (:meth:`prune_dirs`): one (or a parent of it) it removed between this making or opening it
        and the temp file's create (ENOENT; ESTALE on NFS) is made again, up to :data:`_DIR_ATTEMPTS` tries
        (once the temp file is in it, the directory is not empty and cannot be removed)."""
        for attempt in range(_DIR_ATTEMPTS):
            dfd = -1
            try:
                dfd = self._open_dir(dirs, create=True)
                return dfd, self._write_temp(dfd, base, data)
            except OSError as e:
                if dfd >= 0:
                    os.close(dfd)
                if e.errno not in (errno.ENOENT, errno.ESTALE) or attempt == _DIR_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def prune_dirs(self, names: Iterable[str]) -> int:
        """Remove the directories of ``names`` left empty, and their emptied parents (``rmdir`` only; never
        the root or its own subdirectories): :func:`.fs_prune.prune_empty_dirs`. Returns how many."""
        return prune_empty_dirs(self._open_dir, names)

    def put_if_absent(self, name: str, data: DataIn) -> bool:
        dirs, base = self._split(name)
        try:
            dfd, tmp = self._open_and_write(dirs, base, data)
            try:  # link, EEXIST checked; a name deleted meanwhile is linked again (fs_put.link_exclusive)
                created = link_exclusive(dfd, tmp, base, lambda what: self._refused(name, what))
                if created and self.fsync:
                    os.fsync(dfd)
                return created
            finally:
                os.close(dfd)
        except OSError as e:
            raise self._wrap("put", name, e) from None

    def put(self, name: str, data: DataIn) -> None:
        dirs, base = self._split(name)
        try:
            dfd, tmp = self._open_and_write(dirs, base, data)
            try:
                try:
                    os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    unlink_quiet(tmp, dfd)
                    raise
                if self.fsync:
                    os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise self._wrap("put", name, e) from None

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytearray | memoryview | None:
        """Bytes ``offset`` to ``offset + length`` (default: to the end) of ``name``, or None if absent.
        A whole object read O_DIRECT into a 4 KiB-aligned buffer where the filesystem takes it and the
        object is whole 4 KiB blocks (bypasses the page cache, as the O_DIRECT baseline does); buffered
        otherwise. Raises StoreUnavailable for EIO and the like, OSError for a link or a non-regular file."""
        try:
            opened = self._open_file(name, offset == 0 and length is None and self._direct is not False)
            if opened is not None and opened[1]:
                got = self._read_whole_direct(opened[0])
                if got is not None:
                    return got
                opened = self._open_file(name, False)  # not whole 4 KiB blocks, or the read refused
            if opened is None:
                return None
            return self._read_buffered(opened[0], offset, length, opened[2])
        except OSError as e:
            raise self._wrap("get", name, e) from None

    def _read_whole_direct(self, fd: int) -> memoryview | None:
        """The whole file of O_DIRECT ``fd`` (closed here) into a 4 KiB-aligned buffer; None when its size is
        not whole 4 KiB blocks or the filesystem refuses the read (then this store reads buffered)."""
        try:
            size = os.fstat(fd).st_size
            if size % 4096:
                return None
            buf = aligned_empty(size)
            got = 0
            while got < size:
                n = os.preadv(fd, [buf.data[got:]], got)
                if n == 0:
                    break
                got += n
            self._direct = True
            return buf.data[:got]  # ndarray.data: its memoryview, no copy
        except OSError as e:
            if refuses_direct(e):
                self._direct = False
                return None
            raise
        finally:
            os.close(fd)

    @staticmethod
    def _read_buffered(fd: int, offset: int, length: int | None, size: int) -> bytearray:
        """Bytes ``offset`` to ``offset + length`` (default: to the end) of buffered ``fd`` (closed here), a file of
        ``size`` bytes when opened: a buffer of what it holds there, not of ``length`` (a cap such as namespace.json's
        64 KiB or an announce batch's 64 MiB: before 2026-12 a small file's read allocated and zeroed all of it)."""
        try:
            length = max(0, size - offset) if length is None else min(length, max(0, size - offset))
            buf = bytearray(length)
            mv, got = memoryview(buf), 0
            while got < length:
                n = os.preadv(fd, [mv[got:]], offset + got)
                if n == 0:
                    break
                got += n
            del buf[got:]  # a file cut short meanwhile: shrunk in place, no copy
            return buf
        finally:
            os.close(fd)

    reads_into = True
    reads_into_parts = True  # get_into takes a list of buffers (one scatter read)

    def get_into(self, name: str, buf: DataIn | list[Any] | tuple[Any, ...]) -> int | None:
        """Read the first ``min(size, len(buf))`` bytes of ``name`` into ``buf``; returns the object's
        size in bytes (None if absent; fewer if the file is shorter than ``fstat`` said).

        ``buf``: a writable bytes-like, or a list of them filled in order by one scatter read (``preadv``;
        e.g. a header buffer then the caller's payload row, so the payload needs no copy). O_DIRECT (no
        page cache, no copy) when every buffer is 4 KiB aligned in address and length and the filesystem
        takes it; buffered otherwise. Pass huge-page-backed buffers
        (:func:`kvbm_backend.pool.g4.reader.bounce_buffers`) for full speed. Raises StoreUnavailable for
        EIO and the like, OSError for a link or a non-regular file on the path.
        """
        mvs = [_bytes_of(b) for b in (buf if isinstance(buf, (list, tuple)) else (buf,))]
        direct = self._direct is not False and all(len(m) % 4096 == 0 and _address(m) % 4096 == 0 for m in mvs)
        try:
            try:
                return self._read_into(name, mvs, direct)
            except _DirectRefused:  # the filesystem refused the O_DIRECT read: buffered from now on
                return self._read_into(name, mvs, False)
        except OSError as e:
            raise self._wrap("get", name, e) from None

    def _read_into(self, name: str, mvs: list[memoryview], direct: bool) -> int | None:
        """:meth:`get_into` with one open (O_DIRECT if ``direct`` and the filesystem takes it): the size, or
        None if absent. Raises _DirectRefused when the filesystem refused an O_DIRECT read (EINVAL)."""
        opened = self._open_file(name, direct, blocking=False)  # one call fewer per read
        if opened is None:
            return None
        fd, direct, size = opened
        try:
            want = min(size, sum(len(m) for m in mvs))
            lim = -(-want // 4096) * 4096 if direct else want  # O_DIRECT lengths are whole 4 KiB blocks
            got = 0
            while got < want:  # the first read takes the buffers whole (the file's end ends it)
                try:
                    n = preadv_clearing(fd, mvs if got == 0 else _iov(mvs, got, lim), got, direct)
                except OSError as e:
                    if direct and refuses_direct(e):
                        self._direct = False
                        raise _DirectRefused() from None
                    raise
                if n == 0:
                    break
                got += n
            if direct:
                self._direct = True
            return size if got >= want else got
        finally:
            os.close(fd)

    def stored_matches(self, name: str, data: DataIn, size: int) -> bool:
        """True only when the file ``name`` is a regular file of ``size`` bytes that starts with ``data``,
        read afresh past the page cache (O_DIRECT, else after POSIX_FADV_DONTNEED: :mod:`.fs_confirm`; a bad
        read, not bad stored bytes, gives False); False on any error."""
        return reread_matches(lambda n, d: self._open_file(n, d), name, _bytes_of(data), size)

    def delete_if_matches(self, name: str, data: DataIn, size: int) -> bool:
        """Delete ``name`` only while it holds the bytes proven bad (renamed to a quarantine name, read again,
        then unlinked or put back): :mod:`.fs_quarantine`, :meth:`~.store.ObjectStore.delete_if_matches`."""
        return delete_if_matches(self, name, _bytes_of(data), size)

    def delete_if_listed(self, info: ObjectInfo) -> bool:
        """Quarantine rename, then inode/mtime/size compared with the listing: :func:`.fs_quarantine.delete_if_listed`."""
        return delete_if_listed(self, info)

    def head(self, name: str) -> int | None:
        info = self.stat(name)
        return None if info is None else info.size

    def stat(self, name: str) -> ObjectInfo | None:
        """The file's size, mtime and version as :meth:`list` gives them (:func:`.fs_list.stat_version`)."""
        dirs, base = self._split(name)
        try:
            dfd = self._open_dir(dirs, create=False)
            if dfd is None:
                return None
            try:
                st = os.stat(base, dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refused(name, "not a regular file")
            return ObjectInfo(name, st.st_size, st.st_mtime, stat_version(st))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._wrap("head", name, e) from None

    def delete(self, name: str) -> None:
        dirs, base = self._split(name)
        try:
            dfd = self._open_dir(dirs, create=False)
            if dfd is None:
                return
            try:
                os.unlink(base, dir_fd=dfd)
            finally:
                os.close(dfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._wrap("delete", name, e) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return walk(self.root, self.url, prefix, temps=False)

    def list_temps(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return walk(self.root, self.url, prefix, temps=True)


def _bytes_of(data: DataIn) -> memoryview:
    """``data`` (bytes-like or a contiguous array) as a flat byte memoryview, no copy (an ndarray through its
    ``.data``: numpy's stubs give ndarray ``__buffer__`` only for Python >= 3.12)."""
    return (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")


def _iov(mvs: list[memoryview], start: int, end: int) -> list[memoryview]:
    """The pieces of the concatenation of ``mvs`` from byte ``start`` to ``end`` (a preadv iovec)."""
    out, pos = [], 0
    for m in mvs:
        lo, hi = max(start, pos), min(end, pos + len(m))
        if lo < hi:
            out.append(m[lo - pos:hi - pos])
        pos += len(m)
    return out


def _address(mv: memoryview) -> int:
    if mv.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)) if len(mv) else 0

