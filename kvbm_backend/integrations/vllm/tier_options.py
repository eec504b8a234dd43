"""The checks of a native tier's own keys (:mod:`.tiering`: ``G3Tier``/``G4Tier`` in vLLM's ``secondary_tiers``).

vLLM hands every key of the tier's dict to the constructor as it came from the JSON, unchecked. Before these checks
(review, 2026-11-30) a JSON typo went through or failed far from its cause: ``"enable_kv_events": "false"`` (a
string) turned events on, ``"mla": "false"`` cut pages as MLA latents, ``"locality": "local"`` raised vLLM's
``'local' is not a valid Locality`` and ``"io_threads": "4"`` a ``TypeError`` about ``<``, neither naming the key.
Each key is now checked by type (an integer is no bool; a number is finite) and range, and refused with a ValueError
that names it, before anything opens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import Locality

__all__ = ["TierOptions", "check_options"]

LOCALITIES = tuple(m.value for m in Locality)  # vLLM 0.32: LOCAL, REMOTE (upper case, as vLLM's own tiers take them)


@dataclass(frozen=True)
class TierOptions:
    """A tier's checked scalar keys (the geometry keys are checked and passed on unchanged)."""
    locality: Locality
    enable_kv_events: bool
    io_threads: int
    job_timeout_s: float
    staging_mb: float


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


def _flag(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ValueError(f"{name}: true or false (a JSON boolean, not a string), {_got(value)}")


def _whole(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: an integer >= {minimum}, {_got(value)}")


def _number(name: str, value: Any, what: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}: {what}, {_got(value)}")
    return float(value)


def _text(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name}: a string, {_got(value)}")


def check_options(*, default_locality: str, locality: Any, enable_kv_events: Any, io_threads: Any,
                  job_timeout_s: Any, staging_mb: Any, config: Any, tenant: Any, revision: Any, num_kv_heads: Any,
                  head_dim: Any, mla: Any, layout: Any, kv_cache_layout: Any) -> TierOptions:
    """Check a tier's keys as given in ``secondary_tiers`` (``None``: the key was not given). ``locality``:
    ``LOCAL`` or ``REMOTE`` (exactly: vLLM's own tiers refuse other spellings), default ``default_locality``;
    ``enable_kv_events``, ``mla``: booleans; ``io_threads`` (>= 1), ``num_kv_heads``, ``head_dim`` (>= 1):
    integers; ``job_timeout_s`` (seconds, > 0) and ``staging_mb`` (MiB, >= 0): finite numbers; ``config``: a path
    or a mapping; ``tenant``, ``revision``, ``layout``, ``kv_cache_layout``: strings (their values are checked
    where they are used). Raises ValueError naming the key."""
    loc = default_locality if locality is None else locality
    if loc not in LOCALITIES:
        raise ValueError(f"locality: {' or '.join(LOCALITIES)}, {_got(loc)}")
    _flag("enable_kv_events", enable_kv_events)
    _flag("mla", mla, optional=True)
    _whole("io_threads", io_threads, 1)
    _whole("num_kv_heads", num_kv_heads, 1, optional=True)
    _whole("head_dim", head_dim, 1, optional=True)
    if config is not None and not isinstance(config, (str, dict)):
        raise ValueError(f"config: a config file path or a mapping of settings, {_got(config)}")
    for name, value in (("tenant", tenant), ("revision", revision), ("layout", layout),
                        ("kv_cache_layout", kv_cache_layout)):
        _text(name, value)
    return TierOptions(
        locality=Locality(loc), enable_kv_events=enable_kv_events, io_threads=io_threads,
        job_timeout_s=_number("job_timeout_s", job_timeout_s, "a number of seconds > 0", lambda v: v > 0),
        staging_mb=_number("staging_mb", staging_mb, "a number of MiB >= 0", lambda v: v >= 0))
