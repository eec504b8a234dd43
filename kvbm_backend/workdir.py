"""A process whose working directory has been removed (a shell left in a deleted directory, a pod's workdir
unmounted): native libraries that call ``getcwd()`` as they load must not end it (docs/cli.md).

:func:`workdir_removed` tells; :func:`outside_removed_workdir` runs a block in ``/`` and goes back into the removed
directory (relative paths still name nothing: :func:`kvbm_backend.fsmodes.abspath` refuses them, naming the field);
:func:`guard_native_imports` makes later imports of torch and vLLM load that way (the CLI and the launcher's
preflight call it before any thread starts).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def workdir_removed() -> bool:
    """True when this process's working directory has been removed (``os.getcwd()`` fails: ENOENT)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


@contextmanager
def outside_removed_workdir() -> Iterator[None]:
    """Run the block in ``/`` when this process's working directory has been removed, then go back into it (an fd of
    it, ``fchdir``: relative paths still name nothing, as before). For imports of native libraries that call
    ``getcwd()`` as they load and end the process when it fails: torch's oneMKL (``Intel oneMKL FATAL ERROR: Cannot
    load .../libtorch_cpu.so``, exit 2, no traceback; ``nixl._api`` and vllm import torch). Does nothing while the
    working directory exists. The working directory is the process's: no other thread may resolve a relative path
    meanwhile."""
    if not workdir_removed():
        yield
        return
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.chdir("/")
        try:
            yield
        finally:
            os.fchdir(fd)
    finally:
        os.close(fd)


class _LoadOutsideRemovedWorkdir:
    """A module loader that runs ``inner``'s ``create_module`` (an extension's ``dlopen``) and ``exec_module`` under
    :func:`outside_removed_workdir` (every other attribute is ``inner``'s)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def create_module(self, spec):
        with outside_removed_workdir():
            return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        with outside_removed_workdir():
            self._inner.exec_module(module)


class _NativeImportsOutsideRemovedWorkdir:
    """A ``sys.meta_path`` finder: torch and vLLM (and their modules) found as the other finders find them, loaded
    outside a removed working directory (:func:`guard_native_imports`)."""

    NAMES = ("torch", "vllm")

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] not in self.NAMES:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoadOutsideRemovedWorkdir(spec.loader)
                return spec
        return None


def guard_native_imports() -> None:
    """When this process's working directory has been removed, make later imports of torch and vLLM (directly, or
    through ``nixl._api``, the G3 engines, the G3 mirror) load in ``/`` (:func:`outside_removed_workdir`) instead of
    ending the process: torch's oneMKL calls ``getcwd()`` as it loads (``Intel oneMKL FATAL ERROR``, exit 2: before
    2026-12-03 what ``bench --tier g3``, ``replay``, ``model`` and ``doctor`` did there), and vLLM's import reaches
    ``torch._dynamo.config``, which calls ``os.getcwd()`` (a FileNotFoundError: ``bench --tier index``). Nothing while
    the working directory exists or when already installed: no cost to other runs. For command lines
    (``kvbm-backend``), before their threads start."""
    if not workdir_removed():
        return
    if not any(isinstance(f, _NativeImportsOutsideRemovedWorkdir) for f in sys.meta_path):
        sys.meta_path.insert(0, _NativeImportsOutsideRemovedWorkdir())
