"""Benchmarks: each tier's module exposes ``run(opts: BenchOptions) -> dict`` (JSON-able result)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BenchOptions:
    tier: str  # g3 | g4 | vllm-tiers
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
