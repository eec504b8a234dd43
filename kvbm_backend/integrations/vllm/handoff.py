"""Prefill -> decode handoff through the shared tier G4: the "cache-mediated" form of disaggregated serving,
no KV transport between the engines. (G3 is private to one worker: a second process on the same G3
directory is refused, ``G3LockedError``; only G4 is shared.)

The prefill worker computes the prompt and its connector offloads the prompt's full blocks as usual (G3 and
G4, write-behind); the decode worker's connector onboards them like any G4 hit. The only thing that
crosses from prefill to decode is a hint in vLLM's ``kv_transfer_params`` (Dynamo passes it from the
prefill response to the decode request):

* the prefill request carries ``{"kvbm_backend_handoff": true}`` (set by Dynamo's PD protocol for our
  connector, :mod:`kvbm_backend.integrations.dynamo.pd_protocol`, or by any router);
* when it finishes, the prefill connector answers ``{"kvbm_backend_handoff": {"blocks": N, "block_size": B,
  "namespace": F, "tenant": T, "salt": S}}``: N = the prompt's full blocks another engine can load,
  ``(prompt tokens - 1) // B``, when this worker writes them to G4 (G4 open, ``save`` and ``save_to_g4`` on, and
  its G4 keyring does not refuse the request's tenant: :func:`write_refusal`), else 0 (nothing to wait for).
  Blocks this worker did not compute for the request (loaded from its own G3 or G4, or served by its engine's
  prefix cache) are written to G4 too, where G4 lacks them (``SaveJob.g4_only``: checked with one
  ``lookup_prefix``, then only the missing ones are put; of a sliding-window group the window before them). A
  hybrid model's sliding-window groups store the window before block N too, which the decode side's hit needs
  (:meth:`~.scheduler_side.SchedulerSide._group_saves`). N stops at the first block the prefill side knows it will
  not write (:class:`Promises`: a failed layer-wise load's step, whose saves the worker drops; a
  request that computed on its unloaded blocks; under ``external_launcher`` with TP > 1 a block not every rank's
  scheduler planned, which the ranks' agreement offers nowhere; after a connector reset, ``reset_tiers``, the blocks
  not offered before it). Otherwise N is what the write-behind is asked to store, not a
  receipt: a put that is dropped (staging room, queue full, store down), or a save of the step in which the request
  finished dropped for a layer-wise load failed in that step (reported after ``request_finished``), ends the decode
  side's wait at ``handoff_wait_s``. F = the fingerprint of the namespace the prefill worker's G4 blocks are stored
  under (:func:`g4_fingerprint`: model, revision, dtype, layout, TP world size, or the canonical namespace with
  ``g4.layout: canonical``), T = the first 8 bytes (hex) of the request's tenant pseudonym in G4 (a keyed
  HMAC with an encrypted pool's keyring: the tenant id is not in the clear), S = 16 hex characters of the
  request's salt hash (the seed of its blocks' names, from its cache_salt, LoRA adapter name and path and the reset
  epoch: :func:`~.identity.request_salt`), keyed with the tenant's G4 naming key where G4 has a keyring (so a reader of
  the params cannot confirm a guessed cache_salt or LoRA adapter), the hash itself without one
  (:func:`~.handoff_ident.salt_tag`). F and S name the reset epoch of the request (one in the engine at a reset keeps
  the epoch before it: :mod:`.reset_epoch`). The scheduler thread asks the keyring only through the pool's
  :class:`~kvbm_backend.pool.g4.keyring_view.KeyringView` (no file I/O, no keyring lock);
* the decode connector, seeing that, waits (without blocking the scheduler: vLLM's "ask me again" ``None``
  from ``get_num_new_matched_tokens``) until its tiers show those N blocks, at most ``wait_s`` from the first
  look; past it, it takes what is there and the engine computes the rest (counted ``handoff_timeouts`` and
  logged once per request at WARNING, with the request id and the blocks found). It does not wait at all
  when F, T or S differ from its own (the blocks are under names it never reads: a prefill worker of another
  TP size, dtype, revision or reset epoch, with another default tenant, or a decode request naming another
  cache_salt or LoRA adapter than its prefill request): served at once, counted ``handoff_identity_mismatches``,
  one WARNING per pair of values (each field its own budget, a flood of forged values counted and the pairs that
  recur named once a minute: :func:`~.handoff_ident.mismatch`). T is sent only by a pool with a
  keyring (an unkeyed pseudonym would let a client confirm a guessed tenant id), so F without T is a prefill
  worker whose G4 has none: its blocks are under unkeyed names, which a decode worker with a keyring never reads,
  a tenant mismatch there (before 2026-12-03 waited ``handoff_wait_s``); two workers without a keyring compare no T.
  Params without F, T or S (older prefill workers; S since 2026-12-03) are not compared on the fields they lack:
  waited for as before.
  A decode request that also carries NIXL's ``do_remote_prefill`` (:func:`remote_prefill`; a ``MultiConnector``
  merges both connectors' params) is not waited for: NIXL brings its KV.

Never wrong KV: the decode side loads only blocks whose frames check (the ordinary load path); the wait
only decides *when* it looks. The write-behind that makes blocks visible is the prefill side's ordinary
publish-after-durable path.
"""
from __future__ import annotations

import logging
import reprlib
import time
from dataclasses import dataclass
from typing import Any

from . import stats
from ...log_limits import LimitedLog
from .handoff_ident import IDENT_FIELDS, keyring_view, mismatch
from .handoff_ident import _warned_pairs, g4_fingerprint, identity, salt_tag, tenant_tag  # noqa: F401 - re-exported

KEY = "kvbm_backend_handoff"
DEFAULT_WAIT_S = 5.0
log = logging.getLogger("kvbm_backend.handoff")
#: the hand-off's per-request WARNINGs, one per kind per minute (:mod:`kvbm_backend.log_limits`)
LOG = LimitedLog(log)


def _params(request: Any) -> dict:
    p = getattr(request, "kv_transfer_params", None)
    return p if isinstance(p, dict) else {}


def requested(request: Any) -> bool:
    """The prefill side: the request asks for a handoff (``kv_transfer_params[KEY] is True``)."""
    return _params(request).get(KEY) is True


_warned_nothing_shared = False


def start_keyring_view(g4: Any) -> None:
    """Start the refresh of ``g4``'s :func:`keyring_view` (its first snapshot made on this thread); no-op without."""
    view = keyring_view(g4)
    if view is not None:
        view.start()


def tenant_state(g4: Any, tenant: str) -> str | None:
    """``tenant``'s state in ``g4``'s keyring as of the view's last refresh (``"active"``, ``"revoked"``,
    ``"unknown"``, ``"unavailable"``; ``"unknown"`` only for an encrypted pool: a plaintext one needs no key to read a
    tenant's blocks, so None); None without a keyring. No I/O, no keyring lock."""
    view = keyring_view(g4)
    st = view.state(tenant) if view is not None else None
    return None if st == "unknown" and not view.encrypt else st


def write_refusal(g4: Any, tenant: str) -> str | None:
    """Why ``g4`` drops every offload of ``tenant`` (a key of :data:`REFUSAL_TEXT`), or None: written as far as its
    keyring's view knows (:meth:`~kvbm_backend.pool.g4.keyring_view.KeyringView.write_refusal`). No I/O, no lock."""
    view = keyring_view(g4)
    return view.write_refusal(tenant) if view is not None else None


#: what the prefill worker's log says of each :meth:`~kvbm_backend.pool.g4.keyring_view.KeyringView.write_refusal`
REFUSAL_TEXT = {
    "revoked_tenant": "the tenant was revoked (only `kvbm-backend keys create` brings it back)",
    "unknown_tenant": "the keyring holds no key for the tenant and creates none here (a read-only keyring, "
                      "g4.keyring.auto_create_tenants off, g4.keyring.max_auto_tenants reached, or an id over 1024 "
                      "bytes: create it with `kvbm-backend keys create`)",
    "keyring": "the keyring file does not load (see the keyring's own ERROR line, `kvbm-backend doctor`)"}


def finished_params(request: Any, block_size: int, offloads: bool = True,
                    ident: dict[str, str] | None = None, limit: int | None = None,
                    refused: str | None = None) -> dict | None:
    """``kv_transfer_params`` for a finished prefill request that asked for a handoff, else None:
    ``{KEY: {"blocks": N, "block_size": tokens per block, **ident}}`` with N = ``(prompt tokens - 1) //
    block_size``, the full blocks another engine can load for this prompt (vLLM computes at least the prompt's
    last token itself, so a block ending on it is never loaded). ``offloads``: this connector writes the
    prompt's blocks to the shared G4 (G4 open, ``save`` and ``save_to_g4`` on); False: N = 0, so the decode
    worker computes the prompt at once instead of waiting ``handoff_wait_s`` for blocks that never reach a tier
    it reads (before 2026-11-30 a worker with G3 alone, or ``save_to_g4`` off, promised every block); logged
    once per process at WARNING. ``refused``: this worker's G4 drops every offload of the request's tenant, by
    its keyring (a key of :data:`REFUSAL_TEXT`: :meth:`~kvbm_backend.pool.g4.keyring_view.KeyringView.write_refusal`):
    N = 0 too, counted ``handoff_unwritable_tenant_requests``, logged at WARNING (one per minute, :data:`LOG`;
    before 2026-12-01 every block was promised and the decode worker waited ``handoff_wait_s`` each time).
    ``limit``: the first block this worker is known not to write to G4
    (:meth:`Promises.limit`; None: none known): N stops there, the blocks cut counted
    ``handoff_promise_cut_blocks``. ``ident``: :func:`identity` of the request's tenant, added to the answer."""
    global _warned_nothing_shared
    if not requested(request):
        return None
    writes = offloads and refused is None
    n = max(0, len(getattr(request, "prompt_token_ids", None) or []) - 1) // block_size if writes else 0
    if limit is not None and limit < n:
        stats.add(handoff_promise_cut_blocks=n - max(0, limit))
        n = max(0, limit)
    if offloads and refused is not None:
        stats.add(handoff_unwritable_tenant_requests=1)
        LOG.warning("unwritable", "kvbm_backend handoff: request %s asked for a prefill->decode handoff, but this "
                    "worker's G4 drops every offload of its tenant: %s; it answers 0 blocks and the decode worker "
                    "computes the prompt", getattr(request, "request_id", "?"), REFUSAL_TEXT.get(refused, refused))
    if not offloads and not _warned_nothing_shared:
        _warned_nothing_shared = True
        log.warning("kvbm_backend handoff: request %s asked for a prefill->decode handoff, but this worker writes "
                    "nothing to a shared G4 (no G4 tier, or connector save / save_to_g4 off; G3 is private to one "
                    "worker): it answers 0 blocks and the decode worker computes the prompt",
                    getattr(request, "request_id", "?"))
    stats.add(handoff_offered_requests=1, handoff_offered_blocks=n)
    return {KEY: {"blocks": n, "block_size": block_size, **(ident or {})}}


class Promises:
    """The prefill side's bound on its hand-off promises (:func:`finished_params`): per request that asked for a
    hand-off, the first block its worker is known not to write to G4, so N never counts blocks that cannot come
    (before 2026-11-30 N counted every loadable block whatever was dropped, and the decode worker waited
    ``handoff_wait_s`` for blocks that never came, then computed them).

    Known, from the step reports that reach the scheduler before the request finishes: a layer-wise load
    (``g3.layerwise_load``) that failed in a step. The worker then drops every save of that step and the failed
    request's saves from then on (:meth:`~.layerwise.LayerwiseLoads.saves`); the scheduler re-offers none of them
    (a request vLLM rolls back after the failure computes its blocks again, but they are not offered again,
    or are withheld). So each such request loses from the first block its jobs of that step named, and the failed
    one from its first failed block too. A request that computed on the unloaded blocks is cut at its
    ``save_limit`` (:func:`.failed_blocks.contain_failed_sync_load`), read by :meth:`limit`. Under
    ``external_launcher`` with TP > 1, blocks some rank's scheduler planned and another did not, which the ranks'
    agreement therefore offers nowhere (:meth:`withheld`): the request loses from the first of them, on every rank.
    A connector reset (``reset_tiers``) makes the requests in the engine opaque, never saved again (:meth:`stop`): a
    hand-off request promises only the blocks offered before it (before 2026-12-03, every block).

    Not known, the bound of the promise: vLLM calls ``request_finished`` before the step's connector output
    reaches the scheduler (``Scheduler.update_from_output``), so a request that finishes in the very step whose
    layer-wise load fails still promises that step's blocks (the failed request and those on its blocks do not
    finish there: vLLM rolls them back); and the worker's later drops (``max_pending_save_bytes``, a hand-off job's
    half of the staging room, a full G4 write queue, a store that fails) are never reported. For those the decode
    side waits ``handoff_wait_s`` at most, as for a slow write-behind. Scheduler thread only."""

    def __init__(self) -> None:
        self._meta: Any = None            # the last step's KvbmConnectorMetadata (its loads and saves)
        self._lost: dict[str, int] = {}   # request id -> first block its worker will not write (hand-offs only)

    def step(self, meta: Any) -> Any:
        """``meta`` (a :class:`~.metadata.KvbmConnectorMetadata` being built: its ``saves`` list is filled after
        this call) is the step whose outcome the next :meth:`loads_failed` reports; returns ``meta``."""
        self._meta = meta
        return meta

    def loads_failed(self, failed: list, reqs: dict[str, Any]) -> None:
        """The worker's reports of failed loads (:class:`~.metadata.FailedLoad`) for the last :meth:`step`;
        ``reqs``: the scheduler's ``_Req`` by request id. Only a layer-wise job of that step makes its saves
        dropped; an asynchronous load's blocks are offered again as they are recomputed (and those before the
        failed one to G4 alone), so nothing is lost then."""
        meta = self._meta
        sync = {j.req_id for j in meta.loads if j.layerwise} if meta is not None else set()
        hit = [f for f in failed if f.req_id in sync]
        if not hit:
            return
        for j in meta.saves:  # every save of the step was dropped
            if j.seq_hashes:
                self._lose(reqs.get(j.req_id), j.seq_hashes[0])
        for f in hit:  # and the failed request's from its first failed block on
            self._lose(reqs.get(f.req_id), f.first_failed)

    def withheld(self, st: Any, seq_hashes: list[int]) -> None:
        """Blocks ``seq_hashes`` of request state ``st`` (a ``_Req``) planned for saving by some TP rank's scheduler
        but not offered by any (:meth:`.tp_sched.SchedAgree.saves`, ``external_launcher``): G4 gets not every rank's
        slice of them, so a hand-off request promises only the blocks before the first of them (a hash not among
        its blocks: none). No-op for a request that did not ask for a hand-off."""
        if st is None or not requested(st.request) or not seq_hashes:
            return
        want = set(seq_hashes)
        self.stop(st, next((i for i, h in enumerate(st.hashes) if h in want), 0))

    def stop(self, st: Any, upto: int) -> None:
        """Request state ``st`` (a ``_Req``) writes no block from index ``upto`` on (a connector reset made it opaque
        after it offered its first ``upto`` blocks: :func:`.reset_epoch.reset`): a hand-off request promises at most
        those. No-op for a request that did not ask for a hand-off."""
        if st is not None and requested(st.request):
            i = max(0, upto)
            self._lost[st.req_id] = min(i, self._lost.get(st.req_id, i))

    def _lose(self, st: Any, seq_hash: int) -> None:
        if st is None or not requested(st.request):
            return
        try:
            i = st.hashes.index(seq_hash)
        except (ValueError, OverflowError, TypeError):  # not one of its blocks: promise none
            i = 0
        self.stop(st, i)

    def limit(self, request_id: str, st: Any = None) -> int | None:
        """The first block of ``request_id`` (``st``: its ``_Req``, or None) its worker is known not to write to G4,
        or None when none is known; forgets the request (call once, at ``request_finished``)."""
        cuts = [self._lost.pop(request_id, None), getattr(st, "save_limit", None)]
        known = [c for c in cuts if c is not None]
        return min(known) if known else None


def offered(request: Any) -> bool:
    """The decode side: the request carries a prefill worker's handoff answer (a dict under ``KEY``)."""
    return isinstance(_params(request).get(KEY), dict)


def remote_prefill(request: Any) -> bool:
    """Another connector supplies this request's prompt KV (NixlConnector's ``do_remote_prefill``): a G3/G4
    lookup for it would only hold the request back (MultiConnector waits for every child's answer)."""
    return _params(request).get("do_remote_prefill") is True


def _count(x: Any) -> int | None:
    """``x`` if it is a plain int (not bool, float, string: a client's JSON ``1e999`` is a float ``inf``)."""
    return x if type(x) is int else None


def expected_blocks(request: Any, block_size: int, ours: dict[str, str] | None = None) -> int | None:
    """The decode side: how many leading blocks the prefill worker offloaded for this request, or None when
    the request carries no handoff (or one for another block size, or for another G4 namespace, tenant or request
    salt than ``ours``, :func:`identity` of this engine with the request's salt S: those cannot be matched, so the
    request is served like any other, no wait, counted ``handoff_identity_mismatches``: :func:`~.handoff_ident.mismatch`). Values
    come from the client's request: anything but a plain int >= 0 (and >= 1 for ``block_size``), or an identity field
    that is not a string, is malformed, served without waiting and logged with a bounded description. Called once
    per request (the scheduler keeps the answer)."""
    v = _params(request).get(KEY)
    if not isinstance(v, dict):
        return None
    n, bs = _count(v.get("blocks")), _count(v.get("block_size"))
    if (n is None or bs is None or n < 0 or bs < 1
            or any(not isinstance(v.get(f), (str, type(None))) for f in IDENT_FIELDS)):
        LOG.warning("malformed", "kvbm_backend handoff: malformed %s %s in request %s; served without waiting", KEY,
                    reprlib.repr(v), getattr(request, "request_id", "?"))
        return None
    if bs != block_size:
        LOG.warning("block_size", "kvbm_backend handoff: request %s was prefilled with %d-token blocks, this "
                    "engine uses %d; served without waiting", getattr(request, "request_id", "?"), bs, block_size)
        return None
    if mismatch(request, v, ours, LOG):
        return None
    return n


#: the timeout WARNING's question when this worker's keyring holds no key of the request's tenant
UNKNOWN_TENANT_HINT = ("This worker's G4 keyring holds no key of the request's tenant: does the prefill worker's "
                       "keyring create none (read-only, g4.keyring.auto_create_tenants off, max_auto_tenants reached, "
                       "an id over 1024 bytes) or do the workers use different keyring files?")

#: seconds before a waiting decode request looks at G3/G4 again: the first after a look that found more blocks than
#: the request's looks before (the prefill's write-behind is landing), each next one after every look in a row that
#: found nothing new, the last for all later ones; never past the end of the wait (``wait_s`` after the first look)
RETRY_S = (0.05, 0.1, 0.2, 0.4)


@dataclass
class _Wait:
    first: float        # clock of the first look
    next_at: float      # no look before it
    found: int = -1     # most blocks a look found
    idle: int = 0       # looks in a row that found nothing new


class HandoffWaits:
    """The decode side's waits, per request: when it may look again and whether it keeps waiting.

    A request waits (vLLM's "not yet") until a look shows every block its prefill worker offloaded, at most
    ``wait_s`` seconds from its first look; looks follow :data:`RETRY_S` (:meth:`may_look`). Each look asks only
    beyond the prefix the request's earlier looks confirmed (:class:`~.lookup.TierLookup` ``known``): a block once
    found stays counted for the request (the load verifies every block; one gone meanwhile is a failed load,
    recomputed: :meth:`~.scheduler_side.SchedulerSide.loads_failed`). The wait also ends at once when the look lacks
    blocks and every G4 pool that could supply them has its circuit breaker open (``refused``: they answer every
    lookup 0 without asking the store, :func:`~.lookup.breaker_open`): counted ``handoff_timeouts`` and
    ``handoff_breaker_timeouts``, the engine computes the rest, so a G4 outage costs no hand-off ``wait_s``. So too
    when this worker's keyring serves no key of the request's tenant (revoked, or its file does not load: its G4 loads
    none of the blocks): ``handoff_timeouts`` and ``handoff_keyring_timeouts``. So too
    once a look's full-attention prefix reaches a promised block that cools after a failed load (no hit goes past it
    for ``FAILED_BLOCK_COOLDOWN_S``, :mod:`.failed_blocks`): ``handoff_timeouts`` and ``handoff_cooled_timeouts``;
    a hybrid model's hit cut there may find fewer blocks (its windows probed at the cut, 0 when none is stored
    there), which no later look changes (before 2026-12-03 such a request waited the whole ``wait_s``).
    The request's lookup counts once, from the look that ended its wait (:meth:`~.lookup.TierLookup.count_request`).

    Args:
        wait_s: seconds (>= 0; ``handoff_wait_s``). Raises ValueError below 0.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, wait_s: float = DEFAULT_WAIT_S, clock=time.monotonic):
        if wait_s < 0:
            raise ValueError(f"handoff_wait_s: expected >= 0 seconds, got {wait_s!r}")
        self.wait_s, self._clock = float(wait_s), clock
        self._w: dict[str, _Wait] = {}

    def may_look(self, request_id: str) -> bool:
        """Whether ``request_id`` may look at the tiers now: before its first look, then once the delay that
        :meth:`should_wait` set (:data:`RETRY_S`) has passed."""
        w = self._w.get(request_id)
        return w is None or self._clock() >= w.next_at

    def should_wait(self, request_id: str, found_blocks: int, expected: int, refused: bool = False,
                    reachable: int | None = None, tenant_state: str | None = None,
                    reached: int | None = None) -> bool:
        """A look at ``request_id`` found ``found_blocks`` leading blocks: True while fewer than ``expected`` are
        found, ``wait_s`` has not passed since its first look and ``refused`` is False (then the next look waits
        :data:`RETRY_S`); False once they are all there (counted ``handoff_complete_requests``; a promise of 0 blocks,
        ``expected`` <= 0, is no hand-off: False, nothing counted), when ``refused``
        (G4's breakers open: ``handoff_timeouts`` and ``handoff_breaker_timeouts``), when ``found_blocks`` or
        ``reached`` (blocks the look's hit could have reached but for the cool-down: :attr:`.lookup.PrefixLookup.
        reach`, None: ``found_blocks``) reaches ``reachable`` (the end of the longest hit of the promised blocks that
        reads no block cooling after a failed load, :mod:`.failed_blocks`: no load goes past it, whatever the tiers
        hold; ``handoff_timeouts`` and ``handoff_cooled_timeouts``), when
        ``tenant_state`` (the request's tenant in this worker's G4 keyring, :meth:`~kvbm_backend.pool.g4.keyring_view.
        KeyringView.state`) is ``"revoked"`` or ``"unavailable"``: this worker loads none of its blocks
        (``handoff_timeouts`` and ``handoff_keyring_timeouts``), or the wait is over (``handoff_timeouts``; its
        WARNING names the keyring when ``tenant_state`` is ``"unknown"``); each ending is logged (limited:
        :data:`LOG`). ``handoff_wait_s`` adds the seconds waited."""
        if expected <= 0:  # a promise of nothing (the prefill worker wrote nothing to G4): no hand-off, not counted
            self._w.pop(request_id, None)
            return False
        now = self._clock()
        w = self._w.setdefault(request_id, _Wait(now, now))
        if found_blocks >= expected:
            if self._w.pop(request_id, None) is not None:
                stats.add(handoff_complete_requests=1, handoff_wait_s=now - w.first)
            return False
        if refused:
            self._w.pop(request_id, None)
            stats.add(handoff_timeouts=1, handoff_breaker_timeouts=1, handoff_wait_s=now - w.first)
            LOG.warning("breaker", "kvbm_backend handoff: request %s found %d of the %d blocks its prefill worker "
                        "offloaded and G4 is unavailable (circuit breaker open); the engine computes the rest at once "
                        "instead of waiting handoff_wait_s", request_id, found_blocks, expected)
            return False
        if tenant_state in ("revoked", "unavailable"):
            self._w.pop(request_id, None)
            stats.add(handoff_timeouts=1, handoff_keyring_timeouts=1, handoff_wait_s=now - w.first)
            LOG.warning("keyring", "kvbm_backend handoff: request %s found %d of the %d blocks its prefill worker "
                        "offloaded and this worker's G4 keyring serves no key of its tenant (%s); the engine computes "
                        "the rest at once instead of waiting handoff_wait_s", request_id, found_blocks, expected,
                        "the tenant was revoked" if tenant_state == "revoked" else "the keyring file does not load")
            return False
        if reachable is not None and max(found_blocks, reached or 0) >= reachable:
            self._w.pop(request_id, None)
            stats.add(handoff_timeouts=1, handoff_cooled_timeouts=1, handoff_wait_s=now - w.first)
            LOG.warning("cooled", "kvbm_backend handoff: request %s found %d of the %d blocks its prefill worker "
                        "offloaded and no load goes past block %d: a load of that block failed lately (cooling down), "
                        "so the engine computes the rest at once instead of waiting handoff_wait_s", request_id,
                        found_blocks, expected, reachable)
            return False
        if now - w.first < self.wait_s:
            w.idle = 0 if found_blocks > w.found else w.idle + 1
            w.found = max(w.found, found_blocks)
            w.next_at = min(now + RETRY_S[min(w.idle, len(RETRY_S) - 1)], w.first + self.wait_s)
            return True
        if self._w.pop(request_id, None) is not None:
            stats.add(handoff_timeouts=1, handoff_wait_s=now - w.first)
            LOG.warning("timeout", "kvbm_backend handoff: request %s found %d of the %d blocks its prefill worker offloaded "
                        "after %.1f s (handoff_wait_s); the engine computes the rest. %s", request_id,
                        found_blocks, expected, now - w.first, UNKNOWN_TENANT_HINT if tenant_state == "unknown" else
                        "Is G4 shared by both workers and reachable, and is the prefill worker's G4 write-behind "
                        "keeping up?")
        return False

    def forget(self, request_id: str) -> None:
        self._w.pop(request_id, None)
