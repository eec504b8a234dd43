"""vLLM's real ``Scheduler`` with ``KvbmBackendConnector`` on the tiny model (no engine, no GPU): tests drive its
``schedule`` / ``update_from_output`` and play the worker's part themselves (tests/integrations/vllm/
test_sched_lifecycle.py, test_sched_resume.py, test_handoff_hybrid.py, test_handoff_promise.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from kvbm_backend.apps.engine_model import TINY, write_model_dir


def tiny_scheduler(tmp: Path, extra: dict[str, Any], groups: Callable[[dict[str, Any], list[str]], list[KVCacheGroupSpec]],
                   *, block_size: int, num_blocks: int, batched_tokens: int, ktc: KVTransferConfig | None = None,
                   log_stats: bool = False) -> Scheduler:
    """A ``Scheduler`` of the tiny model written under ``tmp`` (``uni`` executor: the scheduler role uses the pools
    itself), ``kv_load_failure_policy`` ``recompute``, prefix caching and chunked prefill on, ``batched_tokens``
    tokens a step. ``extra``: the ``kv_connector_extra_config``; ``groups(spec_kwargs, layer_names)``: the KV cache
    groups (``spec_kwargs``: block_size, num_kv_heads, head_size, dtype of the tiny model). ``ktc``: another
    ``KVTransferConfig`` (e.g. a ``MultiConnector`` holding ours; ``extra`` then unused); ``log_stats``: vLLM's, so
    outputs carry the connectors' stats."""
    model = write_model_dir(tmp / "model", TINY)
    ktc = ktc or KVTransferConfig(
        kv_connector="KvbmBackendConnector", kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    vc = VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512,
                                             skip_tokenizer_init=True),
                    cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=8,
                                                     max_model_len=512, enable_chunked_prefill=True,
                                                     is_encoder_decoder=False),
                    kv_transfer_config=ktc)
    vc.cache_config.num_gpu_blocks = num_blocks
    vc.parallel_config.distributed_executor_backend = "uni"
    kw = dict(block_size=block_size, num_kv_heads=TINY.num_key_value_heads,
              head_size=TINY.hidden_size // TINY.num_attention_heads, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(TINY.num_hidden_layers)]
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups(kw, names))
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=block_size, log_stats=log_stats)


def runner_output(s: Scheduler, so: Any, connector: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """The step output vLLM's model runner sends for ``so`` (a ``SchedulerOutput`` of ``s``, after ``s.schedule()``):
    one sampled token (5) for each scheduled request whose prompt is computed by this step, none for a request still
    in a partial (chunked) prefill (vLLM's runner discards those tokens), and ``connector`` as the connector's part."""
    rids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                             sampled_token_ids=[[5] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens
                                                else [] for r in rids],
                             kv_connector_output=connector)
