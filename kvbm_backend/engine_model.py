"""Small model configs (Llama; DeepSeek-V2 MLA) with random weights, for running the real vLLM engine
without a real checkpoint.

vLLM loads a model from a directory holding a Hugging Face ``config.json`` and weights; with
``skip_tokenizer_init=True`` (token-id prompts) it needs no tokenizer. :func:`write_model_dir` writes
such a directory with random weights scaled so that the KV cache decides the output (vLLM's own
``load_format="dummy"`` weights do not: see :func:`write_model_dir`).

Three shapes are used:

* :data:`TINY` (CI): 4 layers, hidden 256, 4 query heads, 2 KV heads of 64, vocab 2048:
  ``layouts/tiny.toml`` geometry, 2,048 bytes of bf16 KV per token.
* :data:`DEMO` (``kvbm-backend demo``): more layers and a wider MLP so that a prefill costs more
  than reading its KV back (KV bytes per token grow with layers x KV heads, compute with
  layers x hidden^2); same head geometry so the KV block stays small.
* :data:`TINY_MLA` (CI, MLA): a 2-layer DeepSeek-V2-architecture model, one 576-wide latent per token
  and layer (2,304 bytes of bf16 KV per token); run it with the weights of :func:`write_mla_weights`
  (``load_format="safetensors"``), since dummy weights make outputs blind to the KV.
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


def write_model_dir(path: str | Path, model: TinyLlama = TINY, dtype: str = "bfloat16",
                    weights_seed: int | None = 0, tokenizer: bool = True) -> Path:
    """Write ``config.json``, a ``kvbm_model.json`` note, unless ``weights_seed`` is None random
    weights (:func:`write_llama_weights`, ``model.safetensors``) and, with ``tokenizer``, a small real
    tokenizer (:func:`write_tokenizer`: what Dynamo's frontend needs) into ``path``; returns the path.
    Existing files are overwritten.

    The directory is what ``vllm.LLM(model=path, load_format="safetensors", skip_tokenizer_init=True)``
    takes (:mod:`kvbm_backend.engine_run` picks that format when the weights file is there). vLLM's
    ``load_format="dummy"`` draws every weight from U(-1e-3, 1e-3): attention output is then ~0 and
    the greedy tokens do not depend on the KV cache at all (measured: loading all-zero KV for 33
    blocks of the tiny Llama left every output token unchanged), so "outputs identical" would prove
    nothing. With these weights a foreign KV changes the output (``tests/test_connector_e2e.py``).
    A config written for an MLA model (:class:`TinyDeepseekMla`) gets no weights here: use
    :func:`write_mla_weights`.
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(model.hf_config(dtype), indent=2))
    (p / "kvbm_model.json").write_text(json.dumps(asdict(model), indent=2))
    if weights_seed is not None and isinstance(model, TinyLlama):
        write_llama_weights(p, model, seed=weights_seed, dtype=dtype)
    if tokenizer:
        write_tokenizer(p, model.vocab_size)
    return p


# Special tokens of the tiny tokenizer; ids match the model configs' bos/eos (1/2), 0 is padding.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def _tokenizer_corpus(n_words: int = 6000, seed: int = 7) -> list[str]:
    """A fixed pseudo-English corpus (syllable words from a seeded generator, plus ASCII punctuation and
    digits) to train the tiny BPE on: deterministic, no download."""
    import random
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "th",
              "ch", "sh", "tr", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                     for _ in range(rng.choice((1, 1, 2, 2, 3)))) for _ in range(n_words)]
    lines, punct = [], [".", ",", "?", "!", ":", ";", "-", "'", '"', "(", ")"]
    for i in range(0, n_words, 12):
        ws = words[i:i + 12]
        lines.append(" ".join(ws) + rng.choice(punct) + f" {rng.randrange(10000)}")
        lines.append(" ".join(w.capitalize() for w in ws[:4]))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids (all the model's embedding rows),
    trained here on :func:`_tokenizer_corpus`: any text encodes (bytes), any id decodes. Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # a corpus too small for the vocab: fail, never a short vocab
        raise ValueError(f"tiny tokenizer has {tok.get_vocab_size()} ids, want {vocab_size}")
    return tok


def write_tokenizer(path: str | Path, vocab_size: int = 2048) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (with a chat template), ``special_tokens_map.json``
    and ``generation_config.json`` into ``path`` so Hugging Face ``AutoTokenizer`` and Dynamo's frontend
    (which tokenizes the text of OpenAI requests) load the model directory like a hub checkpoint."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(p / "tokenizer.json"))
    specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
    (p / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 16384, "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        **specials}, indent=2))
    (p / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (p / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                          "pad_token_id": 0}, indent=2))
    return p


@dataclass(frozen=True)
class TinyDeepseekMla:
    """A DeepSeek-V2-architecture (MLA) config: one compressed latent KV per token and layer.

    The latent is ``kv_lora_rank + qk_rope_head_dim`` elements (512 + 64 = 576, as in DeepSeek-V2/V3/R1:
    vLLM's CPU MLA backend ``vllm/v1/attention/backends/mla/cpu_mla.py`` supports only head size 576
    and block size 16, and the CPU platform turns the engine's prefix caching and chunked prefill off
    for MLA). Dense MLP in every layer (``first_k_dense_replace = num_hidden_layers``: no MoE), no
    query LoRA (``q_lora_rank`` None). Sizes are counts or widths (elements).
    """

    num_hidden_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    vocab_size: int = 2048
    max_position_embeddings: int = 16384
    name: str = "kvbm-backend/tiny-deepseek-mla"

    @property
    def latent_dim(self) -> int:
        """Elements of one token's latent per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token in bf16 (2 bytes), on every TP rank: ``layers * latent_dim * 2``."""
        return self.num_hidden_layers * self.latent_dim * 2

    def hf_config(self, dtype: str = "bfloat16") -> dict:
        """The ``config.json`` dict (Hugging Face ``DeepseekV2Config`` fields)."""
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": None,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": self.num_hidden_layers,
            "moe_layer_freq": 1,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "initializer_range": 0.02,
            "attention_bias": False,
        }


TINY_MLA = TinyDeepseekMla()


def _save_random(path: str | Path, shapes: dict[str, tuple], std: float, seed: int, dtype: str) -> Path:
    """Write ``model.safetensors`` into ``path``: 2-D projections N(0, ``std`` / sqrt(fan_in)),
    ``*embed_tokens*`` N(0, 1), 1-D (norm) weights 1. Deterministic for ``seed``. Returns the file."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    t = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t[name] = torch.ones(shape, dtype=tdt)
        elif "embed_tokens" in name:
            t[name] = torch.randn(shape, generator=g).to(tdt)
        else:
            t[name] = (torch.randn(shape, generator=g) * (std / shape[1] ** 0.5)).to(tdt)
    f = Path(path) / "model.safetensors"
    save_file(t, str(f))
    return f


def write_llama_weights(path: str | Path, model: TinyLlama = TINY, std: float = 2.0, seed: int = 0,
                        dtype: str = "bfloat16") -> Path:
    """Random weights for ``model`` as ``model.safetensors`` (Llama checkpoint names) in ``path``;
    returns the file. Why not vLLM's ``load_format="dummy"``: see :func:`write_model_dir`."""
    h, i_, hd = model.hidden_size, model.intermediate_size, model.head_dim
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (model.vocab_size, h)}
    for li in range(model.num_hidden_layers):
        p = f"model.layers.{li}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (model.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (model.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (model.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, model.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (i_, h), p + "mlp.up_proj.weight": (i_, h),
            p + "mlp.down_proj.weight": (h, i_)})
    return _save_random(path, shapes, std, seed, dtype)


def write_mla_weights(path: str | Path, model: TinyDeepseekMla = TINY_MLA, std: float = 2.0, seed: int = 0,
                      dtype: str = "bfloat16") -> Path:
    """Write random weights for ``model`` as ``model.safetensors`` (DeepSeek-V2 checkpoint names) into
    ``path``; returns the file path. Load with ``load_format="safetensors"``.

    Why: vLLM's ``load_format="dummy"`` draws every weight (norms included) from U(-1e-3, 1e-3), so
    attention outputs are ~0 and greedy tokens depend only on the last token: a test comparing
    outputs then cannot see wrong KV. Projection weights here are N(0, ``std`` / sqrt(fan_in)), embeddings
    N(0, 1) and norm weights 1; ``std`` 2 makes attention sharp enough that the cached latents decide the
    greedy tokens (measured on the CPU engine with 300-token prompts, 288 tokens loaded: zeroing the
    loaded latents, swapping the two layers' latents or zeroing only their 64 rope dims each changed
    the first greedy token of all three prompts; with ``std`` 0.5, or vLLM's dummy weights, none of
    the three changed any of 8 greedy tokens).
    Deterministic for a given ``seed``.
    """
    m = model
    h, nh, i_ = m.hidden_size, m.num_attention_heads, m.intermediate_size
    shapes = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (m.vocab_size, h)}
    for li in range(m.num_hidden_layers):
        p = f"model.layers.{li}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * (m.qk_nope_head_dim + m.qk_rope_head_dim), h),
            p + "self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
            p + "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            p + "self_attn.o_proj.weight": (h, nh * m.v_head_dim),
            p + "mlp.gate_proj.weight": (i_, h), p + "mlp.up_proj.weight": (i_, h),
            p + "mlp.down_proj.weight": (h, i_)})
    return _save_random(path, shapes, std, seed, dtype)
