"""The record batches of G4 announcements (:mod:`.g4_announce`): their JSON form, and the checks a poller runs
on every record before any of it reaches vLLM's KV event publisher.

Batch (sealed by :class:`~kvbm_backend.pool.g4.announce.Announcements`; ``docs/format.md``)::

    {"v": 2, "w": writer id, "d": hash domain, "bs": block size, "t": write time (epoch s, the writer's
     estimate of the store's clock), "b": [[seq, parent_seq, vLLM hash, parent vLLM hash,
     base64 uint32 tokens, event extra keys, lora_id, lora_name], ...]}

``t`` is sealed with the records (AES-256-GCM: nobody without the tenant's key can change it), so a batch's
age is never only its store mtime, which anyone with write access to the store sets: a copy of an expired
batch written back under its name is still expired (2026-11-30). Version 1 batches (no ``t``, before
2026-11-30) are ignored and counted with the other hash domains (``announce_ignored_domain``); they expire
by their mtime.

Checks (:func:`decode_records`; any failure makes the whole batch ``corrupt``: ignored, counted, never read
again). Every field has the type and range vLLM's msgpack encoder and Dynamo's router take: a vLLM hash is an
int in ``[0, 2**64)`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) or 1 to 64 bytes (hex); KVBM sequence hashes
in ``[0, 2**64)``; ``lora_id`` None or in ``[0, 2**63)``; ``lora_name`` None or a str of at most
:data:`MAX_STR` characters; event extra keys None or a list of at most :data:`MAX_EXTRA_KEYS` items, each a
bounded str or a ``[str, int]`` pair (a multimodal identifier and offset); at most :data:`MAX_BATCH_RECORDS`
records. Before (2026-11-30) a record with a vLLM hash of 2**70 reached vLLM's ``ZmqEventPublisher`` with
the engine's own events of the step: msgpack raised OverflowError and the whole batch, GPU events included,
was lost, on every republish too.

Tenant: a record's bare-string extra keys are its LoRA name or its request's cache salt, and the cache salt
is the tenant (:mod:`.scheduler_side`); a record naming a cache salt other than the tenant whose key sealed
the batch makes the batch corrupt (a batch sealed for tenant y announcing tenant x's blocks). Blocks past a
prompt's first carry no salt (vLLM chains it through the parent hash), so that check covers first blocks only.
"""
from __future__ import annotations

import base64
import hashlib
import math
from array import array
from typing import Any, Callable

RECORD_VERSION = 2  # 2 (2026-11-30): sealed write time "t"; 1: none (ignored)
MAX_BATCH_RECORDS = 16384  # records in one batch at most (a writer writes at most this many)
MAX_STR = 1024  # characters of a lora_name / extra-key string / writer id at most
MAX_EXTRA_KEYS = 64  # event extra keys of one record at most
U64 = 1 << 64


def hash_domain() -> str | None:
    """Digest of vLLM's ``NONE_HASH`` and hash form (None before vLLM set it): equal across workers exactly
    when their block hashes agree."""
    from vllm import envs
    from vllm.v1.core import kv_cache_utils as kcu
    if kcu.NONE_HASH is None:
        return None
    form = b"int" if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else b"bytes"
    return hashlib.sha256(bytes(kcu.NONE_HASH) + form).hexdigest()[:16]


def _enc_hash(h: Any) -> Any:
    return None if h is None else (h.hex() if isinstance(h, (bytes, bytearray)) else int(h))


def _int(v: Any, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v < hi:  # bool is not a hash
        raise ValueError("record: integer out of range")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str) or len(v) > MAX_STR:
        raise ValueError("record: string")
    return v


def _dec_hash(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, str):
        if not 2 <= len(v) <= 128:
            raise ValueError("record: hash length")
        return bytes.fromhex(v)
    return _int(v, 0, U64)


def _extra_keys(ek: Any, lora_name: str | None, tenant_ok: Callable[[str], bool]) -> Any:
    """The event extra keys ``ek`` as vLLM publishes them (tuple), checked (module doc)."""
    if ek is None:
        return None
    if not isinstance(ek, list) or len(ek) > MAX_EXTRA_KEYS:
        raise ValueError("record: extra keys")
    out: list[Any] = []
    for k in ek:
        if isinstance(k, str):
            if k != lora_name and not tenant_ok(_str(k)):
                raise ValueError("record: another tenant's cache salt")
            out.append(k)
        elif isinstance(k, list) and len(k) == 2:
            out.append((_str(k[0]), _int(k[1], -(1 << 63), 1 << 63)))
        else:
            raise ValueError("record: extra key")
    return tuple(out)


def encode_records(writer: str, domain: str, block_size: int, blocks: list[tuple], t: float,
                   ttl_s: float | None = None) -> dict:
    """Record batch (JSON-able) of ``blocks``: ``(seq_hash, parent_seq, ev_info)`` with ``ev_info`` =
    ``(vLLM hash, parent hash, tokens, event extra keys, lora_id, lora_name)``, written at ``t`` (epoch s,
    the store's clock as the writer measures it), live for ``ttl_s`` seconds (the writer's
    ``g4.announce_ttl_s``, key ``"ttl"``; batches written before 2026-12-01 have none: :func:`sealed_ttl`)."""
    out = []
    for seq, pseq, (h, ph, toks, ek, lora_id, lora_name) in blocks:
        out.append([seq, pseq, _enc_hash(h), _enc_hash(ph), base64.b64encode(array("I", toks).tobytes()).decode(),
                    ek, lora_id, lora_name])
    recs = {"v": RECORD_VERSION, "w": writer, "d": domain, "bs": block_size, "t": t, "b": out}
    if ttl_s is not None:
        recs["ttl"] = float(ttl_s)
    return recs


MAX_TTL_S = 30 * 86400.0  # g4.announce_ttl_s's upper bound (config.py): a sealed TTL above it is clamped


def sealed_ttl(recs: dict, default_s: float) -> float:
    """The TTL (seconds) a batch's writer sealed in it (clamped to ``(0, MAX_TTL_S]``), else ``default_s`` (a
    batch written before 2026-12-01, or a value that is not a positive finite number)."""
    v = recs.get("ttl")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        return default_s
    return min(float(v), MAX_TTL_S)


def decode_records(recs: dict, domain: str, block_size: int,
                   tenant_ok: Callable[[str], bool] = lambda s: True) -> tuple[float, list[tuple]] | None:
    """``(sealed write time, [(seq, parent_seq, ev_info), ...])`` of a batch, or None when it is of another
    version, hash domain or block size. ``tenant_ok(cache_salt)``: whether a cache salt names the tenant of
    the batch. Raises ValueError/TypeError/KeyError when any record fails a check (module doc)."""
    if recs.get("v") != RECORD_VERSION or recs.get("d") != domain or recs.get("bs") != block_size:
        return None
    t = recs["t"]
    if type(t) not in (int, float) or not math.isfinite(t):
        raise ValueError("batch: write time")
    _str(recs["w"])
    rows = recs["b"]
    if not isinstance(rows, list) or len(rows) > MAX_BATCH_RECORDS:
        raise ValueError("batch: records")
    out = []
    for seq, pseq, h, ph, toks, ek, lora_id, lora_name in rows:
        if not isinstance(toks, str) or len(toks) > 8 * block_size + 8:
            raise ValueError("record: tokens")
        tk = array("I")
        tk.frombytes(base64.b64decode(toks, validate=True))
        if len(tk) != block_size or h is None:
            raise ValueError("record")
        _int(seq, 0, U64)
        if pseq is not None:
            _int(pseq, 0, U64)
        if lora_id is not None:
            _int(lora_id, 0, 1 << 63)
        if lora_name is not None:
            _str(lora_name)
        out.append((seq, pseq, (_dec_hash(h), _dec_hash(ph), tk, _extra_keys(ek, lora_name, tenant_ok),
                                lora_id, lora_name)))
    return float(t), out
