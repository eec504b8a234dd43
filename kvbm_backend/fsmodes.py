"""Private file and directory modes for everything kvbm-backend creates on disk (G3 slabs, journal, lock and
namespace.json; G4 ``file://`` objects, temps and directories; keyring, its lock and its directory).

Files are created 0600 and directories 0700 whatever the process umask (a umask can only narrow a mode
given to ``open``/``mkdir``, never widen it, so an explicit mode is enough for new paths; a directory that
already exists keeps its mode, and :func:`mode_problems` reports it for ``kvbm-backend doctor``).

Trust (what may be read or locked): :func:`dir_problem` is the one owner/mode rule for directories (G3's
directory: this uid, not group/other-writable; the keyring's: this uid or root, sticky allowed) and
:func:`open_trusted` opens the keyring, its KEK file and its lock only when nobody but this uid or root can
have placed them (docs/format.md, "G4 keyring", "Who may own them").
"""
from __future__ import annotations

import errno
import os
import stat

FILE_MODE = 0o600
DIR_MODE = 0o700


class WorkdirRemoved(FileNotFoundError, ValueError):
    """A relative path while this process's working directory has been removed (``os.getcwd()`` fails): it names
    nothing, and nothing can be created there. Both a ValueError (a field error: :func:`abspath`'s contract, what
    :func:`kvbm_backend.config.dir_problem` reports) and a FileNotFoundError (errno ENOENT, what every file operation
    here raises for a path that is not there, so each caller's handling of a missing path still applies). Its text
    names the path and the fix (``str(e)``, also ``e.strerror``: no ``[Errno 2]`` prefix)."""

    def __str__(self) -> str:
        return str(self.strerror)


def abspath(path: str | os.PathLike) -> str:
    """``os.path.abspath(path)``, or :class:`WorkdirRemoved` (a ValueError) naming ``path``: a relative ``path`` while
    this process's working directory has been removed (``os.getcwd()`` fails; nothing can be created there, so there
    is no directory to name: give an absolute path). Before 2026-12-03 that was a bare ``FileNotFoundError`` from
    ``os.getcwd()`` naming neither the path nor the field; the helpers below (:func:`missing_dirs`,
    :func:`makedirs_private`, :func:`check_trusted_dir`, :func:`open_trusted`) raised it until 2026-12-03 (a relative
    ``g4.keyring.path``: ``g4.keyring: [Errno 2] No such file or directory``)."""
    p = os.fspath(path)
    try:
        return os.path.abspath(p)
    except FileNotFoundError:
        raise WorkdirRemoved(errno.ENOENT, f"{p!r} is relative to the working directory, and this process's working "
                                           "directory has been removed (os.getcwd() fails): give an absolute path, or "
                                           "run from a directory that exists") from None


def unresolvable(fields) -> str | None:
    """The first of ``fields`` (``(name, path or None)`` pairs, e.g. ``("g4.keyring.path", kc.path)``) whose path
    :func:`abspath` refuses, as ``"name: why"`` (a relative path while the working directory has been removed); None
    when every set one resolves."""
    for name, p in fields:
        try:
            if p:
                abspath(p)
        except ValueError as e:
            return f"{name}: {e}"
    return None


def missing_dirs(path: str | os.PathLike) -> list[str]:
    """``path`` (absolute) and those of its ancestors that are not directories, deepest first: what
    ``os.makedirs(path)`` creates (``replay`` and ``model`` remove them again: :func:`remove_made_dirs`). A relative
    ``path`` while the working directory has been removed raises :class:`WorkdirRemoved` (:func:`abspath`)."""
    out: list[str] = []
    p = abspath(path)
    while not os.path.isdir(p):
        out.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return out


def remove_made_dirs(made: list[str]) -> None:
    """Remove the directories :func:`missing_dirs` listed (deepest first) once a run that made them is done with
    them; stops at the first that holds something else now (never raises)."""
    for d in made:
        try:
            os.rmdir(d)
        except OSError:
            break


def makedirs_private(path: str | os.PathLike) -> None:
    """``os.makedirs(path, exist_ok=True)`` where every directory it creates (parents too) is 0700.

    Existing directories are left as they are. Raises OSError like ``os.makedirs`` (FileExistsError when
    a component exists and is not a directory; :class:`WorkdirRemoved` for a relative ``path`` while the working
    directory has been removed).
    """
    for d in reversed(missing_dirs(path)):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def mode_problems(root: str | os.PathLike, max_entries: int = 10000, notes: list[str] | None = None) -> list[str]:
    """One line per path at or under ``root`` (not following links) whose mode gives group or others any
    access (``chmod`` fixes named), at most ``max_entries`` paths looked at. Nothing for a missing root.
    Never raises (an unreadable directory is itself a line).

    With ``notes`` (a list, appended to): a directory that group and others may list but not write
    (e.g. 0755, what kubelet's ``hostPath`` ``DirectoryOrCreate`` makes) is a line there instead of a
    problem: the G3 directory rule (:func:`dir_problem`) accepts it, no one else can plant files in it."""
    root = os.fspath(root)
    out: list[str] = []
    seen = 0

    def check(p: str, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode) or not mode & 0o077:
            return
        if notes is not None and stat.S_ISDIR(st.st_mode) and not mode & 0o022:
            notes.append(f"{p}: directory mode {mode:04o} lets group/others list it, not write it (accepted; "
                         f"chmod 700 {p} makes it private)")
            return
        want = DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        out.append(f"{p}: {kind} mode {mode:04o} gives group/others access (fix: chmod {want:o} {p})")

    try:
        check(root, os.lstat(root))
    except FileNotFoundError:
        return out
    except OSError as e:
        return [f"{root}: cannot stat ({e.strerror})"]
    if not os.path.isdir(root) or os.path.islink(root):
        return out
    for dirpath, dirs, files in os.walk(root, onerror=lambda e: out.append(f"{e.filename}: cannot list ({e.strerror})")):
        for n in dirs + files:
            seen += 1
            if seen > max_entries:
                return out
            p = os.path.join(dirpath, n)
            try:
                check(p, os.lstat(p))
            except OSError:
                continue
    return out


# ---- trusted directories and files (G3 directories; the keyring, its KEK file and its lock) ----------------
class UnsafePath(ValueError):
    """A directory or file is not safe to trust with secrets: another user's, writable by others, a symbolic
    link where none is allowed, not a regular file. The message names the path, what is wrong and the fix."""


def dir_problem(st: os.stat_result, uid: int | None = None, *, root_ok: bool = False,
                sticky_ok: bool = False) -> str | None:
    """What makes a directory with status ``st`` unsafe to hold this process's private files, or None.

    Safe: owned by ``uid`` (default: the effective uid), or by root when ``root_ok``; and not writable by
    group or others, unless ``sticky_ok`` and the sticky bit is set (then others may add entries but never
    rename, remove or replace ours: an entry of ours or root's in it cannot be swapped).
    The G3 directory rule is ``dir_problem(st)``; the keyring's is ``root_ok=True, sticky_ok=True``."""
    uid = os.geteuid() if uid is None else uid
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        return f"is owned by uid {st.st_uid}, not by this process (uid {uid}){' or root' if root_ok else ''}"
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return (f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}"
                f"{', and not sticky' if sticky_ok else ''})")
    return None


def check_trusted_dir(d: str | os.PathLike, what: str) -> None:
    """The keyring rule for the directory ``d`` holding ``what`` (followed if a link; its parents are not
    checked): :func:`dir_problem` with ``root_ok`` and ``sticky_ok``. Raises UnsafePath, or OSError
    (FileNotFoundError when missing; :class:`WorkdirRemoved`, relative while the working directory is removed)."""
    d = abspath(d)
    problem = dir_problem(os.stat(d), root_ok=True, sticky_ok=True)
    if problem:
        uid = os.geteuid()
        raise UnsafePath(f"directory {d} of the {what} {problem}: another user could plant or replace the "
                         f"{what} there; refusing it (fix: chown {uid} {d}; chmod 700 {d}, or use a directory of "
                         "this user's)")


MAX_LINKS = 8


def _resolve_owned_links(d: str, name: str) -> str:
    """``name`` in the trusted directory ``d``, its symbolic links resolved the way a Kubernetes Secret or
    ConfigMap volume makes them (``keyring.json -> ..data/keyring.json``, ``..data -> ..2024_01_01...``): a
    link is followed only when owned by this uid or root and relative without a ``..`` component (it stays
    under ``d``), every directory passed is trusted (:func:`dir_problem`, ``root_ok``, ``sticky_ok``), at most
    :data:`MAX_LINKS` links. Raises UnsafePath, or OSError (FileNotFoundError)."""
    uid, cur, links = os.geteuid(), d, 0
    todo = name.split("/")
    while todo:
        c = todo.pop(0)
        if c in ("", "."):
            continue
        p = os.path.join(cur, c)
        if c == "..":
            raise UnsafePath(f"{p}: a '..' component leaves the directory; refusing it")
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            target = os.readlink(p)
            if st.st_uid not in (uid, 0):
                raise UnsafePath(f"{p} is a symbolic link owned by uid {st.st_uid}, not by this process (uid {uid}) "
                                 f"or root: refusing to follow it (fix: replace it by a regular file of uid {uid})")
            if os.path.isabs(target) or ".." in target.split("/") or links > MAX_LINKS:
                raise UnsafePath(f"{p} is a symbolic link to {target!r}: only relative links that stay in their "
                                 "directory (as in a Kubernetes Secret volume) are followed; replace it by the file")
            todo = target.split("/") + todo
        elif todo:
            if stat.S_ISDIR(st.st_mode):
                problem = dir_problem(st, uid, root_ok=True, sticky_ok=True)
                if problem:
                    raise UnsafePath(f"directory {p} {problem}: refusing to read through it")
            cur = p
        else:
            return p
    return cur


def open_trusted(path: str | os.PathLike, what: str, flags: int = os.O_RDONLY, *, private: bool = True,
                 follow_owned_links: bool = False) -> int:
    """Open ``what`` (a keyring, KEK or lock file) at ``path`` only if nobody but this uid (and root) can
    have put it there or changed it; returns the fd (blocking, close-on-exec; the caller closes it).

    The rule: the directory holding it passes :func:`check_trusted_dir`; the file is opened with
    ``O_NOFOLLOW`` (a symbolic link is refused, its target left untouched), except with
    ``follow_owned_links`` the links :func:`_resolve_owned_links` allows (a Secret volume's); it must be a
    regular file owned by this uid and, when ``private``, give group and others no access (mode 0600/0400).
    ``flags`` may include ``O_CREAT`` (created 0600). Raises UnsafePath, or OSError (FileNotFoundError;
    :class:`WorkdirRemoved`: a relative ``path`` while the working directory has been removed)."""
    p = abspath(path)
    d, name = os.path.split(p)
    check_trusted_dir(d, what)
    real = _resolve_owned_links(d, name) if follow_owned_links else p
    try:  # O_NONBLOCK: a FIFO must not block the open (cleared below)
        fd = os.open(real, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:  # ELOOP; EACCES for another uid's link in a sticky directory (fs.protected_symlinks)
        if e.errno == errno.ELOOP or (e.errno == errno.EACCES and os.path.islink(real)):
            raise UnsafePath(f"{what} {p} is a symbolic link: refused (a planted link could redirect it; "
                             f"make it a regular file: rm {p})") from None
        raise
    try:
        st = os.fstat(fd)
        uid = os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{what} {p} is not a regular file (mode {stat.filemode(st.st_mode)}): remove it")
        if st.st_uid != uid:
            raise UnsafePath(f"{what} {p} is owned by uid {st.st_uid}, not by this process (uid {uid}): refusing "
                             f"it (another user may have planted it; if it is yours: chown {uid} {p})")
        if private and st.st_mode & 0o077:
            raise UnsafePath(f"{what} {p}: mode {stat.S_IMODE(st.st_mode):04o} lets group/others read it; "
                             f"refusing to use it (run: chmod 600 {p}; a Kubernetes Secret volume: defaultMode: 0400)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
