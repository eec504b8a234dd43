"""Benchmarks: each tier's module exposes ``run(opts: BenchOptions) -> dict`` (JSON-able result)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator


@contextmanager
def rounds_progress(enabled: bool, label: str, total: int) -> Iterator[Callable[[], None]]:
    """A transient rich progress bar of ``total`` steps (nothing when not ``enabled``); yields the
    function that advances it by one step."""
    if not enabled:
        yield lambda: None
        return
    from rich.progress import Progress
    progress = Progress(transient=True)
    task = progress.add_task(label, total=total)
    progress.start()
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.stop()


@dataclass
class BenchOptions:
    tier: str  # g3 | g4 | vllm-tiers | index
    layout: str = "llama-3.1-8b"
    page_size: int = 16
    tp: int = 1
    blocks: int = 256
    path: str | None = None  # g3 / vllm-tiers directory
    url: str | None = None  # g4: s3://BUCKET/PREFIX or file:///path
    endpoint_url: str | None = None
    encrypt: bool = True
    io_size_bytes: int = 1 << 20
    engine: str = "auto"
    threads: int = 8
    progress: bool = True
    s3_client: str = "obstore"  # g4 on s3://: g4.s3_client of the pool and the baseline ("boto3" | "obstore")
