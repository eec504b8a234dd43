"""The connector's ``reset_cache``: vLLM's ``reset_prefix_cache(reset_connector=True)`` (``LLM.reset_prefix_cache``,
``POST /reset_prefix_cache?reset_external=true``, ``pause_generation(clear_cache=True)``, sleep, Dynamo 1.6.1's
``clear_kv_blocks``, RL weight updates in place).

With the connector option ``reset_tiers`` false (the default) a reset keeps G3/G4 serving (:func:`kept`), as vLLM
keeps its persistent secondary tiers: Dynamo's ``clear_kv_blocks`` (which asks for the connector's reset) and
sleep/wake then leave the tiers warm. With ``reset_tiers`` true (in-place weight updates), a reset makes this engine see none of the blocks stored before it, in G3 or G4, without deleting anything: the
scheduler draws a random reset epoch (64 bits) and folds it into every request's salt from then on
(:func:`.identity.epoch_salt`), so the sequence hashes (the blocks' names in G3, G4 and KV events) and the token
digests (checked in every frame a load serves) of requests made after the reset differ from every block stored
before it, by this engine or any other. Keys are made on the scheduler side only (the workers name what the load
and save jobs carry), so the workers need no word of it. Later lookups miss the old blocks; blocks computed after
the reset are stored under the new identity and found by this engine's later requests. Old G3 blocks age out by
G3's LRU eviction; G4 blocks stay for other workers (``kvbm-backend gc`` removes them by age).

Requests the scheduler knows at the reset (running, preempted, waiting) keep their old identity, so they are
never loaded or saved again (``opaque`` and ``no_load``: their KV may mix both weights). A hand-off's identity
names the epoch (``namespace`` ``<fingerprint>@reset-<epoch>``): a prefill and a decode worker of different epochs
serve without waiting. The epoch is random, never a count, so two engines reset for different reasons (one with
new weights, one without) never share an identity; engines of one fleet therefore stop sharing G4 blocks after a
reset until they restart. A restart begins at epoch ``""`` again: after an in-place weight update, start workers
with a ``revision`` (kvbm_backend config, part of the namespace) that names the new weights, or reset again.

KV events: the G3 blocks published before are withdrawn (:meth:`.kv_events.G3KvEvents.forget`): silently when the
engine's own prefix cache was reset too (vLLM publishes ``AllBlocksCleared``, after which nothing old is
re-published), with ``BlockRemoved`` when it was not (vLLM's reset failed: blocks in use).
"""
from __future__ import annotations

import logging
import secrets
from typing import Any

from . import handoff, stats

log = logging.getLogger(__name__)


def handoff_identity(g4: Any, tenant: str, epoch: str) -> dict[str, str]:
    """:func:`.handoff.identity` with the reset ``epoch`` in its ``namespace`` (a worker never reset: as it is)."""
    ident = handoff.identity(g4, tenant)
    if epoch and "namespace" in ident:
        ident["namespace"] = f"{ident['namespace']}@reset-{epoch}"
    return ident


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
    side.epoch = epoch = secrets.token_hex(8)
    stopped = 0  # not those already untiered (multimodal, or stopped by an earlier reset): before 2026-12-03 counted
    for st in side._reqs.values():  # old identity: never loaded or saved again (their KV may mix weights)
        stopped += not st.opaque
        st.no_load, st.opaque, st.g3_local, st.lookup = True, True, None, None
    forgotten = side.events.forget(withdraw=not engine_cleared) if side.events is not None else 0
    stats.add(connector_cache_resets=1, reset_untiered_requests=stopped)
    log.info("kvbm_backend: connector cache reset (reset epoch %s): %d requests in the engine are no longer "
             "tiered, blocks stored before are not served by this engine (G3 ages them out, G4 keeps them for other "
             "workers), %d G3 blocks withdrawn from KV events", epoch, stopped, forgotten)
    return epoch
