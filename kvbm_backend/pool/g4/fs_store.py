"""Shared POSIX store (NFS, Lustre, VAST, Weka, local disk) under ``file:///root``.

Publish protocol (invariant 2), safe with many writers on many nodes:

1. write to a unique temp name in the object's own directory,
   ``.{name}.{hostname}.{pid}.{uuid4}.tmp`` (never a fixed ``.tmp``), ``fsync`` it;
2. ``link(temp, final)``: create-exclusive, atomic on local filesystems and NFSv3/v4
   (EEXIST means another writer published first, which is success);
3. unlink the temp, ``fsync`` the directory.

Readers only ever open final names, so they see complete objects or nothing. Directories are
created on demand (``exist_ok``), which is race-free.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import uuid
from pathlib import Path
from typing import Iterator

from ...memory import aligned_empty
from .store import ObjectInfo, ObjectStore, StoreUnavailable

_NO_DIRECT = object()

_HOST = socket.gethostname().replace("/", "_").replace(".", "_")
_UNAVAILABLE = {errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def is_temp_name(basename: str) -> bool:
    return basename.startswith(".") and basename.endswith(".tmp")


class FsStore(ObjectStore):
    """Objects as files under ``root``. ``fsync=False`` only for throwaway benchmarks."""

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True):
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.fsync = fsync
        self._direct: bool | None = None  # O_DIRECT reads: None = not probed yet
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"g4.url {self.url}: cannot create directory: {e}") from None

    @classmethod
    def from_url(cls, url: str, parsed, opts) -> "FsStore":
        """``file:///abs/path`` (or ``file://localhost/abs/path``) with ``opts.fsync``. Raises ValueError
        naming ``g4.url`` for a relative path or another host."""
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(f"g4.url {url!r}: file URLs must be absolute, file:///path")
        return cls(parsed.path, fsync=opts.fsync)

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"object name {name!r}: must be relative without '..'")
        return self.root / name

    def _wrap(self, op: str, name: str, e: OSError) -> OSError:
        if e.errno in _UNAVAILABLE:
            return StoreUnavailable(f"{op} {self.url}/{name}: {e}")
        return e

    def _write_temp(self, final: Path, data) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            mv = memoryview(data).cast("B")
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off:])
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def _fsync_dir(self, d: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put_if_absent(self, name: str, data) -> bool:
        final = self._path(name)
        try:
            tmp = self._write_temp(final, data)
            try:
                os.link(tmp, final)
                created = True
            except FileExistsError:
                created = False
            finally:
                _unlink(tmp)
            if created:
                self._fsync_dir(final.parent)
            return created
        except OSError as e:
            raise self._wrap("put", name, e) from None

    def put(self, name: str, data) -> None:
        final = self._path(name)
        try:
            tmp = self._write_temp(final, data)
            os.replace(tmp, final)
            self._fsync_dir(final.parent)
        except OSError as e:
            raise self._wrap("put", name, e) from None

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        if offset == 0 and length is None and self._direct is not False:
            got = self._get_direct(name)
            if got is not _NO_DIRECT:
                return got
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._wrap("get", name, e) from None
        try:
            if length is None:
                length = max(0, os.fstat(fd).st_size - offset)
            buf = bytearray(length)
            mv, got = memoryview(buf), 0
            while got < length:
                n = os.preadv(fd, [mv[got:]], offset + got)
                if n == 0:
                    break
                got += n
            return buf if got == length else buf[:got]  # bytearray: no extra copy
        except OSError as e:
            raise self._wrap("get", name, e) from None
        finally:
            os.close(fd)

    reads_into = True

    def get_into(self, name: str, buf) -> int | None:
        """Read the first ``min(size, len(buf))`` bytes of ``name`` into ``buf``; returns the object's
        size in bytes (None if absent; fewer if the file is shorter than ``fstat`` said).

        O_DIRECT (no page cache, no copy) when ``buf`` is 4 KiB aligned in address and length and the
        filesystem takes it; buffered otherwise. Pass huge-page-backed buffers
        (:func:`kvbm_backend.pool.g4.reader.bounce_buffers`) for full speed. Raises StoreUnavailable for
        EIO and the like.
        """
        mv = memoryview(buf).cast("B")
        direct = self._direct is not False and len(mv) % 4096 == 0 and _address(mv) % 4096 == 0
        try:
            got = self._read_into(name, mv, direct)
            if got is _NO_DIRECT:
                got = self._read_into(name, mv, False)
            return got
        except OSError as e:
            raise self._wrap("get", name, e) from None

    def _read_into(self, name: str, mv: memoryview, direct: bool):
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(self._path(name), flags)
        except FileNotFoundError:
            return None
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                self._direct = False
                return _NO_DIRECT
            raise
        try:
            size = os.fstat(fd).st_size
            want = min(size, len(mv))
            lim = -(-want // 4096) * 4096 if direct else want  # O_DIRECT lengths are whole 4 KiB blocks
            got = 0
            while got < want:
                try:
                    n = os.preadv(fd, [mv[got:lim]], got)
                except OSError as e:
                    if direct and e.errno == errno.EINVAL:
                        self._direct = False
                        return _NO_DIRECT
                    raise
                if n == 0:
                    break
                got += n
            if direct:
                self._direct = True
            return size if got >= want else got
        finally:
            os.close(fd)

    def _get_direct(self, name: str):
        """Whole-object read with O_DIRECT into a 4 KiB-aligned buffer (bypasses the page cache, as
        the O_DIRECT baseline does). Returns _NO_DIRECT when the filesystem or size does not allow it."""
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.EINVAL:
                self._direct = False
                return _NO_DIRECT
            raise self._wrap("get", name, e) from None
        try:
            size = os.fstat(fd).st_size
            if size % 4096:
                return _NO_DIRECT
            buf = aligned_empty(size)
            got = 0
            while got < size:
                n = os.preadv(fd, [buf[got:]], got)
                if n == 0:
                    break
                got += n
            self._direct = True
            return memoryview(buf[:got])
        except OSError as e:
            if e.errno == errno.EINVAL:
                self._direct = False
                return _NO_DIRECT
            raise self._wrap("get", name, e) from None
        finally:
            os.close(fd)

    def head(self, name: str) -> int | None:
        try:
            return os.stat(self._path(name)).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._wrap("head", name, e) from None

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._wrap("delete", name, e) from None

    def _walk(self, prefix: str, temps: bool) -> Iterator[ObjectInfo]:
        # ``prefix`` is a name prefix; walk the deepest directory it fully names.
        d = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / d if d else self.root
        if not start.is_dir():
            return
        for dirpath, _dirs, files in os.walk(start):
            for f in files:
                if is_temp_name(f) != temps:
                    continue
                p = os.path.join(dirpath, f)
                rel = os.path.relpath(p, self.root)
                if not rel.startswith(prefix):
                    continue
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                yield ObjectInfo(rel, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._walk(prefix, temps=False)

    def list_temps(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._walk(prefix, temps=True)


def _address(mv: memoryview) -> int:
    if mv.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)) if len(mv) else 0


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
