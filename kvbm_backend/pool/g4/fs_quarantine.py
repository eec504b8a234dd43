"""Deleting a corrupt object of a file store only while it is the very object proven bad
(:meth:`.fs_store.FsStore.delete_if_matches`).

A G4 reader that read a bad frame has the store confirm it holds those bytes (:mod:`.fs_confirm`) and then
deletes the object. By name alone that is a race: worker A confirms corrupt X; worker B deletes X; worker C's
create-exclusive write publishes a good X' under the name; A's delete removes X' (a good block lost, written
again only by the next offload). POSIX has no "unlink if it is this file" (and inode numbers are reused at
once), so the delete goes in three steps, each safe against any writer, reader or gc in between:

1. ``rename`` the name to a unique quarantine name in the same directory (atomic on local filesystems and
   NFS): whatever the name held at that instant is now out of reach of readers (a miss) and of writers (a
   create-exclusive write may publish a new copy under the name at once);
2. read the quarantined file again past the page cache (:func:`.fs_confirm.reread_matches`) and compare it
   with the bytes proven bad;
3. the same bytes: ``unlink`` it. Other bytes (a replacement), a read that failed, or a file gone: it goes back
   under its name by ``link`` (create-exclusive: a copy published meanwhile stays, and then the quarantined
   one is dropped, since the name holds a complete copy of the block), then the quarantine name is unlinked.

So a bad object is never served (readers never open quarantine names, and every read verifies anyway) and a
good one is never deleted in place of a bad one. Quarantine names have the shape of writer temp files,
``.{name}.quarantine.{hostname}.{pid}.{uuid4}.tmp`` (:func:`.fs_list.is_temp_name`): listings, migrate and
the pool never see them, and gc removes one that a crash (or an error between steps 1 and 3) left behind as
it does a crashed writer's temp file, once its mtime is ``temp_grace_s`` old.

Right before step 1 the file's mtime is set to now (``futimens`` on an fd opened on it, so the very inode that is
renamed; the server's clock on NFS): a rename keeps the mtime, and gc's temp pass deletes temp-shaped names older
than ``temp_grace_s`` by name, so a quarantined block written long ago was fair game for a gc running between
steps 1 and 3: it unlinked the quarantine name, the ``link`` back found nothing, and a good replacement (or a file
gc itself listed as another) was lost (found 2026-12-03). Now a quarantine name is as young as a writer's temp file
in flight. Step 2 compares a listing's version with the file's stat from before the touch. A file put back keeps
the fresh mtime (to gc's age and capacity rules it looks just written: never older than it is). Where the touch is
not permitted (``EPERM``/``EACCES``: another user's file without write access) the swap goes on untouched, as
before; if another file took the name between the touch and the rename, that one is touched right after it.
Before 2026-12-01 the reader deleted by name after the confirmation (review finding 4).

gc deletes what it listed the same way (:func:`delete_if_listed`): step 2 compares the quarantined file's
inode, mtime (ns) and size with the listing's (:func:`.fs_list.stat_version`) instead of reading it. Before
2026-12-01 gc unlinked by name: a good copy written under the name between its listing and its delete went.
"""
from __future__ import annotations

import errno
import os
import socket
import uuid
from typing import TYPE_CHECKING, Callable

from .fs_confirm import reread_matches
from .fs_list import stat_version

if TYPE_CHECKING:
    from .fs_store import FsStore
    from .store import ObjectInfo

_HOST = socket.gethostname().replace("/", "_").replace(".", "_")
_NOT_PERMITTED = (errno.EPERM, errno.EACCES, errno.ELOOP)  # the touch refused (ELOOP: a link at the name)
_TOUCH_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: ``same(dir_fd, quarantine name, stat before the touch)``: whether the quarantined file is the one to delete
Same = Callable[[int, str, os.stat_result], bool]


def quarantine_name(base: str) -> str:
    """A fresh quarantine name for the object file ``base`` (its last name component), in its directory."""
    return f".{base}.quarantine.{_HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def delete_if_matches(store: FsStore, name: str, want: memoryview, size: int) -> bool:
    """Delete object ``name`` of ``store`` only when it is a file of ``size`` bytes starting with the bytes
    ``want`` (module doc: quarantine, compare, unlink or put back). True when deleted; False when absent or
    holding other bytes (put back, or dropped when a newer copy took the name meanwhile). Raises
    StoreUnavailable (EIO, ESTALE...) or OSError when a step fails: the object then stays under its name, or
    under its quarantine name when putting it back failed (gc collects it: module doc)."""
    dirs = store._split(name)[0]
    return _swap_out(store, name, lambda dfd, q, _st: reread_matches(lambda n, d: store._open_file(n, d),
                                                                     "/".join([*dirs, q]), want, size))


def delete_if_listed(store: FsStore, info: ObjectInfo) -> bool:
    """Delete object ``info.name`` of ``store`` only while it is the file listed as ``info`` (its
    :attr:`~.store.ObjectInfo.version`: inode, mtime, size; by name when None): gc's deletes. True when deleted;
    False when absent or another file (put back, or dropped when a newer copy took the name meanwhile). Raises as
    :func:`delete_if_matches`."""
    if info.version is None:
        store.delete(info.name)
        return True
    return _swap_out(store, info.name, lambda _dfd, _q, st: stat_version(st) == info.version)


def _swap_out(store: FsStore, name: str, same: Same) -> bool:
    """Quarantine ``name`` (its mtime set to now first: module doc), then unlink it when ``same(dir_fd, quarantine
    name, its stat before that)``, else put it back (module doc). Raises the store's wrapped OSError."""
    dirs, base = store._split(name)
    try:
        dfd = store._open_dir(dirs, create=False)
        if dfd is None:
            return False
        try:
            return _swap_out_at(store, dfd, base, same)
        finally:
            os.close(dfd)
    except OSError as e:
        raise store._wrap("delete", name, e) from None


def _swap_out_at(store: FsStore, dfd: int, base: str, same: Same) -> bool:
    q = quarantine_name(base)
    try:
        before = _touch(base, dfd)  # mtime now: never a stale temp file to gc while quarantined (module doc)
        if before is None:
            return False
        os.rename(base, q, src_dir_fd=dfd, dst_dir_fd=dfd)
    except FileNotFoundError:  # gone already (another reader's drop, gc)
        return False
    try:
        st = os.stat(q, dir_fd=dfd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):  # another file took the name meanwhile
            before = st
            _touch_quiet(q, dfd)
        matches = same(dfd, q, before)
    except FileNotFoundError:  # gc took the quarantined one meanwhile
        return False
    except OSError:  # cannot tell (EIO, ESTALE): kept, back under its name
        matches = False
    if matches:
        unlink_quiet(q, dfd)
        return True
    try:  # a replacement (or not readable now): back under its name, never over a copy published meanwhile
        os.link(q, base, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except (FileExistsError, FileNotFoundError):  # a newer copy holds the name / gc took the quarantined one
        pass
    unlink_quiet(q, dfd)
    if store.fsync:
        os.fsync(dfd)  # the name back for good
    return False


def unlink_quiet(name: str, dir_fd: int) -> None:
    """Unlink ``name`` in directory ``dir_fd``; absent is fine."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _touch(name: str, dir_fd: int) -> os.stat_result | None:
    """Set the mtime of the file ``name`` in directory ``dir_fd`` to now (``futimens`` on an fd opened on it) and
    return its stat from before that; None when absent. A touch not permitted (EPERM, EACCES; ELOOP: a link) is
    skipped (the stat is still returned). Raises other OSErrors (EIO, ESTALE, EROFS)."""
    try:
        fd = os.open(name, _TOUCH_OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in _NOT_PERMITTED:
            raise
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
    try:
        st = os.fstat(fd)
        try:
            os.utime(fd)
        except OSError as e:
            if e.errno not in _NOT_PERMITTED:
                raise
        return st
    finally:
        os.close(fd)


def _touch_quiet(name: str, dir_fd: int) -> None:
    """Set the mtime of ``name`` (not followed) in ``dir_fd`` to now; not permitted is fine (module doc)."""
    try:
        os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        if e.errno not in _NOT_PERMITTED:
            raise
