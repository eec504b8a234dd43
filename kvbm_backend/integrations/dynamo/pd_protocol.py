"""Dynamo's disaggregated-serving protocol for ``KvbmBackendConnector``: the prefill -> decode handoff through
the shared tiers (:mod:`kvbm_backend.integrations.vllm.handoff`).

Dynamo 1.6.1's vLLM prefill handler asks a per-connector protocol object (``dynamo.vllm.kv_connector_protocols``,
keyed by ``kv_connector`` name; "new connectors are one class + one registry entry") for the prefill request's
``kv_transfer_params`` and for the decode request's, derived from the prefill response. Ours is
cache-mediated, like Dynamo's ``LMCacheMPConnectorProtocol``: no transport handle crosses, only the handoff
hint, and ``produces_kv_transfer_params = False`` so that in a ``MultiConnector`` beside a transport
connector (``NixlConnector`` + ours, ``examples/dynamo/disagg_prefill.sh``) the transport child keeps PD
coordination and ours only caches.

:func:`register` adds the class to Dynamo's registry; :mod:`.vllm_worker` calls it through
:func:`.compat.apply` (the registry is Dynamo's extension point; nothing in Dynamo is edited).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..vllm.handoff import KEY

NAME = "KvbmBackendConnector"


def _protocol_class():
    from dynamo.vllm.kv_connector_protocols import KvConnectorProtocol

    class KvbmBackendConnectorProtocol(KvConnectorProtocol):
        """Cache-mediated PD: the prefill worker offloads to G3/G4, the decode worker onboards from there."""

        produces_kv_transfer_params = False

        def prefill_request_kv_transfer_params(self) -> Dict[str, Any]:
            return {KEY: True}

        def decode_request_kv_transfer_params(self, prefill_response: Any) -> Optional[Dict[str, Any]]:
            # Empty, not None, when the prefill side sent nothing: Dynamo's prefill router requires the
            # disaggregated_params envelope (as for LMCacheMPConnectorProtocol).
            params = getattr(prefill_response, "kv_transfer_params", None)
            return dict(params) if isinstance(params, dict) and KEY in params else {}

    return KvbmBackendConnectorProtocol


def register() -> bool:
    """Register the protocol under ``KvbmBackendConnector`` in Dynamo's registry. Returns True when it was added,
    False when Dynamo has no such registry or already has an entry of that name."""
    try:
        from dynamo.vllm import kv_connector_protocols as kcp
    except Exception:  # noqa: BLE001 - no Dynamo, or one without the registry
        return False
    if NAME in kcp.KV_CONNECTOR_PROTOCOLS:
        return False
    kcp.KV_CONNECTOR_PROTOCOLS[NAME] = _protocol_class()
    return True
