"""``kvbm-backend`` error lines that named the wrong thing (review 2026-12-03), each through a real subprocess:

* the CLI's catch-all for a FileNotFoundError no check caught, in a working directory that has been removed, blamed
  the working directory even when the missing file was absolute (the directory had nothing to do with it): it names
  the file now; a relative path (or ``os.getcwd()`` itself) still gets the working-directory line;
* ``model tiny ""`` wrote the model into the working directory (``Path("")`` is ``.``), or said ``DIR: : not empty``;
  ``model "" DIR`` said ``expected tiny or demo (got '')``: both say the argument is empty now, nothing written;
* a relative ``KVBM_BACKEND_LAYOUTS`` in a removed working directory said ``presets directory layouts: no such
  directory`` (the directory may well exist: the path names nothing there): it names the variable and the cause, as
  a relative ``--layout FILE.toml`` names that path.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.apps.test_cli_removed_cwd import GONE, _error
from tests.apps.test_effective_default_g3_and_removed_cwd import REMOVED, _run

# the real CLI app with one more command that reads the file it is given without a check of its own, as a shipped
# command's unchecked read would (a file removed while it runs): every shipped command checks its files first
READ = ("import sys\nfrom kvbm_backend.apps.cli import app\n\n"
        "@app.command('read-file')\ndef read_file(path: str) -> None:\n    open(path).close()\n\napp()\n")


def _cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
         code: str | None = None) -> subprocess.CompletedProcess:
    """``kvbm-backend ARGS`` (or ``python -c code ARGS``) in a removed working directory."""
    argv = [sys.executable, *(["-c", code] if code else ["-m", "kvbm_backend.apps.cli"]), *args]
    return _run(argv, (REMOVED, tmp_path / "gone"), env)


def test_the_catch_all_names_a_missing_absolute_file_in_a_removed_working_directory(tmp_path):
    """Before: ``error: read-file: this process's working directory has been removed (os.getcwd() fails), so a
    relative path names nothing ([Errno 2] No such file or directory: '/abs/missing.json'): give absolute paths``."""
    missing = tmp_path / "no-such-dir" / "missing.json"
    line = _error(_cli(tmp_path, "read-file", str(missing), code=READ))
    assert line == f"error: read-file: {missing}: No such file or directory", line
    rel = _error(_cli(tmp_path, "read-file", "rel.json", code=READ))  # a relative one: the working directory's fault
    assert rel.startswith("error: read-file: this process's working directory has been removed"), rel
    assert "('rel.json')" in rel and "give absolute paths" in rel, rel


@pytest.mark.parametrize("argv, name", [(["tiny", ""], "DIR"), (["tiny", "  "], "DIR"), (["", "ABS"], "PRESET")])
def test_model_says_an_argument_is_empty(tmp_path, argv, name):
    """``model tiny ""``: before, exit 0 and the model written into the (empty) working directory, or ``DIR: : not
    empty`` in another; ``model "" DIR``: ``PRESET: expected tiny or demo (got '')``. Now one line saying which
    argument is empty, exit 2, nothing written."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = _run([sys.executable, "-m", "kvbm_backend.apps.cli", "model",
              *[a.replace("ABS", str(tmp_path / "m")) for a in argv]], cwd)
    line = _error(r)
    assert line.startswith(f"error: {name}: the argument is empty"), line
    assert list(cwd.iterdir()) == [] and not (tmp_path / "m").exists()


@pytest.mark.parametrize("argv", [["layouts"], ["plan", "--synthetic", "--layout", "tiny", "--g3-capacity-gb", "1"]])
def test_a_relative_layouts_variable_in_a_removed_working_directory_is_named(tmp_path, argv):
    """Before: ``error: presets directory layouts: no such directory (set by KVBM_BACKEND_LAYOUTS)`` (``--layout: ``
    first for plan): as if the directory did not exist. Now the variable, the path and the cause."""
    line = _error(_cli(tmp_path, *argv, env={"KVBM_BACKEND_LAYOUTS": "layouts"}))
    prefix = "error: --layout: " if argv[0] == "plan" else "error: "
    assert line.startswith(f"{prefix}KVBM_BACKEND_LAYOUTS: 'layouts' is relative to the working directory"), line
    assert GONE in line and "give an absolute path" in line and "no such directory" not in line, line


def test_a_relative_layout_file_in_a_removed_working_directory_is_named(tmp_path):
    """``--layout my.toml`` (a preset file's path): before, ``--layout: no preset 'my.toml'; known: ...``."""
    line = _error(_cli(tmp_path, "plan", "--synthetic", "--layout", "my.toml", "--g3-capacity-gb", "1"))
    assert line.startswith("error: --layout: 'my.toml' is relative to the working directory"), line
    assert GONE in line and "no preset" not in line, line
