"""``kvbm-backend plan``: size G3 (local SSD, per node) and G4 (shared) from a request trace.

Input: a Mooncake JSONL trace (``timestamp`` ms, ``input_length`` tokens, ``hash_ids`` of 512-token
blocks; ``../shared/data/README.md``) or a seeded synthetic one (:func:`synth_trace`), a model preset
(``layouts/``), TP degree, page size and the fleet (:class:`Fleet`). Output, per point of a sweep over
G3 capacity per node x G4 capacity: hit rates per tier, bytes read/written per second per tier, G3
drive writes per day, and time to first token saved against recomputing the prefill.

The simulation is ``replay --simulate``'s, reused (:class:`kvbm_backend.apps.replay.SimPool`: the G3
pool's LRU index and admission filter with no I/O; :class:`kvbm_backend.apps.replay.KeyMaker`: the same
KVBM sequence hashes), so with one worker, TP 1 and no G4 the G3 hits equal ``replay``'s on the same
trace, layout, page size and capacity (``tests/apps/test_plan.py`` checks it against a real-bytes replay).

Model, per request in trace order (stated; every number follows from it):
- A worker is one engine instance of ``tp`` ranks; a node holds ``workers_per_node`` of them. Each
  worker has its own G3 pool (KVBM's G3 is per worker) of ``G3 capacity per node / workers_per_node``
  bytes; G4 is one pool shared by the whole fleet.
- A block stored by a worker in G3 is one frame per rank: ``tp x frame.slot_bytes(per-rank block bytes)``
  bytes (4 KiB header + payload padded to 4 KiB, as the G3 pool stores it); each rank has its own G3
  pool of ``1 / tp`` of the worker's share (the connector's ``rank_g3_config``), MLA included (every rank
  keeps its copy of the replicated latent). In G4 a block is one frame per distinct
  ``Namespace.shared_rank``: ``tp`` frames, but one for MLA (the latent is stored once, under rank 0's
  key); every rank still loads its own copy, so a G4 hit reads ``tp`` frames either way.
- Routing (:class:`Router`): ``round-robin``, or ``prefix``: a stand-in for Dynamo's KV-aware
  router (lowest prefill work plus decayed load).
- Puts: in puts of :func:`~kvbm_backend.apps.replay.put_blocks` pages, as ``replay`` makes them.
- Lookup: the worker's G3 serves the longest prefix of the request's pages it holds; G4 then serves
  the longest run of the following pages it holds. Then every page is offered to the worker's G3 and
  to G4 (each tier's own admission filter: KVBM's second-sighting ``frequency`` or ``--admit-all``;
  present pages are skipped; LRU eviction beyond capacity).
- Rates: bytes over the trace's span (last minus first timestamp). DWPD: G3 bytes written per day on
  the busiest node / G3 capacity per node.
- TTFT saved per request: hit tokens / prefill rate minus load time, load time = G3 hit bytes / the
  node's G3 read bandwidth + G4 hit bytes / the worker's G4 read bandwidth (one load at a time; a
  negative value means loading is slower than recomputing). Recompute time is linear in tokens
  (attention makes long prefills dearer, so this is a lower bound on the saving).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

import numpy as np

from kvbm_backend.config import AdmissionConfig
from kvbm_backend.model import frame
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.model.presets import load_preset
from .replay import (TRACE_BLOCK_TOKENS, KeyMaker, SimPool, capacity_blocks, hybrid_warning, load_trace,
                     no_block_error, parse_record, put_blocks)

ROUTING = ("prefix", "round-robin")


@dataclass(frozen=True)
class SynthSpec:
    """A seeded synthetic multi-turn trace.

    ``users`` x ``conversations_per_user`` conversations of ``turns`` requests each. Every request
    starts with the same system prompt (``system_prompt_tokens``, rounded up to whole 512-token trace
    blocks, shared by all); turn t (1..turns) of a conversation has ``system + t x turn_tokens`` input
    tokens (each turn adds the previous answer and the new message) and extends turn t-1's context.
    Conversations start as a Poisson process of ``arrival_rate`` per second; a conversation's next
    turn follows after an exponential think time of mean ``think_s`` seconds. ``seed`` seeds numpy."""

    users: int = 100
    conversations_per_user: int = 1
    turns: int = 10
    system_prompt_tokens: int = 2048
    turn_tokens: int = 1024
    arrival_rate: float = 1.0
    think_s: float = 60.0
    seed: int = 0


def synth_trace(spec: SynthSpec) -> list[dict]:
    """Mooncake-format records (``timestamp`` ms, ``input_length``, ``output_length`` 0, ``hash_ids``)
    of ``spec``, sorted by timestamp. Raises ValueError for a non-positive count, rate or size."""
    for name in ("users", "conversations_per_user", "turns", "turn_tokens"):
        if getattr(spec, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(spec, name)}")
    if spec.system_prompt_tokens < 0:
        raise ValueError(f"--system-prompt-tokens: must be >= 0, got {spec.system_prompt_tokens}")
    if not spec.arrival_rate > 0 or not math.isfinite(spec.arrival_rate):
        raise ValueError(f"--arrival-rate: must be a finite number > 0, got {spec.arrival_rate}")
    if not spec.think_s >= 0 or not math.isfinite(spec.think_s):
        raise ValueError(f"--think-s: must be a finite number >= 0, got {spec.think_s}")
    rng = np.random.default_rng(spec.seed)
    sys_blocks = -(-spec.system_prompt_tokens // TRACE_BLOCK_TOKENS)
    sys_tokens = sys_blocks * TRACE_BLOCK_TOKENS
    own_blocks = -(-spec.turns * spec.turn_tokens // TRACE_BLOCK_TOKENS)
    n_conv = spec.users * spec.conversations_per_user
    starts = np.cumsum(rng.exponential(1.0 / spec.arrival_rate, n_conv))
    starts -= starts[0]
    out: list[dict[str, Any]] = []
    next_id = sys_blocks
    for c in range(n_conv):
        ids = list(range(sys_blocks)) + list(range(next_id, next_id + own_blocks))
        next_id += own_blocks
        t_s = float(starts[c])
        for t in range(1, spec.turns + 1):
            if t > 1:
                t_s += float(rng.exponential(spec.think_s)) if spec.think_s > 0 else 0.0
            length = sys_tokens + t * spec.turn_tokens
            out.append({"timestamp": round(t_s * 1000.0, 3), "input_length": length, "output_length": 0,
                        "hash_ids": ids[:-(-length // TRACE_BLOCK_TOKENS)]})
    out.sort(key=lambda r: r["timestamp"])  # stable: a conversation's turns keep their order
    return out


def write_trace(records: list[dict], path: str) -> None:
    """Write records as Mooncake JSONL (one object per line)."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def load_timed_trace(path: str, limit: int | None = None) -> list[dict]:
    """Read a Mooncake JSONL trace with its timestamps (ms). Raises ValueError naming ``--trace`` and
    the line of a malformed record or one without a finite numeric ``timestamp`` (a JSON number: a string
    such as ``"5"`` or a boolean is refused, as are NaN and Infinity, which Python's JSON reader accepts), and for a trace with no request (:func:`load_trace`)."""
    def parse(line: str, p: str, n: int) -> dict:
        r = parse_record(line, p, n)
        try:
            ts = json.loads(line)["timestamp"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"--trace {p} line {n}: no numeric timestamp (ms)") from None
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):  # "5" or true is no time: float() took them
            raise ValueError(f"--trace {p} line {n}: timestamp must be a JSON number of ms, got {ts!r:.80}")
        r["timestamp"] = float(ts)
        if not math.isfinite(r["timestamp"]):
            raise ValueError(f"--trace {p} line {n}: timestamp must be a finite number of ms, got {r['timestamp']}")
        return r
    return load_trace(path, limit, parse)


@dataclass(frozen=True)
class Fleet:
    """The serving fleet. Bandwidths in GB/s (1e9 bytes/s), prefill rate in tokens/s per worker."""

    nodes: int = 1
    workers_per_node: int = 1
    g3_read_gbps: float = 6.0      # per node (e.g. one PCIe Gen4 NVMe ~ 6-7 GB/s sequential read)
    g3_write_gbps: float = 3.0     # per node
    g4_read_gbps: float = 2.0      # per worker (its client link to the shared store)
    prefill_tokens_per_s: float = 10_000.0  # per worker; an input (order of magnitude, not measured here)
    routing: str = "prefix"
    router_decay_s: float = 60.0   # prefix routing: time constant of a worker's load

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node


class Router:
    """Picks a worker per request. Deterministic and independent of the tiers' contents, so every
    sweep point sees the same routing.

    ``round-robin``: request i goes to worker i mod workers. ``prefix`` (after Dynamo's KV-aware
    router, whose cost is prefill work plus load): cost(w) = the input tokens w would have to prefill
    (input minus the longest prefix of this request's 512-token trace blocks that w has served
    before; eviction is not modelled) + w's load (input tokens routed to it, decayed exponentially
    with time constant ``router_decay_s``); the lowest cost wins, the lowest index on ties."""

    def __init__(self, fleet: Fleet):
        if fleet.routing not in ROUTING:
            raise ValueError(f"--routing: expected prefix or round-robin, got {fleet.routing!r}")
        if not (math.isfinite(fleet.router_decay_s) and fleet.router_decay_s > 0):
            raise ValueError(f"--router-decay-s: must be a finite number > 0, got {fleet.router_decay_s}")
        self.fleet = fleet
        self.n = 0
        self.load = [0.0] * fleet.workers
        self.t_s: float | None = None
        self.owners: dict[int, set[int]] = {}

    def route(self, hash_ids: list[int], input_length: int, timestamp_ms: float = 0.0) -> int:
        """The worker (0 .. workers-1) for a request; ``timestamp_ms`` in trace order."""
        f = self.fleet
        self.n += 1
        if f.routing == "round-robin" or f.workers == 1:
            return (self.n - 1) % f.workers
        t = timestamp_ms / 1000.0
        if self.t_s is not None and t > self.t_s:
            k = math.exp(-(t - self.t_s) / f.router_decay_s)
            self.load = [x * k for x in self.load]
        self.t_s = t if self.t_s is None else max(t, self.t_s)
        chain, h = [], 0
        overlap = [0] * f.workers
        depth_known = True
        for k, x in enumerate(hash_ids, 1):
            h = hash((h, x))
            chain.append(h)
            if depth_known:
                ws = self.owners.get(h)
                if not ws:
                    depth_known = False
                    continue
                for w in ws:  # a worker that served a prefix served all shorter ones: sets are nested
                    overlap[w] = k
        cost = [max(0, input_length - overlap[w] * TRACE_BLOCK_TOKENS) + self.load[w] for w in range(f.workers)]
        w = min(range(f.workers), key=lambda i: (cost[i], i))
        for h in chain:
            self.owners.setdefault(h, set()).add(w)
        self.load[w] += input_length
        return w


class _Point(TypedDict):
    """One sweep point's simulation state: a G3 pool per worker, the shared G4 pool (None: no G4), the
    capacities simulated (GB per node / GB), G3 hits per worker, G4 hits (pages) and TTFT saved (s)."""
    g3: list[SimPool]
    g4: SimPool | None
    g3_gb: float
    g4_gb: float
    g3_hits: list[int]
    g4_hits: int
    saved_s: float


def _none_if(d: float | None, v: float) -> float | None:
    return None if not d else v / d


def _simulate(requests: list[dict[str, Any]], km: KeyMaker, router: Router, points: list[_Point], page_size: int,
              s_per_token: float, g3_s_per_block: float, g4_s_per_block: float, unique: set[int],
              counts: list[int], bar: Any, task: Any) -> None:
    """The per-request loop of :func:`run_plan` (see the module doc); accumulates into ``points``,
    ``unique`` and ``counts`` ([pages looked up, input tokens])."""
    for r in requests:
        keys = km.seq_hashes(r["hash_ids"], r["input_length"])
        w = router.route(r["hash_ids"], r["input_length"], r["timestamp"])
        counts[0] += len(keys)
        counts[1] += r["input_length"]
        unique.update(keys)
        for p in points:
            g3p, g4p = p["g3"][w], p["g4"]
            n3 = g3p.lookup_prefix(keys)
            n4 = g4p.lookup_prefix(keys[n3:]) if g4p is not None else 0
            g3p.put(keys)
            if g4p is not None:
                g4p.put(keys)
            p["g3_hits"][w] += n3
            p["g4_hits"] += n4
            p["saved_s"] += ((n3 + n4) * page_size * s_per_token - n3 * g3_s_per_block - n4 * g4_s_per_block)
        if bar is not None:
            bar.update(task, advance=1)


def run_plan(requests: list[dict], layout: str, page_size: int = 16, tp: int = 1, fleet: Fleet = Fleet(),
             g3_capacities_gb: Sequence[float] = (1000.0,), g4_capacities_gb: Sequence[float] = (0.0,),
             admit_all: bool = False, source: dict | None = None, progress: bool = False) -> dict:
    """Simulate ``requests`` (records with ``timestamp`` ms, ``input_length``, ``hash_ids``; trace
    order) for every (G3 GB per node, G4 GB) pair of the sweep (G4 0 = no G4). ``progress``: a
    transient rich progress bar on the terminal.

    Returns a JSON-able dict: the settings, ``requests``, ``span_s`` (trace span, None for one
    instant), ``worker_block_bytes`` (bytes of one block of one worker in G3, all ranks' frames: what a
    G3 or G4 hit loads), ``g4_block_bytes`` (bytes of one block in G4: one frame for MLA, else ``tp``),
    ``unique_bytes`` (every distinct page once: the capacity that holds the whole trace),
    ``breakeven_load_gbps`` (the load bandwidth at which loading a page takes as long as recomputing
    it: stored bytes per token x prefill tokens/s) and
    ``points``, one dict per sweep point with ``g3_hit_blocks`` / ``g4_hit_blocks`` (pages),
    ``g3_hit_rate`` / ``g4_hit_rate`` / ``hit_rate`` (of ``lookup_blocks``), byte counts and rates
    (GB/s; per node: mean and busiest node), ``g3_dwpd``, ``ttft_recompute_s_mean``,
    ``ttft_saved_s_mean`` and ``ttft_saved_fraction``. Rates and DWPD are None when ``span_s`` is. A hybrid
    (sliding-window) layout adds ``warnings`` (:func:`hybrid_warning`: it is sized as if every layer stored
    every token).

    Raises:
        ValueError: naming the option: no requests, unknown layout / TP not dividing its KV heads, page size < 1,
            capacities < 0 or non-finite, a G3 capacity of 0, a nonzero capacity that holds no block
            (a worker's share of G3), bad fleet numbers, unknown routing.
    """
    if page_size < 1:
        raise ValueError(f"--page-size: must be >= 1, got {page_size}")
    for name, n in (("--nodes", fleet.nodes), ("--workers-per-node", fleet.workers_per_node), ("--tp", tp)):
        if n < 1:
            raise ValueError(f"{name}: must be >= 1, got {n}")
    for name, v in (("--g3-read-gbps", fleet.g3_read_gbps), ("--g3-write-gbps", fleet.g3_write_gbps),
                    ("--g4-read-gbps", fleet.g4_read_gbps), ("--prefill-tokens-per-s", fleet.prefill_tokens_per_s)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}: must be a finite number > 0, got {v}")
    for name, caps, lo in (("--g3-capacity-gb", g3_capacities_gb, "gt"), ("--g4-capacity-gb", g4_capacities_gb, "ge")):
        if not caps:
            raise ValueError(f"{name}: at least one capacity is needed")
        for c in caps:
            if not math.isfinite(c) or c < 0 or (lo == "gt" and c == 0):
                raise ValueError(f"{name}: each capacity must be a finite number {'>' if lo == 'gt' else '>='} 0, "
                                 f"got {c}")
    preset = load_preset(layout)
    if not requests:
        raise ValueError("--trace: no requests (an empty trace, or --limit 0)")
    lay = preset.layout(page_size=page_size, tp=tp)  # ValueError "tp: ..." / "layout: ..."
    sb = frame.slot_bytes(lay.bytes_per_block)  # one rank's frame
    wb = tp * sb  # G3: every rank stores (and every rank loads) its own frame of a block
    g4_frames = len({Namespace(model=f"plan/{layout}", layout=lay, tp_world_size=tp).shared_rank(r) for r in range(tp)})
    g4b = g4_frames * sb  # G4 stores a block once per distinct shared rank (MLA: once)
    put_n = put_blocks(lay.bytes_per_block, sb)
    adm = AdmissionConfig(policy="all" if admit_all else "frequency")
    W, WPN = fleet.workers, fleet.workers_per_node
    for name, caps, per, ranks, blk in (("--g3-capacity-gb", g3_capacities_gb, WPN, tp, wb),
                                        ("--g4-capacity-gb", g4_capacities_gb, 1, g4_frames, g4b)):
        for c in caps:  # G4 0 = no G4; any other capacity must hold a block (a rank's share of a worker's, for G3)
            if c > 0 and capacity_blocks(c * 1e9 / (per * ranks), sb) < 1:
                share = f"{c / per:g} GB per worker of {per} per node; " if per > 1 else ""
                raise ValueError(no_block_error(name, c, blk, f"{share}layout {layout}, tp {tp}, page size {page_size}",
                                                per))
    points: list[_Point] = []
    for g3 in g3_capacities_gb:
        for g4 in g4_capacities_gb:
            g4_blocks = capacity_blocks(g4 * 1e9 / g4_frames, sb)
            points.append({  # a worker's G3: its tp ranks' pools, alike (same keys), one simulated for all
                "g3": [SimPool(capacity_blocks(g3 * 1e9 / (WPN * tp), sb), adm, wb, put_n) for _ in range(W)],
                "g4": SimPool(g4_blocks, adm, g4b) if g4_blocks > 0 else None,
                "g3_gb": g3, "g4_gb": g4, "g3_hits": [0] * W, "g4_hits": 0, "saved_s": 0.0})
    router = Router(fleet)
    km = KeyMaker(page_size)
    unique: set[int] = set()
    counts = [0, 0]  # pages looked up, input tokens
    g3_s_per_block = wb / (fleet.g3_read_gbps * 1e9)
    g4_s_per_block = wb / (fleet.g4_read_gbps * 1e9)
    s_per_token = 1.0 / fleet.prefill_tokens_per_s
    bar = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.console import Console
        bar = Progress(TextColumn("plan"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True,
                       console=Console(stderr=True))
        bar.start()
        task = bar.add_task("plan", total=len(requests))
    try:
        _simulate(requests, km, router, points, page_size, s_per_token, g3_s_per_block, g4_s_per_block,
                  unique, counts, bar, task if bar is not None else None)
    finally:
        if bar is not None:
            bar.stop()
    lookups, tokens = counts
    ts = [r["timestamp"] for r in requests]
    span = (max(ts) - min(ts)) / 1000.0 if ts else 0.0
    span = span or None
    day = 86_400.0
    out_points = []
    for p in points:
        node_written = [sum(p["g3"][n * WPN + i].written for i in range(WPN)) * wb for n in range(fleet.nodes)]
        node_read = [sum(p["g3_hits"][n * WPN + i] for i in range(WPN)) * wb for n in range(fleet.nodes)]
        g3h, g4h = sum(p["g3_hits"]), p["g4_hits"]
        g4w = p["g4"].written * g4b if p["g4"] is not None else 0
        recompute = tokens * s_per_token
        out_points.append({
            "g3_capacity_gb_per_node": p["g3_gb"], "g4_capacity_gb": p["g4_gb"],
            "g3_capacity_blocks_per_worker": p["g3"][0].capacity,
            "g4_capacity_blocks": p["g4"].capacity if p["g4"] is not None else 0,
            "lookup_blocks": lookups, "g3_hit_blocks": g3h, "g4_hit_blocks": g4h,
            "g3_hit_rate": g3h / lookups if lookups else 0.0, "g4_hit_rate": g4h / lookups if lookups else 0.0,
            "hit_rate": (g3h + g4h) / lookups if lookups else 0.0,
            "g3_evictions": sum(x.evictions for x in p["g3"]),
            "g4_evictions": p["g4"].evictions if p["g4"] is not None else 0,
            "g3_bytes_read": sum(node_read), "g3_bytes_written": sum(node_written),
            "g4_bytes_read": g4h * wb, "g4_bytes_written": g4w,
            "g3_offloads_dropped": sum(x.dropped for x in p["g3"]),
            "g3_read_gbps_per_node": _none_if(span, sum(node_read) / fleet.nodes / 1e9),
            "g3_write_gbps_per_node": _none_if(span, sum(node_written) / fleet.nodes / 1e9),
            "g3_read_gbps_busiest_node": _none_if(span, max(node_read) / 1e9),
            "g3_write_gbps_busiest_node": _none_if(span, max(node_written) / 1e9),
            "g3_read_bandwidth_used": _none_if(span, max(node_read) / 1e9 / fleet.g3_read_gbps),
            "g3_write_bandwidth_used": _none_if(span, max(node_written) / 1e9 / fleet.g3_write_gbps),
            "g3_dwpd": _none_if(span, max(node_written) * day / (p["g3_gb"] * 1e9)),
            "g4_read_gbps": _none_if(span, g4h * wb / 1e9), "g4_write_gbps": _none_if(span, g4w / 1e9),
            "ttft_recompute_s_mean": recompute / len(requests) if requests else 0.0,
            "ttft_saved_s_mean": p["saved_s"] / len(requests) if requests else 0.0,
            "ttft_saved_fraction": p["saved_s"] / recompute if recompute else 0.0,
        })
    extra = {"warnings": [hybrid_warning(preset, "plan")]} if preset.hybrid else {}  # non-hybrid: as before
    return extra | {
        "kind": "plan", "source": source or {}, "layout": layout, "page_size": page_size, "tp": tp,
        "admission": adm.policy, "fleet": asdict(fleet) | {"workers": W},
        "bytes_per_token": preset.layout(page_size=1, tp=tp).bytes_per_block * tp,
        "breakeven_load_gbps": wb / page_size * fleet.prefill_tokens_per_s / 1e9,
        "worker_block_bytes": wb, "g4_block_bytes": g4b, "requests": len(requests), "input_tokens": tokens, "span_s": span,
        "unique_blocks": len(unique), "unique_bytes": len(unique) * wb, "points": out_points,
    }
