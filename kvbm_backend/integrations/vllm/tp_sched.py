"""The scheduler's own TP agreements under vLLM's ``external_launcher`` with TP > 1 (every TP rank its own process
hosting a scheduler and that rank's worker; :mod:`.tp_agree` has the others and the collective pattern).

* **Saves** (:meth:`SchedAgree.saves`, once per step in ``build_connector_meta``, which every rank's scheduler reaches
  in the same step): a block is offered to the pools only when every rank's scheduler planned it, the intersection of
  the ranks' save plans (and a hand-off's G4-only blocks, below). A plan's inputs that run on each process's clock and pools (the revoked tenants' keyring
  checks, a G3 index busy at the look, the G4 lookups a hand-off's G4-only saves skip) can make one rank plan a block
  slice another rank's plan skips: stored on some ranks only, every later lookup of it misses (a lookup needs every
  rank's slice), its capacity wasted. The ranks first compare a 62-bit digest of their plans (one all-reduce of two
  int64s, every step); only when they differ are the plans gathered (:func:`.tp_agree.all_gather_bytes`) and
  intersected, counted ``tp_save_disagreed_steps`` (the blocks planned differ, or only a path) and
  ``tp_save_withheld_blocks`` (blocks this rank planned that no rank offers). The intersection compares a block's identity (request, tenant, KV cache group, engine block,
  sequence hash, token digest), not the path a rank chose for it: a hand-off's block one rank planned G4-only
  (``SaveJob.g4_only``: its view of G3 says G3 holds it, or cannot tell) and another as an ordinary G3 + G4 save is
  planned for G4 by every rank, and is offered **G4-only on every rank** (before 2026-12-03 it was offered nowhere:
  G4 got none of its slices, the decode worker waited ``handoff_wait_s`` and recomputed). One path on every rank,
  because a rank's staging decides by it (a G4-only job stages within half the room, :mod:`.offloads`), and the
  ranks must keep and drop the same blocks; G4-only, because that is the path that writes every rank's slice to G4
  without putting into G3 a block some rank's scheduler holds there already or must not store there (a revoked
  tenant), and its put skips the slices G4 holds. The cost: the rank that planned the ordinary save does not put its
  G3 slice (a later lookup finds the block in G4). The agreed plan is built from rank 0's plan (its jobs, in its
  order, each cut into runs of one path; then the blocks only later ranks planned, in rank order), so every rank
  offers the very same jobs. A block some rank planned
  G4-only and another did not plan at all (a hand-off's block that rank loaded from G4, which proves every rank's
  slice is in G4: a G4 hit needs every rank's key run) is offered G4-only on every rank too, the union of the ranks'
  G4-only blocks (the put skips the slices G4 holds; every rank stages it alike): before 2026-12-03 the intersection
  withheld it and the hand-off's promise N was cut there, also dropping from N the blocks the prefill computed in
  that step and every rank wrote to G4, so the decode worker recomputed them. Withheld (offered by no rank) are only
  ordinary G3 + G4 saves some ranks planned; a hand-off request with one of them promises only the blocks before the
  first (:func:`cut_promises`, :meth:`.handoff.Promises.withheld`, counted ``handoff_promise_cut_blocks`` when it
  finishes): every rank cuts alike. :func:`offer` applies it and counts ``handoff_g4_offered_blocks`` and
  ``save_local_hit_blocks`` from the plan offered.
* **Matches** (:meth:`SchedAgree.match`, at ``get_num_new_matched_tokens``): the answer :class:`.tp_agree.TpMatchAgree`
  agrees (the fewest tokens; None while any rank has none), with the found blocks of the agreed hit, so that the
  lookup counters (``lookup_requests``, ``g3_found_blocks``, ``g4_found_blocks``, ...) count what every rank loads,
  once the ranks agree an answer: summed over the ranks they match the loads (before 2026-12-03 each rank counted
  its own answer, e.g. 4 blocks found on one rank and 2 on another, while both loaded 2). The pools' lookup counters
  (``kvbm_matched_tokens``, the hit rates, ``lookup_blocks`` / ``lookups`` in a pool's ``stats()``), which describe
  the engine's requests on the pod's endpoint (every process's series summed), count the agreed hit on TP rank 0 alone
  (before 2026-12-04 every rank's lookup counted its own answer as it resolved: about TP x on the endpoint, each
  rank's answer rather than the hit loaded). One all-reduce per call, as
  before: the answer is marked agreed (:meth:`.tp_agree.TpMatchAgree.settle`) on the one TpMatchAgree the wiring
  also uses (:attr:`SchedAgree.match_agree`), which returns it as it is.

A scheduler agrees only where the wiring gives it vLLM's TP group (``SchedulerSide(tp_group=...)``): under
``external_launcher`` with TP > 1, the one decision that also turns on the workers' and the G3 reports' agreements
(before 2026-12-03 the scheduler side asked vLLM for a TP group itself, and agreed wherever the process had one).
A failed collective (a rank gone) raises RuntimeError naming what was agreed, as :mod:`.tp_agree` does.
"""
from __future__ import annotations

import hashlib
import struct
import weakref
from typing import Any

from . import stats, tp_agree
from .metadata import SaveJob

_JOB = struct.Struct("<IIBI")  # group, tenant bytes, g4_only, blocks (then req id, tenant, per block: id, hash, digest)
_BLK = struct.Struct("<QQ")
_MASK = (1 << 62) - 1  # a digest and its negation both fit an int64
_U64 = (1 << 64) - 1


def encode_saves(saves: list[SaveJob]) -> bytes:
    """A step's save plan as bytes: per job its group, G4-only flag, request id, tenant, and per block its engine
    block id, sequence hash and token digest (16 bytes, or none)."""
    out: list[bytes] = []
    for j in saves:
        rid, ten = j.req_id.encode("utf-8"), j.tenant.encode("utf-8")
        dg = 16 if j.digests else 0
        out += [_JOB.pack(j.group, len(ten), int(j.g4_only) | (dg << 1), len(j.block_ids)), struct.pack("<I", len(rid)),
                rid, ten]
        for i, (b, h) in enumerate(zip(j.block_ids, j.seq_hashes)):
            out += [_BLK.pack(int(b), int(h) & _U64), j.digests[16 * i:16 * i + dg]]
    return b"".join(out)


def decode_saves(data: bytes) -> list[SaveJob]:
    """The jobs of an encoded plan (:func:`encode_saves`), in order. Raises ValueError when the bytes are truncated
    or malformed (naming the byte)."""
    out, off = [], 0
    try:
        while off < len(data):
            g, nt, flags, n = _JOB.unpack_from(data, off)
            (nr,) = struct.unpack_from("<I", data, off + _JOB.size)
            if flags >> 1 not in (0, 16):
                raise struct.error(f"a job's flags {flags} are not a plan's")
            off += _JOB.size + 4
            if off + nr + nt > len(data):
                raise struct.error("a job's request id or tenant is cut")
            rid, ten = data[off:off + nr].decode("utf-8"), data[off + nr:off + nr + nt].decode("utf-8")
            off, dg = off + nr + nt, flags >> 1
            ids, hs, dgs = [], [], []
            for _ in range(n):
                b, h = _BLK.unpack_from(data, off)
                if off + _BLK.size + dg > len(data):
                    raise struct.error("a block's digest is cut")
                ids.append(b)
                hs.append(h)
                dgs.append(data[off + _BLK.size:off + _BLK.size + dg])
                off += _BLK.size + dg
            out.append(SaveJob(rid, ids, hs, ten, group=g, g4_only=bool(flags & 1), digests=b"".join(dgs)))
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"a TP rank's save plan is truncated or malformed at byte {off} of {len(data)}: {e}") from e
    return out


def _keys(j: SaveJob) -> list[tuple]:
    """The identity of each block of ``j``, without the path (``g4_only``): ``(request id, tenant, group, engine
    block id, sequence hash, digest)``."""
    return [(j.req_id, j.tenant, j.group, int(b), int(h) & _U64, j.digests[16 * i:16 * i + 16])
            for i, (b, h) in enumerate(zip(j.block_ids, j.seq_hashes))]


def agree_plans(plans: list[list[SaveJob]]) -> tuple[list[SaveJob], set[tuple]]:
    """Every TP rank's save plan (in rank order) -> ``(the plan every rank offers, the blocks withheld)``. Offered: the
    blocks every rank planned, whatever path each chose, and the blocks any rank planned G4-only (another rank skips
    those it loaded from G4, which proves every rank's slice is there; the G4-only put skips the slices G4 holds), each
    G4-only where any rank planned it so; as rank 0's jobs in rank 0's order, then the blocks only later ranks planned
    in their order (each job cut into runs of one path). Withheld: the identities (:func:`_keys`) of the blocks some
    rank planned and none offers (ordinary G3 + G4 saves not every rank planned). The same on every rank, given the
    same plans."""
    keys = [[k for j in p for k in _keys(j)] for p in plans]
    common = set(keys[0]).intersection(*keys[1:]) if keys else set()
    g4_only = {k for p in plans for j in p if j.g4_only for k in _keys(j)}
    offered = common | g4_only
    out: list[SaveJob] = []
    seen: set[tuple] = set()
    for j in (j for p in plans for j in p):
        run: list[int] = []
        path = False
        for i, k in enumerate(_keys(j)):
            if k not in offered or k in seen:
                continue
            seen.add(k)
            if run and (k in g4_only) != path:
                out.append(_part(j, run, path))
                run = []
            run.append(i)
            path = k in g4_only
        if run:
            out.append(_part(j, run, path))
    return out, set().union(*keys) - offered


def _part(j: SaveJob, idx: list[int], g4_only: bool) -> SaveJob:
    """``j`` with only its blocks ``idx``, on the path ``g4_only``."""
    return SaveJob(j.req_id, [j.block_ids[i] for i in idx], [j.seq_hashes[i] for i in idx], j.tenant, group=j.group,
                   g4_only=g4_only, digests=b"".join(j.digests[16 * i:16 * i + 16] for i in idx))


_LOCAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler side -> the step's [(req id, hashes)]


def planned_local(side: Any, st: Any, a: int, end: int) -> None:
    """Scheduler side ``side`` planned blocks ``[a, end)`` of request state ``st`` (a ``_Req``) as ordinary saves from
    its engine's prefix cache (``_plan_local_save``): :func:`offer` counts them ``save_local_hit_blocks`` once
    offered (before 2026-12-03 counted when planned: under ``external_launcher`` with TP > 1 withheld blocks too)."""
    if end > a:
        _LOCAL.setdefault(side, []).append((st.req_id, [int(h) & _U64 for h in st.hashes[a:end]]))


def offer(side: Any, saves: list[SaveJob]) -> list[SaveJob]:
    """The step's save plan of scheduler side ``side`` as offered to the workers: under ``external_launcher`` with
    TP > 1 (``side.tp``) what the ranks agreed (:meth:`SchedAgree.saves`), else ``saves``; counts its G4-only
    blocks ``handoff_g4_offered_blocks`` and the prefix-cache blocks :func:`planned_local` named that are offered as
    ordinary saves ``save_local_hit_blocks`` (only blocks offered). Raises RuntimeError when the TP agreement fails."""
    local, planned = _LOCAL.pop(side, []), saves
    if side.tp is not None:
        saves = side.tp.saves(saves, side.promises, side._reqs)
    g4 = sum(len(j.block_ids) for j in saves if j.g4_only)
    if g4:
        stats.add(handoff_g4_offered_blocks=g4)
    if local:  # a block planned as an ordinary save and not offered so (withheld, or G4-only) is not counted
        lost = _ordinary(planned) - _ordinary(saves) if saves is not planned else set()
        n = sum(1 for rid, hs in local for h in hs if (rid, h) not in lost)
        if n:
            stats.add(save_local_hit_blocks=n)
    return saves


def _ordinary(saves: list[SaveJob]) -> set[tuple[str, int]]:
    return {(j.req_id, int(h) & _U64) for j in saves if not j.g4_only for h in j.seq_hashes}


def cut_promises(promises: Any, reqs: dict, withheld: set[tuple]) -> None:
    """The hand-off requests among ``reqs`` (request id -> the scheduler's request state) with blocks in ``withheld``
    (:func:`agree_plans`' identities: offered by no rank) promise only the blocks before the first of them
    (:meth:`.handoff.Promises.withheld` of ``promises``); blocks offered G4-only on every rank never cut a promise."""
    lost: dict[str, list[int]] = {}
    for k in withheld:
        lost.setdefault(k[0], []).append(k[4])
    for rid, hs in lost.items():
        if rid in reqs:
            promises.withheld(reqs[rid], hs)


class SchedAgree:
    """The scheduler's agreements over vLLM's TP ``group`` (see the module doc)."""

    def __init__(self, group: Any):
        self.group = group
        # the wiring's agreement of the connector's answer is this one (its settled answer is taken right after)
        self.match_agree = tp_agree.TpMatchAgree(group)
        self.rank = int(getattr(group, "rank_in_group", 0) or 0)  # TP rank 0 alone counts the pools' lookups
        self.one_announcer: bool | None = None  # TP rank 0 alone announces to G4 (None: not agreed yet; .tp_events)

    def saves(self, saves: list[SaveJob], promises: Any = None, reqs: dict | None = None) -> list[SaveJob]:
        """The step's save plan every TP rank planned: ``saves`` when every rank's plan is the same (one all-reduce),
        else :func:`agree_plans` of every rank's; the hand-off requests among ``reqs`` (request id -> the scheduler's
        request state) whose blocks are withheld are cut in ``promises`` (:meth:`.handoff.Promises.withheld`). Raises
        RuntimeError when a collective fails or a rank's plan is malformed."""
        import torch
        import torch.distributed as dist
        blob = encode_saves(saves)
        h = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") & _MASK
        t = torch.tensor([h, -h], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        except Exception as e:  # noqa: BLE001 - torch.distributed's errors vary by backend
            raise RuntimeError("kvbm_backend: the save plans of the TP ranks (vLLM external_launcher) could not be "
                               f"compared over the TP group: {e}") from e
        if int(t[0]) == -int(t[1]):  # the smallest digest is the largest: every rank planned the same
            return saves
        plans = []
        for rank, b in enumerate(tp_agree.all_gather_bytes(self.group, blob, "the save plans")):
            try:
                plans.append(decode_saves(b))
            except ValueError as ex:
                raise RuntimeError(f"kvbm_backend: TP rank {rank}'s save plan: {ex}") from ex
        kept, withheld = agree_plans(plans)
        mine = sum(1 for j in saves for k in _keys(j) if k in withheld)
        stats.add(tp_save_disagreed_steps=1, tp_save_withheld_blocks=mine)
        if promises is not None and reqs:
            cut_promises(promises, reqs, withheld)
        return kept

    def match(self, side: Any, request: Any, n: int | None, is_async: bool) -> tuple[int | None, bool]:
        """``(n, is_async)``, the answer of scheduler side ``side`` for ``request``, agreed by every rank
        (:meth:`.tp_agree.TpMatchAgree.agree`); once the ranks agree an answer, a request whose lookup waits to be
        counted (``count_as``) is counted as that answer (:func:`count_request`: the fewest blocks any rank's tiers
        found, G3's first), and its look (``count_look``) in the pools' lookup counters (``kvbm_matched_tokens``, the
        hit rates) by TP rank 0 alone, as that hit (:meth:`.lookup.PrefixLookup.count_request`). Raises RuntimeError
        when the collective fails."""
        st = side._reqs.get(request.request_id)
        mine = st.hit[0] if st is not None and st.count_as is False and st.hit is not None else None
        out = self.match_agree.agree_found(n, is_async, mine)
        if out[0] is not None and st is not None and st.count_as is not None:
            (local, st.count_as), (look, st.count_look) = (st.count_as, None), (st.count_look, None)
            count_request(st, local, out[2])
            if look is not None:  # each request once on the pod's endpoint: the pools' series of TP rank 0 only
                look.count_request(out[2], pools=self.rank == 0)
        self.match_agree.settle(out[:2])
        return out[:2]


def count_request(st: Any, local: bool = False, found: int | None = None) -> None:
    """The connector's counters of a request's lookup (``st.hit``, a scheduler side's request state), once per
    request. ``local``: the engine's own prefix cache had every loadable block (no tier was asked): counted with
    those blocks as ``local_hit_blocks`` (before 2026-11-30 such a request was not counted at all, so the demo's
    "engine" tier missed every engine hit); a request with no full block to look up is not counted. ``found``: the
    blocks of the hit the TP ranks agreed (:meth:`SchedAgree.match`; None: ``st.hit``'s), G3's first."""
    if st.counted or (st.hit is None and not local) or (local and st.lookup_blocks == 0):
        return
    st.counted = True
    if local:
        stats.add(lookup_requests=1, lookup_blocks=st.lookup_blocks,
                  local_hit_blocks=min(st.n_local, st.lookup_blocks))
        return
    n, p3 = st.hit[0], st.hit[1]
    if found is not None and found < n:
        n, p3 = found, min(p3, found)
    stats.add(lookup_requests=1, lookup_blocks=st.lookup_blocks, local_hit_blocks=st.n_local,
              g3_found_blocks=p3, g4_found_blocks=n - p3)
