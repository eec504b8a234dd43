"""``kvbm-backend bench``: the checks of its options and the run (``cli.py`` only parses them).

Every option a tier does not use is refused for it (one line naming the option, exit 2), and every error the
run can meet (a bad value, no room, an engine that cannot run here, an unreachable store) is one line too.
SIGTERM cleans up as Ctrl-C does (the bench's temp files and directories are removed)."""
from __future__ import annotations

import os
from typing import Optional

from .cli_checks import DEFAULT_LAYOUT, check_layout, config_error_text, existing_dir, fail, file_url_path, int_range

IO_SIZE_DEFAULT = 1 << 20
ENGINE_DEFAULT = "auto"
THREADS_DEFAULT = 8
TIERS = ("g3", "g4", "vllm-tiers", "index")
_G4_ONLY = ("--url", "--endpoint-url", "--encrypt/--no-encrypt", "--s3-client")
# options a tier does not use, with why: refused when given
UNUSED = {
    "g3": dict.fromkeys(_G4_ONLY, "it writes G3 slab files in --path"),
    "vllm-tiers": dict.fromkeys(_G4_ONLY, "its tiers write G3 slab files in --path"),
    "g4": {"--path": "it writes objects in --url",
           **dict.fromkeys(("--io-size", "--engine"), "it moves every object whole with the store's own I/O; "
                                                       "io_size_bytes in its JSON is the object size")},
    "index": dict.fromkeys(("--path", "--layout", "--page-size", "--tp", "--io-size", "--engine", "--threads",
                            *_G4_ONLY), "it builds the in-memory index of --blocks entries of a fixed tiny layout "
                                        "and does no I/O"),
}
PAGE_SIZE_DEFAULT = 16
TP_DEFAULT = 1
S3_CLIENT_DEFAULT = "obstore"


def _check_engine(engine: str, threads: int) -> None:
    """An engine named explicitly must open here (kvikio without an NVIDIA driver, NIXL missing: one line)."""
    if engine == "auto":
        return
    from kvbm_backend.io import make_engine
    try:
        make_engine(engine, threads=threads).close()
    except (RuntimeError, ImportError, OSError) as e:
        fail(f"--engine {engine}: cannot run here ({e})")


def run_bench(*, tier: str, layout: Optional[str], page_size: Optional[int], tp: Optional[int], blocks: int,
              path: Optional[str], url: Optional[str], endpoint_url: Optional[str], encrypt: Optional[bool],
              s3_client: Optional[str], io_size: Optional[int], engine: Optional[str], threads: Optional[int],
              as_json: bool, max_page_size: int, max_tp: int, max_threads: int, max_index_blocks: int) -> dict:
    """Check the options (:func:`fail` on the first bad one), run the tier's benchmark and return its result.
    An option left out is None (its default is applied here); one given that the tier does not use is refused
    (:data:`UNUSED`)."""
    from kvbm_backend.config import ConfigError, io_size_problem

    from .bench import BenchOptions
    from .signals import sigterm_interrupts
    if tier not in TIERS:
        fail(f"--tier: expected {', '.join(TIERS[:-1])} or {TIERS[-1]} (got {tier!r})")
    given = {"--io-size": io_size, "--engine": engine, "--threads": threads, "--path": path, "--url": url,
             "--endpoint-url": endpoint_url, "--encrypt/--no-encrypt": encrypt, "--s3-client": s3_client,
             "--layout": layout, "--page-size": page_size, "--tp": tp}
    for name, why in UNUSED[tier].items():
        if given[name] is not None:
            fail(f"{name}: not used by bench --tier {tier} ({why}); leave it out")
    io_size = IO_SIZE_DEFAULT if io_size is None else io_size
    engine = ENGINE_DEFAULT if engine is None else engine
    threads = THREADS_DEFAULT if threads is None else threads
    layout = DEFAULT_LAYOUT if layout is None else layout
    page_size = PAGE_SIZE_DEFAULT if page_size is None else page_size
    tp = TP_DEFAULT if tp is None else tp
    encrypt = True if encrypt is None else encrypt
    s3_client = S3_CLIENT_DEFAULT if s3_client is None else s3_client
    int_range("--page-size", page_size, 1, max_page_size)
    int_range("--tp", tp, 1, max_tp)
    int_range("--blocks", blocks, 1, max_index_blocks if tier == "index" else None)
    int_range("--threads", threads, 1, max_threads)
    if io_size_problem(io_size):
        fail(f"--io-size: {io_size_problem(io_size)} (got {io_size})")
    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        fail(f"--endpoint-url: expected http://HOST:PORT or https://HOST (got {endpoint_url!r})")
    if engine not in ("auto", "posix", "nixl", "kvikio"):
        fail(f"--engine: expected auto, posix, nixl or kvikio (got {engine!r})")
    if s3_client not in ("boto3", "obstore"):
        fail(f"--s3-client: expected boto3 or obstore (got {s3_client!r})")
    check_layout(layout, page_size, tp)
    if tier != "index":
        from kvbm_backend.model.presets import load_preset
        need = 2 * blocks * load_preset(layout).layout(page_size=page_size, tp=tp).bytes_per_block
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > mem:
            fail(f"--blocks: {blocks:,} blocks need {need / 1e9:,.1f} GB of host buffers (written and read "
                 f"back), more than this host's {mem / 1e9:,.1f} GB of memory (got {blocks})")
    why = "bench writes its files inside an existing directory and creates none"
    if tier != "g4":
        for d in ([x.strip() for x in path.split(",") if x.strip()] if path else []):
            existing_dir("--path", d, why)
    elif url and (url_dir := file_url_path(url)) is not None:
        existing_dir("--url", url_dir, why)
    if tier in ("g3", "vllm-tiers"):
        _check_engine(engine, threads)
    opts = BenchOptions(tier=tier, layout=layout, page_size=page_size, tp=tp, blocks=blocks, path=path, url=url,
                        endpoint_url=endpoint_url, encrypt=encrypt, io_size_bytes=io_size, engine=engine,
                        threads=threads, progress=not as_json, s3_client=s3_client)
    try:
        with sigterm_interrupts():  # SIGTERM runs the same cleanup as Ctrl-C
            if tier == "g3":
                from .bench.g3 import run
            elif tier == "g4":
                from .bench.g4 import run
            elif tier == "vllm-tiers":
                from .bench.vllm_tiers import run
            else:
                from .bench.index import run
            return run(opts)
    except (ValueError, ConfigError) as e:  # pydantic's ValidationError is a ValueError
        fail(config_error_text(e))
    except MemoryError as e:
        fail(f"--blocks: bench --tier {tier}: out of memory for {blocks} blocks ({e})")
    except (OSError, RuntimeError) as e:
        fail(f"bench --tier {tier}: {e}")
