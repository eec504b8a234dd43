"""Model KV-geometry presets from ``layouts/*.toml`` (one file per model).

A preset gives layers, KV heads, head dim, dtype and MLA-or-not; :meth:`ModelPreset.layout` derives
the per-rank :class:`KvLayout` for a page size and TP degree.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .layout import KvLayout, dtype_bytes


def layouts_dir() -> Path:
    """Directory holding the presets: ``$KVBM_BACKEND_LAYOUTS`` or the repo's ``layouts/``."""
    env = os.environ.get("KVBM_BACKEND_LAYOUTS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "layouts"


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    mla: bool
    bytes_per_token: int  # published full-model figure (TP 1), checked against the geometry

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads held by one TP rank. MLA is replicated; with ``tp > num_kv_heads`` heads are
        replicated (vLLM does the same), so each rank holds one."""
        if tp <= 0:
            raise ValueError(f"tp: must be >= 1, got {tp}")
        if self.mla:
            return self.num_kv_heads
        if tp > self.num_kv_heads:
            return 1
        if self.num_kv_heads % tp:
            raise ValueError(f"tp: {self.name} has {self.num_kv_heads} KV heads, not divisible by tp={tp}")
        return self.num_kv_heads // tp

    def layout(self, page_size: int = 16, tp: int = 1, dtype: str | None = None) -> KvLayout:
        """Per-rank KvLayout for ``page_size`` tokens per block at TP degree ``tp``."""
        return KvLayout(num_layers=self.num_layers, outer_dim=1 if self.mla else 2, page_size=page_size,
                        inner_dim=self.kv_heads_per_rank(tp) * self.head_dim, dtype=dtype or self.dtype)

    def computed_bytes_per_token(self) -> int:
        return self.num_layers * (1 if self.mla else 2) * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)


def list_presets() -> list[str]:
    return sorted(p.stem for p in layouts_dir().glob("*.toml"))


def load_preset(name: str) -> ModelPreset:
    """Load ``layouts/NAME.toml``. Raises ValueError naming the known presets if absent, or the field
    that is wrong if the file is malformed."""
    path = Path(name) if name.endswith(".toml") else layouts_dir() / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"layout: no preset {name!r}; known: {', '.join(list_presets())}")
    with open(path, "rb") as f:
        d = tomllib.load(f)
    try:
        p = ModelPreset(name=str(d["name"]), hf_id=str(d.get("hf_id", "")), num_layers=int(d["num_layers"]),
                        num_kv_heads=int(d["num_kv_heads"]), head_dim=int(d["head_dim"]),
                        dtype=str(d.get("dtype", "bfloat16")), mla=bool(d.get("mla", False)),
                        bytes_per_token=int(d["bytes_per_token"]))
    except KeyError as e:
        raise ValueError(f"layout {path}: missing field {e.args[0]!r}") from None
    if p.computed_bytes_per_token() != p.bytes_per_token:
        raise ValueError(f"layout {path}: bytes_per_token {p.bytes_per_token} != geometry "
                         f"{p.computed_bytes_per_token()}")
    return p


def resolve_layout(name: str, page_size: int = 16, tp: int = 1) -> KvLayout:
    return load_preset(name).layout(page_size=page_size, tp=tp)
