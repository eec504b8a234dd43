"""I/O engines: positioned scatter/gather I/O on file descriptors (see :mod:`.base` for IoOp/IoEngine).

``make_engine("auto")`` picks ``posix``. Why (measured with ``kvbm_backend.bench.engines``, see
``python -m kvbm_backend.bench.engines``; 2 vCPU VM, virtual disk, 256 MiB, 1 MiB ops, 8 in flight):
the posix thread pool matches the raw O_DIRECT baseline, needs nothing outside the standard library,
and fsync/error semantics are ours; NIXL's POSIX backend is kept as an explicit choice (``nixl``).
"""
from __future__ import annotations

from .base import IoEngine, IoOp
from .posix import PosixEngine
from .probe import fdatasync, open_file, probe_o_direct

ENGINES = ("posix", "nixl", "kvikio")
AUTO_ENGINE = "posix"


def make_engine(name: str = "auto", threads: int = 8, queue_depth: int | None = None) -> IoEngine:
    """Build an engine by name.

    Args:
        name: ``posix`` | ``nixl`` | ``kvikio`` | ``auto`` (= :data:`AUTO_ENGINE`, chosen by measurement).
        threads: posix: ops in flight (worker threads). nixl: NIXL transfers in flight.
        queue_depth: nixl: most descriptors per NIXL transfer (default 64); ignored by posix.

    Raises:
        ValueError: unknown name or bad sizes.
        RuntimeError: the engine cannot run here; the message says why (NIXL or its POSIX plugin not
            loadable, kvikio missing or no NVIDIA driver).
    """
    if name == "auto":
        name = AUTO_ENGINE
    if name == "posix":
        return PosixEngine(threads=threads)
    if name == "nixl":
        from .nixl_engine import NixlEngine

        return NixlEngine(threads=threads, queue_depth=queue_depth)
    if name == "kvikio":
        try:
            from . import kvikio_engine
        except ImportError as e:
            raise RuntimeError(f"kvikio engine unavailable: {e}") from e
        try:
            return kvikio_engine.KvikioEngine(threads=threads)
        except (ImportError, OSError) as e:
            raise RuntimeError(f"kvikio engine unavailable: {e}") from e
    raise ValueError(f"unknown I/O engine {name!r}; expected one of auto, {', '.join(ENGINES)}")


__all__ = [
    "IoOp",
    "IoEngine",
    "PosixEngine",
    "make_engine",
    "open_file",
    "probe_o_direct",
    "fdatasync",
    "AUTO_ENGINE",
]
