"""Namespace: what a stored block's bytes mean, and the BlockKey that names one block.

A Namespace is model id + weights revision + dtype + KvLayout (incl. page_size) + TP world size +
hash scheme. Its fingerprint (16 hex chars of xxh3_128 over the canonical JSON) prefixes every stored
key; the canonical JSON is written beside the data (``namespace.json``) so an operator can read what a
directory or prefix holds. Blocks of another namespace are never hits.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from .layout import KvLayout

HASH_SCHEMES = ("kvbm-xxh3-v1", "vllm-block-hash")


@dataclass(frozen=True)
class Namespace:
    """Identity of a KV cache's meaning.

    Attributes:
        model: model id, e.g. ``meta-llama/Llama-3.1-8B-Instruct``.
        revision: weights revision (commit or tag); KV from other weights is wrong KV.
        layout: per-rank KvLayout (dtype and page_size included).
        tp_world_size: tensor-parallel degree the blocks were cut for.
        hash_scheme: ``kvbm-xxh3-v1`` (KVBM sequence hashes, :mod:`.hashing`) or
            ``vllm-block-hash`` (the engine's own block hash used as key).
    """

    model: str
    layout: KvLayout
    revision: str = "main"
    tp_world_size: int = 1
    hash_scheme: str = "kvbm-xxh3-v1"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("namespace.model: must not be empty")
        if self.tp_world_size < 1:
            raise ValueError(f"namespace.tp_world_size: must be >= 1, got {self.tp_world_size}")
        if self.hash_scheme not in HASH_SCHEMES:
            raise ValueError(f"namespace.hash_scheme: {self.hash_scheme!r} not in {HASH_SCHEMES}")

    def to_dict(self) -> dict:
        return {"format": "kvbm-backend-namespace/1", "model": self.model, "revision": self.revision,
                "dtype": self.layout.dtype, "layout": self.layout.to_dict(),
                "tp_world_size": self.tp_world_size, "hash_scheme": self.hash_scheme}

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 lowercase hex chars: first 64 bits of xxh3_128(canonical JSON). Computed once per instance
        (the fields are frozen; every key names it)."""
        return xxhash.xxh3_128_hexdigest(self.canonical_json().encode())[:16]

    @functools.cached_property
    def fingerprint_bytes(self) -> bytes:
        return bytes.fromhex(self.fingerprint)

    @classmethod
    def from_dict(cls, d: dict) -> "Namespace":
        return cls(model=d["model"], revision=d.get("revision", "main"), layout=KvLayout.from_dict(d["layout"]),
                   tp_world_size=int(d.get("tp_world_size", 1)), hash_scheme=d.get("hash_scheme", "kvbm-xxh3-v1"))

    def key(self, seq_hash: int, tenant: str = "", rank: int = 0) -> "BlockKey":
        if not 0 <= rank < self.tp_world_size:
            raise ValueError(f"rank: {rank} outside TP world size {self.tp_world_size}")
        return BlockKey(self.fingerprint, tenant, rank, seq_hash & ((1 << 64) - 1))

    def keys(self, seq_hashes, tenant: str = "", rank: int = 0) -> list["BlockKey"]:
        """``[self.key(h, tenant, rank) for h in seq_hashes]``, with the checks done once."""
        if not 0 <= rank < self.tp_world_size:
            raise ValueError(f"rank: {rank} outside TP world size {self.tp_world_size}")
        fp, m = self.fingerprint, (1 << 64) - 1
        return [BlockKey(fp, tenant, rank, h & m) for h in seq_hashes]

    def shared_rank(self, rank: int) -> int:
        """The rank whose key names TP rank ``rank``'s block in shared storage (G4): 0 when every rank
        holds the same bytes (MLA: ``layout.outer_dim == 1``, the latent is replicated, KVBM
        ``LayoutConfig``), so such a block is stored once rather than once per rank; else ``rank``."""
        return 0 if self.layout.outer_dim == 1 else rank


class BlockKey(NamedTuple):
    """(namespace fingerprint, tenant, TP rank, sequence hash): one rank's block."""

    namespace: str
    tenant: str
    rank: int
    seq_hash: int


def tenant_tag(tenant: str) -> bytes:
    """16-byte tag of a tenant id in G3 frames: xxh3_128 of its UTF-8 (G4 uses a keyed HMAC)."""
    return xxhash.xxh3_128_digest(tenant.encode())
