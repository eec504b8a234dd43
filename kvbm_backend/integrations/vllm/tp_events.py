"""What the KV events and the G4 announcer learn under vLLM's ``external_launcher`` with TP > 1 (every TP rank its own
process hosting a scheduler; :mod:`.tp_sched` agrees the ranks' save plans). Elsewhere (one scheduler per engine) the
scheduler side tells its events every block as before.

* **One announcer when the ranks hash alike** (``g4.announce``): every rank's scheduler runs a
  :class:`~.g4_announce.G4Announcer` and polls. A poller credits only batches of its own hash domain
  (:func:`~.g4_records.hash_domain`, a digest of vLLM's ``NONE_HASH``), and vLLM draws ``NONE_HASH`` at random per
  process for a non-cryptographic prefix-caching hash (``xxhash``, ``xxhash_cbor``) when ``PYTHONHASHSEED`` is unset
  (torchrun does not set it). So the ranks first agree (:func:`agree_domain`: one all-gather of their domains over
  the TP group the wiring gives the scheduler side, at the first ``get_num_new_matched_tokens`` or offered save plan,
  which every rank reaches in the same call; vLLM sets ``NONE_HASH`` before either): when every rank has the same
  domain only TP rank 0's announcer is told the blocks saved (:func:`announces`), so only it HEADs them in G4 and
  writes their announcement batches, and every rank's poller credits them. A block is announced only once G4 holds
  every rank's slice of it (the flush HEADs the G4 key of every rank,
  :meth:`~kvbm_backend.model.namespace.Namespace.rank_runs`), so one rank's announcement speaks for the whole
  engine. When the domains differ (or a rank has none yet), every rank announces for itself, as before 2026-12-03,
  with one WARNING at the first lookup or save plan saying why (:data:`PER_RANK_WARNING`): its batches are the only ones its poller credits.
  Before 2026-12-03 every rank's announcer always HEADed every rank's slices and wrote its own batch of the same
  blocks (TP-fold HEADs and announcement objects); from 2026-12-03 to 2026-12-03 rank 0 announced alone whatever
  the domains, so with per-process domains no other rank's KV events ever carried a G4 block.
* **Only offered blocks are learned** (:func:`offer`): the blocks of a step's save plan (``_plan_save``,
  ``_plan_local_save``) are learned once the ranks agreed the plan, less those withheld (some rank planned them, no
  rank offers them: neither every rank's G3 report nor G4 will hold them). A block this rank planned as an ordinary
  G3 + G4 save that the agreement offers G4-only (another rank planned it so) is told to the announcer only, not
  learned for G3: no rank writes its G3 slice (before 2026-12-03 it sat in the events' learned table). Before
  2026-12-03 they were learned as planned: a withheld block sat in the events' learned table and in the announcer's
  pending list, HEADed with backoff for up to its ``absent_s`` (600 s) and then counted ``announce_dropped_absent``.
  A block learned before (a save offered earlier, still being written) stays learned when a later plan of it is
  withheld. A step whose agreement fails (RuntimeError) learns nothing of its plan, then or later.
"""
from __future__ import annotations

import logging
from typing import Any

from . import tp_agree, tp_sched
from .metadata import SaveJob

log = logging.getLogger("kvbm_backend.connector")

_U64 = (1 << 64) - 1
_OFF = "(g4.announce off)"  # what a rank without an announcer sends to agree_domain
MIXED_WARNING = ("kvbm_backend: g4.announce under external_launcher is on for TP ranks %s only: each of those "
                 "announces the engine's G4 blocks itself; give every rank of the engine the same g4.announce")
PER_RANK_WARNING = (
    "kvbm_backend: g4.announce under external_launcher: the TP ranks' vLLM block hashes differ (hash domains %s), "
    "so every rank announces the engine's G4 blocks itself (a poller credits only batches of its own domain): "
    "TP-fold HEADs and announcement objects. vLLM draws NONE_HASH at random per process for a non-cryptographic "
    "prefix-caching hash when PYTHONHASHSEED is unset (torchrun does not set it): set PYTHONHASHSEED to one value "
    "on every rank, or use --prefix-caching-hash-algo sha256 (or sha256_cbor), to announce once (TP rank 0)")


def agree_domain(side: Any) -> None:
    """Under ``external_launcher`` with TP > 1 (``side.tp``; ``g4.announce`` on or off on this rank), agree
    once whether every TP rank has the same hash domain (:func:`~.g4_records.hash_domain`): one all-gather over the
    TP group, at the first call; later calls return at once. Every rank must call it at the same point (the scheduler
    side's ``get_num_new_matched_tokens`` and :func:`offer`). The same domain: only TP rank 0 announces
    (:func:`announces`); else every rank does, and TP rank 0 logs :data:`PER_RANK_WARNING` once. Raises RuntimeError
    when the collective fails (a rank gone). Every rank under ``external_launcher`` with TP > 1 joins, with an
    announcer or not (a rank without one sends :data:`_OFF`): before 2026-12-03's fix a rank whose ``g4.announce``
    was off skipped the all-gather while the others waited in it, and every rank hung. Ranks whose ``g4.announce``
    differs each announce for themselves, TP rank 0 logs :data:`MIXED_WARNING` once."""
    tp = side.tp
    if tp is None or tp.one_announcer is not None:
        return
    from .g4_records import hash_domain
    mine = (hash_domain() or "") if getattr(side.events, "announcer", None) is not None else _OFF
    doms = [d.decode("utf-8", "replace") for d in
            tp_agree.all_gather_bytes(tp.group, mine.encode(), "the block hash domains")]
    tp.one_announcer = _OFF not in doms and all(doms) and len(set(doms)) == 1
    if tp.one_announcer or _rank(tp) != 0 or all(d == _OFF for d in doms):
        return
    if _OFF in doms:
        log.warning(MIXED_WARNING, ", ".join(str(r) for r, d in enumerate(doms) if d != _OFF))
    else:  # (no domain yet: vLLM's NONE_HASH unset; not seen in vLLM)
        log.warning(PER_RANK_WARNING, ", ".join(d or "none" for d in doms))


def _rank(tp: Any) -> int:
    return int(getattr(tp.group, "rank_in_group", 0))


def announces(side: Any) -> bool:
    """True when scheduler side ``side`` tells its G4 announcer the blocks it saves: always, except under
    ``external_launcher`` with TP > 1 (``side.tp``, the TP group the wiring gave it) once the ranks agreed they share
    one hash domain (:func:`agree_domain`), where only TP rank 0 does."""
    tp = side.tp
    return tp is None or not tp.one_announcer or _rank(tp) == 0


def learn(side: Any, st: Any, first: int, end: int, planned: bool = False, request: Any = None) -> None:
    """Blocks ``[first, end)`` of request state ``st`` (a ``_Req``; of vLLM's ``request``, default ``st.request``)
    are, or are about to be, stored: told to ``side.events`` (:meth:`~.kv_events.G3KvEvents.learn`; nothing without
    events). ``planned``: blocks of this step's save plan (ordinary G3 + G4 saves); under ``external_launcher`` with
    TP > 1 kept until :func:`offer` knows which the ranks offer, and how."""
    ev = side.events
    if ev is None or end <= first:
        return
    if planned and side.tp is not None:
        side._learns.append((st, first, end))
        return
    ev.learn(st.tenant, st.request if request is None else request, st.hashes, first, end, announce=announces(side))


def offer(side: Any, planned: list[SaveJob]) -> list[SaveJob]:
    """The step's save plan ``planned`` of scheduler side ``side`` as offered to the workers
    (:func:`.tp_sched.offer`); the blocks kept by :func:`learn` are learned then: those offered as ordinary saves
    for G3 and the announcer, those offered G4-only for the announcer only, those withheld (planned, offered on no
    path) not at all (KV cache group 0, whose blocks the events and the announcer follow). Raises RuntimeError when
    the TP agreement fails; the kept blocks are dropped then (never learned by a later step)."""
    try:
        agree_domain(side)
        saves = tp_sched.offer(side, planned)
    finally:  # a failed agreement's plan is never learned, nor by the next step's
        learns, side._learns = side._learns, []
    ev = side.events
    if ev is None or not learns:
        return saves
    ann = announces(side)
    if saves is planned:  # every rank planned the same: learned as planned
        for st, a, end in learns:
            ev.learn(st.tenant, st.request, st.hashes, a, end, announce=ann)
        return saves
    ordinary, g4 = _blocks(saves, False), _blocks(saves, True)
    for st, a, end in learns:
        i = a
        while i < end:  # each run of blocks offered on one path; withheld ones skipped
            j, path = i, _path(st, i, ordinary, g4)
            while j < end and _path(st, j, ordinary, g4) == path:
                j += 1
            if path == "g3":
                ev.learn(st.tenant, st.request, st.hashes, i, j, announce=ann)
            elif path == "g4" and ann:
                ev.learn(st.tenant, st.request, st.hashes, i, j, announce=True, to_g3=False)
            i = j
    return saves


def _path(st: Any, i: int, ordinary: set, g4: set) -> str:
    """How block ``i`` of ``st`` is offered: ``"g3"`` (an ordinary save), ``"g4"`` (G4-only), ``""`` (withheld)."""
    k = (st.tenant, int(st.hashes[i]) & _U64)
    return "g3" if k in ordinary else "g4" if k in g4 else ""


def _blocks(saves: list[SaveJob], g4_only: bool) -> set[tuple[str, int]]:
    """``(tenant, sequence hash)`` of every block of group 0 in the jobs of ``saves`` on path ``g4_only``."""
    return {(j.tenant, int(h) & _U64) for j in saves if j.group == 0 and j.g4_only == g4_only for h in j.seq_hashes}
