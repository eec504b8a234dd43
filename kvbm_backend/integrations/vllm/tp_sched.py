"""The scheduler's own TP agreements under vLLM's ``external_launcher`` with TP > 1 (every TP rank its own process
hosting a scheduler and that rank's worker; :mod:`.tp_agree` has the others and the collective pattern).

* **Saves** (:meth:`SchedAgree.saves`, once per step in ``build_connector_meta``, which every rank's scheduler reaches
  in the same step): a block is offered to the pools only when every rank's scheduler planned it, the intersection of
  the ranks' save plans. A plan's inputs that run on each process's clock and pools (the revoked tenants' keyring
  checks, the G4 lookups a hand-off's G4-only saves skip) can make one rank plan a block slice another rank's plan
  skips: stored on some ranks only, every later lookup of it misses (a lookup needs every rank's slice), its capacity
  wasted. The ranks first compare a 62-bit digest of their plans (one all-reduce of two int64s, every step); only when
  they differ are the plans gathered (:func:`.tp_agree.all_gather_bytes`) and intersected, counted
  ``tp_save_disagreed_steps`` and ``tp_save_withheld_blocks`` (blocks this rank planned that another did not).
* **Matches** (:meth:`SchedAgree.match`, at ``get_num_new_matched_tokens``): the answer :class:`.tp_agree.TpMatchAgree`
  agrees (the fewest tokens; None while any rank has none), with the found blocks of the agreed hit, so that the
  lookup counters (``lookup_requests``, ``g3_found_blocks``, ``g4_found_blocks``, ...) count what every rank loads,
  once the ranks agree an answer: summed over the ranks they match the loads (before 2026-12-03 each rank counted
  its own answer, e.g. 4 blocks found on one rank and 2 on another, while both loaded 2). One all-reduce per call, as
  before: the answer is marked agreed (:func:`.tp_agree.settle`), so the wiring's TpMatchAgree returns it as it is.

A scheduler agrees only where its own process hosts a TP rank of a group of more than one (:func:`scheduler_group`:
``external_launcher``; under ``uni``, ``mp`` and ray the scheduler's process has no TP group). A failed collective
(a rank gone) raises RuntimeError naming what was agreed, as :mod:`.tp_agree` does.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import replace
from typing import Any

from . import stats, tp_agree
from .metadata import SaveJob

_JOB = struct.Struct("<IIBI")  # group, tenant bytes, g4_only, blocks (then req id, tenant, per block: id, hash, digest)
_BLK = struct.Struct("<QQ")
_MASK = (1 << 62) - 1  # a digest and its negation both fit an int64


def scheduler_group(tp_world_size: int) -> Any:
    """vLLM's TP group of this scheduler's process when it hosts a TP rank of a group of more than one (vLLM's
    ``external_launcher`` with TP > 1: a scheduler in every rank's process), else None (one scheduler for every
    rank, or no vLLM model-parallel state here). ``tp_world_size``: the namespace's; 1 never asks vLLM."""
    if tp_world_size <= 1:
        return None
    try:
        from vllm.distributed.parallel_state import get_tp_group
        group = get_tp_group()
    except Exception:  # noqa: BLE001 - no vLLM, or no TP group in this process: this scheduler is the only one
        return None
    return group if int(group.world_size) > 1 else None


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
            out += [_BLK.pack(int(b), int(h) & (2**64 - 1)), j.digests[16 * i:16 * i + dg]]
    return b"".join(out)


def block_entries(data: bytes) -> set[tuple]:
    """The blocks of an encoded plan (:func:`encode_saves`), each ``(request id, tenant, group, g4_only, block id,
    sequence hash, digest)``. Raises ValueError when the bytes are truncated."""
    out, off = set(), 0
    try:
        while off < len(data):
            g, nt, flags, n = _JOB.unpack_from(data, off)
            (nr,) = struct.unpack_from("<I", data, off + _JOB.size)
            off += _JOB.size + 4
            rid, ten = data[off:off + nr].decode("utf-8"), data[off + nr:off + nr + nt].decode("utf-8")
            off, dg = off + nr + nt, flags >> 1
            for _ in range(n):
                b, h = _BLK.unpack_from(data, off)
                out.add((rid, ten, g, bool(flags & 1), b, h, data[off + _BLK.size:off + _BLK.size + dg]))
                off += _BLK.size + dg
    except struct.error as e:
        raise ValueError(f"a TP rank's save plan is truncated at byte {off} of {len(data)}: {e}") from e
    if off != len(data):
        raise ValueError(f"a TP rank's save plan is truncated at byte {off} of {len(data)}")
    return out


def _keep(j: SaveJob, common: set[tuple]) -> SaveJob | None:
    """``j`` with only its blocks in ``common`` (None: none is)."""
    idx = [i for i, (b, h) in enumerate(zip(j.block_ids, j.seq_hashes))
           if (j.req_id, j.tenant, j.group, j.g4_only, int(b), int(h) & (2**64 - 1), j.digests[16 * i:16 * i + 16])
           in common]
    if len(idx) == len(j.block_ids):
        return j
    if not idx:
        return None
    return replace(j, block_ids=[j.block_ids[i] for i in idx], seq_hashes=[j.seq_hashes[i] for i in idx],
                   digests=b"".join(j.digests[16 * i:16 * i + 16] for i in idx))


class SchedAgree:
    """The scheduler's agreements over vLLM's TP ``group`` (see the module doc)."""

    def __init__(self, group: Any):
        self.group = group
        self._match = tp_agree.TpMatchAgree(group)

    def saves(self, saves: list[SaveJob]) -> list[SaveJob]:
        """The step's save plan every TP rank planned: ``saves`` when every rank's plan is the same (one all-reduce),
        else only the blocks every rank planned (order kept). Raises RuntimeError when a collective fails or a rank's
        plan is malformed."""
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
        common: set[tuple] | None = None
        for rank, b in enumerate(tp_agree.all_gather_bytes(self.group, blob, "the save plans")):
            try:
                entries = block_entries(b)
            except ValueError as ex:
                raise RuntimeError(f"kvbm_backend: TP rank {rank}'s save plan: {ex}") from ex
            common = entries if common is None else common & entries
        kept = [k for k in (_keep(j, common or set()) for j in saves) if k is not None]
        withheld = sum(len(j.block_ids) for j in saves) - sum(len(j.block_ids) for j in kept)
        stats.add(tp_save_disagreed_steps=1, tp_save_withheld_blocks=withheld)
        return kept

    def match(self, side: Any, request: Any, n: int | None, is_async: bool) -> tuple[int | None, bool]:
        """``(n, is_async)``, the answer of scheduler side ``side`` for ``request``, agreed by every rank
        (:meth:`.tp_agree.TpMatchAgree.agree`); once the ranks agree an answer, a request whose lookup waits to be
        counted (``count_as``) is counted as that answer (:func:`count_request`: the fewest blocks any rank's tiers
        found, G3's first). Raises RuntimeError when the collective fails."""
        st = side._reqs.get(request.request_id)
        mine = st.hit[0] if st is not None and st.count_as is False and st.hit is not None else None
        out = self._match.agree_found(n, is_async, mine)
        if out[0] is not None and st is not None and st.count_as is not None:
            local, st.count_as = st.count_as, None
            count_request(st, local, out[2])
        tp_agree.settle(self.group, out[:2])
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
