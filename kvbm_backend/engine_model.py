"""Small Llama model configs for running the real vLLM engine with dummy weights.

vLLM loads a model from a directory holding a Hugging Face ``config.json``; with
``load_format="dummy"`` it never reads weights and with ``skip_tokenizer_init=True`` (token-id
prompts) it needs no tokenizer. :func:`write_model_dir` writes such a directory.

Two shapes are used:

* :data:`TINY` (CI): 4 layers, hidden 256, 4 query heads, 2 KV heads of 64, vocab 2048:
  ``layouts/tiny.toml`` geometry, 2,048 bytes of bf16 KV per token.
* :data:`DEMO` (``kvbm-backend demo``): more layers and a wider MLP so that a prefill costs more
  than reading its KV back (KV bytes per token grow with layers x KV heads, compute with
  layers x hidden^2); same head geometry so the KV block stays small.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    """A Llama config. Sizes are counts (layers, heads) or widths (elements)."""

    num_hidden_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 2048
    max_position_embeddings: int = 16384
    name: str = "kvbm-backend/tiny-llama"

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token in bf16 (2 bytes): ``layers * 2 * kv_heads * head_dim * 2``."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 2

    def hf_config(self, dtype: str = "bfloat16") -> dict:
        """The ``config.json`` dict (Hugging Face ``LlamaConfig`` fields)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "initializer_range": 0.02,
            "attention_bias": False,
            "mlp_bias": False,
        }


TINY = TinyLlama()
DEMO = TinyLlama(num_hidden_layers=8, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=64, name="kvbm-backend/demo-llama")


def write_model_dir(path: str | Path, model: TinyLlama = TINY, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` (and a ``kvbm_model.json`` note) into ``path``; returns the path.

    The directory is what ``vllm.LLM(model=path, load_format="dummy", skip_tokenizer_init=True)``
    takes. Existing files are overwritten.
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(model.hf_config(dtype), indent=2))
    (p / "kvbm_model.json").write_text(json.dumps(asdict(model), indent=2))
    return p
