"""``kvbm-backend doctor``'s ``paths`` section and the problems it finds: per G3 directory or ``file://`` G4 root,
the filesystem type, O_DIRECT (a real probe), free and total bytes, and whether a G3 pool can use it, judged by
the pool's own rules so that doctor's verdict and :class:`~kvbm_backend.pool.g3.pool.G3Pool`'s open agree:

* :func:`kvbm_backend.config.dir_problem` (what ``g3.paths`` is validated with): a file, a path under a file,
  a directory this process cannot write (a read-only filesystem, another uid);
* :func:`kvbm_backend.fsmodes.dir_problem` (the pool's trust rule for its directory): owned by another uid
  (writable by group or others is doctor's ``modes`` problem line; 0755 passes, a ``modes`` note);
* :func:`kvbm_backend.pool.g3.slabs.o_direct_choice` (the open's O_DIRECT decision): with ``g3.o_direct``
  ``auto`` a probe that fails otherwise than ENOSPC/EDQUOT fails the open; with ``on``, a filesystem that
  refuses O_DIRECT fails it too;
* :func:`kvbm_backend.pool.g3.slabs.space_budget` (the open's space budget): the room above the
  ``g3.min_free_fraction`` watermark and the metadata reserve must hold one slot (the smallest any model has,
  :data:`MIN_SLOT_BYTES`: doctor does not know the model), and, for the config's own ``g3.paths``, the path's
  share of ``g3.capacity_gb`` (the pool would open with less).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from kvbm_backend.config import ConfigError, dir_problem
from kvbm_backend.model.frame import slot_bytes as _frame_slot_bytes

MIN_SLOT_BYTES = _frame_slot_bytes(1)  # bytes: a 4 KiB header plus one 4 KiB page, the smallest G3 slot


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _mounts() -> list[tuple[str, str, str]]:
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for ln in f:
                p = ln.split()
                if len(p) >= 3:
                    out.append((p[1].replace("\\040", " "), p[2], p[0]))
    except OSError:
        pass
    return out


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (longest matching mount point in /proc/self/mounts)."""
    rp = os.path.realpath(path)
    best, typ = "", "unknown"
    for mnt, t, _dev in _mounts():
        if (rp == mnt or rp.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, typ = mnt, t
    return typ


def url_scheme(p: str) -> str | None:
    """The URL scheme of a ``--path`` entry, or None for a local path
    (:func:`kvbm_backend.store_url.path_url_scheme`: ``SCHEME://...``, or ``file:/abs``, ``s3:/bucket``)."""
    from kvbm_backend.store_url import path_url_scheme
    return path_url_scheme(p)


def local_dir(p: str) -> str:
    """The local directory a doctor path names: a ``file:`` URL's path (``file:///abs``, ``file:/abs``,
    ``file://localhost/abs`` -> ``/abs``, as :class:`~kvbm_backend.pool.g4.fs_store.FsStore` opens it), else
    ``p`` as given."""
    from kvbm_backend.store_url import file_url_path
    return (file_url_path(p) or p) if url_scheme(p) == "file" else p


def is_g4_root(p: str) -> bool:
    """``p`` is a ``file:`` URL (a G4 root), not a G3 directory."""
    return url_scheme(p) == "file"


def check_path_arg(p: str) -> None:
    """A ``--path`` entry must be a local path or a ``file:`` URL of an absolute path (``file:///path``,
    ``file:/path`` or ``file://localhost/path``, as ``g4.url`` accepts them, RFC 8089).

    Raises:
        ConfigError: an empty entry, any other URL (``s3://...``: that store is checked from ``g4.url`` of ``--config``) or
            a malformed ``file:`` URL (``file://relative``, ``file:relative``); the message names the entry.
    """
    if not p.strip():
        raise ConfigError("--path '': empty (it would mean the current directory)")
    scheme = url_scheme(p)
    if scheme is None:
        return
    from kvbm_backend.store_url import url_problem
    if scheme != "file":
        raise ConfigError(f"--path {p!r}: not a local directory; give a G3 directory or a file:///path G4 root "
                          f"(an {scheme}:// store is checked from g4.url: doctor --config FILE)")
    problem = url_problem(p)
    if problem:
        raise ConfigError(f"--path {p!r}: {problem}")


def path_info(path: str) -> dict:
    """O_DIRECT (real probe), filesystem type, free/total bytes of one directory; ``dir_problem`` when
    :func:`kvbm_backend.config.dir_problem` refuses it. A missing directory is probed at its nearest existing
    ancestor (``probed_at``). A relative path while the working directory has been removed names no directory:
    ``dir_problem`` says so, nothing is probed (before 2026-12-03 ``os.getcwd()``'s bare FileNotFoundError came out).
    Never raises."""
    from kvbm_backend.fsmodes import abspath
    from kvbm_backend.io import probe_o_direct
    path = local_dir(path)
    problem = dir_problem(os.path.expanduser(path))
    try:
        ap = abspath(os.path.expanduser(path))
    except ValueError:  # relative, the working directory removed (dir_problem's text says so)
        return {"path": path, "exists": False, "dir_problem": problem, "note": problem, "fs_type": "unknown",
                "free_bytes": None, "o_direct": None}
    out: dict[str, Any] = {"path": path, "exists": os.path.isdir(ap)}
    if problem:
        out["dir_problem"] = problem
    probe = ap
    while not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if probe != ap:
        out["probed_at"] = probe
        out["note"] = problem or "missing: probed at the nearest existing ancestor (the pool creates it)"
    elif problem:
        out["note"] = problem
    out["fs_type"] = fs_type(probe)
    try:
        st = os.statvfs(probe)
        out["free_bytes"] = st.f_bavail * st.f_frsize
        out["total_bytes"] = st.f_blocks * st.f_frsize
    except OSError as e:
        out["free_bytes"] = None
        out["statvfs_error"] = _err(e)
    try:
        out["o_direct"] = bool(probe_o_direct(probe))
    except OSError as e:
        out["o_direct"] = None
        out["o_direct_error"] = f"cannot probe ({_err(e)})"
    return out


def g3_path_problems(info: dict, g3, n_paths: int, configured: bool) -> list[str]:
    """Why a G3 pool with config ``g3`` (:class:`~kvbm_backend.config.G3Config`) cannot use the directory of
    ``info`` (a :func:`path_info` result), one line each; empty when it can. ``n_paths``: the directories the
    pool would have (the capacity share's divisor); ``configured``: the path is one of ``g3.paths`` (only then
    is a share of ``g3.capacity_gb`` below it a problem). Adds ``room_bytes`` (the space slab files may take
    there) to ``info``. Never raises."""
    from kvbm_backend.pool.g3.slabs import o_direct_choice, slab_bytes_in, space_budget
    p = info["path"]
    if info.get("dir_problem"):  # the pool cannot create or write it: nothing else to judge
        return [f"g3 path {p}: {info['dir_problem']}"]
    from kvbm_backend.fsmodes import dir_problem as trust_problem
    try:  # the pool's owner rule for its directory (G3Pool's open refuses it with G3PathError); its mode
        st = os.stat(os.path.abspath(os.path.expanduser(p)))  # half is doctor's ``modes`` line, not repeated here
        trust = trust_problem(st) if st.st_uid != os.geteuid() else None
    except OSError:
        trust = None  # missing: the pool creates it 0700
    if trust:
        return [f"g3 path {p}: directory {trust}: G3Pool's open refuses it (fix: chown {os.geteuid()} {p}; "
                f"chmod 700 {p})"]
    probe = info.get("probed_at", os.path.abspath(os.path.expanduser(p)))
    out = []
    slabs_log = logging.getLogger("kvbm_backend.pool.g3.slabs")
    level = slabs_log.level
    slabs_log.setLevel(logging.ERROR)  # the pool's "cannot probe O_DIRECT (full)" warning: the room line says it
    try:
        o_direct_choice(probe, g3.o_direct)  # the open's decision (``auto`` probes; ENOSPC: buffered)
    except OSError as e:
        out.append(f"g3 path {p}: the O_DIRECT probe fails ({_err(e)}): G3Pool's open fails the same way")
    finally:
        slabs_log.setLevel(level)
    if g3.o_direct == "on" and info.get("o_direct") is False:
        out.append(f"g3 path {p}: g3.o_direct is on but {info.get('fs_type')} refuses O_DIRECT here: slab files "
                   "cannot be opened (set g3.o_direct auto or off)")
    capacity = round(g3.capacity_gb * 1e9)
    try:
        own = slab_bytes_in(probe)[0] if info.get("exists") else 0  # every namespace's: doctor knows no model
        budget, room = space_budget(probe, own, capacity, n_paths, MIN_SLOT_BYTES, g3.min_free_fraction)
    except OSError as e:
        return out + [f"g3 path {p}: free space unknown ({_err(e)})"]
    info["room_bytes"] = max(0, room)
    where = f"above the {g3.min_free_fraction:.0%} free-space watermark and the metadata reserve"
    if room < MIN_SLOT_BYTES:
        out.append(f"g3 path {p}: room for no slot: {max(0, room)} bytes {where} on {info.get('fs_type')} "
                   f"(free {info.get('free_bytes')} of {info.get('total_bytes')} bytes; the smallest slot is "
                   f"{MIN_SLOT_BYTES} bytes): G3Pool's open fails with 'g3.capacity_gb: room for no slot' when no "
                   "path has room")
    elif configured and budget < capacity // n_paths:
        out.append(f"g3 path {p}: room for {room / 1e9:.3f} GB {where}, less than its share of g3.capacity_gb "
                   f"{g3.capacity_gb:g} ({capacity // n_paths / 1e9:.3f} GB over {n_paths} path"
                   f"{'s' if n_paths > 1 else ''}): the pool opens with less")
    return out


def g4_path_problems(info: dict) -> list[str]:
    """Why a ``file://`` G4 store cannot write in the directory of ``info`` (:func:`path_info`): the
    directory rule the config holds an enabled ``file://`` ``g4.url`` to, or a probe write that failed."""
    p = info["path"]
    if info.get("dir_problem"):
        return [f"g4 root {p}: {info['dir_problem']}"]
    if info.get("o_direct_error"):
        return [f"g4 root {p}: cannot write a file there: {info['o_direct_error']}"]
    return []
