"""A working directory where ``./kvbm-g3`` (the default ``g3.paths``) cannot be created, as a pytest fixture: a
read-only tmpfs mount (root, as the tests run, writes a 0555 directory regardless; skipped where no mount is
possible) or a file named ``kvbm-g3`` in it. The variables that set ``g3.paths`` are removed for the test."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.tmpfs import mounted_tmpfs


def cannot_mkdir(cwd: Path) -> None:
    """Assert ``cwd/kvbm-g3/x`` cannot be made (by this process, root too)."""
    with pytest.raises(OSError):
        os.makedirs(cwd / "kvbm-g3" / "x")


@pytest.fixture(params=["read-only-mount", "file-in-place"])
def ro_cwd(request, tmp_path, monkeypatch):
    """The working directory (``os.chdir`` for the test, restored after), where ``./kvbm-g3`` cannot be created."""
    for var in ("DYN_KVBM_DISK_CACHE_DIR", "KVBM_BACKEND__G3__PATHS", "KVBM_BACKEND__G3"):
        monkeypatch.delenv(var, raising=False)
    old = os.getcwd()
    if request.param == "read-only-mount":
        with mounted_tmpfs(tmp_path / "ro", "1m", "ro") as mnt:
            os.chdir(mnt)
            try:
                cannot_mkdir(mnt)
                yield mnt
            finally:
                os.chdir(old)
        return
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "kvbm-g3").write_text("not a directory\n")
    os.chdir(cwd)
    try:
        cannot_mkdir(cwd)
        yield cwd
    finally:
        os.chdir(old)
