"""Argument checks shared by the ``kvbm-backend`` command line (``cli.py``) and its G4 commands
(``g4_cli.py``): every operator error is one line on stderr naming the argument, exit code 2."""
from __future__ import annotations

import math
from typing import Callable, NoReturn, Optional

import typer
from rich.console import Console
from rich.text import Text

console = Console(stderr=True)


DEFAULT_LAYOUT = "llama-3.1-8b"  # every command's --layout default (bench, replay, plan)
MAX_ERROR_CHARS = 2000


def error_line(msg: str) -> None:
    """Print ``error: MSG`` as one line on stderr (never wrapped, no markup), cut to
    :data:`MAX_ERROR_CHARS` characters (a message may quote an input of any size)."""
    text = str(msg)
    if len(text) > MAX_ERROR_CHARS:
        text = f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS} more characters)"
    console.print(Text.assemble(("error:", "red"), " ", " ".join(text.split())), soft_wrap=True,
                  highlight=False)


def fail(msg: str) -> NoReturn:
    """:func:`error_line`, then exit code 2."""
    error_line(msg)
    raise typer.Exit(2)


def finite(name: str, value: Optional[float], *, gt: Optional[float] = None, ge: Optional[float] = None,
           le: Optional[float] = None) -> None:
    """``value`` (None: not given) must be finite, > gt / >= ge and <= le, else :func:`fail` naming ``name``."""
    if value is None:
        return
    if not math.isfinite(value):
        fail(f"{name}: must be a finite number (got {value})")
    if gt is not None and not value > gt:
        fail(f"{name}: must be > {gt:g} (got {value:g})")
    if ge is not None and not value >= ge:
        fail(f"{name}: must be >= {ge:g} (got {value:g})")
    if le is not None and not value <= le:
        fail(f"{name}: must be <= {_num(le)} (got {value:g})")


def _num(x: float) -> str:
    """``10,000,000`` for a whole number (below 1e16), else ``%g``."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def int_range(name: str, value: Optional[int], lo: int, hi: Optional[int] = None) -> None:
    """``value`` (None: not given) must lie in ``lo..hi`` (``hi`` None: no upper bound), else :func:`fail`
    naming ``name``."""
    if value is None:
        return
    if value < lo:
        fail(f"{name}: must be >= {lo} (got {value})")
    if hi is not None and value > hi:
        fail(f"{name}: must be <= {hi:,} (got {value:,})")


def existing_dir(name: str, path: str, why: str) -> None:
    """``path`` must be an existing directory this process can write, else :func:`fail` naming ``name``:
    a command that reads or cleans a store (``gc``) or measures one (``bench``) never creates it, so
    a typo does not become an empty new store. ``why`` ends the does-not-exist message."""
    import os

    from kvbm_backend.config import dir_problem
    problem = dir_problem(path)
    if problem:
        fail(f"{name}: {path}: {problem}")
    if not os.path.isdir(path):
        fail(f"{name}: {path}: no such directory ({why})")


def named_paths(*named: tuple[str, Optional[str]]) -> None:
    """Each ``(option, path)`` given (None or empty: skipped) must name a file or directory: a relative path while this
    process's working directory has been removed names none (:func:`kvbm_backend.fsmodes.abspath`), and is
    :func:`fail` naming the option (before 2026-12-03 a traceback, ``keys: [Errno 2] No such file or directory``, or
    ``no file`` / ``not found`` with no word of the working directory)."""
    from kvbm_backend.fsmodes import WorkdirRemoved, abspath
    for name, path in named:
        try:
            if path:
                abspath(path)
        except WorkdirRemoved as e:
            fail(f"{name}: {e}")


def removed_workdir_text(e: FileNotFoundError) -> str:
    """What a FileNotFoundError no check caught means while this process's working directory has been removed (the
    CLI's catch-all, ``error: COMMAND: TEXT``): an absolute file (or two, a rename's) is missing itself and is named, as
    the OS says it (before 2026-12-03 the working directory was blamed for it); a relative one, or none named
    (``os.getcwd()``), names nothing there: the working directory is the cause."""
    import os
    names = [os.fsdecode(f) for f in (e.filename, e.filename2) if isinstance(f, (str, bytes, os.PathLike))]
    rel = [f for f in names if not os.path.isabs(f)]
    if names and not rel:
        return f"{' -> '.join(names)}: {e.strerror or 'No such file or directory'}"
    return ("this process's working directory has been removed (os.getcwd() fails), so a relative path names nothing"
            f" ({repr(rel[0]) if rel else e}): give absolute paths, or run from a directory that exists")


def output_file(name: str, path: str) -> None:
    """``path`` is a file this command may write when it finishes: its directory exists and this process can
    write it, and ``path`` is not a directory (nor an existing file it cannot write); else :func:`fail`
    naming ``name``. Checked before the work (a plan's simulation, a demo's engines), so a typo does not
    cost the results; the directory is never created. A relative ``path`` while the working directory has been
    removed names no file: refused naming ``name`` (before 2026-12-03 a FileNotFoundError traceback)."""
    import os
    from pathlib import Path

    from kvbm_backend.config import dir_problem
    from kvbm_backend.fsmodes import WorkdirRemoved, abspath
    if not path.strip():
        fail(f"{name}: empty file name")
    try:
        target = Path(abspath(path))
    except WorkdirRemoved as e:
        fail(f"{name}: {e}")
    parent = target.parent
    problem = dir_problem(str(parent))  # a file in the way, a directory this process cannot write
    if problem:
        fail(f"{name}: {parent}: {problem}")
    if not parent.is_dir():
        fail(f"{name}: {path}: no directory {parent} (create it first)")
    if target.is_dir():
        fail(f"{name}: {path}: is a directory (give a file name)")
    if target.exists() and not os.access(target, os.W_OK):
        fail(f"{name}: {path}: not writable by this process")


def file_url_path(url: str) -> str | None:
    """The local path of a ``file://`` URL (``file:///p`` or ``file://localhost/p``), else None."""
    from urllib.parse import urlparse
    u = urlparse(url)
    return u.path if u.scheme == "file" and u.netloc in ("", "localhost") and u.path.startswith("/") else None


def check_layout(layout: str, page_size: int, tp: int = 1) -> None:
    """The preset exists, parses, and splits over ``tp`` ranks (messages name --layout / --tp)."""
    from kvbm_backend.model.presets import load_preset
    try:
        load_preset(layout).layout(page_size=page_size, tp=tp)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("tp: "):
            fail(f"--tp: {msg[4:]} (got {tp})")
        fail(f"--layout: {msg.removeprefix('layout: ').removeprefix('layout ')}")


def config_error_text(e: Exception) -> str:
    """A configuration error as one text: pydantic's ValidationError formatted as the config loader does."""
    from pydantic import ValidationError

    from kvbm_backend.config import _fmt_error
    return _fmt_error(e) if isinstance(e, ValidationError) else str(e)


def write_whole(path: str, write: Callable[[str], object]) -> None:
    """Write the file ``path`` whole or not at all: ``write(tmp)`` writes a sibling ``.STEM.partial-*SUFFIX``
    (the suffix kept: matplotlib picks the image format by it), renamed over ``path`` when complete (with the
    mode of a file it replaces). A failed write (a full disk, a file size limit, Ctrl-C) removes the temp file
    and re-raises, so no truncated file is left and an earlier file of that name stays as it was. A ``path``
    that exists and is not a regular file (``/dev/stdout``, a FIFO) is written in place. Raises what ``write``
    raises, or OSError from the rename."""
    import os
    import stat
    import uuid
    from pathlib import Path
    target = Path(os.path.realpath(path))  # a symlink's target is replaced, not the link
    if target.exists() and not target.is_file():
        write(path)
        return
    tmp = target.parent / f".{target.stem}.partial-{uuid.uuid4().hex[:8]}{target.suffix}"
    try:
        write(str(tmp))
        if target.exists():
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        os.replace(tmp, target)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
