"""``kvbm-backend model PRESET DIR``: write the small random-weight Llama the demo and the tests serve
(:func:`kvbm_backend.apps.engine_model.write_model_dir`: ``config.json``, ``model.safetensors``, a small
real tokenizer), so trying the connector with ``vllm serve`` takes one command and no download."""
from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

from .cli_checks import fail, int_range, named_paths

# preset name -> (model attribute of engine_model, what it is)
PRESETS = {
    "tiny": ("TINY", "4 layers, hidden 256, 2 KV heads x 64 (the tests' model; vLLM starts in seconds)"),
    "demo": ("DEMO", "8 layers, hidden 1024, 2 KV heads x 64 (what `kvbm-backend demo` serves)"),
}
DTYPES = ("float32", "bfloat16", "float16")
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range (a larger one ended in an OverflowError traceback)


def model(preset: str = typer.Argument(..., help=f"one of: {', '.join(PRESETS)}"),
          directory: str = typer.Argument(..., metavar="DIR", help="where to write it (new or empty directory)"),
          dtype: str = typer.Option("float32", help=f"weights dtype: {', '.join(DTYPES)} (the demo uses float32: "
                                                     "on vLLM's CPU engine bfloat16 prefill over a cached prefix is "
                                                     "not bit-equal to a full prefill)"),
          seed: int = typer.Option(0, help=f"random weights seed (0-{MAX_SEED})")) -> None:
    """Write a small random-weight Llama model directory (config, safetensors weights, tokenizer) that
    vLLM and Dynamo serve like a Hugging Face checkpoint."""
    from . import engine_model
    for name, value in (("PRESET", preset), ("DIR", directory)):  # before 2026-12-03 an empty DIR wrote into the
        if not value.strip():  # working directory (Path("") is "."), an empty PRESET read "expected tiny or demo"
            fail(f"{name}: the argument is empty (got {value!r}): give "
                 + (f"one of {', '.join(PRESETS)}" if name == "PRESET" else "the directory to write the model to"))
    if preset not in PRESETS:
        fail(f"PRESET: expected {' or '.join(PRESETS)} (got {preset!r})")
    if dtype not in DTYPES:
        fail(f"--dtype: expected {', '.join(DTYPES[:-1])} or {DTYPES[-1]} (got {dtype!r})")
    int_range("--seed", seed, 0, MAX_SEED)
    # a relative DIR in a removed working directory names nothing: refused naming DIR (before 2026-12-03 the CLI's
    # catch-all, ``error: model: this process's working directory has been removed ...``, named no argument)
    named_paths(("DIR", directory))
    d = Path(directory)
    if d.exists() and not d.is_dir():
        fail(f"DIR: {directory}: is a file, not a directory")
    if d.is_dir() and any(d.iterdir()):
        fail(f"DIR: {directory}: not empty (give a new or empty directory; nothing is overwritten)")
    if not d.exists() and not os.access(_existing_parent(d), os.W_OK | os.X_OK):
        fail(f"DIR: {directory}: cannot create it ({_existing_parent(d)} is not writable)")
    from safetensors import SafetensorError  # how safetensors reports a failed write (a full disk)
    spec = getattr(engine_model, PRESETS[preset][0])
    try:
        out = _write_whole(d, lambda p: engine_model.write_model_dir(p, spec, dtype=dtype, weights_seed=seed))
    except OSError as e:
        fail(f"DIR: {directory}: {e.strerror or e} (nothing was left there)")
    except SafetensorError as e:
        fail(f"DIR: {directory}: {e} (nothing was left there)")
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    Console(highlight=False).print(
        f"wrote {spec.name} ({PRESETS[preset][1]}; {dtype}, seed {seed}) to {out.absolute()}: {files}\n"
        f"serve it: vllm serve {out.absolute()} --dtype {dtype} --enable-prompt-tokens-details "
        "--kv-transfer-config '...' (docs/operations.md)", soft_wrap=True)


def _write_whole(d: Path, write) -> Path:
    """``write(path)`` into ``d`` so that a failure (a full disk, Ctrl-C) leaves no part of it, so the
    retry is not refused as "not empty". A new ``d``: written into a sibling ``.NAME.partial-*`` directory
    renamed to ``d`` when complete (removed on failure with the parents made for it). An existing (empty)
    ``d``: written in place (it may be a mount point) and emptied again on failure. Returns ``d``."""
    import shutil
    import uuid

    from kvbm_backend.fsmodes import missing_dirs, remove_made_dirs
    if d.is_dir():
        try:
            write(d)
        except BaseException:
            for p in d.iterdir():  # it was empty: everything in it is this run's
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            raise
        return d
    made = missing_dirs(d.absolute().parent)
    tmp = d.absolute().parent / f".{d.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        os.rename(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made_dirs(made)
        raise
    return d


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def register(app: typer.Typer) -> None:
    """Add ``model`` to the ``kvbm-backend`` CLI."""
    app.command("model")(model)
