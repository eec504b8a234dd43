"""``kvbm-backend`` command line. Each command lives in its own module; this file only parses options."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="G3/G4 KV-cache block pools for NVIDIA Dynamo KVBM and vLLM.")
console = Console(stderr=True)


def _emit(result: dict, as_json: bool, table_fn=None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    elif table_fn is not None:
        table_fn(result)
    else:
        from .report import print_kv_table
        print_kv_table(result)


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


@app.command()
def bench(
    tier: str = typer.Option(..., help="g3 | g4 | vllm-tiers"),
    layout: str = typer.Option("llama-3.1-8b", help="model preset in layouts/ (see `layouts`)"),
    page_size: int = typer.Option(16, help="tokens per block"),
    tp: int = typer.Option(1, help="TP degree (block size is per rank)"),
    blocks: int = typer.Option(256, help="blocks to write then read"),
    path: Optional[str] = typer.Option(None, help="g3 / vllm-tiers: directory (several: comma-separated)"),
    url: Optional[str] = typer.Option(None, help="g4: s3://BUCKET/PREFIX or file:///shared/path"),
    endpoint_url: Optional[str] = typer.Option(None, help="g4: S3 endpoint URL"),
    encrypt: bool = typer.Option(True, "--encrypt/--no-encrypt", help="g4: AES-256-GCM per tenant"),
    io_size: int = typer.Option(1 << 20, help="bytes per coalesced I/O per rank"),
    engine: str = typer.Option("auto", help="auto | posix | nixl | kvikio"),
    threads: int = typer.Option(8, help="I/Os in flight"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Write then read N blocks through a tier, with an in-run baseline of the same bytes."""
    from .bench import BenchOptions
    from .config import ConfigError
    opts = BenchOptions(tier=tier, layout=layout, page_size=page_size, tp=tp, blocks=blocks, path=path, url=url,
                        endpoint_url=endpoint_url, encrypt=encrypt, io_size_bytes=io_size, engine=engine,
                        threads=threads, progress=not as_json)
    try:
        if tier == "g3":
            from .bench.g3 import run
        elif tier == "g4":
            from .bench.g4 import run
        elif tier == "vllm-tiers":
            from .bench.vllm_tiers import run
        else:
            _fail(f"--tier: expected g3, g4 or vllm-tiers, got {tier!r}")
        result = run(opts)
    except (ValueError, ConfigError) as e:
        _fail(str(e))
    _emit(result, as_json)


@app.command()
def replay(
    trace: str = typer.Option(..., help="Mooncake-format JSONL trace"),
    layout: str = typer.Option("tiny", help="model preset"),
    page_size: int = typer.Option(16, help="tokens per block"),
    g3_path: str = typer.Option(..., help="G3 directory"),
    g3_capacity_gb: float = typer.Option(..., help="G3 capacity, GB (1e9 bytes)"),
    admit_all: bool = typer.Option(False, "--admit-all", help="store every block (default: second sighting)"),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    simulate: bool = typer.Option(False, "--simulate", help="index only, no bytes (capacity planning)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a request trace through the G3 pool and report prefix hits."""
    from .replay import run_replay
    try:
        result = run_replay(trace=trace, layout=layout, page_size=page_size, g3_path=g3_path,
                            g3_capacity_gb=g3_capacity_gb, admit_all=admit_all, limit=limit, simulate=simulate,
                            progress=not as_json)
    except ValueError as e:
        _fail(str(e))
    _emit(result, as_json)


@app.command()
def demo(
    json_path: str = typer.Option("kvbm-demo.json", "--json", help="where to write the results JSON"),
    plot: Optional[str] = typer.Option("kvbm-demo.png", help="where to write the PNG plot ('' for none)"),
    trace: Optional[str] = typer.Option(None, help="trace (default: ../shared/data/mooncake_synthetic_trace.jsonl)"),
    requests: int = typer.Option(24, help="requests taken from the trace"),
    workdir: Optional[str] = typer.Option(None, help="G3/G4 directories go here (default: a temp dir)"),
    g4: Optional[str] = typer.Option(None, help="G4 URL (default: a local directory store)"),
    endpoint_url: Optional[str] = typer.Option(None, help="S3 endpoint for --g4 s3://..."),
) -> None:
    """The main job: a real vLLM engine on a real trace, baseline vs kvbm_backend vs restart."""
    from .demo import run_demo
    run_demo(json_path=json_path, plot=plot or None, trace=trace, requests=requests, workdir=workdir, g4=g4,
             endpoint_url=endpoint_url)


@app.command()
def doctor(
    path: list[str] = typer.Option([], help="G3/G4 paths to probe (O_DIRECT, free space)"),
    config: Optional[str] = typer.Option(None, help="config file; its paths are probed too"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """GPU, driver, cuFile/GDS, kvikio, NIXL plugins, O_DIRECT per path, and the engine chosen."""
    from .config import ConfigError
    from .doctor import print_doctor, run_doctor
    try:
        result = run_doctor(paths=path, config=config)
    except ConfigError as e:
        _fail(str(e))
    _emit(result, as_json, table_fn=print_doctor)


@app.command()
def layouts(page_size: int = typer.Option(16), tp: int = typer.Option(1), as_json: bool = typer.Option(False, "--json")) -> None:
    """List model presets with bytes per token and per block."""
    from .model.presets import list_presets, load_preset
    rows = {}
    for n in list_presets():
        p = load_preset(n)
        lay = p.layout(page_size=page_size, tp=tp)
        rows[n] = {"bytes_per_token_tp1": p.bytes_per_token, "bytes_per_block": lay.bytes_per_block,
                   "num_layers": lay.num_layers, "outer_dim": lay.outer_dim, "inner_dim": lay.inner_dim,
                   "dtype": lay.dtype}
    _emit(rows, as_json)


@app.command()
def plot(files: list[str] = typer.Argument(..., help="benchmark or demo JSON files"),
         out: str = typer.Option("kvbm-plot.png", help="PNG to write")) -> None:
    """Plot benchmark/demo JSON results (throughput vs baseline, TTFT per config)."""
    from .report import plot_results
    plot_results(files, out)
    console.print(f"wrote {out}")


def _register_g4_commands() -> None:
    # G4 commands (gc, keys) live with the G4 code.
    from .g4.cli import register
    register(app)


_register_g4_commands()

if __name__ == "__main__":
    app()
