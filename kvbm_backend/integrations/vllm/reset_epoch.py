"""The connector's ``reset_cache``: vLLM's ``reset_prefix_cache(reset_connector=True)`` (``LLM.reset_prefix_cache``,
``POST /reset_prefix_cache?reset_external=true``, ``pause_generation(clear_cache=True)``, sleep, Dynamo 1.6.1's
``clear_kv_blocks``, RL weight updates in place).

With the connector option ``reset_tiers`` false (the default) a reset keeps G3/G4 serving (:func:`kept`), as vLLM
keeps its persistent secondary tiers: Dynamo's ``clear_kv_blocks`` (which asks for the connector's reset) and
sleep/wake then leave the tiers warm. With ``reset_tiers`` true (in-place weight updates), a reset makes this engine see none of the blocks stored before it, in G3 or G4, without deleting anything: the
scheduler draws a random reset epoch (64 bits; :func:`agreed`: one for every TP rank's scheduler) and folds it
into every request's salt from then on
(:func:`.identity.epoch_salt`), so the sequence hashes (the blocks' names in G3, G4 and KV events) and the token
digests (checked in every frame a load serves) of requests made after the reset differ from every block stored
before it, by this engine or any other. Keys are made on the scheduler side only (the workers name what the load
and save jobs carry), so the workers need no word of it. Later lookups miss the old blocks; blocks computed after
the reset are stored under the new identity and found by this engine's later requests. Old G3 blocks age out by
G3's LRU eviction; G4 blocks stay for other workers (``kvbm-backend gc`` removes them by age).

Requests the scheduler knows at the reset (running, preempted, waiting) keep their old identity, so they are
never loaded or saved again (``opaque`` and ``no_load``: their KV may mix both weights). A hand-off's identity
names the epoch (``namespace`` ``<fingerprint>@reset-<epoch>``): a prefill and a decode worker of different epochs
serve without waiting. A hand-off request in the engine at the reset answers the identity its blocks have (the epoch
before the reset) and promises only the blocks it offered before the reset (:meth:`.handoff.Promises.stop`; before
2026-12-03 every block, under the new epoch's name: a decode request of that epoch, as in one engine doing both roles,
waited ``handoff_wait_s`` for blocks never written under a name it reads). The epoch is random, never a count, so two engines reset for different reasons (one with
new weights, one without) never share an identity; engines of one fleet therefore stop sharing G4 blocks after a
reset until they restart. A restart begins at epoch ``""`` again: after an in-place weight update, start workers
with a ``revision`` (kvbm_backend config, part of the namespace) that names the new weights, or reset again.

KV events: the G3 blocks published before are withdrawn (:meth:`.kv_events.G3KvEvents.forget`): silently when the
engine's own prefix cache was reset too (vLLM publishes ``AllBlocksCleared``, after which nothing old is
re-published), with ``BlockRemoved`` when it was not (vLLM's reset failed: blocks in use). G4 announcements
(:mod:`.g4_announce`) name the epoch their blocks were stored under: the engine is credited only those of its
current epoch, and those credited before the reset are withdrawn (:meth:`~.g4_announce.G4Announcer.set_epoch`).

TP > 1 under vLLM's ``external_launcher`` (every TP rank its own process, each with its own scheduler, which plans
the jobs of its own rank's worker): each rank's scheduler is reset, and every one must fold in the same epoch, or
rank 0 would store and look up its slices under one identity and rank 1 under another, and a lookup (every rank's
slices) would never hit again. Rank 0 draws it and broadcasts it over vLLM's TP group (:func:`agreed`). Before
2026-12-03 each process drew its own.
"""
from __future__ import annotations

import logging
import secrets
from typing import Any

from . import handoff, stats

log = logging.getLogger(__name__)


def handoff_identity(g4: Any, tenant: str, epoch: str, salt: int | None = None) -> dict[str, str]:
    """:func:`.handoff.identity` (of ``tenant`` and a request's salt hash ``salt``) with the reset ``epoch`` in its
    ``namespace`` (a worker never reset: as it is). A request's ``epoch`` and ``salt`` are those its blocks are named
    with: a request in the engine at a reset keeps the epoch before it."""
    ident = handoff.identity(g4, tenant, salt)
    if epoch and "namespace" in ident:
        ident["namespace"] = f"{ident['namespace']}@reset-{epoch}"
    return ident


def agreed(drawn: str, group: Any = None) -> str:
    """The reset epoch every TP rank's scheduler of this engine starts: ``drawn`` (16 hex characters) as TP rank 0
    drew it, broadcast over ``group`` (its CPU process group: raw bytes, no pickle), the TP group the wiring gave the
    scheduler side (``SchedulerSide.tp``: under ``external_launcher`` with TP > 1 only, a scheduler in every rank's
    process, all reset in the same call, as every rank runs the same program); with no group (one scheduler:
    ``uni``, ``mp``, ray) or a group of one, ``drawn``. The wiring's decision is the only one (before 2026-12-03
    this asked vLLM for a TP group itself and broadcast wherever the process had one of more than one rank, whatever
    the executor the wiring saw, beside the wiring's own decision for every other agreement). A failed broadcast
    (a rank gone: the engine's next collective fails too) is logged at ERROR and ``drawn`` is used: the blocks
    stored before the reset are still never served, though the ranks may then miss each other's new blocks (a miss,
    never wrong KV: loads check every frame's token digest)."""
    if group is None or int(group.world_size) <= 1:
        return drawn
    import torch
    import torch.distributed as dist
    buf = torch.tensor(list(bytes.fromhex(drawn)), dtype=torch.uint8)
    try:
        dist.broadcast(buf, src=group.ranks[0], group=group.cpu_group)
    except Exception as e:  # noqa: BLE001 - torch.distributed's errors vary by backend
        log.error("kvbm_backend: connector cache reset: the reset epoch could not be broadcast over the TP group "
                  "(%s); this rank uses its own, and may miss the other ranks' blocks stored from now on", e)
        return drawn
    return bytes(buf.tolist()).hex()


def kept() -> None:
    """A reset of the connector's cache with ``reset_tiers`` false: G3/G4 keep serving what they hold (vLLM's own
    persistent tiers are not reset either). Counted ``connector_cache_resets_kept``, logged at INFO."""
    stats.add(connector_cache_resets_kept=1)
    log.info("kvbm_backend: connector cache reset: G3/G4 keep their blocks and keep serving them (reset_tiers is "
             "false); after an in-place weight update set reset_tiers true, or restart with a revision naming the "
             "new weights")


def reset(side: Any, engine_cleared: bool) -> str:
    """Start a new reset epoch on scheduler side ``side`` (:class:`~.scheduler_side.SchedulerSide`) and return it.

    ``engine_cleared``: the engine's own prefix cache was reset in the same call (vLLM then publishes
    ``AllBlocksCleared``); else the published G3 blocks are withdrawn with ``BlockRemoved``. Counted
    ``connector_cache_resets`` (requests it stops tiering: ``reset_untiered_requests``), logged at INFO."""
    tp = getattr(side, "tp", None)  # the wiring's TP agreement (.tp_sched.SchedAgree): external_launcher, TP > 1
    side.epoch = epoch = agreed(secrets.token_hex(8), tp.group if tp is not None else None)
    set_epoch = getattr(getattr(side.events, "announcer", None), "set_epoch", None)  # a .g4_announce.G4Announcer
    if set_epoch is not None:  # G4 announcements of another epoch are no longer this engine's hits
        set_epoch(epoch)
    stopped = 0  # not those already untiered (multimodal, or stopped by an earlier reset): before 2026-12-03 counted
    for st in side._reqs.values():  # old identity: never loaded or saved again (their KV may mix weights)
        if not st.opaque:  # a hand-off promises only the blocks offered before (its F names its own epoch)
            side.promises.stop(st, st.saved_upto or 0)
        stopped += not st.opaque
        st.no_load, st.opaque, st.g3_local, st.lookup = True, True, None, None
    forgotten = side.events.forget(withdraw=not engine_cleared) if side.events is not None else 0
    stats.add(connector_cache_resets=1, reset_untiered_requests=stopped)
    log.info("kvbm_backend: connector cache reset (reset epoch %s): %d requests in the engine are no longer "
             "tiered, blocks stored before are not served by this engine (G3 ages them out, G4 keeps them for other "
             "workers), %d G3 blocks withdrawn from KV events", epoch, stopped, forgotten)
    return epoch
