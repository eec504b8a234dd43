"""Scheduler role of the connector: prefix lookup (G3 then G4), load plans, save plans.

Identity: KVBM sequence hashes (:mod:`kvbm_backend.model.hashing`) over the request's tokens in vLLM-``block_size``
blocks, salted by ``salt_hash(salt_bytes(cache_salt, lora_name, lora_path))``; the tenant is the request's
``cache_salt`` (else the default tenant). A block one worker wrote is found by any worker of the namespace.

Saves cover prompt blocks and, with ``save_decode`` (default), blocks filled by generated tokens too:
the chain of hashes is extended as the request's ``all_token_ids`` grow, so the next turn of a chat
(prompt = previous prompt + previous answer + new message) finds the previous answer's KV as well. A
block is saved only when every one of its tokens is known (in ``all_token_ids``, never a speculative
draft or an async-scheduling placeholder) and its KV is computed by the step being scheduled.

Lookups never block the scheduler: they run on the pools' threads; until a request's lookup is done,
``get_num_new_matched_tokens`` answers None ("ask again next step"), and a lookup that outlives the
tier's timeout counts as a miss beyond what is already known (the lookups: :mod:`.lookup`).
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any, cast

from ...model.hashing import salt_hash, sequence_hashes
from ...model.namespace import KeyRun, Namespace
from ...pool.base import BlockPool
from ..revoked_tenants import RevokedTenants
from . import handoff, reset_epoch, stats, tp_events, tp_sched
from .identity import block_digests, kv_beyond_token_ids, renew_opaque, request_salt
from .failed_blocks import FailedBlocks, Unrecomputed, withhold_tainted
from .g3_mirror import G3Mirror
from .kv_events import G3KvEvents, IdlePublisher
from .load_failures import FailedBlockCount, errored, on_failed_loads, on_failed_recving
from .lookup import GroupTiers, PrefixLookup
from .metadata import KvbmConnectorMetadata, KvbmWorkerMeta, LoadJob, SaveJob

__all__ = ["G3KvEvents", "G3Mirror", "GroupTiers", "SchedulerSide", "kv_beyond_token_ids"]  # re-exported


@dataclass
class _Req:
    req_id: str
    tenant: str
    hashes: array                     # array('Q'): sequence hashes of full prompt (then decode) blocks, uint64 as is
    lookup_blocks: int                # blocks that may be served from outside: (prompt_len - 1) // bs
    lookup: PrefixLookup | None = None
    n_local: int = 0                  # blocks the engine's own prefix cache had at the last query
    g3_local: int | None = None       # leading blocks of that local hit G3 already holds (None: unknown)
    planned: tuple[int, int] | None = None  # (first, end) block range being loaded
    group_block_ids: list[list[int]] = field(default_factory=list)  # engine block ids per KV cache group
    hit: tuple | None = None          # PrefixLookup's result (n, g3_full, windows), failed blocks cut
    no_load: bool = False             # a load of this request failed: it is recomputed, never reloaded
    saved_upto: int | None = None     # blocks [0, saved_upto) are stored or owned by someone else
    save_limit: int = 1 << 62         # blocks from here on are never saved (computed on a failed sync load's blocks)
    counted: bool = False
    request: Any = None               # vLLM Request (its all_token_ids grow during decode)
    salt: int = 0
    sync_load: bool = False           # the hit was offered synchronously (g3.layerwise_load: loaded in the step)
    opaque: bool = False              # never tiered: KV beyond token ids (images, embeds); made before a reset_cache
    handoff_want: int | None = None   # blocks a prefill worker offloaded for it (.handoff), parsed once
    handoff_done: bool = False        # its handoff wait ended: later asks (after a preemption) do not wait again
    handoff_known: tuple[int, int] = (0, 0)  # (G3, G4) leading blocks its wait's looks confirmed: not asked again
    digests: bytearray = field(default_factory=bytearray)  # token digests of its first blocks (.identity)
    epoch: str = ""                   # the reset epoch its hashes and digests are salted with (.reset_epoch)
    count_as: bool | None = None      # its lookup, counted once the TP ranks agree an answer (local?; .tp_sched)
    count_look: PrefixLookup | None = None  # the look whose pools' counters wait for that agreement too (.tp_sched)


class SchedulerSide:
    """State and decisions of the scheduler-role connector (one per engine)."""

    def __init__(self, namespace: Namespace, block_size: int, g3: BlockPool | None, g4: BlockPool | None,
                 default_tenant: str = "", lookup_timeout_s: float = 2.0, save: bool = True, load: bool = True,
                 save_decode: bool = True, groups: list[GroupTiers] | None = None,
                 handoff_wait_s: float = handoff.DEFAULT_WAIT_S, layerwise: bool = False, save_to_g4: bool = True,
                 tp_group: Any = None):
        """``groups``: the KV cache groups (:class:`GroupTiers`, index = vLLM's group index); None for one
        full-attention group (``namespace``, ``g3``, ``g4``). A hit counts only when every group has what the
        engine reads (:class:`PrefixLookup`), and loads/saves are planned per group (one :class:`LoadJob` /
        :class:`SaveJob` per group that has blocks in it). ``handoff_wait_s``: how long a decode
        request handed off by a prefill worker waits for the blocks it was promised (:mod:`.handoff`).
        ``layerwise`` (``g3.layerwise_load``): a hit served by G3 alone is offered synchronously (vLLM loads it
        inside the step, layer by layer: :mod:`.layerwise`); G4 hits and models of several or windowed groups
        stay asynchronous (layer-wise failures are reported as block ids: :func:`.workers.block_level_errors`).
        ``save_to_g4``: the workers write saves to G4 too (the connector option): a prefill request's handoff
        promises blocks only then (:attr:`hands_off`). ``tp_group``: vLLM's TP group, given by the wiring under
        ``external_launcher`` with TP > 1 only: saves and matches are agreed over it (:mod:`.tp_sched`)."""
        self.groups = list(groups) if groups else [GroupTiers(namespace, g3, g4, None)]
        self.ns, self.bs, self.save_decode, self.g3, self.g4 = namespace, block_size, save_decode, g3, g4
        self.default_tenant, self.lookup_timeout_s = default_tenant, lookup_timeout_s
        self.save_enabled, self.load_enabled, self.save_to_g4 = save, load, save_to_g4
        self.layerwise = layerwise and len(self.groups) == 1 and self.groups[0].window_blocks is None
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._hit_source: dict[str, dict[str, int]] = {}
        self.mirror_wait_s, self._first_query = 10.0, cast("float | None", None)
        self.events: G3KvEvents | None = None  # set by the connector when vLLM publishes KV events
        self.idle_events: IdlePublisher | None = None  # publishes them while the engine does not step
        self.handoff = handoff.HandoffWaits(handoff_wait_s)
        self.promises = handoff.Promises()  # the prefill side's: blocks its hand-off answers must not promise
        self.failed_blocks = FailedBlocks(windows=[g.window_blocks for g in self.groups])  # per group's window
        self.unrecomputed = Unrecomputed()
        self.failed_counts = FailedBlockCount()  # failed and loaded blocks of its loads, each once at any TP size
        self.evict_engine_blocks: Any = None  # vLLM's BlockPool.evict_blocks (connector.bind_gpu_block_pool)
        self.revoked: RevokedTenants | None = None  # tenants G3 does not serve (.revoked_tenants; set by the wiring)
        self.epoch = ""  # reset epoch folded into every new request's salt ("": never reset; .reset_epoch)
        handoff.start_keyring_view(g4)  # hand-offs ask G4's keyring through it: no I/O on the scheduler thread
        self.tp = tp_sched.SchedAgree(tp_group) if tp_group is not None else None
        self._learns: list = []  # this step's planned blocks for the KV events, until the plan is agreed (.tp_events)

    # ---- identity ------------------------------------------------------------------------------
    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            cache_salt = getattr(request, "cache_salt", None)
            salt = salt_hash(request_salt(request, self.epoch))
            toks = list(request.prompt_token_ids or [])
            hashes = sequence_hashes(toks, self.bs, salt=salt, into=array("Q"))
            assert isinstance(hashes, array)  # sequence_hashes fills and returns ``into``
            st = _Req(request.request_id, cache_salt or self.default_tenant, hashes,
                      lookup_blocks=max(0, (len(toks) - 1) // self.bs), request=request, salt=salt,
                      group_block_ids=[[] for _ in self.groups], epoch=self.epoch)
            ours = self._ident(st.tenant, st) if self.g4 is not None and handoff.offered(request) else None
            want = handoff.expected_blocks(request, self.bs, ours)
            if want is not None and want > st.lookup_blocks:
                handoff.LOG.warning("promise", "kvbm_backend handoff: request %s promises %d blocks, its prompt has "
                                    "%d; served without waiting", request.request_id, want, st.lookup_blocks)
                want = None
            st.handoff_want = want
            self._reqs[request.request_id] = st
        return renew_opaque(st)

    def _extend_hashes(self, st: _Req, upto_blocks: int) -> None:
        """Extend ``st.hashes`` over generated tokens up to ``upto_blocks`` full blocks, using only
        tokens already in ``request.all_token_ids``."""
        toks = getattr(st.request, "all_token_ids", None)
        if toks is None:
            return
        upto = min(upto_blocks, len(toks) // self.bs)
        have = len(st.hashes)
        if upto <= have:
            return
        parent = st.hashes[-1] if st.hashes else None
        sequence_hashes(list(toks[have * self.bs:upto * self.bs]), self.bs, salt=st.salt, parent=parent,
                        into=st.hashes)

    def _ident(self, tenant: str, st: _Req | None) -> dict[str, str]:  # the reset epoch and salt st's blocks have
        return reset_epoch.handoff_identity(self.g4, tenant, *((st.epoch, st.salt) if st else (self.epoch, None)))

    def _group_keys(self, g: GroupTiers, st: _Req, a: int, n: int) -> list[KeyRun]:
        """Keys of blocks ``[a, n)`` of ``st`` in group ``g``'s namespace, one run per TP rank."""
        return g.ns.rank_runs(st.hashes[a:n], st.tenant)[0]

    # ---- vLLM scheduler hooks --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """:meth:`_answer`; under ``external_launcher`` with TP > 1 the answer every TP rank agrees, its lookup counted
        as agreed (:meth:`.tp_sched.SchedAgree.match`; RuntimeError when that collective fails)."""
        tp_events.agree_domain(self)  # (once) whether TP rank 0 alone announces to G4
        n, is_async = self._answer(request, num_computed_tokens)
        if self.tp is None or not self.load_enabled or (self.g3 is None and self.g4 is None):
            return n, is_async
        return self.tp.match(self, request, n, is_async)

    def _answer(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: ``(tokens loadable beyond num_computed_tokens, async)``, or
        ``(None, False)`` while the answer is not known yet (vLLM asks again next step; never blocks). A request
        handed off by a prefill worker (:func:`.handoff.expected_blocks`) is answered only once the tiers show
        the promised blocks, or ``handoff_wait_s`` after the first look, or at once when G4 is unavailable (then with
        what is there): :class:`.handoff.HandoffWaits` (its looks, their timing, how it is counted). One that also
        carries NIXL's ``do_remote_prefill`` (both forms' params, merged by a ``MultiConnector``) is never waited
        for: NIXL brings its KV."""
        if not self.load_enabled or (self.g3 is None and self.g4 is None):
            return self._matched(request, num_computed_tokens)
        rid = request.request_id
        st = self._state(request)
        want = st.handoff_want
        if want is None or st.handoff_done:
            return self._matched(request, num_computed_tokens)
        if st.no_load or st.opaque:  # its load failed, or never tiered: recomputed at once, never waited for
            self.handoff.forget(rid)
            return self._matched(request, num_computed_tokens)
        if handoff.remote_prefill(request):  # NIXL's form of the hand-off brings its KV (MultiConnector): never
            st.handoff_done = True           # waited for, then or after NIXL clears the flag (looked up as any)
            self.handoff.forget(rid)
            return self._matched(request, num_computed_tokens)
        if not self.handoff.may_look(rid):
            return None, False
        n, is_async = self._matched(request, num_computed_tokens, count=False)  # counted when the wait ends
        if n is None:
            return None, False
        look = st.lookup  # this look (None: none was needed, e.g. the engine's own prefix cache had it all)
        refused = look is not None and look.full.g4_refused()
        cool = self.failed_blocks.first_for(st, want, self.bs)  # no hit goes past it
        if self.handoff.should_wait(rid, (num_computed_tokens + n) // self.bs, want, refused=refused,
                                    reachable=cool if cool < want else None, reached=look.reach if look else None,
                                    tenant_state=handoff.tenant_state(self.g4, st.tenant)):
            if look is not None:
                st.handoff_known = look.confirmed  # the next look asks G3/G4 only beyond what this one found
            st.lookup = None
            return None, False
        st.handoff_done = True  # at most handoff_wait_s per request, even when vLLM asks anew (preemption)
        if look is not None and st.hit is not None and not st.counted:
            self._count_request(st, look=look)  # the look that ended the wait is the request's (pools' counters, cut)
        elif look is None and st.lookup_blocks <= st.n_local:  # the engine's prefix cache had it all
            self._count_request(st, local=True)
        return n, is_async

    def _matched(self, request: Any, num_computed_tokens: int, count: bool = True) -> tuple[int | None, bool]:
        """The answer of the tiers (and the engine's own prefix cache) for ``request``; ``count`` False: its lookup
        is not counted as the request's (a hand-off's wait counts the look that ends it)."""
        if self.g3 is None and self.g4 is None:
            return 0, False
        if not self.load_enabled:
            self._state(request)  # saves still need the request's identity
            return 0, False
        if isinstance(self.g3, G3Mirror) and not self.g3.ready:
            # Wait (bounded) for the worker's first G3 report, so a restarted worker's blocks count.
            now = time.monotonic()
            self._first_query = self._first_query or now
            if now - self._first_query < self.mirror_wait_s:
                return None, False
        st = self._state(request)
        st.n_local = num_computed_tokens // self.bs
        if st.no_load or st.opaque or handoff.remote_prefill(request):  # (NixlConnector clears the flag once
            return 0, False                                         # it has loaded: asked again, we look)
        if st.lookup_blocks <= st.n_local:
            # served by the engine's own prefix cache: remember how much of it G3 holds, so blocks seen
            # again only in the engine's cache still reach G3 (saved from the engine's blocks this step)
            st.g3_local = self._g3_prefix(st, st.n_local)
            if st.g3_local:
                tp_events.learn(self, st, 0, st.g3_local, request=request)
            if count:
                self._count_request(st, local=True)
            return 0, False
        if st.lookup is None:
            st.lookup = PrefixLookup(self, st, known=st.handoff_known,  # TP > 1 here: counted once agreed (.tp_sched)
                                     count=count and not st.counted and self.tp is None)
        res = st.lookup.poll()
        if res is None:
            return None, False
        n, p3, wins = res  # cut before any block cooling after a failed load, windows probed there (PrefixLookup)
        st.hit = (n, p3, wins)
        p4 = n - p3
        st.g3_local = min(p3, st.n_local)
        if p3:
            tp_events.learn(self, st, 0, p3, request=request)  # e.g. found again after a restart
        if count:
            self._count_request(st, look=None if st.lookup.count else st.lookup)
        total = p3 + p4
        if total <= st.n_local:
            return 0, False
        st.sync_load = self.layerwise and p4 == 0
        return (total - st.n_local) * self.bs, not st.sync_load

    def _count_request(self, st: _Req, local: bool = False, look: PrefixLookup | None = None) -> None:
        """The connector's counters of the request's lookup, once (:func:`.tp_sched.count_request`), with ``look``'s
        pool counters (a look that did not count itself: :meth:`.PrefixLookup.count_request`); under
        ``external_launcher`` with TP > 1 once the TP ranks agree its answer (:meth:`.tp_sched.SchedAgree.match`: the
        pools' by TP rank 0 alone)."""
        if st.counted:
            return
        if self.tp is not None:
            st.count_as, st.count_look = local, look
            return
        if look is not None:
            look.count_request()
        tp_sched.count_request(st, local)

    def _g3_prefix(self, st: _Req, n: int) -> int | None:
        """Leading blocks of ``st``'s first ``n`` that G3 holds for every rank (an index lookup, no
        I/O); None without G3 or when the answer is not there at once."""
        if self.g3 is None or n <= 0 or (self.revoked is not None and self.revoked.refused(st.tenant)):
            return None
        try:  # the full-attention groups' prefix (sliding windows are re-offered, see _plan_local_save)
            futs = [g.g3.lookup_prefix(k, request=False) for g in self.groups
                    if g.window_blocks is None and g.g3 is not None for k in self._group_keys(g, st, 0, n)]
            # never waited for: a pool whose lock is busy answers later (pool/g3/lookup_defer.py): unknown now
            return min([f.result() for f in futs] or [n]) if all(f.done() for f in futs) else None
        except Exception:  # noqa: BLE001 - unknown: nothing extra is saved
            return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.g3 is None and self.g4 is None:
            return
        st = self._state(request)
        st.lookup = None  # answered: vLLM asks again only after a preemption, to be looked up anew
        if num_external_tokens <= 0:  # no load of ours (under MultiConnector another member's may run: not ours)
            st.planned = None
            return
        self._plan_load(request, self._reqs[request.request_id], blocks, num_external_tokens)

    def _plan_load(self, request: Any, st: _Req, blocks: Any, num_external_tokens: int) -> None:
        """One :class:`LoadJob` per KV cache group: full-attention groups load blocks ``[n_local, n)``,
        sliding-window groups the blocks of their window before ``n`` that vLLM allocated (it null-blocks,
        block id 0, what the window does not reach). A G3-only hit offered synchronously (``layerwise``) is
        a layer-wise job."""
        n, p3, wins = st.hit or (0, 0, {})
        first = st.n_local
        end = first + num_external_tokens // self.bs
        ids = blocks.get_block_ids()
        planned = g3n = 0
        for gi, g in enumerate(self.groups):
            gids = list(ids[gi])
            if g.window_blocks is None:
                pos = list(range(first, end))
                tiers = ["G3" if i < p3 else "G4" for i in pos]
            else:
                start, k3 = wins.get(gi, (end, 0))
                # every block vLLM allocated (non-null) is filled: it computes with and caches them all. Normally
                # end == n and that is the probed window [start, n) (window_blocks counts speculative decoding's
                # retained tokens, namespaces.group_window_blocks); others were not probed: tried in G3, and a
                # miss fails the load (recomputed), never wrong KV.
                pos = [i for i in range(first, end) if i < len(gids) and gids[i] != 0]
                tiers = ["G3" if i < start or i - start < k3 else "G4" for i in pos]
            if not pos:
                continue
            self._loads.append(LoadJob(request.request_id, [gids[i] for i in pos], [st.hashes[i] for i in pos],
                                       tiers, st.tenant, group=gi, layerwise=st.sync_load,
                                       digests=block_digests(st, pos, self.bs)))
            self.failed_counts.planned(request.request_id, gi, range(first, end) if g.window_blocks is None else pos,
                                       sync=st.sync_load)
            planned += len(pos)
            g3n += tiers.count("G3")
        st.planned = (first, end)
        t3 = max(0, min(p3, end) - first) * self.bs  # full-attention blocks decide the tier of a token
        self._hit_source[request.request_id] = {"G3": t3, "G4": (end - first) * self.bs - t3}
        stats.add(load_planned_requests=1, load_planned_blocks=planned, load_planned_g3_blocks=g3n,
                  load_planned_g4_blocks=planned - g3n)

    def load_failed(self, req_ids) -> None:
        """vLLM reported these requests' loads failed (``failed_recving``): :func:`.load_failures.on_failed_recving`
        (only requests with a load of this connector outstanding are; under ``MultiConnector`` others are not ours)."""
        on_failed_recving(self._reqs, req_ids, self.failed_counts)

    def loads_failed(self, failed, group: int = 0) -> None:
        """Worker reports of loads of KV cache group ``group`` that did not deliver every block (:class:`~.metadata.
        FailedLoad`): never offered a load again, blocks cooled, counted once: :func:`.load_failures.on_failed_loads`."""
        on_failed_loads(self, failed, group)

    def update_connector_output(self, worker_meta) -> None:
        if not isinstance(worker_meta, KvbmWorkerMeta):
            return
        for gi in range(len(self.groups)):
            m = worker_meta.for_group(gi)
            if m is not None:
                if m.failed:
                    self.loads_failed(m.failed, gi)
                if m.added or m.removed or m.snapshot:
                    self.apply_g3_report(gi, m)

    def apply_g3_report(self, group: int, meta: KvbmWorkerMeta, rank: int | None = None) -> None:
        """One worker's G3 index changes of KV cache group ``group``, from a step's output (every TP rank's,
        aggregated by vLLM: ``rank`` None) or the report channel (:mod:`.report_channel`, one TP rank's, any
        thread): into that group's :class:`G3Mirror` and, for group 0, the KV events (set only for a model of
        one full-attention group; both take their own locks)."""
        g = self.groups[group] if group < len(self.groups) else None
        if g is None:
            return
        if isinstance(g.g3, G3Mirror):
            g.g3.apply(meta, rank=rank)
        if group == 0 and self.events is not None:
            self.events.apply(meta, rank=rank)

    def take_events(self, engine_cache_reset: bool = False) -> list:
        if self.events is None:
            return []
        if engine_cache_reset:
            self.events.republish()
        return self.idle_events.take() if self.idle_events is not None else self.events.take()

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """Tokens planned from each tier for a request (``{"G3": t, "G4": t}``)."""
        return self._hit_source.get(request_id, {})

    @property
    def offloads(self) -> bool:
        """True when this connector saves blocks: saving is enabled and a G3 or G4 pool is configured."""
        return self.save_enabled and (self.g3 is not None or self.g4 is not None)

    @property
    def hands_off(self) -> bool:
        """True when a prefill request's blocks reach a tier another worker reads: G4 is open and saving to it is
        on (``save``, ``save_to_g4``). G3 is private to its worker, so it never counts (:mod:`.handoff`)."""
        return self.save_enabled and self.save_to_g4 and self.g4 is not None

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        again = self.unrecomputed.step(scheduler_output, self._reqs, self.bs)  # unloaded blocks read: reported again
        self.failed_counts.step(scheduler_output.num_scheduled_tokens)  # settled loads: their loaded blocks counted
        meta = self.promises.step(KvbmConnectorMetadata(loads=self._loads, reinvalidate=again))  # (saves: below)
        self._loads = []
        save = self.offloads  # block ids are tracked even when not saving: contain_failed_sync_load evicts by them
        sched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            renew_opaque(st)  # a streaming session's next chunk comes as a new request
            st.group_block_ids = [list(b) for b in nr.block_ids]
            if not save:
                continue
            if st.saved_upto is None:
                st.saved_upto = nr.num_computed_tokens // self.bs
                self._plan_local_save(meta, st)
                self._plan_handoff_g4(meta, st)
            self._plan_save(meta, st, nr.num_computed_tokens + sched.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            renew_opaque(st)
            nb = cached.new_block_ids[i]
            if rid in resumed:
                st.group_block_ids = [list(b) for b in nb] if nb is not None else [[] for _ in self.groups]
            elif nb is not None:
                for gl, b in zip(st.group_block_ids, nb):
                    gl.extend(b)
            if not save:
                continue
            if st.saved_upto is None:
                st.saved_upto = cached.num_computed_tokens[i] // self.bs
            self._plan_save(meta, st, cached.num_computed_tokens[i] + sched.get(rid, 0))
        if save:  # under external_launcher every rank reaches here each step: the blocks every rank planned
            meta.saves = tp_events.offer(self, meta.saves)  # (.tp_sched.offer) the KV events learn those offered
        return meta

    def _plan_local_save(self, meta: KvbmConnectorMetadata, st: _Req) -> None:
        """Blocks the engine's own prefix cache served (``[0, n_local)``) but G3 lacks from ``g3_local`` on: offered to
        the pools from the engine's blocks (their KV is final). Without this, a prefix used again while it is still in
        the engine's cache never reaches G3, because only newly computed blocks are offered and G3's admission filter
        wants a second sighting."""
        held, n_local = st.g3_local, min(st.n_local, len(st.group_block_ids[0]), len(st.hashes))
        if held is None or held >= n_local:
            return
        n_local = max(held, self._group_saves(meta, st, held, n_local))
        tp_sched.planned_local(self, st, held, n_local)  # counted save_local_hit_blocks once offered
        tp_events.learn(self, st, held, n_local, planned=True)

    def _plan_handoff_g4(self, meta: KvbmConnectorMetadata, st: _Req) -> None:
        """A prefill request that asked for a handoff (:mod:`.handoff`) promises every loadable prompt block in
        G4, but the ordinary saves offer only blocks it computes: blocks ``[0, saved_upto)`` came from its engine's
        prefix cache or a load (its own G3, or G4), and the decode worker reads G4 only. Those not saved by
        :meth:`_plan_local_save` (``[g3_local, n_local)``) are offered to G4 alone (``SaveJob.g4_only``: the worker puts
        only those G4 lacks), from the engine's blocks, whose KV is final once the request is scheduled; of a
        sliding-window group the window before them, which the decode side's hit needs too (before 2026-11-30 never
        offered: a prompt the prefill worker's engine or G3 held was no hit on the decode side, which waited). Counted
        ``handoff_g4_offered_blocks`` as offered (:func:`.tp_sched.offer`: under ``external_launcher``, agreed)."""
        if not self.hands_off or st.opaque or not handoff.requested(st.request):
            return
        end = min(st.saved_upto or 0, st.lookup_blocks, len(st.hashes), st.save_limit)
        held, n_local = st.g3_local, min(st.n_local, len(st.group_block_ids[0]) if st.group_block_ids else 0)
        local = set(range(held, n_local)) if held is not None else set()  # saved to G3+G4 by _plan_local_save
        g4 = set(range(max(st.hit[1], st.n_local), st.hit[0])) if st.hit is not None else set()  # loaded from G4
        for gi, g in enumerate(self.groups):
            gids = st.group_block_ids[gi] if gi < len(st.group_block_ids) and g.g4 is not None else []
            lo, sk = (0, local | g4) if g.window_blocks is None else (max(0, end - g.window_blocks), local)
            pos = [i for i in range(lo, min(end, len(gids))) if i not in sk and gids[i] != 0]
            if pos:
                meta.saves.append(SaveJob(st.req_id, [gids[i] for i in pos], [st.hashes[i] for i in pos], st.tenant,
                                          group=gi, g4_only=True, digests=block_digests(st, pos, self.bs)))

    def _group_saves(self, meta: KvbmConnectorMetadata, st: _Req, a: int, end: int) -> int:
        """Offer blocks ``[a, end)`` of every full-attention group, and of every sliding-window group only the window a
        request resuming at ``end`` reads (``[end - window, end)`` within ``[a, end)``, engine blocks that are not
        vLLM's null block), from the window before ``lookup_blocks`` when it is in ``(a, end]``: where the same prompt
        (a hand-off) resumes, a block before ``end`` for a block-aligned prompt (before 2026-11-30 not stored: never a
        hit, a hand-off waited ``handoff_wait_s``). Consecutive offers leave each resume point's whole window stored (a
        window reaching before ``a`` was offered by earlier steps). Returns the end offered: a tainted request's blocks
        from its ``save_limit`` on are not (:func:`.failed_blocks.withhold_tainted`)."""
        end = withhold_tainted(st, a, end, self.evict_engine_blocks)
        resume = min(end, st.lookup_blocks) if a < st.lookup_blocks else end
        for gi, g in enumerate(self.groups):
            gids = st.group_block_ids[gi] if gi < len(st.group_block_ids) else []
            lo = a if g.window_blocks is None else max(a, resume - g.window_blocks)
            pos = [i for i in range(lo, min(end, len(gids))) if gids[i] != 0]
            if pos:
                meta.saves.append(SaveJob(st.req_id, [gids[i] for i in pos], [st.hashes[i] for i in pos], st.tenant,
                                          group=gi, digests=block_digests(st, pos, self.bs)))
        return end

    def _plan_save(self, meta: KvbmConnectorMetadata, st: _Req, computed_after: int) -> None:
        if st.opaque:
            return
        full = min([computed_after // self.bs] + [len(b) for b in st.group_block_ids])
        if self.save_decode and full > len(st.hashes):
            self._extend_hashes(st, full)
        full = min(full, len(st.hashes))
        if st.saved_upto is None or full <= st.saved_upto:
            return
        a, st.saved_upto = st.saved_upto, full
        full = self._group_saves(meta, st, a, full)
        tp_events.learn(self, st, a, full, planned=True)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Saves are gathered into host staging inside the step that computed them (the worker's ``wait_for_save``), so
        no engine block has to outlive its request: always ``(False, None)``. An in-flight load keeps its blocks through
        vLLM's WAITING_FOR_REMOTE_KVS handling until the worker reports the request in ``finished_recving``."""
        st = self._reqs.pop(request.request_id, None)
        self._hit_source.pop(request.request_id, None)
        # an errored request's (kv_load_failure_policy fail) load still counts the failure reports that follow
        self.failed_counts.forget(request.request_id, st.hashes if st is not None and errored(request) else None)
        self.handoff.forget(request.request_id)
        limit = self.promises.limit(request.request_id, st)  # (forgets it, handed off or not)
        if kv_beyond_token_ids(request) or not handoff.requested(request):
            return False, None
        tenant = st.tenant if st is not None else (getattr(request, "cache_salt", None) or self.default_tenant)
        on = self.hands_off  # and then the tenant's G4 writes refused by the keyring, if they are: 0 blocks promised
        return False, handoff.finished_params(request, self.bs, on, self._ident(tenant, st) if on else None,
                                              limit, handoff.write_refusal(self.g4, tenant) if on else None)
