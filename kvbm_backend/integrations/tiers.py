"""Open the G3 and G4 pools an integration talks to, from one :class:`KvbmBackendConfig`.

:func:`open_tiers` opens fresh pools. :func:`shared_tiers` / :func:`release_tiers` keep one pair per
process and (config, namespace): vLLM builds a scheduler-side and a worker-side connector, which live
in the same process whenever the engine core runs its worker in-process (TP 1: vLLM's
``UniProcExecutor``); sharing the pool object there means the scheduler's prefix lookups see every
block the worker has published, through one index.

Whoever opens pools (:func:`open_tiers`, the vLLM tiering tiers) calls :func:`announce_tiers`: once per
process and (config, tiers) it logs one INFO line with the effective configuration (``kvbm_backend.tiers``
logger; no credentials, no key material) and starts the Prometheus ``/metrics`` server when
``metrics.port`` / ``DYN_KVBM_METRICS`` ask for one (:func:`kvbm_backend.metrics.serve_once`: one
endpoint per pod and port, serving every process's series; a port another program holds is one ERROR
line naming ``metrics.port``, and the engine runs on without metrics).
"""
from __future__ import annotations

import logging
import threading

from .. import metrics
from . import load_priority
from ..config import KvbmBackendConfig
from ..model.namespace import Namespace
from ..pool import open_pool
from ..pool.base import BlockPool

log = logging.getLogger("kvbm_backend.tiers")


def open_tiers(cfg: KvbmBackendConfig, namespace: Namespace,
               kv_heads: int | None = None) -> tuple[BlockPool | None, BlockPool | None]:
    """Open ``(g3, g4)`` for ``namespace``; a tier that is disabled (``g3.enabled`` false, or
    ``g4.enabled`` false / no ``g4.url``) is None. With ``g4.layout: canonical`` G4 is a
    :class:`~kvbm_backend.pool.g4.canonical.CanonicalG4` over the canonical namespace of ``namespace``
    (``kv_heads``: the model's KV heads before TP; may be None for MLA).

    Raises:
        ConfigError / ValueError: from the pools, naming the bad field (e.g. an unusable G3 path).
    """
    g3 = g4 = None
    metrics.prepare(cfg.metrics.serve_port)  # before the pools create their series (one endpoint per pod)
    if cfg.g3.enabled:
        g3 = open_pool(cfg.g3, namespace)
    if cfg.g4.enabled:
        if not cfg.g4.url:
            if g3 is not None:
                g3.close()
            raise ValueError("g4.url: G4 is enabled but no url is set (s3://BUCKET/PREFIX or file:///path)")
        try:
            g4 = _open_g4(cfg, namespace, kv_heads)
        except BaseException:
            if g3 is not None:
                g3.close()
            raise
    announce_tiers(cfg, namespace=namespace, g3=g3, g4=g4)
    return g3, g4


def _open_g4(cfg: KvbmBackendConfig, namespace: Namespace, kv_heads: int | None) -> BlockPool:
    if cfg.g4.layout != "canonical":
        return open_pool(cfg.g4, namespace, default_tenant=cfg.tenant)
    from ..model.canonical import HeadMap
    from ..pool.g4.canonical import CanonicalG4
    if kv_heads is None and namespace.layout.outer_dim != 1:
        raise ValueError("g4.layout: canonical needs the model's KV head count (the vLLM connector gives it); "
                         "this integration stores per-rank blocks only")
    heads = HeadMap(namespace, int(kv_heads or 1))
    return CanonicalG4(open_pool(cfg.g4, heads.canonical, default_tenant=cfg.tenant), heads)


_announced: set[str] = set()
_announce_lock = threading.Lock()  # not _lock: shared_tiers holds that while it opens pools


def announce_tiers(cfg: KvbmBackendConfig, *, namespace: Namespace | None = None, g3: BlockPool | None = None,
                   g4: BlockPool | None = None) -> None:
    """Start the pod's metrics endpoint or join it (once per process: :func:`kvbm_backend.metrics.serve_once`)
    and log the start-up line (once per process, config, namespace and set of open tiers). Never raises:
    metrics and logs must not stop an engine."""
    try:
        load_priority.configure(cfg.load_gil_switch_ms)  # every call: the config of the tiers opened last
        port = cfg.metrics.serve_port
        serving = metrics.serve_once(port, cfg.metrics.addr) if port is not None else None
        ns_key = namespace.canonical_json() if namespace is not None else ""
        key = f"{cfg.model_dump_json()}|{ns_key}|g3={g3 is not None}|g4={g4 is not None}"
        with _announce_lock:
            if key in _announced:
                return
            _announced.add(key)
        log.info("%s", startup_line(cfg, namespace=namespace, g3=g3, g4=g4, metrics_serving=serving))
    except Exception:  # noqa: BLE001 - a bug here is logged, the pools stay open
        log.exception("kvbm_backend: start-up summary failed")


def startup_line(cfg: KvbmBackendConfig, *, namespace: Namespace | None = None, g3=None, g4=None,
                 metrics_serving: bool | None = None) -> str:
    """The effective configuration in one line: what an operator checks first in a worker's log. It names the
    ``namespace`` the blocks are stored under (``model=M@REVISION namespace=FINGERPRINT``: the model and revision
    the connector or tier decided, ``+q=``/``+hf=`` suffixes included, and the fingerprint that names its
    directories and objects); without one (a caller that has none), the config's ``model@revision``. Before
    2026-12-01 it always printed the config's, which is not the namespace when vLLM named the model or when a
    suffix was added (review finding)."""
    if namespace is not None:
        parts = [f"model={namespace.model}@{namespace.revision} namespace={namespace.fingerprint}"]
    else:
        parts = [f"model={cfg.model}@{cfg.revision} (config)"]
    if g3 is not None:
        c = cfg.g3
        st = _stats(g3)
        adm = c.admission.policy + (f"(min_sightings={c.admission.min_sightings})"
                                    if c.admission.policy == "frequency" else "")
        parts.append(f"G3 paths={list(st.get('paths') or c.paths)} capacity_gb={c.capacity_gb:g} "
                     f"engine={st.get('engine', c.engine)} o_direct={st.get('o_direct', c.o_direct)} "
                     f"fsync={c.fsync} admission={adm} load_timeout_s={c.load_timeout_s:g} "
                     f"write_queue_blocks={c.write_queue_blocks}")
    else:
        parts.append("G3 off")
    if g4 is not None:
        from ..store_url import redact_url
        c4 = cfg.g4
        st = _stats(g4)
        kr = "none"
        if c4.keyring.path:
            kr = c4.keyring.path + (" (read-only)" if st.get("keyring_read_only") else "")
        ep = f" endpoint={redact_url(c4.endpoint_url)}" if c4.endpoint_url else ""
        parts.append(f"G4 url={redact_url(st.get('url') or c4.url)}{ep} encryption={'on' if c4.encrypt else 'OFF'} "
                     f"keyring={kr} timeout_s={c4.timeout_s:g} retries={c4.retries} "
                     f"breaker={c4.breaker_failures} failures/{c4.breaker_reset_s:g}s "
                     f"write_queue_blocks={c4.write_queue_blocks}")
    else:
        parts.append("G4 off")
    ms = cfg.load_gil_switch_ms
    parts.append(f"load_gil_switch_ms={ms:g}" if ms is not None else "load_gil_switch_ms=off")
    port = cfg.metrics.serve_port
    if cfg.metrics.enabled is False:
        parts.append("metrics: disabled (metrics.enabled false)")
    elif port is None:
        parts.append("metrics: no endpoint (metrics.port unset)")
    elif metrics_serving is False:
        parts.append(f"metrics: NOT serving, port {port} could not be bound (see the error above)")
    else:
        parts.append(f"metrics=http://{cfg.metrics.addr}:{port}/metrics")
    return "kvbm_backend tiers open: " + "; ".join(parts)


def _stats(pool) -> dict:
    try:
        return pool.stats()
    except Exception:  # noqa: BLE001
        return {}


_lock = threading.Lock()
_shared: dict[tuple[str, str], list] = {}  # (config json, namespace json) -> [g3, g4, refcount]


def _skey(cfg: KvbmBackendConfig, namespace: Namespace) -> tuple[str, str]:
    return cfg.model_dump_json(), namespace.canonical_json()


def shared_tiers(cfg: KvbmBackendConfig, namespace: Namespace,
                 kv_heads: int | None = None) -> tuple[BlockPool | None, BlockPool | None]:
    """Like :func:`open_tiers`, but returns the same pools to every caller in this process with an
    equal config and namespace (reference counted; pair each call with :func:`release_tiers`)."""
    k = _skey(cfg, namespace)
    with _lock:
        ent = _shared.get(k)
        if ent is None:
            g3, g4 = open_tiers(cfg, namespace, kv_heads)
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
