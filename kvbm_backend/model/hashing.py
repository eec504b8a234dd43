"""KVBM-compatible block identity.

Source: dynamo ``lib/llm/src/tokens.rs`` (KVBM's token blocks):

* ``SaltHash  = xxh3_64(salt_bytes, seed=0)``; no salt means salt hash 0.
* ``BlockHash = xxh3_64(tokens as little-endian u32, seed=salt_hash)``.
* ``SequenceHash``: first block = its BlockHash; block i>0 =
  ``xxh3_64(le_u64(parent_sequence_hash) || le_u64(block_hash), seed=salt_hash)``.

Only full blocks are hashed; a trailing partial block has no identity.

Dynamo's router hash (``dynamo._core.compute_block_hash_for_seq``) is the unchained BlockHash with
seed 1337 (:data:`ROUTER_SEED`); tests check equality with it.
"""
from __future__ import annotations

import json
import struct
from typing import Sequence

import numpy as np
import xxhash

ROUTER_SEED = 1337
_U64 = (1 << 64) - 1


def salt_bytes(cache_salt: str | None = None, lora_name: str | None = None) -> bytes | None:
    """The salt for a request: its ``cache_salt`` (the tenant) and LoRA name, canonical JSON.

    Returns None when both are absent (salt hash 0, as KVBM does for an unsalted sequence).
    """
    if not cache_salt and not lora_name:
        return None
    d = {}
    if cache_salt:
        d["cache_salt"] = cache_salt
    if lora_name:
        d["lora_name"] = lora_name
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def salt_hash(salt: bytes | str | None) -> int:
    """``xxh3_64(salt, seed=0)``; 0 for no salt."""
    if salt is None:
        return 0
    if isinstance(salt, str):
        salt = salt.encode()
    return xxhash.xxh3_64_intdigest(salt, seed=0)


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def block_hash(tokens: Sequence[int] | np.ndarray, seed: int = 0) -> int:
    """``xxh3_64(tokens as LE u32, seed)``."""
    return xxhash.xxh3_64_intdigest(_token_bytes(tokens), seed=seed & _U64)


def chain(parent: int | None, bhash: int, seed: int) -> int:
    """Sequence hash of a block given its parent's sequence hash (None for the first block)."""
    if parent is None:
        return bhash
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent & _U64, bhash & _U64), seed=seed & _U64)


def sequence_hashes(tokens: Sequence[int] | np.ndarray, page_size: int, salt: int = 0,
                    parent: int | None = None) -> list[int]:
    """Sequence hashes of every full ``page_size``-token block of ``tokens``.

    Args:
        tokens: token ids (u32 range).
        page_size: tokens per block.
        salt: the salt hash (see :func:`salt_hash`).
        parent: sequence hash of the block preceding ``tokens[0]``, if any.
    Returns:
        one u64 per full block, in order.
    """
    if page_size <= 0:
        raise ValueError(f"page_size: must be positive, got {page_size}")
    arr = np.asarray(tokens, dtype="<u4")
    n = len(arr) // page_size
    out: list[int] = []
    for i in range(n):
        b = xxhash.xxh3_64_intdigest(arr[i * page_size:(i + 1) * page_size].tobytes(), seed=salt)
        parent = chain(parent, b, salt)
        out.append(parent)
    return out
