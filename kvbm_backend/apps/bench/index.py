"""``kvbm-backend bench --tier index``: the in-memory G3 index, compact (numpy arrays,
:class:`~kvbm_backend.pool.g3.compact_index.CompactLruIndex`) against the OrderedDict index
(:class:`~kvbm_backend.pool.g3.index.LruIndex`) in the same run.

Sizes: 1M and 10M entries by default; ``--blocks N`` (other than the default 256) measures N entries
only. The OrderedDict index is measured at up to 1M entries (10M of them take several GB).

Per size, per index:

- ``bytes_per_block``: memory held by the index divided by its entries, measured with ``tracemalloc``
  (traced bytes after the build minus before; the entries' keys count for the OrderedDict index, where
  the index holds them). The compact index also reports ``array_bytes`` (its numpy arrays' ``nbytes``,
  capacity included) and ``capacity``.
- ``rebuild_s``: warm-restart build of the index from the journal's entries. Compact: from arrays
  (``restore_arrays``: tags, ranks, seq hashes, files, slots: the journal's columns, what a restart builds
  from), and ``rebuild_from_keys_s`` from (TagKey, slot) pairs (``restore_many``; at most 1M). OrderedDict:
  ``restore`` one by one. Journal file reading and decoding is not included.
- ``prefix_lookup_ms``: the scheduler's prefix lookup of an 8192-block prefix (all present, random start;
  blocks of one tenant, touched as found), median / p99 / min / max of ``LOOKUPS`` calls, timed on the
  public path from the sequence hashes as the scheduler holds them (the ``array('Q')`` it hashes a prompt
  into, :func:`~kvbm_backend.model.hashing.sequence_hashes` ``into=``; sliced to the lookup's length as
  it slices them) to the prefix length: the key runs the connector builds (:meth:`~kvbm_backend.model.namespace.Namespace.rank_runs`, what
  ``integrations/vllm/lookup.py`` calls), then rank 0's run through
  :meth:`~kvbm_backend.pool.g3.pool.G3Pool.lookup_prefix` (pool lock, counters and metrics included) of a
  real G3 pool (a tiny one in a temporary directory) holding the built index; ``prefix_lookup_path``
  names the calls measured. ``keys_lookup_ms``: full-hit lookups of other 8192-block prefixes given as lists of
  :class:`BlockKey` objects built beforehand (not timed), the per-key path.
- ``partial_lookup_ms``: the same lookups of prefixes whose block ``PARTIAL_AT`` (300) is absent (a
  sequence hash no entry has), i.e. a partial hit of 300 blocks, the usual case of a new request
  (``partial_hit_blocks``); median / p99 / min / max.
- ``get_us``: ``get(key, touch=True)`` of one random present key (the pool's get/lease path), mean.
- ``evict_ms``: ``evict(1024)`` on the full index, median of 5.
- ``table_grow_s`` (compact): one rebuild of the hash table at twice its size, what a ``put`` that
  crosses a power of two pays once (under the pool lock).

``mirror``: the scheduler's G3 mirror (:class:`~kvbm_backend.integrations.vllm.g3_mirror.G3Mirror`, 64-bit
fingerprints in a numpy hash set) at the same sizes: ``bytes_per_block`` (its table's ``nbytes`` / blocks),
``apply_s`` (the snapshot applied as 1M-entry reports: fingerprinting and table growth included, building
the reports not), ``prefix_lookup_ms`` (``rank_runs`` then ``G3Mirror.lookup_prefix(run).result()`` of the
same 8192-block prefixes, all present), ``partial_lookup_ms`` (the same with block 300 absent, as above) and
``keys_lookup_ms`` (full hits given BlockKey lists, as above).

``sequence_hashes_ms``: what the scheduler does for every new request before its lookup, hashing the
prompt's full blocks (:func:`~kvbm_backend.model.hashing.sequence_hashes`, KVBM's chained xxh3) from a list
of Python int token ids as vLLM holds them into an ``array('Q')`` (as the scheduler does): ``PREFIX`` blocks
of ``HASH_BLOCK_TOKENS`` tokens, median / p99 / min / max of ``HASH_RUNS`` calls. ``token_digests_ms``: the same
prompt's token digests (:func:`~kvbm_backend.model.hashing.token_digests`, BLAKE2b-128 chained), which the scheduler
computes for the blocks its load and save jobs name (docs/format.md "Token digest"): the same statistics.

Keys: random 64-bit sequence hashes, 8 tenants (one of them ``""``, the rest restored as tag entries),
rank 0, 8 files. Times are wall-clock (``perf_counter``), on whatever else the machine runs.
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import BlockKey, Namespace, tenant_tag
from kvbm_backend.pool.g3.compact_index import CompactLruIndex
from kvbm_backend.pool.g3.index import LruIndex, TagKey
from ..signals import raise_if_terminated
from . import BenchOptions

NAMESPACE = Namespace(model="bench/index", layout=KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64,
                                                              dtype="bfloat16"))  # 8 KiB blocks
NS = NAMESPACE.fingerprint
TENANTS = [""] + [f"tenant-{i}" for i in range(7)]
PREFIX = 8192
LOOKUPS = 50
PARTIAL_AT = 300
HASH_BLOCK_TOKENS = 32
HASH_RUNS = 10
OLD_MAX = 1_000_000
KEYS_MAX = 1_000_000


def _data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = rng.integers(0, 2 ** 64, n, dtype=np.uint64, endpoint=False)
    tenant = (np.arange(n) // PREFIX) % len(TENANTS)  # one tenant per 8K run (a sequence)
    tagtab = np.frombuffer(b"".join(tenant_tag(t) for t in TENANTS), np.uint8).reshape(-1, 16)
    return {"seqs": seqs, "tenant": tenant, "tags": tagtab[tenant], "ranks": np.zeros(n, np.int64),
            "files": np.arange(n, dtype=np.int64) % 8, "slots": np.arange(n, dtype=np.int64) // 8}


def _tag_entries(d, n: int) -> list:
    tags = [tenant_tag(t) for t in TENANTS]
    return [(TagKey(NS, tags[t], 0, s), (f, sl)) for t, s, f, sl in
            zip(d["tenant"][:n].tolist(), d["seqs"][:n].tolist(), d["files"][:n].tolist(), d["slots"][:n].tolist())]


def _prefixes(d, n: int, rng) -> list[tuple[str, array]]:
    """``LOOKUPS`` prefixes as (tenant, sequence hashes as an ``array('Q')``, as the scheduler holds them)."""
    out = []
    for _ in range(LOOKUPS):
        raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
        run = int(rng.integers(0, max(1, n // PREFIX)))
        a = run * PREFIX
        b = min(n, a + PREFIX)
        out.append((TENANTS[int(d["tenant"][a])], array("Q", d["seqs"][a:b].tobytes())))
    return out


def _partial(pre: list[tuple[str, array]], d, n: int) -> list[tuple[str, array]]:
    """The prefixes with block PARTIAL_AT's hash replaced by a sequence hash none of the ``n`` entries has."""
    cand = np.random.default_rng(2).integers(0, 2 ** 64, 4 * len(pre), dtype=np.uint64, endpoint=False)
    absent = cand[~np.isin(cand, d["seqs"][:n])].tolist()
    return [(t, hs[:PARTIAL_AT] + array("Q", [a]) + hs[PARTIAL_AT + 1:]) if len(hs) > PARTIAL_AT else (t, hs)
            for (t, hs), a in zip(pre, absent)]


def _partial_want(q) -> int:
    return min(PARTIAL_AT, len(q[1]))


def _full_want(q) -> int:
    return len(q[1])


def _public(lookup):
    """The scheduler's lookup of one prefix, ``(tenant, hashes)`` -> prefix length: the key runs of every
    rank (``Namespace.rank_runs``, as ``integrations/vllm/lookup.py`` builds them), rank 0's run looked up
    with ``lookup(run)``. The hashes are sliced first, as the scheduler slices its ``array('Q')``
    (``st.hashes[:n]``)."""
    return lambda q: lookup(NAMESPACE.rank_runs(q[1][:len(q[1])], q[0])[0][0])


def _timed(lookup, pre: Sequence[Any], want, what: str) -> dict:
    times = []
    for q in pre:
        t0 = time.perf_counter()
        got = lookup(q)
        times.append(time.perf_counter() - t0)
        if got != want(q):
            raise RuntimeError(f"index bench: {what} prefix lookup found {got} of {want(q)} (index is wrong)")
    return _ms(times)


def _keys_timed(lookup, pre: list) -> dict:
    """Full-hit lookups given BlockKey lists built beforehand (the per-key path; building not timed). The
    caller passes prefixes other than the timed public path's (their entries not cached by it)."""
    keys = [NAMESPACE.keys(hs, t, 0) for t, hs in pre]
    return _timed(lambda i: lookup(keys[i]), range(len(pre)), lambda i: len(keys[i]), "BlockKey list")


def _ms(times: list[float]) -> dict:
    times = sorted(times)
    return {"median": round(statistics.median(times) * 1e3, 4),
            "p99": round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, 4),
            "min": round(times[0] * 1e3, 4), "max": round(times[-1] * 1e3, 4)}


def _measure(ix, d, n: int, seed: int, lookup=None) -> dict:
    rng = np.random.default_rng(seed)
    pre = _prefixes(d, n, rng)
    if lookup is None:
        def lookup(keys):
            return ix.lookup_prefix(keys, NS)
    full = _timed(_public(lookup), pre, _full_want, "")
    part = _timed(_public(lookup), _partial(pre, d, n), _partial_want, "partial")
    keys_ms = _keys_timed(lookup, _prefixes(d, n, np.random.default_rng(seed + 100)))
    pick = rng.integers(0, n, 10000)
    gk = [BlockKey(NS, TENANTS[int(d["tenant"][i])], 0, int(d["seqs"][i])) for i in pick]
    t0 = time.perf_counter()
    for k in gk:
        if ix.get(k, touch=True) is None:
            raise RuntimeError("index bench: a present key was not found")
    get_us = (time.perf_counter() - t0) / len(gk) * 1e6
    ev = []
    for _ in range(5):
        raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
        t0 = time.perf_counter()
        ix.evict(1024)
        ev.append(time.perf_counter() - t0)
    return {"prefix_blocks": PREFIX, "lookups": len(pre), "prefix_lookup_ms": full,
            "partial_hit_blocks": PARTIAL_AT, "partial_lookup_ms": part, "keys_lookup_ms": keys_ms,
            "get_us": round(get_us, 3),
            "evict_ms": round(statistics.median(ev) * 1e3, 3)}


def _compact(d, n: int) -> dict:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    ix = CompactLruIndex()
    ix.restore_arrays(NS, d["tags"][:n], d["ranks"][:n], d["seqs"][:n], d["files"][:n], d["slots"][:n])
    rebuild = time.perf_counter() - t0
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if len(ix) != n:
        raise RuntimeError(f"index bench: {len(ix)} entries after restoring {n}")
    out: dict[str, Any] = {"entries": n, "bytes_per_block": round((cur - base) / n, 2), "index_bytes": cur - base,
           "build_peak_bytes": peak - base, "array_bytes": ix.nbytes, "capacity": ix._ent.cap,
           "rebuild_s": round(rebuild, 3)}
    if n <= KEYS_MAX:
        ents = _tag_entries(d, n)
        t0 = time.perf_counter()
        ix2 = CompactLruIndex()
        ix2.restore_many(ents)
        out["rebuild_from_keys_s"] = round(time.perf_counter() - t0, 3)
        del ents, ix2
    out.update(_pool_measure(ix, d, n))
    t0 = time.perf_counter()
    ix._table.rebuild(ix._table.size.bit_length())
    out["table_grow_s"] = round(time.perf_counter() - t0, 3)
    return out


def _pool_measure(ix: CompactLruIndex, d, n: int) -> dict:
    """:func:`_measure` with the prefix lookups through a real :class:`G3Pool` holding ``ix`` (what its
    journal restore builds), so the time is the public ``pool.lookup_prefix(keys).result()``."""
    from kvbm_backend.config import AdmissionConfig, G3Config
    from kvbm_backend.metrics import new_registry
    from kvbm_backend.pool import open_pool
    from kvbm_backend.pool.g3.pool import G3Pool
    with tempfile.TemporaryDirectory(prefix="kvbm-bench-index-") as tmp:
        pool = open_pool(G3Config(paths=[tmp], capacity_gb=0.02, files_per_path=1,
                               admission=AdmissionConfig(policy="all")), NAMESPACE, registry=new_registry())
        assert isinstance(pool, G3Pool)  # open_pool(G3Config) opens a G3Pool; the bench swaps its index
        try:
            empty, pool.index = pool.index, ix  # the index the pool's journal restore would have built
            out = _measure(ix, d, n, seed=1, lookup=lambda keys: pool.lookup_prefix(keys).result())
            out["prefix_lookup_path"] = "Namespace.rank_runs(hashes, tenant) -> G3Pool.lookup_prefix(run).result()"
        finally:
            pool.index = empty  # close() journals nothing of the bench's entries
            pool.close()
    return out


def _ordered(d, n: int) -> dict:
    ents = _tag_entries(d, n)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ix = LruIndex()
    ix.restore_many(_tag_entries(d, n))  # keys made here count: the index holds them
    cur = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del ix
    gc.collect()
    t0 = time.perf_counter()
    ix = LruIndex()
    ix.restore_many(ents)
    rebuild = time.perf_counter() - t0
    out: dict[str, Any] = {"entries": n, "bytes_per_block": round((cur - base) / n, 2), "index_bytes": cur - base,
           "rebuild_s": round(rebuild, 3)}
    out.update(_measure(ix, d, n, seed=1))
    out["prefix_lookup_path"] = "Namespace.rank_runs(hashes, tenant) -> LruIndex.lookup_prefix(run, namespace)"
    return out


def _mirror(d, n: int) -> dict:
    from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror  # imports vLLM (metadata classes): only here
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    tags = [tenant_tag(t) for t in TENANTS]
    m = G3Mirror(NAMESPACE)
    apply_s = 0.0
    for a in range(0, n, 1_000_000):
        raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
        b = min(n, a + 1_000_000)
        meta = KvbmWorkerMeta(added=[(tags[t], 0, s) for t, s in
                                     zip(d["tenant"][a:b].tolist(), d["seqs"][a:b].tolist())], snapshot=a == 0)
        t0 = time.perf_counter()
        m.apply(meta)
        apply_s += time.perf_counter() - t0
        del meta
    if len(m) != n:
        raise RuntimeError(f"index bench: mirror holds {len(m)} of {n}")
    pre = _prefixes(d, n, np.random.default_rng(1))
    def lookup(keys):
        return m.lookup_prefix(keys).result()
    full = _timed(_public(lookup), pre, _full_want, "mirror")
    part = _timed(_public(lookup), _partial(pre, d, n), _partial_want, "mirror partial")
    keys_ms = _keys_timed(lookup, _prefixes(d, n, np.random.default_rng(101)))
    st = m.stats()
    return {"entries": n, "bytes_per_block": round(st["bytes"] / n, 2), "array_bytes": st["bytes"],
            "apply_s": round(apply_s, 3), "prefix_lookup_ms": full, "partial_hit_blocks": PARTIAL_AT,
            "partial_lookup_ms": part, "keys_lookup_ms": keys_ms,
            "prefix_lookup_path": "Namespace.rank_runs(hashes, tenant) -> G3Mirror.lookup_prefix(run).result()"}


def _hashing(digests: bool = False) -> dict:
    """``sequence_hashes`` (``digests``: ``token_digests``) of a ``PREFIX``-block prompt given as a list of Python ints
    (the module docstring)."""
    from kvbm_backend.model.hashing import salt_bytes, sequence_hashes, token_digests
    toks = np.random.default_rng(1).integers(0, 128_000, PREFIX * HASH_BLOCK_TOKENS).tolist()
    times = []
    for _ in range(HASH_RUNS):
        raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
        t0 = time.perf_counter()
        if digests:  # as the scheduler's identity.block_digests: into the request's bytearray, 16 bytes a block
            n = len(token_digests(toks, HASH_BLOCK_TOKENS, salt_bytes("tenant-a"), into=bytearray())) // 16
        else:
            n = len(sequence_hashes(toks, HASH_BLOCK_TOKENS, into=array("Q")))  # as the scheduler hashes
        times.append(time.perf_counter() - t0)
        if n != PREFIX:
            raise RuntimeError(f"index bench: {'token_digests' if digests else 'sequence_hashes'} gave {n} for "
                               f"{PREFIX} blocks")
    return {**_ms(times), "blocks": PREFIX, "block_tokens": HASH_BLOCK_TOKENS}


def run(opts: BenchOptions) -> dict:
    """Returns the JSON-able result (see the module docstring); sizes from ``opts.blocks``."""
    sizes = [1_000_000, 10_000_000] if opts.blocks == 256 else [int(opts.blocks)]
    d = _data(max(sizes))
    res: dict[str, Any] = {"tier": "index", "namespace_entries": "one namespace, 8 tenants, rank 0",
           "memory_method": "tracemalloc (traced bytes after build minus before)", "prefix_blocks": PREFIX,
           "cpu_count": os.cpu_count(), "compact": {}, "ordereddict": {}, "mirror": {}}
    res["sequence_hashes_ms"] = _hashing()
    res["token_digests_ms"] = _hashing(digests=True)
    for n in sizes:
        raise_if_terminated()
        res["compact"][str(n)] = _compact(d, n)
        gc.collect()
    for n in sizes:
        raise_if_terminated()
        res["mirror"][str(n)] = _mirror(d, n)
        gc.collect()
    for n in sizes:
        if n <= OLD_MAX:
            res["ordereddict"][str(n)] = _ordered(d, n)
            gc.collect()
    big = str(max(sizes))
    c = res["compact"][big]
    res["targets"] = {"entries": max(sizes),
                      "memory_under_1_gib": c["index_bytes"] < 1 << 30,
                      "prefix_8k_under_1_ms": c["prefix_lookup_ms"]["median"] < 1.0,
                      "mirror_prefix_8k_under_1_ms": res["mirror"][big]["prefix_lookup_ms"]["median"] < 1.0,
                      "rebuild_under_10_s": c["rebuild_s"] < 10.0}
    return res
