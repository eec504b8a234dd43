"""``kvbm-backend replay``: run a Mooncake-format request trace through the G3 pool.

Trace format (``../shared/data/README.md``): one JSON object per line with ``input_length`` (tokens)
and ``hash_ids`` (one id per 512-token block; equal ids at equal positions are a shared prefix).

Tokens: trace block ``id`` stands for the 512 tokens ``numpy.random.default_rng(id).integers(0,
32000, 512, dtype=uint32)``; a request's tokens are the concatenation over its ids cut to
``input_length`` (so a partial last block is the leading tokens of that function). Only full pages
of ``page_size`` tokens exist as blocks; their keys are KVBM sequence hashes
(:func:`kvbm_backend.model.hashing.sequence_hashes`, no salt, tenant ``""``, rank 0).

Per request, in trace order: look up its pages in order and count hits up to the first miss (real
mode: the hit pages are read back and their bytes compared with what was stored for the key, a
mismatch raises), then store all its pages (present ones are skipped by the pool, the admission
filter applies) and wait for the writes (so results do not depend on disk speed). Reads run with the largest
``g3.load_timeout_s`` (120 s), so a read slowed by a busy machine is not counted a miss.

Real mode writes real frames (payload = a deterministic function of the key) into a fresh
``replay-<random>`` directory under ``g3_path``, removed at the end (also on an error, Ctrl-C or SIGTERM),
with the directories it created for ``g3_path``. ``simulate`` drives the same
LRU index and admission code with no I/O, for capacity planning at full scale; its capacity is the
configured one (free disk space is not consulted).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvbm_backend.config import LOAD_TIMEOUT_MAX_S, AdmissionConfig, G3Config
from kvbm_backend.fsmodes import missing_dirs, remove_made_dirs
from kvbm_backend.model import frame
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.namespace import BlockKey, Namespace
from kvbm_backend.model.presets import load_preset

from .signals import raise_if_terminated, sigterm_as_interrupt

TRACE_BLOCK_TOKENS = 512
VOCAB = 32000
_MIX = np.uint64(0x9E3779B97F4A7C15)


def block_tokens(hash_id: int) -> np.ndarray:
    """The 512 token ids (uint32) trace block ``hash_id`` stands for."""
    return np.random.default_rng(int(hash_id)).integers(0, VOCAB, TRACE_BLOCK_TOKENS, dtype=np.uint32)


def request_tokens(hash_ids: list[int], input_length: int) -> np.ndarray:
    """A request's token ids: the blocks' tokens concatenated, cut to ``input_length``."""
    if not hash_ids:
        return np.zeros(0, np.uint32)
    return np.concatenate([block_tokens(h) for h in hash_ids])[:input_length]


def load_trace(path: str, limit: int | None = None, parse=None) -> list[dict]:
    """Read a Mooncake JSONL trace (UTF-8): up to ``limit`` records, each ``parse(line, path, line_number)``
    (default :func:`parse_record`). Raises ValueError naming ``--trace`` (and the line) for a missing file,
    a line that is not UTF-8, a malformed record, or no record at all (an empty trace, ``limit`` 0)."""
    parse = parse or parse_record
    if not os.path.isfile(path):
        raise ValueError(f"--trace: no file {path}")
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"--trace {path} line {n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            out.append(parse(line, path, n))
    if not out:
        raise ValueError(f"--trace {path}: no requests" + (" (--limit 0)" if limit == 0 else " (an empty trace)"))
    return out


def parse_record(line: str, path: str, n: int) -> dict:
    """One trace line as ``{"hash_ids": [int], "input_length": int}``. Raises ValueError naming
    ``path`` and line ``n`` when it is not a Mooncake record (``hash_ids`` a list of JSON integers,
    ``input_length`` one: a float, a boolean or a string is refused, never truncated, since ``1.2`` and ``1.7``
    would become the same block) or its length does not fit its blocks."""
    try:
        r = json.loads(line)
        ids, length = r["hash_ids"], r["input_length"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--trace {path} line {n}: not a Mooncake record ({e})") from None
    if not isinstance(ids, list):
        raise ValueError(f"--trace {path} line {n}: hash_ids must be a list of integers, got {ids!r:.80}")
    if not _is_int(length):
        raise ValueError(f"--trace {path} line {n}: input_length must be an integer, got {length!r:.80}")
    bad = next((x for x in ids if not _is_int(x)), None)
    if bad is not None:
        raise ValueError(f"--trace {path} line {n}: hash_ids must be integers >= 0, got {bad!r:.80}")
    bad = next((x for x in ids if x < 0), None)
    if bad is not None:
        raise ValueError(f"--trace {path} line {n}: hash_ids must be integers >= 0, got {bad}")
    if length < 0 or length > len(ids) * TRACE_BLOCK_TOKENS:
        raise ValueError(f"--trace {path} line {n}: input_length {length} does not fit "
                         f"{len(ids)} blocks of {TRACE_BLOCK_TOKENS} tokens")
    return {"hash_ids": ids, "input_length": length}


def _is_int(x: object) -> bool:
    """A JSON integer (Python's JSON reader gives int; bool is an int subclass, but ``true`` is no id)."""
    return isinstance(x, int) and not isinstance(x, bool)


class KeyMaker:
    """Sequence hashes of a request's full pages, memoised per (parent sequence hash, trace block)
    when ``page_size`` divides 512 (trace blocks are then whole pages); exact either way."""

    def __init__(self, page_size: int, memo_entries: int = 200_000):
        self.page_size = page_size
        self._aligned = TRACE_BLOCK_TOKENS % page_size == 0
        self._memo: OrderedDict = OrderedDict()
        self._memo_entries = memo_entries

    def seq_hashes(self, hash_ids: list[int], input_length: int) -> Sequence[int]:
        ps = self.page_size
        if not self._aligned:
            return sequence_hashes(request_tokens(hash_ids, input_length), ps)
        out: list[int] = []
        parent = None
        left = input_length
        for h in hash_ids:
            if left <= 0:
                break
            if left >= TRACE_BLOCK_TOKENS:
                mk = (parent, h)
                hs = self._memo.get(mk)
                if hs is None:
                    hs = sequence_hashes(block_tokens(h), ps, parent=parent)
                    self._memo[mk] = hs
                    if len(self._memo) > self._memo_entries:
                        self._memo.popitem(last=False)
                out.extend(hs)
                left -= TRACE_BLOCK_TOKENS
                parent = hs[-1]
            else:
                out.extend(sequence_hashes(block_tokens(h)[:left], ps, parent=parent))
                left = 0
        return out


def payload_for(seq_hash: int, base: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Deterministic block bytes for a key: ``base ^ mix(seq_hash)`` as u64 words, into ``out``."""
    np.bitwise_xor(base, np.uint64(xxhash.xxh3_64_intdigest(seq_hash.to_bytes(8, "little"))), out=out.view(np.uint64))
    return out


def capacity_blocks(capacity_bytes: float, slot_bytes: int) -> int:
    """Slots of ``slot_bytes`` bytes that fit in ``capacity_bytes`` bytes: ``round(capacity_bytes) // slot``,
    the slots a G3 pool of ``capacity_gb = capacity_bytes / 1e9`` holds (its capacity is
    ``round(capacity_gb * 1e9)`` bytes)."""
    return round(capacity_bytes) // slot_bytes


def put_blocks(block_bytes: int, slot_bytes: int) -> int:
    """Blocks per ``put`` in a replay (both modes; ``plan`` too): at most 4,096 blocks, 64 MiB of payload
    and one G3 writer piece, so the real pool publishes a put's blocks in order and its LRU order (hence
    hits and evictions) is deterministic and equal to :class:`SimPool`'s."""
    from kvbm_backend.pool.g3.pool import G3Pool
    piece = max(1, G3Pool.min_chunk_blocks, G3Pool.chunk_bytes // slot_bytes)
    return max(1, min(4096, (64 << 20) // block_bytes, piece))


def no_block_error(option: str, gb: float, slot_bytes: int, what: str, shares: int = 1) -> str:
    """The message for a capacity of ``gb`` GB (split in ``shares``) that holds no block of ``slot_bytes``
    bytes."""
    return (f"{option}: {gb:g} GB holds no block ({what}: {slot_bytes:,} bytes per block, frame header and "
            f"padding included); give at least {slot_bytes * shares / 1e9:.9g} GB")


class SimPool:
    """The G3 pool's index, eviction and admission without I/O (``--simulate``; ``kvbm-backend plan``).

    ``capacity_blocks`` slots, the admission filter of ``admission_cfg``; keys are any hashables (replay:
    BlockKey, plan: sequence hashes). :meth:`put` takes its keys in puts of at most ``put_blocks`` and
    each put follows the real pool (``G3Writer.put`` then ``_start_batch``): first the whole put is
    sorted out (a key held, or repeated in the put, is skipped and not touched; the admission filter
    sees each other key once, in order), then the admitted keys take free slots, the least recently
    used blocks are evicted at once for the ones short of a slot, and keys that still find none (a put
    larger than the pool) are dropped (``dropped``); the stored keys become most recently used in order."""

    def __init__(self, capacity_blocks: int, admission_cfg: AdmissionConfig, slot_bytes: int,
                 put_blocks: int | None = None):
        from kvbm_backend.pool.g3.admission import make_admission
        from kvbm_backend.pool.g3.index import LruIndex
        self.index = LruIndex()
        self.admission = make_admission(admission_cfg)
        self.capacity = capacity_blocks
        self.slot_bytes = slot_bytes
        self.put_blocks = put_blocks
        self.evictions = 0
        self.written = 0
        self.dropped = 0

    def lookup_prefix(self, keys) -> int:
        n = 0
        for k in keys:
            if self.index.get(k, touch=True) is None:
                break
            n += 1
        return n

    def put(self, keys) -> None:
        if self.capacity < 1:  # room for no block: nothing is stored (as a pool of that size)
            return
        keys = list(keys)
        step = self.put_blocks or max(1, len(keys))
        for c0 in range(0, len(keys), step):
            self._put_one(keys[c0:c0 + step])

    def _put_one(self, keys) -> None:
        index = self.index
        seen: set = set()
        new = []
        for k in keys:  # G3Writer.put: held or repeated keys skipped (not touched), the rest offered to admission
            if k in seen or k in index:
                continue
            seen.add(k)
            if self.admission.admit(k):
                new.append(k)
        if not new:
            return
        free = self.capacity - len(index)
        if len(new) > free:  # _start_batch: the batch's shortfall evicted at once, oldest first
            ev = index.evict(len(new) - free)
            self.evictions += len(ev)
            free += len(ev)
        take = new[:free]
        self.dropped += len(new) - len(take)
        for k in take:
            index.put(k, (0, 0))
        self.written += len(take)


_SimPool = SimPool  # the name this class had before ``plan`` used it


def hybrid_warning(preset, command: str) -> str:
    """What ``command`` (``plan`` / ``replay``, which size a layout's every layer for every token) does not
    model for a hybrid (sliding-window) preset, as one warning text."""
    overstated = "bytes, GB/s and DWPD are" if command == "plan" else "bytes are"
    return (f"{preset.name} is a hybrid model ({preset.sliding_layers} of {preset.num_layers} layers attend to a "
            f"{preset.sliding_window}-token window); {command} sizes it as if every layer stored every token "
            f"({preset.bytes_per_token:,} B/token), while the connector stores the full-attention layers "
            f"({preset.full_bytes_per_token:,} B/token) for every block and the sliding layers only near a "
            f"resume point, in pools of their own: {overstated} overstated and hit rates are "
            "those of a smaller cache (docs/capacity.md)")


def run_replay(trace: str, layout: str = "tiny", page_size: int = 16, g3_path: str | None = None,
               g3_capacity_gb: float = 1.0, admit_all: bool = False, limit: int | None = None,
               simulate: bool = False, progress: bool = False) -> dict:
    """Replay ``trace`` (see module doc). Returns a JSON-able dict with ``requests``, ``lookup_blocks``,
    ``hit_blocks``, ``hit_rate``, ``bytes_written``, ``bytes_read`` (frame bytes incl. 4 KiB headers),
    ``prefill_tokens_saved`` (hit blocks x page size), ``offloads_dropped``, ``evictions``,
    ``stored_blocks``, ``capacity_blocks``, ``elapsed_s`` and the settings; a hybrid (sliding-window) layout
    adds ``warnings`` (:func:`hybrid_warning`: every layer is sized for every token).

    Raises:
        ValueError: a missing/malformed trace, unknown layout, page size < 1, a capacity that holds no
            block, or no ``g3_path`` in real mode.
        RuntimeError: a hit served bytes other than those stored for its key (never expected).
    """
    if page_size < 1:
        raise ValueError(f"--page-size: must be >= 1, got {page_size}")
    if g3_capacity_gb <= 0:
        raise ValueError(f"--g3-capacity-gb: must be > 0, got {g3_capacity_gb}")
    if limit is not None and limit < 0:
        raise ValueError(f"--limit: must be >= 0, got {limit}")
    if not simulate and not g3_path:
        raise ValueError("--g3-path: a directory is needed unless --simulate")
    preset = load_preset(layout)
    lay = preset.layout(page_size=page_size)
    ns = Namespace(model=f"replay/{layout}", layout=lay)
    fp = ns.fingerprint
    reqs = load_trace(trace, limit)
    admission = AdmissionConfig(policy="all" if admit_all else "frequency")
    bb = lay.bytes_per_block
    sb = frame.slot_bytes(bb)
    if capacity_blocks(g3_capacity_gb * 1e9, sb) < 1:  # the real pool refuses it too: checked before any I/O
        raise ValueError(no_block_error("--g3-capacity-gb", g3_capacity_gb, sb, f"layout {layout}, page size {page_size}"))
    km = KeyMaker(page_size)
    chunk = put_blocks(bb, sb)
    t_start = time.perf_counter()

    pool = sim = run_dir = st = None
    created: list[str] = []  # directories made for g3_path (removed with the run directory)
    if simulate:
        sim = SimPool(capacity_blocks(g3_capacity_gb * 1e9, sb), admission, sb, chunk)
    elif bb % 8 != 0:
        raise ValueError(f"layout {layout}: block of {bb} bytes is not a multiple of 8")
    lookup_blocks = hit_blocks = 0
    bar = None
    restore_sigterm = None if simulate else sigterm_as_interrupt()
    try:  # from the run directory's creation on: a failure anywhere removes it (finally)
        if not simulate:
            from kvbm_backend.memory import aligned_empty
            from kvbm_backend.metrics import new_registry
            from kvbm_backend.pool import open_pool
            assert g3_path  # checked above: real mode needs it
            base = np.arange(bb // 8, dtype=np.uint64) * _MIX
            created = missing_dirs(g3_path)
            run_dir = os.path.join(g3_path, f"replay-{uuid.uuid4().hex[:12]}")
            cfg = G3Config(paths=[run_dir], capacity_gb=g3_capacity_gb, admission=admission,
                           write_queue_blocks=max(chunk, 1), files_per_path=4,
                           load_timeout_s=LOAD_TIMEOUT_MAX_S)  # the trace's hit rate, not the machine's load
            pool = open_pool(cfg, ns, registry=new_registry())
            wbufs = [aligned_empty(bb) for _ in range(chunk)]
            rbufs = [aligned_empty(bb) for _ in range(chunk)]
            expect = aligned_empty(bb)
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            bar = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("hit {task.fields[hr]}"), TimeRemainingColumn(), transient=True)
            bar.start()
            task = bar.add_task("replay", total=len(reqs), hr="-")
        for ri, r in enumerate(reqs):
            raise_if_terminated()  # a SIGTERM (real mode) ends the replay here (apps/signals.py)
            keys = [BlockKey(fp, "", 0, h) for h in km.seq_hashes(r["hash_ids"], r["input_length"])]
            lookup_blocks += len(keys)
            if sim is not None:
                hits = sim.lookup_prefix(keys)
                sim.put(keys)
            else:
                assert pool is not None  # real mode: opened above
                n = pool.lookup_prefix(keys).result()
                hits = 0
                for c0 in range(0, n, chunk):
                    part = keys[c0:min(n, c0 + chunk)]
                    got = pool.get(part, rbufs[:len(part)]).result()
                    ph = got.prefix_hits
                    for j in range(ph):
                        payload_for(part[j].seq_hash, base, expect)
                        if not np.array_equal(rbufs[j], expect):
                            raise RuntimeError(f"replay: request {ri} page {c0 + j}: G3 served bytes that differ "
                                               "from those stored for the key")
                    hits += ph
                    if ph < len(part):
                        break
                for c0 in range(0, len(keys), chunk):
                    part = keys[c0:c0 + chunk]
                    bufs = [payload_for(k.seq_hash, base, wbufs[j]) for j, k in enumerate(part)]
                    pool.put(part, bufs).result()
            hit_blocks += hits
            if bar is not None:
                bar.update(task, advance=1, hr=f"{hit_blocks / lookup_blocks:.1%}" if lookup_blocks else "-")
    finally:
        if bar is not None:
            bar.stop()
        if pool is not None:
            st = pool.stats()
            pool.close()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        remove_made_dirs(created)
        if restore_sigterm is not None:
            restore_sigterm()
    out = {
        "trace": trace,
        "layout": layout,
        "page_size": page_size,
        "block_bytes": bb,
        "slot_bytes": sb,
        "simulate": simulate,
        "admission": admission.policy,
        "g3_capacity_gb": g3_capacity_gb,
        "requests": len(reqs),
        "lookup_blocks": lookup_blocks,
        "hit_blocks": hit_blocks,
        "hit_rate": hit_blocks / lookup_blocks if lookup_blocks else 0.0,
        "prefill_tokens_saved": hit_blocks * page_size,
        "elapsed_s": time.perf_counter() - t_start,
    }
    if preset.hybrid:  # as plan: the result says what it leaves out (non-hybrid: no key)
        out["warnings"] = [hybrid_warning(preset, "replay")]
    if sim is not None:
        out.update(bytes_written=sim.written * sb, bytes_read=hit_blocks * sb, offloads_dropped=sim.dropped,
                   evictions=sim.evictions, stored_blocks=len(sim.index), capacity_blocks=sim.capacity,
                   corrupt_blocks=0)
    else:
        assert st is not None  # real mode: read before the pool closed
        out.update(bytes_written=st["bytes_written"], bytes_read=st["bytes_read"],
                   offloads_dropped=st["offloads_dropped"], evictions=st["evictions"], stored_blocks=st["blocks"],
                   capacity_blocks=st["capacity_blocks"], corrupt_blocks=st["corrupt"])
    return out
