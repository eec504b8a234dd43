"""``kvbm-backend`` command line. Each command lives in its own module; this file only parses options.

Every error an operator can cause (a bad value, a missing file, a usage mistake) is one line on stderr,
``error: --option: what is wrong (got VALUE)``, and exit code 2; tracebacks are left to real bugs.
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from .cli_checks import check_layout as _check_layout, config_error_text as _config_error_text, error_line
from .cli_checks import DEFAULT_LAYOUT, finite as _finite, int_range, named_paths as _named_paths
from .cli_checks import output_file as _output_file, removed_workdir_text, write_whole

# Upper bounds of the numeric flags (a value past them is an operator mistake that would otherwise end
# in a MemoryError or OverflowError traceback minutes later). Capacities: config.MAX_CAPACITY_GB.
MAX_PAGE_SIZE = 4096  # tokens per block
MAX_TP = 1024
MAX_THREADS = 256  # as g3.io_threads
MAX_INDEX_BLOCKS = 100_000_000  # bench --tier index entries
MAX_SYNTH_BLOCK_IDS = 100_000_000  # plan --synthetic: block ids the whole trace holds
MAX_NODES = 10_000
MAX_WORKERS_PER_NODE = 256
LAYOUT_HELP = (f"model preset in layouts/ (default for every command: {DEFAULT_LAYOUT}; see: kvbm-backend layouts); "
               "NAME:fp8 for an engine with an FP8 KV cache (--kv-cache-dtype fp8)")

console = Console(stderr=True)



@contextmanager
def _one_line_usage_errors():
    try:
        yield
    except typer.TyperException as e:  # typer's (vendored) click usage errors derive from it
        if type(e).__name__ == "NoArgsIsHelpError":  # typer prints the help itself
            raise
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        error_line(e.format_message() + hint)
        raise typer.Exit(2) from None


class _OneLineErrorsGroup(TyperGroup):
    """Click usage errors (missing option, a value of the wrong type, unknown command or option) as one
    ``error:`` line, exit 2, instead of the usage text and a framed panel."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        from kvbm_backend.workdir import guard_native_imports, workdir_removed
        guard_native_imports()  # torch ends the process in a removed working directory
        with _one_line_usage_errors():
            try:
                return super().invoke(ctx)
            except FileNotFoundError as e:  # a path no check named, the working directory removed: no traceback
                if not workdir_removed():
                    raise
                _fail(f"{ctx.invoked_subcommand or 'kvbm-backend'}: {removed_workdir_text(e)}")


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_OneLineErrorsGroup,
                  help="G3/G4 KV-cache block pools for NVIDIA Dynamo KVBM and vLLM.")


def _emit(result: dict, as_json: bool, table_fn=None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    elif table_fn is not None:
        table_fn(result)
    else:
        from .report import print_kv_table
        print_kv_table(result)


def _fail(msg: str) -> NoReturn:
    error_line(msg)
    raise typer.Exit(2)


def _int_at_least(name: str, value: Optional[int], lo: int, hi: Optional[int] = None) -> None:
    int_range(name, value, lo, hi)


def _max_capacity_gb() -> float:
    from kvbm_backend.config import MAX_CAPACITY_GB
    return MAX_CAPACITY_GB


def _writable_dirs(name: str, value: Optional[str], sep: Optional[str] = None) -> None:
    """Each directory named (``sep``-separated) exists as a writable directory or can be created."""
    from kvbm_backend.config import dir_problem
    if value is None:
        return
    for d in ([x.strip() for x in value.split(sep) if x.strip()] if sep else [value]):
        problem = dir_problem(d)
        if problem:
            _fail(f"{name}: {d}: {problem}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(f"{name}: expected {', '.join(choices[:-1])} or {choices[-1]} (got {value!r})")


@app.command()
def bench(
    tier: str = typer.Option(..., help="g3 | g4 | vllm-tiers | index (the in-memory G3 index; --blocks N "
                                       "entries, default 1M and 10M)"),
    layout: Optional[str] = typer.Option(None, help=LAYOUT_HELP + " (g3 / g4 / vllm-tiers)"),
    page_size: Optional[int] = typer.Option(None, help=f"tokens per block (1-{MAX_PAGE_SIZE}; default 16; "
                                                       "g3 / g4 / vllm-tiers)"),
    tp: Optional[int] = typer.Option(None, help=f"TP degree (block size is per rank; 1-{MAX_TP}; default 1; "
                                                "g3 / g4 / vllm-tiers)"),
    blocks: int = typer.Option(256, help="blocks to write then read (their source and read-back buffers must fit "
                                         f"in host memory; index: at most {MAX_INDEX_BLOCKS:,})"),
    path: Optional[str] = typer.Option(None, help="g3 / vllm-tiers: an existing directory (several: "
                                                  "comma-separated)"),
    url: Optional[str] = typer.Option(None, help="g4: s3://BUCKET/PREFIX or file:///shared/path (an existing "
                                                 "directory)"),
    endpoint_url: Optional[str] = typer.Option(None, help="g4: S3 endpoint URL"),
    encrypt: Optional[bool] = typer.Option(None, "--encrypt/--no-encrypt", help="g4: AES-256-GCM per tenant "
                                                                                  "(default: --encrypt)"),
    s3_client: Optional[str] = typer.Option(None, help="g4 on s3://: the S3 client of the block traffic, "
                                                       "obstore | boto3 (default obstore: g4.s3_client's default)"),
    io_size: Optional[int] = typer.Option(None, help="g3 / vllm-tiers: bytes per coalesced I/O per rank of the pool "
                                                     "(a multiple of 4096, at most 1 GiB; default 1 MiB)"),
    engine: Optional[str] = typer.Option(None, help="g3 / vllm-tiers: auto | posix | nixl | kvikio (default auto)"),
    threads: Optional[int] = typer.Option(None, help=f"g3 / g4 / vllm-tiers: the pool's I/Os in flight (1-{MAX_THREADS}"
                                                     "; default 8)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Write then read N blocks through a tier, against the best plain I/O of the same bytes in the same run."""
    from .bench_cli import run_bench
    result = run_bench(tier=tier, layout=layout, page_size=page_size, tp=tp, blocks=blocks, path=path, url=url,
                       endpoint_url=endpoint_url, encrypt=encrypt, s3_client=s3_client, io_size=io_size,
                       engine=engine, threads=threads, as_json=as_json, max_page_size=MAX_PAGE_SIZE, max_tp=MAX_TP,
                       max_threads=MAX_THREADS, max_index_blocks=MAX_INDEX_BLOCKS)
    _emit(result, as_json)


@app.command()
def replay(
    trace: str = typer.Option(..., help="Mooncake-format JSONL trace"),
    layout: str = typer.Option(DEFAULT_LAYOUT, help=LAYOUT_HELP),
    page_size: int = typer.Option(16, help=f"tokens per block (1-{MAX_PAGE_SIZE})"),
    g3_path: Optional[str] = typer.Option(None, help="G3 directory (real mode; not used with --simulate)"),
    g3_capacity_gb: float = typer.Option(..., help="G3 capacity, GB (1e9 bytes; at most 10,000,000: 10 PB)"),
    admit_all: bool = typer.Option(False, "--admit-all", help="store every block (default: second sighting)"),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    simulate: bool = typer.Option(False, "--simulate", help="index only, no bytes (capacity planning)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a request trace through the G3 pool and report prefix hits."""
    from .replay import run_replay
    _named_paths(("--trace", trace))
    _int_at_least("--page-size", page_size, 1, MAX_PAGE_SIZE)
    _finite("--g3-capacity-gb", g3_capacity_gb, gt=0, le=_max_capacity_gb())
    _int_at_least("--limit", limit, 0)
    _check_layout(layout, page_size)
    if not simulate:
        if not g3_path:
            _fail("--g3-path: a directory is needed unless --simulate")
        _writable_dirs("--g3-path", g3_path)
    try:
        result = run_replay(trace=trace, layout=layout, page_size=page_size, g3_path=g3_path,
                            g3_capacity_gb=g3_capacity_gb, admit_all=admit_all, limit=limit, simulate=simulate,
                            progress=not as_json)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        _fail(_config_error_text(e))
    except MemoryError as e:
        _fail(f"replay: out of memory ({e})")
    except OSError as e:
        _fail(f"replay: {e}")
    _print_warnings(result)
    _emit(result if as_json else {k: v for k, v in result.items() if k != "warnings"}, as_json)  # table: on stderr


def _gb_list(name: str, value: str) -> list[float]:
    """Comma-separated GB values (``1000,4000``), each finite, >= 0 and at most ``MAX_CAPACITY_GB``; else one
    error line naming ``name``."""
    out = []
    for part in value.split(","):
        try:
            v = float(part)
        except ValueError:
            _fail(f"{name}: expected comma-separated numbers of GB (got {value!r})")
        _finite(name, v, ge=0, le=_max_capacity_gb())
        out.append(v)
    return out


@app.command()
def plan(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format JSONL trace (or --synthetic)"),
    synthetic: bool = typer.Option(False, "--synthetic", help="generate a seeded multi-turn trace instead"),
    users: int = typer.Option(100, help="synthetic: users"),
    conversations_per_user: int = typer.Option(1, help="synthetic: conversations per user"),
    turns: int = typer.Option(10, help="synthetic: turns (requests) per conversation"),
    system_prompt_tokens: int = typer.Option(2048, help="synthetic: shared system prompt, tokens"),
    turn_tokens: int = typer.Option(1024, help="synthetic: tokens each turn adds to the context"),
    arrival_rate: float = typer.Option(1.0, help="synthetic: new conversations per second (Poisson)"),
    think_s: float = typer.Option(60.0, help="synthetic: mean seconds between turns (exponential)"),
    seed: int = typer.Option(0, help="synthetic: random seed (>= 0)"),
    save_trace: Optional[str] = typer.Option(None, help="synthetic: also write the trace here (JSONL; an existing "
                                                        "directory)"),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    layout: str = typer.Option(DEFAULT_LAYOUT, help=LAYOUT_HELP),
    tp: int = typer.Option(1, help=f"TP degree of a worker (1-{MAX_TP})"),
    page_size: int = typer.Option(16, help=f"tokens per block (1-{MAX_PAGE_SIZE})"),
    nodes: int = typer.Option(1, help=f"nodes in the fleet (1-{MAX_NODES:,})"),
    workers_per_node: int = typer.Option(1, help=f"workers (engine instances) per node (1-{MAX_WORKERS_PER_NODE})"),
    routing: str = typer.Option("prefix", help="prefix | round-robin"),
    router_decay_s: float = typer.Option(60.0, help="prefix routing: time constant (s) of a worker's load"),
    g3_capacity_gb: str = typer.Option("1000", help="G3 GB per node; a sweep: comma-separated (each at most "
                                                    "10,000,000: 10 PB)"),
    g4_capacity_gb: str = typer.Option("0", help="G4 GB, shared; comma-separated; 0 = no G4 (at most 10 PB)"),
    g3_read_gbps: float = typer.Option(6.0, help="G3 read GB/s per node"),
    g3_write_gbps: float = typer.Option(3.0, help="G3 write GB/s per node"),
    g4_read_gbps: float = typer.Option(2.0, help="G4 read GB/s per worker"),
    prefill_tokens_per_s: float = typer.Option(10000.0, help="prefill tokens/s per worker (recompute)"),
    admit_all: bool = typer.Option(False, "--admit-all", help="store every block (default: second sighting)"),
    out: Optional[str] = typer.Option(None, help="write the results JSON here (in an existing directory)"),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="write a PNG/PDF/SVG plot here (in an existing "
                                                                "directory)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Capacity planner: per-tier hit rates, bytes/s, SSD drive writes per day and TTFT saved over a
    sweep of G3/G4 capacities, simulated from a trace with replay's G3 index and admission code."""
    from pathlib import Path

    from .plan import Fleet, SynthSpec, load_timed_trace, run_plan, synth_trace, write_trace
    from .plan_report import plot_plan, print_plan
    if (trace is None) == (not synthetic):
        _fail("--trace: give a trace file or --synthetic (one of them)")
    _named_paths(("--trace", trace))
    if save_trace and not synthetic:
        _fail(f"--save-trace: only with --synthetic (got {save_trace!r})")
    for name, v, lo in (("--users", users, 1), ("--conversations-per-user", conversations_per_user, 1),
                        ("--turns", turns, 1), ("--system-prompt-tokens", system_prompt_tokens, 0),
                        ("--turn-tokens", turn_tokens, 1), ("--limit", limit, 1 if synthetic else 0),
                        ("--seed", seed, 0)):
        _int_at_least(name, v, lo)
    for name, v, hi in (("--tp", tp, MAX_TP), ("--page-size", page_size, MAX_PAGE_SIZE), ("--nodes", nodes, MAX_NODES),
                        ("--workers-per-node", workers_per_node, MAX_WORKERS_PER_NODE)):
        _int_at_least(name, v, 1, hi)
    if synthetic:
        from .replay import TRACE_BLOCK_TOKENS
        sys_tokens = -(-system_prompt_tokens // TRACE_BLOCK_TOKENS) * TRACE_BLOCK_TOKENS
        ids = users * conversations_per_user * (turns * sys_tokens + turn_tokens * turns * (turns + 1) // 2) // TRACE_BLOCK_TOKENS
        if ids > MAX_SYNTH_BLOCK_IDS:
            _fail(f"--users: the synthetic trace (--users x --conversations-per-user x --turns requests of "
                  f"--system-prompt-tokens + turn x --turn-tokens) would hold {ids:,} block ids, more than "
                  f"{MAX_SYNTH_BLOCK_IDS:,}")
    _finite("--arrival-rate", arrival_rate, gt=0)
    _finite("--think-s", think_s, ge=0)
    for name, gbps in (("--g3-read-gbps", g3_read_gbps), ("--g3-write-gbps", g3_write_gbps),
                       ("--g4-read-gbps", g4_read_gbps), ("--prefill-tokens-per-s", prefill_tokens_per_s)):
        _finite(name, gbps, gt=0)
    _finite("--router-decay-s", router_decay_s, gt=0)
    _one_of("--routing", routing, ("prefix", "round-robin"))
    g3s = _gb_list("--g3-capacity-gb", g3_capacity_gb)
    if 0 in g3s:
        _fail(f"--g3-capacity-gb: each capacity must be > 0 (got {g3_capacity_gb!r})")
    g4s = _gb_list("--g4-capacity-gb", g4_capacity_gb)
    _check_layout(layout, page_size, tp)
    for name, f in (("--out", out), ("--plot", plot_out), ("--save-trace", save_trace)):
        if f is not None:  # before the simulation: a bad name must not cost its results
            _output_file(name, f)
    if plot_out and Path(plot_out).suffix.lower() not in (".png", ".pdf", ".svg"):
        _fail(f"--plot: unknown image format; use .png, .pdf or .svg (got {plot_out!r})")
    spec = None
    try:
        if synthetic:
            spec = SynthSpec(users=users, conversations_per_user=conversations_per_user, turns=turns,
                             system_prompt_tokens=system_prompt_tokens, turn_tokens=turn_tokens,
                             arrival_rate=arrival_rate, think_s=think_s, seed=seed)
            reqs = synth_trace(spec)[:limit]
            if save_trace:
                try:
                    write_whole(save_trace, lambda p: write_trace(reqs, p))
                except OSError as e:
                    _fail(f"--save-trace: {save_trace}: {e.strerror or e}")
            source: dict[str, Any] = {"synthetic": spec.__dict__}
        else:
            assert trace is not None  # checked above: a trace file or --synthetic
            reqs = load_timed_trace(trace, limit)
            source = {"trace": trace, "limit": limit}
        fleet = Fleet(nodes=nodes, workers_per_node=workers_per_node, g3_read_gbps=g3_read_gbps,
                      g3_write_gbps=g3_write_gbps, g4_read_gbps=g4_read_gbps,
                      prefill_tokens_per_s=prefill_tokens_per_s, routing=routing,
                      router_decay_s=router_decay_s)
        result = run_plan(reqs, layout, page_size, tp, fleet, g3s, g4s, admit_all=admit_all, source=source,
                          progress=not as_json)
    except ValueError as e:
        _fail(str(e))
    except MemoryError as e:
        _fail(f"plan: out of memory ({e})")
    except OSError as e:
        _fail(f"plan: {e}")
    # A file that cannot be written now (the disk filled up, the directory went away) is an error line
    # naming its option, after the results are printed: the simulation's work is not lost. Each file is
    # written whole (write_whole): a failed write leaves no truncated file, an earlier one as it was.
    write_errors = []
    if out:
        try:
            text = json.dumps(result, indent=2, sort_keys=True) + "\n"
            write_whole(out, lambda p: Path(p).write_text(text))
        except OSError as e:
            write_errors.append(f"--out: {out}: {e.strerror or e}")
    if plot_out:
        try:
            write_whole(plot_out, lambda p: plot_plan(result, p))
        except OSError as e:
            write_errors.append(f"--plot: {plot_out}: {e.strerror or e}")
    _print_warnings(result)
    _emit(result, as_json, table_fn=print_plan)
    for msg in write_errors:
        error_line(msg)
    if write_errors:
        raise typer.Exit(2)


def _print_warnings(result: dict) -> None:
    """``warning:`` lines on stderr for ``result["warnings"]`` (hybrid layouts: what plan / replay leave out)."""
    for w in result.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {w}", soft_wrap=True, highlight=False)


def _g4_problem(g4: str) -> str | None:
    """Why ``--g4`` is not a store the demo can use (``g4.url``'s own check: ``s3://BUCKET/PREFIX``, or a
    ``file:`` URL of an absolute path, ``file:///path`` or ``file:/path``), or None."""
    from kvbm_backend.store_url import url_problem
    why = url_problem(g4)
    if why is None and not g4.startswith(("s3:", "file:")):
        why = "expected s3://BUCKET/PREFIX or file:///path"
    return why


@app.command()
def demo(
    json_path: str = typer.Option("kvbm-demo.json", "--json", help="where to write the results JSON"),
    plot: Optional[str] = typer.Option("kvbm-demo.png", help="where to write the PNG plot ('' for none)"),
    trace: Optional[str] = typer.Option(None, help="trace (default: ../shared/data/mooncake_synthetic_trace.jsonl)"),
    requests: int = typer.Option(24, help="requests taken from the trace"),
    workdir: Optional[str] = typer.Option(None, help="G3/G4 directories go here; must not hold an "
                                           "earlier run's (default: a temp dir)"),
    g4: Optional[str] = typer.Option(None, help="G4 URL; each run writes under its own "
                                                 "sub-prefix kvbm-demo-ID (default: a local directory store)"),
    endpoint_url: Optional[str] = typer.Option(None, help="S3 endpoint for --g4 s3://..."),
    engine: str = typer.Option("dynamo", help="dynamo: Dynamo frontend + dynamo.vllm workers, TTFT at the HTTP "
                                              "client; direct: in-process vLLM engines"),
) -> None:
    """The main job: a real vLLM engine on a real trace, baseline vs kvbm_backend vs restart (served through
    NVIDIA Dynamo by default, or in-process with --engine direct) vs vllm_fs and native_tiers (vLLM's native
    offloading with vLLM's fs tier, or with our G3+G4 tiers; in-process)."""
    from pathlib import Path

    from .demo import default_trace, demo_requests, run_demo
    # checked here (before minutes of engine start-up) so that only real failures trace back
    _int_at_least("--requests", requests, 2)
    _named_paths(("--trace", trace))
    if engine not in ("dynamo", "direct"):
        _fail(f"--engine: expected dynamo or direct (got {engine!r})")
    trace_path = Path(trace) if trace else default_trace()
    if not trace_path.is_file():
        _fail(f"--trace: no file {trace_path}" + ("" if trace else " (the default trace; give --trace FILE)"))
    if g4 is not None and (why := _g4_problem(g4)):
        _fail(f"--g4: {why} (got {g4!r})")
    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        _fail(f"--endpoint-url: expected http://HOST:PORT or https://HOST (got {endpoint_url!r})")
    if endpoint_url is not None and not (g4 or "").startswith("s3://"):  # else it would be ignored
        _fail("--endpoint-url needs --g4 s3://...")
    _writable_dirs("--workdir", workdir)
    for name, f in (("--json", json_path), ("--plot", plot)):
        if f:  # written after minutes of runs: checked now
            _output_file(name, f)
    try:  # a malformed trace, one with too few requests, a used --workdir: one line, before any engine starts
        demo_requests(trace=trace, requests=requests, workdir=workdir, g4=g4, engine=engine)
    except ValueError as e:
        _fail(str(e))
    res = run_demo(json_path=json_path, plot=plot or None, trace=trace, requests=requests, workdir=workdir, g4=g4,
                   endpoint_url=endpoint_url, engine=engine)
    if not res["ok"]:  # some config's greedy outputs differ from its baseline: different KV
        raise typer.Exit(1)


@app.command()
def doctor(
    path: list[str] = typer.Option([], help="G3/G4 paths to probe (O_DIRECT, free space)"),
    config: Optional[str] = typer.Option(None, help="config file; its paths are probed too"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """GPU, driver, cuFile/GDS, kvikio, NIXL plugins, O_DIRECT per path, file modes, the engine chosen,
    and G4 (URL, endpoint, credentials, bucket, a create-exclusive probe object, keyring and KEK). Ends
    with one verdict line, OK or N problems; exit code 1 when there are problems."""
    from kvbm_backend.config import ConfigError
    from .doctor import print_doctor, run_doctor
    _named_paths(("--config", None if (config or "{").lstrip().startswith("{") else config))  # not inline JSON
    try:
        result = run_doctor(paths=path, config=config)
    except ConfigError as e:
        _fail(str(e))
    _emit(result, as_json, table_fn=print_doctor)
    if result["problems"]:
        raise typer.Exit(1)


@app.command()
def layouts(page_size: int = typer.Option(16, help=f"tokens per block (1-{MAX_PAGE_SIZE})"),
            tp: int = typer.Option(1, help=f"TP degree (1-{MAX_TP})"),
            as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List model presets with bytes per token and per block (a preset whose KV heads --tp does not
    divide gets an error entry instead). Hybrid presets (gpt-oss, Gemma) also state the full-attention
    layers' bytes per token (every token) and the sliding-window layers' (at most sliding_window
    tokens per sequence) separately, per rank at --tp, with the KV of an 8K-token sequence."""
    from kvbm_backend.model.presets import list_presets, load_preset
    _int_at_least("--page-size", page_size, 1, MAX_PAGE_SIZE)
    _int_at_least("--tp", tp, 1, MAX_TP)
    rows: dict[str, dict[str, Any]] = {}
    try:
        names = list_presets()
    except ValueError as e:  # no presets directory: say where it was looked for, not an empty list
        _fail(str(e).removeprefix("layout: "))
    for n in names:
        try:  # a malformed preset file is listed with its error (the file and field), the rest still are
            p = load_preset(n)
        except ValueError as e:
            rows[n] = {"bytes_per_token_tp1": None, "error": str(e)}
            continue
        try:
            lay = p.layout(page_size=page_size, tp=tp)
        except ValueError as e:
            rows[n] = {"bytes_per_token_tp1": p.bytes_per_token, "error": str(e).removeprefix("tp: ")}
            continue
        rows[n] = {"bytes_per_token_tp1": p.bytes_per_token, "bytes_per_block": lay.bytes_per_block,
                   "num_layers": lay.num_layers, "outer_dim": lay.outer_dim, "inner_dim": lay.inner_dim,
                   "dtype": lay.dtype}
        if p.hybrid:
            assert p.sliding_window is not None  # load_preset: a hybrid preset names its window
            g = p.group_layouts(page_size=page_size, tp=tp)
            rows[n].update({"full_layers": p.full_layers, "sliding_layers": p.sliding_layers,
                            "sliding_window": p.sliding_window,
                            "full_bytes_per_token": g["full"].bytes_per_token,
                            "sliding_bytes_per_token": g["sliding"].bytes_per_token,
                            "sliding_bytes_max": g["sliding"].bytes_per_token * p.sliding_window,
                            "kv_bytes_8k_tokens": p.kv_bytes(8192, tp=tp)})
    if as_json:
        _emit(rows, as_json)
        return
    from .report import print_layouts
    print_layouts(rows, page_size=page_size, tp=tp, default=DEFAULT_LAYOUT)


@app.command()
def plot(files: list[str] = typer.Argument(..., help="benchmark or demo JSON files"),
         out: str = typer.Option("kvbm-plot.png", help="PNG to write")) -> None:
    """Plot benchmark/demo/plan JSON results (throughput vs baseline, TTFT per config, hit rate vs capacity)."""
    from pathlib import Path

    from .report import plot_results
    _named_paths(*(("FILES", f) for f in files))
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
        except OSError as e:
            _fail(f"FILES: {f}: {e.strerror or e}")
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            _fail(f"FILES: {f}: not JSON ({e})")
        if not isinstance(d, dict):
            _fail(f"FILES: {f}: expected a JSON object (bench or demo results), got {type(d).__name__}")
    _output_file("--out", out)
    try:
        import matplotlib.figure
        supported = matplotlib.figure.Figure().canvas.get_supported_filetypes()
    except ImportError as e:
        _fail(f"plot: matplotlib is needed ({e})")
    if Path(out).suffix.lower().lstrip(".") not in supported:
        _fail(f"--out: unknown image format {Path(out).suffix or '(none)'!r}; use .png, .pdf or .svg (got {out!r})")
    try:
        write_whole(out, lambda p: plot_results(files, p))
    except ValueError as e:  # a JSON object that is neither bench nor demo results
        _fail(f"FILES: {e}")
    except OSError as e:  # the write failed (a full disk): no part of it was left (write_whole)
        _fail(f"--out: {out}: {e.strerror or e}")
    console.print(f"wrote {out}")


def _register_g4_commands() -> None:
    # G4 commands (gc, keys): g4_cli.py.
    from .g4_cli import register
    register(app)


_register_g4_commands()
from .model_cli import register as _register_model  # noqa: E402 - `kvbm-backend model tiny DIR`
_register_model(app)
# `kvbm-backend config effective`: the launch scripts' effective settings (effective.py).
from .effective import typer_app as _config_app  # noqa: E402
app.add_typer(_config_app, name="config")

if __name__ == "__main__":
    app()
