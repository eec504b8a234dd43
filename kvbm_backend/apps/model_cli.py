"""``kvbm-backend model PRESET DIR``: write the small random-weight Llama the demo and the tests serve
(:func:`kvbm_backend.apps.engine_model.write_model_dir`: ``config.json``, ``model.safetensors``, a small
real tokenizer), so trying the connector with ``vllm serve`` takes one command and no download."""
from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

from .cli_checks import fail

# preset name -> (model attribute of engine_model, what it is)
PRESETS = {
    "tiny": ("TINY", "4 layers, hidden 256, 2 KV heads x 64 (the tests' model; vLLM starts in seconds)"),
    "demo": ("DEMO", "8 layers, hidden 1024, 2 KV heads x 64 (what `kvbm-backend demo` serves)"),
}
DTYPES = ("float32", "bfloat16", "float16")


def model(preset: str = typer.Argument(..., help=f"one of: {', '.join(PRESETS)}"),
          directory: str = typer.Argument(..., metavar="DIR", help="where to write it (new or empty directory)"),
          dtype: str = typer.Option("float32", help=f"weights dtype: {', '.join(DTYPES)} (the demo uses float32: "
                                                     "on vLLM's CPU engine bfloat16 prefill over a cached prefix is "
                                                     "not bit-equal to a full prefill)"),
          seed: int = typer.Option(0, help="random weights seed (>= 0)")) -> None:
    """Write a small random-weight Llama model directory (config, safetensors weights, tokenizer) that
    vLLM and Dynamo serve like a Hugging Face checkpoint."""
    from . import engine_model
    if preset not in PRESETS:
        fail(f"PRESET: expected {' or '.join(PRESETS)} (got {preset!r})")
    if dtype not in DTYPES:
        fail(f"--dtype: expected {', '.join(DTYPES[:-1])} or {DTYPES[-1]} (got {dtype!r})")
    if seed < 0:
        fail(f"--seed: must be >= 0 (got {seed})")
    d = Path(directory)
    if d.exists() and not d.is_dir():
        fail(f"DIR: {directory}: is a file, not a directory")
    if d.is_dir() and any(d.iterdir()):
        fail(f"DIR: {directory}: not empty (give a new or empty directory; nothing is overwritten)")
    if not d.exists() and not os.access(_existing_parent(d), os.W_OK | os.X_OK):
        fail(f"DIR: {directory}: cannot create it ({_existing_parent(d)} is not writable)")
    spec = getattr(engine_model, PRESETS[preset][0])
    try:
        out = engine_model.write_model_dir(d, spec, dtype=dtype, weights_seed=seed)
    except OSError as e:
        fail(f"DIR: {directory}: {e.strerror or e}")
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    Console(highlight=False).print(
        f"wrote {spec.name} ({PRESETS[preset][1]}; {dtype}, seed {seed}) to {out.absolute()}: {files}\n"
        f"serve it: vllm serve {out.absolute()} --dtype {dtype} --enable-prompt-tokens-details "
        "--kv-transfer-config '...' (docs/operations.md)", soft_wrap=True)


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def register(app: typer.Typer) -> None:
    """Add ``model`` to the ``kvbm-backend`` CLI."""
    app.command("model")(model)
