"""What the KV events and the G4 announcer learn under vLLM's ``external_launcher`` with TP > 1 (every TP rank its own
process hosting a scheduler; :mod:`.tp_sched` agrees the ranks' save plans). Elsewhere (one scheduler per engine) the
scheduler side tells its events every block as before.

* **One announcer** (``g4.announce``): every rank's scheduler runs a :class:`~.g4_announce.G4Announcer` and polls, but
  only TP rank 0's is told the blocks saved (:func:`announces`), so only it HEADs them in G4 and writes their
  announcement batches. A block is announced only once G4 holds every rank's slice of it (the flush HEADs the G4 key
  of every rank, :meth:`~kvbm_backend.model.namespace.Namespace.rank_runs`), so one rank's announcement speaks for the
  whole engine, and every rank's poller credits it. Before (2026-12-03) every rank's announcer HEADed every rank's
  slices and wrote its own batch of the same blocks: TP-fold HEADs, TP-fold announcement objects (each read by every
  poller of the fleet).
* **Only offered blocks are learned**: the blocks of a step's save plan (``_plan_save``, ``_plan_local_save``) are
  learned once the ranks agreed the plan (:func:`offered`), less those withheld (some rank planned them, no rank
  offers them: neither every rank's G3 report nor G4 will hold them). Before (2026-12-03) they were learned as
  planned: a withheld block sat in the events' learned table and in the announcer's pending list, HEADed with backoff
  for up to its ``absent_s`` (600 s) and then counted ``announce_dropped_absent``. A block learned before (a save
  offered earlier, still being written) stays learned when a later plan of it is withheld.
"""
from __future__ import annotations

from typing import Any

from .metadata import SaveJob

_U64 = (1 << 64) - 1


def announces(side: Any) -> bool:
    """True when scheduler side ``side`` tells its G4 announcer the blocks it saves: always, except under
    ``external_launcher`` with TP > 1 (``side.tp``, the TP group the wiring gave it), where only TP rank 0 does."""
    tp = side.tp
    return tp is None or int(getattr(tp.group, "rank_in_group", 0)) == 0


def learn(side: Any, st: Any, first: int, end: int, planned: bool = False, request: Any = None) -> None:
    """Blocks ``[first, end)`` of request state ``st`` (a ``_Req``; of vLLM's ``request``, default ``st.request``)
    are, or are about to be, stored: told to ``side.events`` (:meth:`~.kv_events.G3KvEvents.learn`; nothing without
    events). ``planned``: blocks of this step's save plan; under ``external_launcher`` with TP > 1 kept until
    :func:`offered` knows which the ranks offer."""
    ev = side.events
    if ev is None or end <= first:
        return
    if planned and side.tp is not None:
        side._learns.append((st, first, end))
        return
    ev.learn(st.tenant, st.request if request is None else request, st.hashes, first, end, announce=announces(side))


def offered(side: Any, planned: list[SaveJob], saves: list[SaveJob]) -> None:
    """The step's save plan ``planned`` was offered as ``saves`` (:func:`.tp_sched.offer`): the blocks kept by
    :func:`learn` are learned now, but those withheld (in ``planned``, not in ``saves`` on any path; KV cache group 0,
    whose blocks the events and the announcer follow)."""
    learns, side._learns = side._learns, []
    ev = side.events
    if ev is None or not learns:
        return
    withheld = set() if saves is planned else _blocks(planned) - _blocks(saves)
    ann = announces(side)
    for st, a, end in learns:
        i = a
        while i < end:  # each run of blocks not withheld
            j = i
            while j < end and (st.tenant, int(st.hashes[j]) & _U64) not in withheld:
                j += 1
            if j > i:
                ev.learn(st.tenant, st.request, st.hashes, i, j, announce=ann)
            i = j + 1


def _blocks(saves: list[SaveJob]) -> set[tuple[str, int]]:
    """``(tenant, sequence hash)`` of every block of group 0 in ``saves``."""
    return {(j.tenant, int(h) & _U64) for j in saves if j.group == 0 for h in j.seq_hashes}
