"""A small real tmpfs for the full-filesystem tests (G3 slab room, G4 ``file://`` stores): mounted for one test,
unmounted after it; the test is skipped with the reason where mounting is not possible (not root, no mount(8), a
container without the capability)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str, options: str = "", why_skip: str = "") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount(8) syntax: ``8m``, ``1M``) at ``mnt`` (made here), ``options`` (e.g.
    ``mode=0700``) appended; yields ``mnt`` and unmounts it (lazily: a test's open files never block teardown).
    Skips the test naming why when it cannot mount; ``why_skip`` is added to that reason."""
    mnt.mkdir(parents=True, exist_ok=True)
    extra = f"; {why_skip}" if why_skip else ""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip(f"mounting a small tmpfs needs root and mount(8){extra}")
    opts = f"size={size}" + (f",{options}" if options else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}){extra}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_filesystem(mnt: Path) -> None:
    """Write ``mnt/filler`` until the filesystem answers ENOSPC, then check it is really full: a 4 KiB file more
    fails with ENOSPC too (not one more page)."""
    import errno
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    with pytest.raises(OSError) as e:
        (mnt / "probe").write_bytes(b"x" * 4096)
    assert e.value.errno == errno.ENOSPC
