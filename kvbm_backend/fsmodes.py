"""Private file and directory modes for everything kvbm-backend creates on disk (G3 slabs, journal, lock and
namespace.json; G4 ``file://`` objects, temps and directories; keyring, its lock and its directory).

Files are created 0600 and directories 0700 whatever the process umask (a umask can only narrow a mode
given to ``open``/``mkdir``, never widen it, so an explicit mode is enough for new paths; a directory that
already exists keeps its mode, and :func:`mode_problems` reports it for ``kvbm-backend doctor``).
"""
from __future__ import annotations

import os
import stat

FILE_MODE = 0o600
DIR_MODE = 0o700


def makedirs_private(path: str | os.PathLike) -> None:
    """``os.makedirs(path, exist_ok=True)`` where every directory it creates (parents too) is 0700.

    Existing directories are left as they are. Raises OSError like ``os.makedirs`` (FileExistsError when
    a component exists and is not a directory).
    """
    path = os.fspath(path)
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def mode_problems(root: str | os.PathLike, max_entries: int = 10000) -> list[str]:
    """One line per path at or under ``root`` (not following links) whose mode gives group or others any
    access (``chmod`` fixes named), at most ``max_entries`` paths looked at. Nothing for a missing root.
    Never raises (an unreadable directory is itself a line)."""
    root = os.fspath(root)
    out: list[str] = []
    seen = 0

    def check(p: str, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode) or not mode & 0o077:
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
