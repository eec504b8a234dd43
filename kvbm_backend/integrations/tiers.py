"""Open the G3 and G4 pools an integration talks to, from one :class:`KvbmBackendConfig`.

:func:`open_tiers` opens fresh pools. :func:`shared_tiers` / :func:`release_tiers` keep one pair per
process and (config, namespace): vLLM builds a scheduler-side and a worker-side connector, which live
in the same process whenever the engine core runs its worker in-process (TP 1: vLLM's
``UniProcExecutor``); sharing the pool object there means the scheduler's prefix lookups see every
block the worker has published, through one index.
"""
from __future__ import annotations

import importlib
import threading

from ..config import KvbmBackendConfig
from ..model.namespace import Namespace
from ..pool.base import BlockPool


def _import_first(paths: list[tuple[str, str]]):
    errors = []
    for mod, name in paths:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{mod}.{name}: {e}")
    raise ImportError("; ".join(errors))


def open_tiers(cfg: KvbmBackendConfig, namespace: Namespace) -> tuple[BlockPool | None, BlockPool | None]:
    """Open ``(g3, g4)`` for ``namespace``; a tier that is disabled (``g3.enabled`` false, or
    ``g4.enabled`` false / no ``g4.url``) is None.

    Raises:
        ConfigError / ValueError: from the pools, naming the bad field (e.g. an unusable G3 path).
        ImportError: the pool implementation is missing from this install.
    """
    g3 = g4 = None
    if cfg.g3.enabled:
        G3Pool = _import_first([("kvbm_backend.pool.g3", "G3Pool"), ("kvbm_backend.pool.g3.pool", "G3Pool")])
        g3 = G3Pool(cfg.g3, namespace)
    if cfg.g4.enabled:
        if not cfg.g4.url:
            if g3 is not None:
                g3.close()
            raise ValueError("g4.url: G4 is enabled but no url is set (s3://BUCKET/PREFIX or file:///path)")
        try:
            G4Pool = _import_first([("kvbm_backend.g4", "G4Pool"), ("kvbm_backend.g4.pool", "G4Pool")])
            g4 = G4Pool(cfg.g4, namespace)
        except BaseException:
            if g3 is not None:
                g3.close()
            raise
    return g3, g4


_lock = threading.Lock()
_shared: dict[tuple[str, str], list] = {}  # (config json, namespace json) -> [g3, g4, refcount]


def _skey(cfg: KvbmBackendConfig, namespace: Namespace) -> tuple[str, str]:
    return cfg.model_dump_json(), namespace.canonical_json()


def shared_tiers(cfg: KvbmBackendConfig, namespace: Namespace) -> tuple[BlockPool | None, BlockPool | None]:
    """Like :func:`open_tiers`, but returns the same pools to every caller in this process with an
    equal config and namespace (reference counted; pair each call with :func:`release_tiers`)."""
    k = _skey(cfg, namespace)
    with _lock:
        ent = _shared.get(k)
        if ent is None:
            g3, g4 = open_tiers(cfg, namespace)
            ent = _shared[k] = [g3, g4, 0]
        ent[2] += 1
        return ent[0], ent[1]


def release_tiers(cfg: KvbmBackendConfig, namespace: Namespace) -> None:
    """Drop one reference taken by :func:`shared_tiers`; the last one closes the pools."""
    k = _skey(cfg, namespace)
    with _lock:
        ent = _shared.get(k)
        if ent is None:
            return
        ent[2] -= 1
        if ent[2] > 0:
            return
        del _shared[k]
    for p in (ent[0], ent[1]):
        if p is not None:
            p.close()
