"""Hybrid models (vLLM's hybrid KV cache manager: sliding-window and full-attention KV cache groups) end
to end on the real vLLM CPU engine, each engine in its own process.

Models (random weights, float32: see ``tests/e2e/test_connector_e2e.py`` for why float32):

* gpt-oss-like (:data:`~kvbm_backend.apps.engine_model.TINY_GPT_OSS`, ``GptOssForCausalLM``: alternating
  sliding-window (64 tokens) / full attention, attention sinks, MoE MLP). vLLM's CPU engine runs it
  (sinks are native in its CPU attention kernel; the unquantized MoE runs on CPU).
* Gemma-3-like (:data:`~kvbm_backend.apps.engine_model.TINY_GEMMA3`, ``Gemma3ForCausalLM``: two sliding
  layers then one full layer, twice).

What is checked (five engine processes in all, to keep CI time down): a restarted engine (empty G3) loads
the gpt-oss-like model's blocks from G4, and a fresh engine process loads the Gemma-like model's blocks
from G3, with greedy outputs identical to the engine that computed them (a corrupt block in one group
fails its request's load, which vLLM recomputes: identical too); every group has its own
namespace, which records the group structure; sliding-window groups store and load only the window the
engine reads (exact block counts); an engine with other weights that loads the gpt-oss-like KV from G3
answers differently from its own recompute (the equal outputs are not luck).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.vllm_runner import connector_extra, prompts, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY_GEMMA3, TINY_GPT_OSS, write_hybrid_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(600)]

_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

BS = 32            # engine block size (tokens)
NUM_BLOCKS = 96    # engine KV blocks, shared by every group (hybrid manager)
MAX_LEN = 512


def _run(tmp: Path, name: str, model_dir: Path, ps, extra: dict, **kw) -> dict:
    kw.setdefault("warmup", False)
    return run_engine(tmp, name, model_dir, ps, {"extra": extra}, dtype="float32", num_gpu_blocks=NUM_BLOCKS,
                      max_model_len=MAX_LEN, **kw)


def _prompts(vocab: int) -> list[list[int]]:
    # independent prompts: every hit is the connector's, never the engine's own prefix cache
    return [prompts(1, n, seed=s, vocab=vocab)[0] for n, s in ((400, 21), (300, 22), (360, 23))]


def _expected(ps, window_blocks: list[int | None]) -> tuple[list[int], int]:
    """Per prompt the blocks a hit covers ((len - 1) // BS: vLLM computes at least the last token), and
    the blocks moved for all prompts: every block of each full group, the window of each sliding one."""
    hits = [(len(p) - 1) // BS for p in ps]
    moved = sum(n if w is None else min(w, n) for n in hits for w in window_blocks)
    return hits, moved


def _groups(res: dict) -> list[dict]:
    return res["connector_info"]["kv_cache_groups"]


def _write(tmp_path: Path, model, g4: str) -> tuple[Path, list, dict, list, list[int], int]:
    """Write the model dir, run the writer engine (G3 + G4) and check what it stored."""
    model_dir = write_hybrid_model_dir(tmp_path / "model", model)
    ps = _prompts(model.vocab_size)
    a = _run(tmp_path, "writer", model_dir, ps, connector_extra(tmp_path / "w", g4))
    groups = _groups(a)
    kinds = sorted(g["kind"] for g in groups)
    assert "sliding" in kinds and "full" in kinds, groups
    windows = [g["window_blocks"] for g in groups]
    for g in groups:
        if g["kind"] == "sliding":
            assert g["sliding_window"] == model.sliding_window
            assert g["window_blocks"] == -(-(model.sliding_window - 1) // BS)
    assert len({g["namespace"] for g in groups}) == len(groups), groups  # one namespace per group
    hits, moved = _expected(ps, windows)
    # saved: each prompt's full blocks in every full group, only the final window in every sliding one
    sa = a["connector_stats"]
    saved_full = sum(len(p) // BS for p in ps)
    want_saved = sum(saved_full if w is None else sum(min(w, len(p) // BS) for p in ps) for w in windows)
    assert sa.get("g3_put_written_blocks") == want_saved, sa
    if g4:
        assert sa.get("g4_put_written_blocks") == want_saved, sa
    # the G3 directory of each group records the whole structure and its own group
    for gi in range(len(groups)):
        ns = json.loads((tmp_path / "w" / "g3" / f"group{gi}" / "namespace.json").read_text())
        assert ns["group"] == gi and [x["kind"] for x in ns["groups"]] == [x["kind"] for x in groups], ns
        assert ns["layout"]["dtype"] == "float32"
    return model_dir, ps, a, groups, hits, moved


def test_gpt_oss_like_restart_from_g4_and_foreign_weights_from_g3(tmp_path):
    g4 = f"file://{tmp_path / 'g4'}"
    model_dir, ps, a, groups, hits, moved = _write(tmp_path, TINY_GPT_OSS, g4)

    # a restarted worker with an EMPTY G3 reads G4: outputs identical to the computing engine
    c = _run(tmp_path, "restart", model_dir, ps, connector_extra(tmp_path / "fresh", g4))
    sc = c["connector_stats"]
    assert c["outputs"] == a["outputs"]
    assert c["cached_tokens"] == [n * BS for n in hits], c["cached_tokens"]
    assert sc.get("load_g4_blocks_ok") == moved and sc.get("load_blocks_failed", 0) == 0, sc

    # Negative control, in a fresh process on the writer's G3: other weights, same namespace. Loading
    # model A's KV for prompt 0 (from G3: its full blocks and only its window in the sliding group)
    # answers differently from this model's own recompute of the prompt (another tenant: no hit).
    model_b = write_hybrid_model_dir(tmp_path / "model-b", TINY_GPT_OSS, weights_seed=1)
    extra = connector_extra(tmp_path / "w", g4)
    extra["save"] = False
    d = _run(tmp_path, "foreign", model_b, [ps[0], ps[0]], extra, cache_salts=[None, "other-tenant"])
    sd = d["connector_stats"]
    assert d["cached_tokens"] == [hits[0] * BS, 0], d["cached_tokens"]
    assert sd.get("load_g3_blocks_ok") == _expected(ps[:1], [g["window_blocks"] for g in groups])[1], sd
    assert d["outputs"][0] != d["outputs"][1], d["outputs"]


def _corrupt_block(g3_dir: Path, block_bytes: int, seq_hash: int) -> int:
    """Flip a payload byte of the G3 slot holding ``seq_hash`` (frame header offset 48, u64 LE) in every
    slab file of ``g3_dir``; returns slots touched."""
    import struct

    from kvbm_backend.model import frame
    slot, n = frame.slot_bytes(block_bytes), 0
    for f in sorted(g3_dir.glob("*.slab")):
        with open(f, "r+b") as fh:
            for s in range(f.stat().st_size // slot):
                fh.seek(s * slot + 48)
                if struct.unpack("<Q", fh.read(8))[0] != seq_hash:
                    continue
                off = s * slot + frame.HEADER_BYTES + 100
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ 0x5A]))
                n += 1
    return n


def test_gemma3_like_fresh_engine_loads_from_g3_and_a_corrupt_window_block_is_recomputed(tmp_path):
    """A fresh engine loads every prompt's prefix from G3 with identical outputs, except prompt 1, whose
    last sliding-window block was corrupted on disk: its load fails in that group, vLLM is told the
    request failed (several KV cache groups: failed_recving) and recomputes it; the connector does not
    offer the doomed load again (no livelock) and the output is still identical."""
    from kvbm_backend.model.hashing import sequence_hashes
    model_dir, ps, a, groups, hits, moved = _write(tmp_path, TINY_GEMMA3, "")
    gi = next(i for i, g in enumerate(groups) if g["kind"] == "sliding")
    victim = sequence_hashes(ps[1], BS)[hits[1] - 1]
    assert _corrupt_block(tmp_path / "w" / "g3" / f"group{gi}", groups[gi]["bytes_per_block"], victim) == 1
    b = _run(tmp_path, "reader", model_dir, ps, connector_extra(tmp_path / "w"))
    sb = b["connector_stats"]
    assert b["outputs"] == a["outputs"]
    assert [b["cached_tokens"][i] for i in (0, 2)] == [hits[0] * BS, hits[2] * BS], b["cached_tokens"]
    assert b["cached_tokens"][1] < hits[1] * BS, b["cached_tokens"]
    assert sb.get("load_failed_requests") == 1 and sb.get("load_blocks_failed", 0) >= 1, sb
    ok_0_2 = _expected([ps[0], ps[2]], [g["window_blocks"] for g in groups])[1]
    assert ok_0_2 <= sb.get("load_g3_blocks_ok", 0) < moved, sb
