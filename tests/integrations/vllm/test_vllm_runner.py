"""``tests/helpers/vllm_runner.import_problem`` (behind ``vllm_available``), which decides at collection time
whether the vLLM tests run (issue 22 item 11): a loaded machine makes it slow, never an error. The old check
ran ``import vllm, llguidance`` with a 120 s timeout at every collection; on a busy 2-core VM it timed out
and the lane failed with a collection error. Real packages in a temporary directory, real interpreters."""
from __future__ import annotations

import os
import uuid

from tests.helpers.vllm_runner import import_problem


def _package(root, name: str, body: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)


def test_slow_import_is_available_and_imported_once_per_run(tmp_path):
    pkgs, cache = tmp_path / "pkgs", tmp_path / "cache"
    pkgs.mkdir()
    log = tmp_path / "imports.log"
    a, b = f"slowpkg_{uuid.uuid4().hex[:8]}", f"otherpkg_{uuid.uuid4().hex[:8]}"
    # a slow import, as `import vllm` is on a loaded machine (and no timeout may turn it into a failure)
    _package(pkgs, a, f"import time\nopen({str(log)!r}, 'a').write('x\\n')\ntime.sleep(2)\n")
    _package(pkgs, b, "")
    for _ in range(3):
        assert import_problem((a, b), pythonpath=str(pkgs), cache_dir=cache) is None
    assert log.read_text().count("x") == 1, "the import must run once per run, then come from the cache"
    # a package that changes is imported again
    (pkgs / b / "__init__.py").write_text("VERSION = 2\n")
    os.utime(pkgs / b / "__init__.py", ns=(1, 1))
    assert import_problem((a, b), pythonpath=str(pkgs), cache_dir=cache) is None
    assert log.read_text().count("x") == 2


def test_missing_and_broken_packages_are_reasons_not_errors(tmp_path):
    pkgs, cache = tmp_path / "pkgs", tmp_path / "cache"
    pkgs.mkdir()
    missing = f"nopkg_{uuid.uuid4().hex[:8]}"
    assert import_problem((missing,), pythonpath=str(pkgs), cache_dir=cache) == f"{missing} is not installed"
    broken = f"brokenpkg_{uuid.uuid4().hex[:8]}"
    _package(pkgs, broken, "raise ImportError('libfoo.so: cannot open shared object file')\n")
    for _ in range(2):  # a failure is not cached
        assert import_problem((broken,), pythonpath=str(pkgs), cache_dir=cache) == (
            "ImportError: libfoo.so: cannot open shared object file")
    assert not cache.exists() or not any(cache.iterdir())
