"""Namespace: what a stored block's bytes mean, and the BlockKey that names one block.

A Namespace is model id + weights revision + dtype + KvLayout (incl. page_size) + TP world size +
hash scheme, and for hybrid models (several vLLM KV cache groups: sliding-window and full-attention
layers) the whole group structure plus which group the blocks belong to (:class:`KvGroup`). Its fingerprint (16 hex chars of xxh3_128 over the canonical JSON) prefixes every stored
key; the canonical JSON is written beside the data (``namespace.json``) so an operator can read what a
directory or prefix holds. Blocks of another namespace are never hits.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import operator
import threading
from array import array
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Protocol, Sequence, TypeAlias, overload

import numpy as np
import numpy.typing as npt
import xxhash

from .layout import KvLayout

HASH_SCHEMES = ("kvbm-xxh3-v1", "vllm-block-hash")
#: stored layout ids: ``per-rank`` (one block per TP rank, its KV heads; every namespace before any-TP G4)
#: and ``canonical-head/1`` (one part per KV head, TP-independent: :mod:`.canonical`)
LAYOUT_IDS = ("per-rank", "canonical-head/1")
KV_VERSIONS = (0, 2)  # Namespace.kv_version: 0 as before the field, 2 K/V read with the 2026-11-30 fix (below)
GROUP_KINDS = ("full", "sliding", "mla", "vllm-offload")


@dataclass(frozen=True)
class KvGroup:
    """One KV cache group of a hybrid model (vLLM's ``KVCacheGroupSpec``): layers sharing one block table.

    Attributes:
        kind: ``"full"`` (full attention: a block is needed for every token of the prefix),
            ``"sliding"`` (sliding-window attention: only the last ``sliding_window - 1`` tokens before a
            resume point are read), ``"mla"``, or ``"vllm-offload"`` (a group as vLLM's offloading
            connector hands its chunks to the tiering tiers: vLLM decides which blocks it offloads and
            does not tell the tier the group's attention kind; ``layers`` names the group instead).
        layout: per-rank KvLayout of this group's block (its layers only).
        sliding_window: window in tokens (``kind == "sliding"``), else None.
        layers: the group's layer names (recorded where the kind alone does not say what a block holds).
    """

    kind: str
    layout: KvLayout
    sliding_window: int | None = None
    layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"group.kind: {self.kind!r} not in {GROUP_KINDS}")
        if (self.kind == "sliding") != (self.sliding_window is not None):
            raise ValueError(f"group.sliding_window: {self.sliding_window!r} for kind {self.kind!r} "
                             "(set for sliding groups only)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"group.sliding_window: must be >= 1 token, got {self.sliding_window}")

    @property
    def window_blocks(self) -> int | None:
        """Blocks a sliding group needs before a resume point: ``ceil((sliding_window - 1) / page_size)``
        (vLLM ``SlidingWindowManager._contiguous_blocks_for_hit``); None for other kinds."""
        if self.sliding_window is None:
            return None
        return max(1, -(-(self.sliding_window - 1) // self.layout.page_size))

    def to_dict(self) -> dict[str, Any]:
        """The group as a JSON object (``kind``, ``layout``; ``sliding_window`` and ``layers`` where set)."""
        d: dict[str, Any] = {"kind": self.kind, "layout": self.layout.to_dict()}
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        if self.layers:
            d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KvGroup":
        """Inverse of :meth:`to_dict`. Raises KeyError for a missing field, ValueError for a bad value."""
        sw = d.get("sliding_window")
        return cls(kind=str(d["kind"]), layout=KvLayout.from_dict(d["layout"]),
                   sliding_window=None if sw is None else int(sw), layers=tuple(d.get("layers") or ()))


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
        groups: the KV cache groups of a hybrid model, or the one group of an all-sliding-window model
            (empty for one full-attention or MLA group: the canonical JSON and the fingerprint are then
            exactly those of a namespace written before groups existed). When set, ``layout`` is
            ``groups[group].layout`` and the namespace names the blocks of group ``group``: each group
            has its own fingerprint, every fingerprint covers the whole structure, and the sequence hash
            of a block is the same in every group (KVBM identity over the token prefix).
        group: index into ``groups`` of the blocks this namespace names (0 when ``groups`` is empty).
        layout_id: ``per-rank`` (default: ``layout`` is one TP rank's block, keys name TP ranks; not written
            into the canonical JSON, so fingerprints are those of namespaces written before the field) or
            ``canonical-head/1`` (a TP-independent G4 namespace, :mod:`.canonical`: ``layout`` is one KV
            head's part, ``tp_world_size`` the number of parts (KV heads of the model, 1 for MLA) and the
            key's rank the KV head index). The id is part of the fingerprint: a per-rank block is never
            read as a canonical part, nor the reverse.
        kv_heads: KV heads per rank in ``layout.inner_dim`` (``inner_dim = kv_heads * head_dim``), recorded
            where an operator states the head split (vLLM secondary tiers: ``num_kv_heads`` / ``layout``):
            two engines whose settings cut the same bytes into different heads (4 x 32 against 2 x 64) never
            share blocks. 0 (default): derived from the engine itself, not written into the canonical JSON
            (fingerprints as before the field).
        kv_version: 0 (default, not written into the canonical JSON: fingerprints as before the field) or 2:
            the blocks were read from a vLLM GPU engine's packed K|V tensors with the reading fixed on
            2026-11-30 (``kvbm_backend.integrations.vllm.kv_io`` ``"packed"``). Before that, such tensors were
            read as the CPU backend's K-rows-then-V-rows and stored a wrong K/V interleave; the version keeps
            those blocks (fingerprint without it) from ever being read as right KV. CPU engines keep 0.
            vLLM secondary tiers (``integrations/vllm/tiering.py``, ``hash_scheme="vllm-block-hash"``) the
            other way round: 2 for a CPU engine's K/V blocks, read as vLLM's CPU backend keeps them (K rows
            then V rows) since 2026-11-30, before as packed K|V (scrambled); GPU engines' tiers keep 0.
    """

    model: str
    layout: KvLayout
    revision: str = "main"
    tp_world_size: int = 1
    hash_scheme: str = "kvbm-xxh3-v1"
    groups: tuple[KvGroup, ...] = ()
    group: int = 0
    layout_id: str = "per-rank"
    kv_heads: int = 0
    kv_version: int = 0

    def __post_init__(self) -> None:
        if self.kv_version not in KV_VERSIONS:
            raise ValueError(f"namespace.kv_version: {self.kv_version!r} not in {KV_VERSIONS}")
        if self.layout_id not in LAYOUT_IDS:
            raise ValueError(f"namespace.layout_id: {self.layout_id!r} not in {LAYOUT_IDS}")
        if self.kv_heads < 0 or (self.kv_heads and self.layout.inner_dim % self.kv_heads):
            raise ValueError(f"namespace.kv_heads: {self.kv_heads} does not divide the layout's inner_dim "
                             f"{self.layout.inner_dim}")
        if self.groups:
            if len(self.groups) < 2 and self.groups[0].kind != "sliding":
                raise ValueError("namespace.groups: set only for two or more KV cache groups, or one "
                                 "sliding-window group")
            if not 0 <= self.group < len(self.groups):
                raise ValueError(f"namespace.group: {self.group} outside {len(self.groups)} groups")
            if self.groups[self.group].layout != self.layout:
                raise ValueError(f"namespace.layout: {self.layout} is not group {self.group}'s layout "
                                 f"{self.groups[self.group].layout}")
        elif self.group != 0:
            raise ValueError(f"namespace.group: {self.group} without groups")
        if not self.model:
            raise ValueError("namespace.model: must not be empty")
        if self.tp_world_size < 1:
            raise ValueError(f"namespace.tp_world_size: must be >= 1, got {self.tp_world_size}")
        if self.hash_scheme not in HASH_SCHEMES:
            raise ValueError(f"namespace.hash_scheme: {self.hash_scheme!r} not in {HASH_SCHEMES}")

    def to_dict(self) -> dict[str, Any]:
        """The namespace as the JSON object its fingerprint and ``namespace.json`` are made of."""
        return {"format": "kvbm-backend-namespace/1", "model": self.model, "revision": self.revision,
                "dtype": self.layout.dtype, "layout": self.layout.to_dict(),
                "tp_world_size": self.tp_world_size, "hash_scheme": self.hash_scheme,
                **({"groups": [g.to_dict() for g in self.groups], "group": self.group} if self.groups else {}),
                **({"layout_id": self.layout_id} if self.layout_id != "per-rank" else {}),
                **({"kv_heads": self.kv_heads} if self.kv_heads else {}),
                **({"kv_version": self.kv_version} if self.kv_version else {})}

    def for_group(self, group: int) -> "Namespace":
        """The namespace of group ``group``'s blocks (same model, revision, TP, structure). Raises
        ValueError for an index outside ``groups`` (only 0 is valid without groups)."""
        if not self.groups:
            if group != 0:
                raise ValueError(f"group: {group}, but the namespace has one KV cache group")
            return self
        if not 0 <= group < len(self.groups):
            raise ValueError(f"group: {group} outside {len(self.groups)} groups")
        return dataclasses.replace(self, layout=self.groups[group].layout, group=group)

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
    def from_dict(cls, d: Mapping[str, Any]) -> "Namespace":
        """Inverse of :meth:`to_dict`. Raises KeyError for a missing field, ValueError for a bad value."""
        return cls(model=d["model"], revision=d.get("revision", "main"), layout=KvLayout.from_dict(d["layout"]),
                   tp_world_size=int(d.get("tp_world_size", 1)), hash_scheme=d.get("hash_scheme", "kvbm-xxh3-v1"),
                   groups=tuple(KvGroup.from_dict(g) for g in d.get("groups") or ()), group=int(d.get("group", 0)),
                   layout_id=str(d.get("layout_id", "per-rank")), kv_heads=int(d.get("kv_heads", 0)),
                   kv_version=int(d.get("kv_version", 0)))

    def key(self, seq_hash: int, tenant: str = "", rank: int = 0) -> "BlockKey":
        if not 0 <= rank < self.tp_world_size:
            raise ValueError(f"rank: {rank} outside TP world size {self.tp_world_size}")
        return BlockKey(self.fingerprint, tenant, rank, seq_hash & ((1 << 64) - 1))

    def keys(self, seq_hashes: Iterable[int], tenant: str = "", rank: int = 0,
             digests: bytes | bytearray | None = None) -> list["BlockKey"]:
        """``[self.key(h, tenant, rank) for h in seq_hashes]``, with the checks done once. ``digests``: the
        blocks' token digests, 16 bytes each in order (:func:`~.hashing.token_digests`): the keys are then
        :class:`DigestKey` s. Raises ValueError for a rank outside the TP world or digests of another count."""
        if not 0 <= rank < self.tp_world_size:
            raise ValueError(f"rank: {rank} outside TP world size {self.tp_world_size}")
        fp, m = self.fingerprint, (1 << 64) - 1
        if digests is None:
            return [BlockKey(fp, tenant, rank, h & m) for h in seq_hashes]
        hs = list(seq_hashes)
        if len(digests) != 16 * len(hs):
            raise ValueError(f"digests: {len(digests)} bytes for {len(hs)} blocks (16 bytes each)")
        d = bytes(digests)
        return [DigestKey(fp, tenant, rank, h & m, d[16 * i:16 * i + 16]) for i, h in enumerate(hs)]

    def run(self, seq_hashes: "SeqHashes | HashesLike", tenant: str = "", rank: int = 0) -> "KeyRun":
        """The keys ``self.keys(seq_hashes, tenant, rank)`` as one :class:`KeyRun` (no per-key object).
        ``seq_hashes``: a :class:`SeqHashes` (shared, e.g. by every TP rank's run), or what one takes: a
        list of Python ints (taken modulo 2**64, as :meth:`key` does) or a 1-D uint64 array. Raises
        ValueError for a rank outside the TP world size (or a wrong array)."""
        if not 0 <= rank < self.tp_world_size:
            raise ValueError(f"rank: {rank} outside TP world size {self.tp_world_size}")
        h = seq_hashes if isinstance(seq_hashes, SeqHashes) else SeqHashes(seq_hashes)
        return KeyRun(self.fingerprint, tenant, rank, h)

    def rank_runs(self, seq_hashes: "HashesLike", tenant: str = "") -> tuple[list["KeyRun"], list["KeyRun"]]:
        """``(by_rank, shared)``: the keys of ``seq_hashes`` (Python ints, the ``array('Q')`` the scheduler
        hashes into, or a uint64 array; see :class:`SeqHashes`) as one :class:`KeyRun` per TP rank (``by_rank[r]``: rank r's G3 keys), all over one
        :class:`SeqHashes` (converted to uint64 once, only as far as a pool probes them), and the runs of
        the distinct :meth:`shared_rank` ranks (G4's keys: one run for replicated MLA blocks). What the
        scheduler's prefix lookups build once per lookup and hand to G3 and G4."""
        h = SeqHashes(seq_hashes)
        by_rank = [KeyRun(self.fingerprint, tenant, r, h) for r in range(self.tp_world_size)]
        return by_rank, [by_rank[r] for r in sorted({self.shared_rank(r) for r in range(self.tp_world_size)})]

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


class DigestKey(BlockKey):
    """A :class:`BlockKey` that also names its block's token digest (``token_digest``: 16 bytes,
    :func:`~.hashing.token_digests`). Equal to, and hashed as, its :class:`BlockKey` (indexes and sets
    treat both alike); frames written under it carry the digest and a read serves a frame for it only when
    the frame holds that digest (``frame.accept``, docs/format.md "Token digest")."""

    token_digest: bytes

    def __new__(cls, namespace: str, tenant: str, rank: int, seq_hash: int, token_digest: bytes) -> "DigestKey":
        if not isinstance(token_digest, bytes) or len(token_digest) != 16:
            raise ValueError(f"token_digest: 16 bytes expected, got {token_digest!r:.40}")
        self = super().__new__(cls, namespace, tenant, rank, seq_hash)
        self.token_digest = token_digest
        return self

    def __getnewargs__(self) -> tuple[str, str, int, int, bytes]:
        return (self.namespace, self.tenant, self.rank, self.seq_hash, self.token_digest)

    def _replace(self, **kw: Any) -> "DigestKey":
        vals = [kw.pop(f, v) for f, v in zip(self._fields, self)]
        if kw:
            raise ValueError(f"DigestKey._replace: unknown fields {sorted(kw)}")
        ns, tenant, rank, seq_hash = vals
        return DigestKey(ns, tenant, rank, seq_hash, self.token_digest)

    @classmethod
    def _make(cls, iterable: Iterable[Any]) -> "DigestKey":  # type: ignore[override]
        raise TypeError("DigestKey._make: a DigestKey names its token digest (DigestKey(..., token_digest))")


class KeyIdentity(Protocol):
    """What a frame's identity check reads of a key (:func:`~.frame.accept`): a :class:`BlockKey`, or any
    key type with these read-only fields (e.g. G3's restored keys that know only the tenant's tag)."""

    @property
    def namespace(self) -> str:
        """The namespace fingerprint (16 hex chars)."""
        ...

    @property
    def rank(self) -> int: ...

    @property
    def seq_hash(self) -> int: ...


_M64 = (1 << 64) - 1

#: Sequence hashes as :class:`SeqHashes` takes them: Python ints (a list, a tuple, any iterable; an
#: ``array('Q')``) or a 1-D uint64 array.
HashesLike: TypeAlias = Iterable[int] | npt.NDArray[np.uint64]


def _to_u64(ints: Sequence[int]) -> npt.NDArray[np.uint64]:
    """uint64 array of Python ints taken modulo 2**64 (``array('Q')``, the fastest conversion: ~20-40 ns per
    int; negative or wider ints are masked first). TypeError names the first item that is not an int."""
    try:
        return np.frombuffer(array("Q", ints), np.uint64)
    except OverflowError:
        return np.frombuffer(array("Q", [operator.index(h) & _M64 for h in ints]), np.uint64)
    except TypeError:
        bad = next((h for h in ints if not isinstance(h, int)), None)
        raise TypeError(f"seq_hashes: sequence hashes are ints, got {type(bad).__name__} {bad!r}") from None


class SeqHashes:
    """The sequence hashes of one prefix, shared by the key runs of one lookup (every TP rank, G3 and G4):
    Python ints (as vLLM and :func:`~.hashing.sequence_hashes` give them) converted to uint64 on demand, as
    a growing prefix, each int once. A lookup that stops in its first chunk (a partial hit) converts only
    that chunk. Or a uint64 array, used as is (not copied).

    Args:
        seq_hashes: a list or tuple of ints (taken modulo 2**64, as :meth:`Namespace.key` does; an item
            that is not an int raises TypeError naming it when its part is converted), an ``array('Q')``
            (what the scheduler hashes into: copied as uint64 at once, a memcpy, nothing converted), or a
            1-D uint64 array (ValueError otherwise).

    Thread-safe: conversions hold a lock (G4 lookups read from I/O threads).
    """

    __slots__ = ("_ints", "_arr", "_done", "_lock")

    _ints: list[int] | tuple[int, ...] | None
    _arr: npt.NDArray[np.uint64]

    def __init__(self, seq_hashes: HashesLike) -> None:
        if isinstance(seq_hashes, np.ndarray):
            if seq_hashes.dtype != np.uint64 or seq_hashes.ndim != 1:
                raise ValueError(f"seq_hashes: a 1-D uint64 array is needed, got {seq_hashes.dtype} of shape "
                                 f"{seq_hashes.shape}")
            self._ints, self._arr, self._done = None, seq_hashes.view(), len(seq_hashes)
            self._arr.flags.writeable = False
        elif isinstance(seq_hashes, array) and seq_hashes.typecode == "Q":  # copied: the caller may append to it
            self._ints, self._arr, self._done = None, np.frombuffer(seq_hashes, np.uint64).copy(), len(seq_hashes)
            self._arr.flags.writeable = False
        else:
            self._ints = seq_hashes if isinstance(seq_hashes, (list, tuple)) else list(seq_hashes)
            self._arr, self._done = np.empty(len(self._ints), np.uint64), 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._arr)

    def array(self, stop: int | None = None) -> npt.NDArray[np.uint64]:
        """Read-only (stop,) uint64 view of hashes ``[0, stop)`` (all when None), converting the part not
        converted yet."""
        n = len(self._arr)
        stop = n if stop is None else max(0, min(int(stop), n))
        if stop > self._done:
            with self._lock:
                if stop > self._done:
                    assert self._ints is not None  # only the ints' form starts with _done < len
                    self._arr[self._done:stop] = _to_u64(self._ints[self._done:stop])
                    self._done = stop
        v = self._arr[:stop]
        v.flags.writeable = False
        return v

    def ints(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Hashes ``[start, stop)`` as Python ints modulo 2**64 (from the ints given, or the array's)."""
        if self._ints is None:
            out: list[int] = self._arr[start:stop].tolist()
            return out
        return [operator.index(h) & _M64 for h in self._ints[start:stop]]

    def __getitem__(self, s: slice) -> "SeqHashes":
        """Hashes ``[a, b)`` as their own SeqHashes (the ints' slice, or a view of the array)."""
        return SeqHashes(self._arr[s] if self._ints is None else self._ints[s])


@dataclass(frozen=True, eq=False)
class KeyRun(_SequenceABC[BlockKey]):
    """A run of keys of one (namespace, tenant, TP rank): ``BlockKey(namespace, tenant, rank, h)`` for each
    sequence hash ``h`` of ``hashes``, with no per-key object (a prefix lookup of 8K blocks on the
    scheduler's hot path). A :class:`Sequence` of :class:`BlockKey`: ``run[i]`` and iteration make the
    BlockKeys lazily and ``run[a:b]`` is a KeyRun, so any pool taking ``Sequence[BlockKey]`` accepts it;
    the compact G3 index and the scheduler's G3 mirror probe the uint64 hashes (:meth:`hash_array`)
    directly. Build with :meth:`Namespace.run`.

    Attributes:
        namespace: the namespace fingerprint (16 hex chars).
        tenant: the tenant id.
        rank: TP rank, 0 <= rank < 2**32.
        hashes: the sequence hashes (:class:`SeqHashes`, shared by the runs of every rank).

    Raises:
        ValueError: a rank outside [0, 2**32); TypeError: ``hashes`` not a SeqHashes.
    """

    namespace: str
    tenant: str
    rank: int
    hashes: SeqHashes

    def __post_init__(self) -> None:
        if type(self.rank) is not int or not 0 <= self.rank <= 0xFFFFFFFF:
            raise ValueError(f"KeyRun.rank: an int in [0, 2**32) is needed, got {self.rank!r}")
        if not isinstance(self.hashes, SeqHashes):
            raise TypeError(f"KeyRun.hashes: a SeqHashes is needed, got {type(self.hashes).__name__}")

    @property
    def seq_hashes(self) -> npt.NDArray[np.uint64]:
        """(N,) uint64 array of the sequence hashes, read-only (all converted)."""
        return self.hashes.array()

    def hash_array(self, stop: int) -> npt.NDArray[np.uint64]:
        """(min(stop, N),) uint64 array of hashes ``[0, stop)``: only that part is converted (a probe that
        goes chunk by chunk converts no more than it reads)."""
        return self.hashes.array(stop)

    def __len__(self) -> int:
        return len(self.hashes)

    @overload
    def __getitem__(self, i: int) -> BlockKey: ...

    @overload
    def __getitem__(self, i: slice) -> "KeyRun": ...

    def __getitem__(self, i: int | slice) -> "BlockKey | KeyRun":
        if isinstance(i, slice):
            return KeyRun(self.namespace, self.tenant, self.rank, self.hashes[i])
        n = len(self.hashes)
        if not -n <= i < n:
            raise IndexError(f"KeyRun index {i} outside {n} keys")
        i %= n
        return BlockKey(self.namespace, self.tenant, self.rank, self.hashes.ints(i, i + 1)[0])

    def __iter__(self) -> Iterator["BlockKey"]:
        ns, t, r, n = self.namespace, self.tenant, self.rank, len(self.hashes)
        for c in range(0, n, 512):  # lazily: a caller stopping early makes few keys
            for h in self.hashes.ints(c, min(n, c + 512)):
                yield BlockKey(ns, t, r, h)

    def keys(self) -> list["BlockKey"]:
        """The run as a list of :class:`BlockKey` (one object per key)."""
        ns, t, r = self.namespace, self.tenant, self.rank
        return [BlockKey(ns, t, r, h) for h in self.hashes.ints()]

    def __repr__(self) -> str:
        return f"KeyRun({self.namespace!r}, {self.tenant!r}, rank={self.rank}, {len(self)} keys)"


def tenant_bytes(tenant: str) -> bytes:
    """The bytes of a tenant id wherever it is hashed: UTF-8 with ``surrogatepass``. Identical to UTF-8
    for every valid string; a lone surrogate (U+D800..U+DFFF, what Python makes of undecodable bytes,
    e.g. a client's ``cache_salt``) becomes its 3-byte form instead of raising UnicodeEncodeError, so
    every ``str`` is a tenant (docs/format.md, Identity).

    Raises:
        TypeError: ``tenant`` is not a str.
    """
    if type(tenant) is not str and not isinstance(tenant, str):
        raise TypeError(f"tenant: a str is needed, got {type(tenant).__name__}")
    return tenant.encode("utf-8", "surrogatepass")


def tenant_tag(tenant: str) -> bytes:
    """16-byte tag of a tenant id in G3 frames: xxh3_128 of :func:`tenant_bytes` (UTF-8; G4 uses a keyed
    HMAC). Raises TypeError for a non-str."""
    return xxhash.xxh3_128_digest(tenant_bytes(tenant))


def key_columns(rows: Sequence[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
    """The columns of ``rows`` (e.g. :class:`BlockKey` s: namespace, tenant, rank, seq_hash) in one C pass,
    ``tuple(zip(*rows))`` (about half the time of one ``map(itemgetter)`` pass per column). Used by the
    batch lookups of the G3 index and the scheduler's G3 mirror. The cyclic garbage collector is paused
    meanwhile: zip holds one iterator per row until it returns, and 8K live allocations would start
    collections (a full collection of a big process is tens of ms); all are freed before it resumes, so
    the pause leaves no garbage and no allocation debt. (A ``gc.disable()`` made by another thread during
    this sub-millisecond window would be undone; nothing in kvbm_backend does that.)"""
    if not gc.isenabled():
        return tuple(zip(*rows))
    gc.disable()
    try:
        return tuple(zip(*rows))
    finally:
        gc.enable()
