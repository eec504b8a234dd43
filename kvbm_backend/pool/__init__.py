"""Block pools: one :class:`~kvbm_backend.pool.base.BlockPool` protocol for G3 and G4, and
:func:`open_pool`, the one way to open either from its config section."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config import G3Config, G4Config
    from ..io import IoEngine
    from ..model.namespace import Namespace
    from .base import BlockPool

__all__ = ["open_pool"]


def open_pool(cfg: G3Config | G4Config, namespace: Namespace, *, registry: CollectorRegistry | None = None,
              engine: IoEngine | None = None, default_tenant: str = "") -> BlockPool:
    """Open the pool a config section describes, bound to ``namespace``. Imports the tier only when it
    is opened (G4 pulls in the crypto and, for ``s3://``, boto3).

    Args:
        cfg: :class:`kvbm_backend.config.G3Config` (a :class:`~kvbm_backend.pool.g3.G3Pool`; opened
            whatever ``g3.enabled`` says: callers decide whether G3 is wanted) or
            :class:`kvbm_backend.config.G4Config` (a :class:`~kvbm_backend.pool.g4.G4Pool`; must have
            ``enabled`` true).
        namespace: what the blocks mean; keys of other namespaces are misses.
        registry: ``prometheus_client`` registry for the tier's metrics (default: the process registry).
        engine: G3 only: an I/O engine to share (not closed by the pool); None: the pool makes its own.
        default_tenant: G4 only: the config's ``tenant`` (the tenant of requests without a cache_salt), so
            that a drop's log line can say a missing key is the default tenant's (never logging its id).
    Raises:
        ValueError: a G4 config with ``enabled`` false (naming ``g4.enabled``), or with ``layout: canonical``
            for a per-rank namespace (naming ``g4.layout``: only :func:`~kvbm_backend.integrations.tiers.open_tiers`
            opens canonical G4, over the canonical namespace); from the pools, naming
            the field at fault (e.g. ``g4.url``, an unusable ``g3.paths`` entry).
        TypeError: ``cfg`` is neither a G3Config nor a G4Config.
        KeyringError, G3LockedError, OSError: from the pools (see their docstrings).
    """
    from ..config import G3Config, G4Config

    if isinstance(cfg, G3Config):
        from .g3 import G3Pool
        return G3Pool(cfg, namespace, engine=engine, registry=registry)
    if isinstance(cfg, G4Config):
        if not cfg.enabled:
            raise ValueError("g4.enabled: false; set g4.enabled: true (and g4.url) to open the G4 pool")
        if cfg.layout == "canonical" and namespace.layout_id == "per-rank":
            raise ValueError("g4.layout: canonical is served through the vLLM connector (KvbmBackendConnector, "
                             "integrations.tiers.open_tiers) only; this caller stores per-rank blocks: set "
                             "g4.layout: per-rank")
        from .g4 import G4Pool
        return G4Pool(cfg, namespace, registry=registry, default_tenant=default_tenant)
    raise TypeError(f"open_pool: cfg must be a G3Config or G4Config, got {type(cfg).__name__}")
