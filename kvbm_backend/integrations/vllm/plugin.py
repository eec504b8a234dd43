"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``kvbm_backend``; pyproject.toml).

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API server, engine core,
workers) before it builds connectors. :func:`register` puts ``KvbmBackendConnector`` into vLLM's
``KVConnectorFactory`` registry, so the connector is known by name everywhere, not only where its module
was imported through ``kv_connector_module_path``: vLLM's ``MultiConnector`` rebuilds each sub-connector's
stats in the engine core by registry name (``build_kv_connector_stats``), and raised "Connector
'KvbmBackendConnector' is not registered" there when the connector ran in worker processes (vLLM's ``mp``
executor). Importing this module imports nothing of vLLM's; :func:`register` imports only the factory.

It also routes the package's logs (loggers ``kvbm_backend.*``) through vLLM's ``vllm`` logger
(:func:`route_logs`): the package configures no handler of its own, so under ``vllm serve`` or a Dynamo
worker its INFO lines (``kvbm_backend tiers open``, the connector's role line) were dropped and its
warnings printed bare by Python's last-resort handler. They now take vLLM's handlers, format and level
(``VLLM_LOGGING_LEVEL``), and Dynamo's where Dynamo configures vLLM's logger (``DYN_LOG``).
"""
from __future__ import annotations

import logging

NAME = "KvbmBackendConnector"
MODULE = "kvbm_backend.integrations.vllm.connector"

log = logging.getLogger("kvbm_backend.connector")


class _ToVllm(logging.Handler):
    """Hands each record to the handlers of vLLM's ``vllm`` logger as they are when the record is emitted
    (vLLM's default stream handler, or Dynamo's once Dynamo configured vLLM's logging), at that logger's
    level; only where the root logger has no handler of its own (else the record reaches the application's
    handlers by propagation, as before: no duplicates, and pytest's caplog still sees it)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        vl = logging.getLogger("vllm")
        if record.levelno >= vl.getEffectiveLevel():
            vl.handle(record)


def route_logs() -> bool:
    """Send ``kvbm_backend.*`` records to vLLM's logger (see the module doc) unless ``kvbm_backend`` has
    handlers already. Returns True when this call installed the route. The package logger's level becomes
    INFO when it had none (records below vLLM's level are still dropped by the route)."""
    lg = logging.getLogger("kvbm_backend")
    if lg.handlers:
        return False
    lg.addHandler(_ToVllm())
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.INFO)
    return True


def register() -> bool:
    """Register ``KvbmBackendConnector`` in vLLM's ``KVConnectorFactory`` (lazily: the module is imported
    when vLLM first builds the connector). Returns True when this call registered it, False when it was
    already registered or vLLM's factory is not importable. Also routes the package's logs through vLLM's
    logger (:func:`route_logs`). Never raises: a plugin must not break vLLM."""
    try:
        route_logs()
    except Exception:  # noqa: BLE001
        pass
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # noqa: BLE001 - no vLLM (or another version's layout): nothing to register
        return False
    if NAME in getattr(KVConnectorFactory, "_registry", {}):
        return False
    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except Exception as e:  # noqa: BLE001
        log.warning("kvbm_backend: could not register %s with vLLM's KVConnectorFactory: %s", NAME, e)
        return False
    return True
