"""What identifies a request's blocks beyond its sequence hashes: its salt, its blocks' token digests (for the load
and save jobs the scheduler side plans), and whether its KV is a function of its token ids at all.

A block's KVBM sequence hash (its name in G3/G4 and in KV events) is xxh3_64 with a public seed: token ids can
be searched whose block has another prompt's sequence hash (a few seconds to a minute for a 16-token block), so
a client could have its KV stored under, then loaded for, another prompt of the same tenant. Every frame the
connector writes therefore also carries the block's token digest (BLAKE2b-128 chained over the salt and every
token of the prefix: :func:`kvbm_backend.model.hashing.token_digests`), and a load serves a frame only when it
holds the digest the request's own tokens give (``frame.accept``; docs/format.md "Token digest").

The scheduler computes them here, lazily (only as far as a job needs: a request that neither loads nor saves
never pays for them; each block once per request, about 1-2 us on the 2-core VM), from the request's
``all_token_ids`` (prompt, then generated tokens), and sends them in :class:`~.metadata.LoadJob` /
:class:`~.metadata.SaveJob` ``digests``; the workers name them in their keys (:class:`~kvbm_backend.model.namespace.DigestKey`).
"""
from __future__ import annotations

import json
from typing import Any, Protocol, Sequence

from ...model.hashing import DIGEST_BYTES, salt_bytes, token_digests
from . import stats


def kv_beyond_token_ids(request: Any) -> bool:
    """Whether the request's KV depends on more than its token ids: multimodal inputs (each image is the same
    placeholder token ids) or prompt embeddings (``prompt_token_ids`` None: vLLM's placeholders are 0s).
    vLLM's own block hash adds those inputs' hashes (``kv_cache_utils.generate_block_hash_extra_keys``); ours
    is token ids, ``cache_salt`` and LoRA only, so such a request is neither loaded nor saved (before
    2026-11-29, a second image with the same text loaded the first image's KV)."""
    return (bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None
            or getattr(request, "prompt_token_ids", []) is None)


def epoch_salt(salt: bytes | None, epoch: str) -> bytes | None:
    """``salt`` with a reset epoch folded in (:mod:`.reset_epoch`): ``salt`` itself for epoch ``""`` (never reset),
    else canonical JSON ``{"reset_epoch": epoch, "salt": salt}``, which :func:`~kvbm_backend.model.hashing.salt_bytes`
    never returns (it has no such key), so a block of one epoch never has another epoch's or an unreset engine's
    sequence hash or token digest."""
    if not epoch:
        return salt
    return json.dumps({"reset_epoch": epoch, "salt": None if salt is None else salt.decode("latin-1")},
                      sort_keys=True, separators=(",", ":")).encode()


def renew_opaque(st: Any) -> Any:
    """``st`` (a scheduler request state), ``opaque`` renewed: a streaming session's next chunk (``StreamingUpdate``)
    may bring images (before 2026-11-30 the first chunk's verdict stayed: the image chunk was saved under token-id
    hashes); counted ``requests_not_tiered``."""
    if not st.opaque and kv_beyond_token_ids(st.request):
        st.opaque = True
        stats.add(requests_not_tiered=1)
    return st


def request_salt(request: Any, epoch: str = "") -> bytes | None:
    """The salt bytes of a vLLM request: its ``cache_salt`` and LoRA adapter (:func:`~kvbm_backend.model.hashing.
    salt_bytes`) and the scheduler's reset ``epoch`` (:func:`epoch_salt`); None when it has none of them."""
    lr = getattr(request, "lora_request", None)
    return epoch_salt(salt_bytes(getattr(request, "cache_salt", None), getattr(lr, "lora_name", None),
                                 getattr(lr, "lora_path", None)), epoch)


class _Digested(Protocol):
    request: Any
    digests: bytearray
    epoch: str  # the scheduler's reset epoch when its identity was made (.reset_epoch; absent: "")


def block_digests(st: _Digested, pos: Sequence[int], block_size: int) -> bytes:
    """The token digests of blocks ``pos`` (block indexes, any order) of request state ``st`` (its vLLM
    ``request``; ``st.digests`` caches the chain of its first blocks and is extended here; salted with its
    ``epoch`` as its sequence hashes are): 16 bytes per block, in ``pos`` order.

    Raises:
        ValueError: a block in ``pos`` is not full in the request's tokens (a job must never name a block
            whose tokens are not all known; the sequence hashes are computed from the same tokens).
    """
    if not pos:
        return b""
    need = max(pos) + 1
    have = len(st.digests) // DIGEST_BYTES
    if need > have:
        req = st.request
        toks = getattr(req, "all_token_ids", None)
        if toks is None:
            toks = getattr(req, "prompt_token_ids", None) or []
        if len(toks) < need * block_size:
            raise ValueError(f"block {need - 1}: the request has {len(toks)} tokens, not {need * block_size}")
        parent = bytes(st.digests[-DIGEST_BYTES:]) if have else None
        token_digests(list(toks[have * block_size:need * block_size]), block_size,
                      request_salt(req, getattr(st, "epoch", "")), parent, into=st.digests)
    d = st.digests
    return b"".join(d[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] for i in pos)
