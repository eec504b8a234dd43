"""What a G3 call is handed, made canonical and checked at the pool's entry (:class:`~.pool.G3Pool`), before any
effect.

Keys (:func:`int_keys`): the pool's state (index, slot pins, write queue, journal, removal log, frame headers) holds
keys whose ``rank`` and ``seq_hash`` are Python ints. A key naming either as another integral type (a numpy integer
such as ``np.int64(3)``, a bool, an IntEnum) is the same key (equal to it, hashed alike) and is rebuilt here with
:func:`operator.index`'s values, once per call, before anything is looked up, pinned, queued or removed. Before
2026-12-04 such a key raised OverflowError from the compact index's hash (:mod:`.compact_table`) in ``get``, ``put``,
``holds``, ``contains``, ``lease``, ``delete`` and lookups of up to 8 keys, after part of the call had taken effect:
``lease([good, bad])`` left the good slot pinned for good (never evicted), ``delete([held, bad])`` removed the held
key from the index and zeroed its header but journaled no DEL record and counted no ``deleted``. A field that is no
integer (a float, a str) or is out of range is left as it is: no slot holds such a key (:func:`~.index.valid_key`),
so it is a miss, not held, or an ``invalid_key`` drop of that key alone, as before; so is, in ``get`` and ``put``, a
key whose tenant is not a str. An item that is no key at all (no ``rank``, ``seq_hash`` or ``tenant`` field), or
elsewhere a key whose tenant is not a str, raises TypeError naming its position and the field, before anything
happened (before, a None tenant raised TypeError and a list one "unhashable" from the
index, partway through those calls too).

Buffers (:func:`check_buffers`): the numpy buffers of ``put`` and of a host ``get``.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence, TypeVar

import numpy as np

from ...model.namespace import KeyRun

K = TypeVar("K")

#: a prefix lookup of at most this many keys probes them key by key, a longer one column-wise
#: (:meth:`.compact_index.CompactLruIndex.lookup_prefix`: ranks and sequence hashes go to uint32 / uint64 arrays through
#: ``array``, which takes any integral value as :func:`operator.index` does), so only such short lists are rebuilt: no
#: extra pass over an 8K-key list on vLLM's scheduler thread
SCALAR_LOOKUP_KEYS = 8


def _as_int(v: Any) -> Any:
    """``v`` as a Python int when it is integral (:func:`operator.index`), else ``v`` unchanged."""
    try:
        return operator.index(v)
    except TypeError:
        return v


def int_keys(keys: Sequence[K], what: str, tenants: bool = True) -> list[K]:
    """``keys`` as a new list in which every key's ``rank`` and ``seq_hash`` are Python ints where they are integral
    (see the module doc; keys that already are are kept as they are, the usual case: one type check per field).

    Raises:
        TypeError: an item has no ``rank``, ``seq_hash`` or ``tenant`` (not a key), or its tenant is not a str (a
            restored :class:`~.index.TagKey`'s is); ``what`` (the call), the position and the field named.
            ``tenants`` False (``get``, ``put``): a key whose tenant is not a str is left as it is, a miss or an
            ``invalid_key`` drop of that key alone, as every other key no slot can hold
            (``tests/pool/g3/test_g3_hostile.py``: bad keys drop nothing).
    """
    out = list(keys)
    for i, k in enumerate(out):
        try:
            r, s, t = k.rank, k.seq_hash, k.tenant  # type: ignore[attr-defined]
        except AttributeError:
            raise TypeError(f"G3 {what}: key {i} is a {type(k).__name__}, not a BlockKey (namespace, tenant, rank, "
                            f"seq_hash): {k!r:.120}") from None
        if tenants and type(t) is not str and not isinstance(t, str):
            raise TypeError(f"G3 {what}: key {i}'s tenant is a {type(t).__name__}, not a str: {k!r:.120}")
        if (type(r) is not int or type(s) is not int) and hasattr(k, "_replace"):  # a BlockKey, DigestKey, TagKey
            out[i] = k._replace(rank=_as_int(r), seq_hash=_as_int(s))
    return out


def lookup_keys(keys: Sequence[K]) -> Sequence[K]:
    """:func:`int_keys` for a prefix lookup: a :class:`~kvbm_backend.model.namespace.KeyRun` (its rank an int, its
    hashes uint64: made ints when keys are made of them) and a list longer than :data:`SCALAR_LOOKUP_KEYS` are
    passed as they are."""
    if type(keys) is KeyRun or len(keys) > SCALAR_LOOKUP_KEYS:
        return keys
    return int_keys(keys, "lookup_prefix")


def check_buffers(keys: Sequence[object], bufs: Sequence[object] | None, what: str, block_bytes: int,
                  writable: bool = False) -> None:
    """Check ``bufs`` against ``keys``: as many, each a contiguous 1-D uint8 numpy array of ``block_bytes`` bytes
    (and ``writable``: not read-only). Raises ValueError naming ``what`` (the call) and the buffer at fault."""
    if bufs is not None and len(keys) != len(bufs):
        raise ValueError(f"{what}: {len(keys)} keys but {len(bufs)} buffers")
    if bufs is None:
        return
    for i, b in enumerate(bufs):
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 1 or not b.flags.c_contiguous:
            raise ValueError(f"{what}: buffer {i} must be a contiguous 1-D uint8 numpy array "
                             f"(got {type(b).__name__} {getattr(b, 'dtype', '')} {getattr(b, 'shape', '')})")
        if b.nbytes != block_bytes:
            raise ValueError(f"{what}: buffer {i} holds {b.nbytes} bytes; this namespace's block is "
                             f"{block_bytes} bytes")
        if writable and not b.flags.writeable:
            raise ValueError(f"{what}: buffer {i} is read-only")
