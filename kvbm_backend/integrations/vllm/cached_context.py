"""Whether the engine's attention can use KV it did not compute itself: a connector load.

A load hands the engine a cached prefix (``num_computed_tokens`` > 0 at the request's first prefill), as its own
prefix cache does. Some attention backends cannot compute a prefill over a cached prefix, and vLLM turns its
prefix caching (and chunked prefill) off for them; a connector's hit would still give them one, and the tokens
computed after it would attend to that prefix wrongly: wrong outputs from correct KV (docs/invariants.md #1).

vLLM 0.32 (``vllm/platforms/cpu.py``, ``check_and_update_config``: "MLA is enabled on a non-GPU platform; forcing
chunked prefill and prefix caching to be disabled") does this for MLA models (DeepSeek-V2/V3/R1) on the CPU
platform unless the AMX MLA backend runs them: x86 with AMX tiles, and the ``CPU_MLA`` backend not asked for
(DeepSeek-V4 on AMX runs its own kernels). The backend then is the reference
``vllm/v1/attention/backends/mla/cpu_mla.py``. Measured on it (tiny DeepSeek-V2, float32, TP=1, one 300-token
prompt, 2026-12-02): the first token's logprob is -3.17 computed whole, -2.97 after loading 288 tokens (the same
greedy tokens, another runner-up), and other greedy tokens after loading 256, 160 or 64 tokens; the loaded bytes
were identical to those saved. With TP=2 the same: G4 objects of the shared prefix bit-identical, the blocks
computed after a 160-token load differing in every layer-1 value.
"""
from __future__ import annotations

from typing import Any


def cached_context_problem(vllm_config: Any) -> str | None:
    """Why this engine must get no loads (its attention cannot compute a prefill over a cached prefix), or None
    when it can. Follows vLLM 0.32's own test for turning prefix caching off (module doc)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not getattr(model, "use_mla", False):
        return None
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return None
    import torch
    from vllm.platforms.interface import CpuArchEnum
    amx = current_platform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
    dsv4 = getattr(getattr(model, "hf_config", None), "model_type", None) == "deepseek_v4"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    cpu_mla_asked = getattr(backend, "name", None) == "CPU_MLA"
    if amx and (dsv4 or not cpu_mla_asked):
        return None
    return ("an MLA model on vLLM's reference CPU MLA backend (no AMX tiles on this CPU, or attention backend "
            "CPU_MLA asked for), which computes no correct prefill over a cached prefix (vLLM turns its own prefix "
            "caching off for it)")
