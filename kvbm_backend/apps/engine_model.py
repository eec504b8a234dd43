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
    takes (:mod:`kvbm_backend.integrations.vllm.engine_run` picks that format when the weights file is there). vLLM's
    ``load_format="dummy"`` draws every weight from U(-1e-3, 1e-3): attention output is then ~0 and
    the greedy tokens do not depend on the KV cache at all (measured: loading all-zero KV for 33
    blocks of the tiny Llama left every output token unchanged), so "outputs identical" would prove
    nothing. With these weights a foreign KV changes the output (``tests/e2e/test_connector_e2e.py``).
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


# ---- hybrid (sliding-window + full attention) models ------------------------------------------------

@dataclass(frozen=True)
class TinyHybrid:
    """A small hybrid-attention config: some layers attend to a sliding window of ``sliding_window``
    tokens, the others to the whole prefix (vLLM's hybrid KV cache manager puts them in separate KV
    cache groups). ``layer_types`` lists ``"sliding_attention"`` / ``"full_attention"`` per layer (the
    Hugging Face field). Sizes are counts or widths (elements); ``sliding_window`` is in tokens.

    ``arch`` selects the Hugging Face architecture: ``"gpt_oss"`` (``GptOssForCausalLM``: alternating
    sliding/full layers starting with sliding, attention sinks, MoE MLP with ``num_local_experts``
    experts, ``num_experts_per_tok`` active; vLLM applies the window on even layers, which
    ``layer_types`` must match) or ``"gemma3_text"`` (``Gemma3ForCausalLM``: ``N`` sliding layers then
    one full layer, repeated; dense MLP).
    """

    arch: str = "gpt_oss"
    num_hidden_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 2048
    sliding_window: int = 64
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 16384
    name: str = "kvbm-backend/tiny-gpt-oss"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.arch not in ("gpt_oss", "gemma3_text"):
            raise ValueError(f"arch: {self.arch!r} is not gpt_oss or gemma3_text")

    @property
    def num_full_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_sliding_layers(self) -> int:
        return self.num_hidden_layers - self.num_full_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token and layer set in bf16 over ALL layers (what a non-hybrid cache holds):
        ``layers * 2 * kv_heads * head_dim * 2``; sliding layers keep at most ``sliding_window`` tokens."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 2

    def hf_config(self, dtype: str = "bfloat16") -> dict:
        """The ``config.json`` dict (Hugging Face ``GptOssConfig`` / ``Gemma3TextConfig`` fields)."""
        common = {
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window, "layer_types": list(self.layer_types),
            "tie_word_embeddings": False, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "initializer_range": 0.02,
        }
        if self.arch == "gpt_oss":
            return {**common, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                    "num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "experts_per_token": self.num_experts_per_tok, "attention_bias": True, "rms_norm_eps": 1e-5,
                    "hidden_act": "silu", "swiglu_limit": 7.0, "rope_theta": 150000.0,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096}}
        return {**common, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "query_pre_attn_scalar": self.head_dim, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
                "final_logit_softcapping": None, "attn_logit_softcapping": None}


# gpt-oss-20b/120b shape in small: alternating sliding (even layers) / full attention, sinks, MoE.
TINY_GPT_OSS = TinyHybrid()
# Gemma 3 shape in small: two sliding layers then one full layer, twice (Gemma 3 uses five then one).
TINY_GEMMA3 = TinyHybrid(arch="gemma3_text", num_hidden_layers=6, intermediate_size=512,
                         layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2,
                         name="kvbm-backend/tiny-gemma3")


def write_hybrid_model_dir(path: str | Path, model: TinyHybrid = TINY_GPT_OSS, dtype: str = "float32",
                           weights_seed: int = 0, std: float = 2.0) -> Path:
    """Write ``config.json``, ``kvbm_model.json`` and random weights (``model.safetensors``) of ``model``
    into ``path``; returns the path. Load with ``load_format="safetensors"`` and token-id prompts.

    The weights come from Hugging Face ``transformers`` (``AutoModelForCausalLM.from_config``, so the
    checkpoint names are the architecture's own), then every projection is redrawn N(0, ``std`` /
    sqrt(fan_in)) (MoE expert tensors ``[experts, in, out]``: fan_in = ``in``), embeddings N(0, 1);
    biases, norms and attention sinks keep their initial values (0, or 1 for Llama-style norms).
    Why: with transformers' default N(0, 0.02) or vLLM's dummy weights the logits are nearly flat, so
    greedy tokens flip on rounding and do not depend on the cached KV (see :func:`write_model_dir`).
    Deterministic for ``weights_seed``. Raises ImportError without ``transformers``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    d = model.hf_config(dtype)
    cfg = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "torch_dtype"})
    torch.manual_seed(weights_seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(weights_seed)
    with torch.no_grad():
        for name, t in m.named_parameters():
            if "embed_tokens" in name:
                t.copy_(torch.randn(t.shape, generator=g))
            elif t.ndim == 2:  # nn.Linear [out, in]
                t.copy_(torch.randn(t.shape, generator=g) * (std / t.shape[1] ** 0.5))
            elif t.ndim == 3:  # experts [E, in, out]
                t.copy_(torch.randn(t.shape, generator=g) * (std / t.shape[1] ** 0.5))
    m.to(getattr(torch, dtype)).save_pretrained(str(p), safe_serialization=True)
    cfg_json = json.loads((p / "config.json").read_text())
    cfg_json["torch_dtype"] = dtype
    (p / "config.json").write_text(json.dumps(cfg_json, indent=2))
    (p / "kvbm_model.json").write_text(json.dumps(asdict(model), indent=2))
    for f in p.glob("model-*.safetensors"):  # one shard expected; engine_run looks for model.safetensors
        raise ValueError(f"{f}: sharded checkpoint; the tiny models fit one file")
    return p
