"""Our G3 and G4 pools as vLLM ``secondary_tiers`` (``OffloadingConnector`` + ``TieringOffloadingSpec``).

vLLM (0.32, ``vllm/v1/kv_offload/tiering/base.py``) defines :class:`SecondaryTierManager`: a tier below
the CPU *primary* tier. Every call runs on the scheduler thread and must not block; data moves in
asynchronous jobs between the primary tier's host buffer (a ``memoryview`` of shape
``(num_chunks, row_stride)``) and the tier; finished jobs are polled with ``get_finished_jobs()``.
:class:`G3Tier` and :class:`G4Tier` implement it on :class:`kvbm_backend.pool.base.BlockPool`. They are
loaded out of tree (no vLLM patch) with::

    "secondary_tiers": [{"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering",
                         "config": "/etc/kvbm-backend.yaml", "g3": {"paths": ["/nvme/kvbm"]},
                         "num_kv_heads": 8}]

Tier keyword arguments (every other key of the tier's dict reaches ``__init__``, see
``SecondaryTierFactory.create_secondary_tier``):

* ``config``: kvbm-backend config, a YAML/TOML/JSON file path or a dict (:func:`.extra_config.tier_config`).
* ``g3`` / ``g4``: dict merged over that config's ``g3`` / ``g4`` section field by field, nested sections
  (``keyring``, ``admission``) too (e.g. ``paths``, ``url``). A G3Tier whose config names ``g4.keyring.path``
  follows that keyring's revocations (below). The tier's own section must be on: a G3Tier whose config says
  ``g3.enabled: false``, a G4Tier whose config sets ``g4.enabled: false`` (unset counts as on) raises ConfigError
  naming the field when vLLM builds it. A tier checks and creates only its own pool's directories (a G4Tier's
  ``g4.url`` store, not ``g3.paths``; a G3Tier's ``g3.paths``). G3 admits every chunk vLLM's CPU tier hands down
  (``all``) unless ``g3.admission.policy`` is set (``frequency`` logs a WARNING at start: vLLM hands a chunk down
  once per residency, so it skips most; :func:`.extra_config.tier_config`, docs/configuration.md).
* ``tenant``: default tenant; a request's ``kv_transfer_params["kvbm_tenant"]`` overrides it.
* ``revision``: the namespace's revision (default the config's ``revision``). vLLM hands a tier neither
  ``--revision`` nor ``--quantization`` nor ``--hf-overrides``: engines differing in any of them that share G3
  paths or a G4 store need distinct values here, or they share blocks.
* ``num_kv_heads`` (per rank), ``head_dim``, ``mla`` or ``layout`` (a preset in ``layouts/``, whose layer
  count must be the engine's): the geometry needed to map vLLM's page to KVBM's block (below). ``head_dim``
  defaults from the byte sizes when ``num_kv_heads`` is given, ``mla`` to false. The head split is part of
  the namespace (``kv_heads``): engines whose settings cut a page into other heads never share blocks.
* ``kv_cache_layout``: vLLM ``KVCacheLayout`` name; default the engine's resolved one, else LBNHC (CPU: LBHNC).
  Where vLLM resolved one, a key naming another is refused (ValueError naming both): the namespace does not
  record the layout, so such a tier stored scrambled blocks that were served as hits (before 2026-12-04). A name
  that places every byte alike is not another (MLA or one KV head per rank: ``*HNC`` = ``*NHC``).
* ``enable_kv_events`` (emit ``OffloadingEvent`` for stored chunks and, on G3, for chunks it no longer holds;
  below), ``locality`` (``LOCAL``/``REMOTE``), ``io_threads`` (threads for loads, as many for stores: :mod:`.tier_jobs`), ``job_timeout_s`` (seconds from
  vLLM's submission of a job: past it the job fails, at once if it waits for a thread (the pool not asked) or a
  store for the pool; a running load keeps the chunks verified by then: ``successful_keys``; the pool's own
  timeouts usually fire first), ``staging_mb`` (MiB of block staging buffers, default 256, capped at the primary
  tier's size, allocated and pre-faulted at construction; jobs beyond it allocate fresh buffers). Each key is
  checked by type and range before anything opens, a bad one refused naming it (:mod:`.tier_options`).

Keys: vLLM's ``OffloadKey`` (block hash bytes + 4-byte KV-group index) becomes a
:class:`~kvbm_backend.model.namespace.DigestKey` in a namespace with ``hash_scheme = "vllm-block-hash"`` (model =
the config's ``model`` when set, else vLLM's model name, as the connector decides:
:func:`.namespaces.namespace_model`; TP world size = the ranks sharing one primary chunk): its name, the 64-bit
sequence hash ``xxh3_64(offload_key)`` (:func:`.tier_base.offload_key_hash`), and its token digest, BLAKE2b-128 of
the whole key (:func:`.tier_base.offload_key_digest`), which every frame served for it must hold. The name alone
resists no search: before 2026-12-01 two keys sharing it shared a block, and one request was served the other's
KV; now the second is a miss (docs/format.md "The native tiers' digest": colliding keys, frames written before,
and why vLLM's ``--prefix-caching-hash-algo`` bounds the strength). vLLM's cache salt is already inside its block
hash; the tenant only selects G4's key and prefix.

Mapping of the primary buffer to FullyContiguous blocks (vLLM 0.32, direct layout):

* Chunk ``c`` is row ``c`` of the primary view, ``row_stride`` bytes (page-aligned, may pad). The row
  holds one slice per rank: ``[rank0 | rank1 | ... | pad]``, each ``P = cpu_page_size_per_worker =
  worker_kv_bytes_per_block * blocks_per_chunk`` bytes (``SharedOffloadRegion.create_next_worker_view``).
  With ``replicated_layout`` (MLA) there is one slice. Rank ``r``'s slice is our block of rank ``r``.
* Inside a rank's slice vLLM concatenates its KV tensors' chunk pages. Layer-compact layouts
  (``LBHNC``, ``LBNHC``: one tensor per layer) give ``[layer, sub_block, page]``; block-outermost
  layouts (``BLHNC``, ``BLNHC``: one cross-layer tensor) give ``[sub_block, layer, page]``.
* A page (one layer, one GPU block) is vLLM's logical ``[H, N, C]`` (RFC #42082) in physical order
  ``[H, N, C]`` (``*HNC``) or ``[N, H, C]`` (``*NHC``); ``C = (K head_dim | V head_dim) * dtype`` bytes,
  i.e. ``[outer=2, head_dim]`` (MLA: ``outer=1``, the latent). A CPU engine's page (LBHNC only;
  :class:`.native_cpu.CpuTieringOffloadingSpec` on vLLM's CPU platform, ``cpu_attn.py``) is ``[H, 2, N, D]``:
  per head K rows then V rows. Its namespace has ``kv_version`` 2 (blocks before 2026-11-30 read it as packed).
* Our block is KVBM FullyContiguous ``[layer, outer, token, heads*head_dim]`` with ``token =
  sub_block * tokens_per_block + n`` (``page_size = blocks_per_chunk * tokens_per_block``).

:class:`PrimaryGeometry` (:mod:`.geometry`) does this permutation (one copy, in the tier's I/O threads, ~10 GB/s with
numpy) on store and its exact inverse on load, so a load returns the primary's bytes exactly whatever
the layout. ``LHBNC``/``BHLNC`` (heads outside the block), canonical layout and padded pages are refused with a
ValueError naming the setting.

Hybrid models (vLLM's hybrid KV cache manager, several KV cache groups: gpt-oss, Gemma 2): vLLM's
offloading connector decides per group which blocks it offloads (for a sliding-window group, the ones
its window needs) and the ``OffloadKey`` carries the group index, so the tier stores what it is handed.
A chunk of group ``g`` holds that group's layers; the tiers need every group to have the same layer count
and block size, and refuse anything else with the counts (Gemma 3 under vLLM 0.32: its 52 sliding and 10
full layers make groups of 8, 9 and 10 layers). The namespace records
the groups (:class:`~kvbm_backend.model.namespace.KvGroup` ``kind="vllm-offload"`` with each group's
layer names), so a hybrid model's blocks never meet a one-group namespace.

Parallel layouts: one tier per engine (vLLM builds it on the scheduler side) names rank ``r``'s slice of a chunk by
``r`` (``OffloadingParallelConfig.rank``: TP x PCP x PP ranks). Pipeline parallelism > 1 and decode/prefill context
parallelism > 1 are refused at construction, a ValueError naming ``parallel_config.<field>`` and its value, as the
connector refuses them (:func:`.namespaces.refuse_parallel_layouts`, one check for both): the namespace describes
one stage's layers (vLLM hands the scheduler stage 0's) and a block's tokens whole on every rank, so engines of
other layouts got one fingerprint and loaded each other's chunks (a PCP=2 engine a TP=2 engine's). The KV cache
dtype is in the namespace (the layout's ``dtype``: ``OffloadingModelConfig.dtype``, the ``--kv-cache-dtype`` unless
``auto``): an FP8 engine never loads a BF16 engine's chunks; dtypes of no known element width (``fp8_inc``,
``*_per_token_head``, nvfp4, turboquant) are refused naming the dtype.

KV events (``enable_kv_events`` and vLLM's ``--kv-events-config``; add ``"self_describing_kv_events": true`` to
the connector's extra config so they carry token ids, which Dynamo's KV router needs): a finished store is one
``OffloadingEvent(removed=False)`` with the tier's ``medium`` (``STORAGE``) and ``locality``; vLLM's
``OffloadingEventsTracker`` turns it into a ``BlockStored`` per chunk (its engine blocks' hashes and tokens).
A pool that can list its index (G3: ``keys()``) also reports the chunks it dropped since (evicted for capacity,
deleted, corrupt): stores are then published with ``removal_expected=True`` (the tracker keeps each chunk's
payload until the tier's removal, so the ``BlockRemoved`` names the same block hashes), and ``take_events``
emits one ``OffloadingEvent(removed=True)`` for the published chunks the pool dropped since (a chunk stored for
several tenants once none of their copies is left), from G3's log of removals (O(removals): :mod:`.tier_removals`; a pool without one is checked against its index at most every
:attr:`KvbmSecondaryTier.reconcile_interval_s`, and only when its counters moved). Memory while events are on: one key per published chunk here,
and its payload (token ids) in vLLM's tracker. G4 (no index listing) publishes stores only.

Never wrong KV: a chunk is copied into the primary only after every rank's block was verified by the pool (header
identity + integrity in our staging buffer); failed chunks are reported failed (``JobResult.success=False`` with
``successful_keys`` the verified ones), their lookup verdict is forced to miss (and for the connector's 30 s cool-down every new lookup of them: :class:`.failed_blocks.FailedChunks`;
G3 deletes a copy it failed to read, not by a timeout, so the recomputed chunk is written again: at once on a proof of bad bytes (a re-read's frame error, short file or other token digest); a copy the re-read cannot read either (an I/O error) is kept, cooling, and deleted only once its re-reads failed in 3 loads over 300 s or more, none verifying:
docs/invariants.md #1, :mod:`kvbm_backend.pool.g3.read.unreadable`), and the primary slot stays untouched.

Revocations (G3Tier, :mod:`.tier_revoked`): a G3Tier follows the G4 keyring its config names, else that of a
G4Tier of ours in the same manager; a tenant revoked there (``kvbm-backend keys revoke``) is neither looked up nor
loaded nor stored in G3 and its G3 blocks are deleted, as the connector's G3 does (docs/configuration.md
"Revocation and G3"). Without a keyring it follows none.

The classes vLLM loads by name from this module (``module_path``): :class:`G3Tier`, :class:`G4Tier`, defined here
over :class:`.tier_base.KvbmSecondaryTier` (jobs, lookups, events, counters), which is importable from here too.
"""
from __future__ import annotations

import logging
from typing import Any

from ...config import KvbmBackendConfig
from ...model.namespace import Namespace
from ...pool import open_pool
from .geometry import PrimaryGeometry
from .tier_base import KvbmSecondaryTier, offload_key_digest, offload_key_hash
from .tier_revoked import COUNTERS, TierRevocation, own_keyring, share_keyrings
from .tier_threads import staging_pool

log = logging.getLogger(__name__)

__all__ = ["G3Tier", "G4Tier", "KvbmSecondaryTier", "PrimaryGeometry", "offload_key_digest", "offload_key_hash",
           "staging_pool"]
# PrimaryGeometry: defined in .geometry (with EngineGeometry), staging_pool in .tier_threads, KvbmSecondaryTier,
# offload_key_digest and offload_key_hash in .tier_base; importable from here

MODULE_PATH = __name__


class G3Tier(KvbmSecondaryTier):
    """G3 (local NVMe / mounted filesystem) pool as a vLLM secondary tier (``type: G3Tier``). Follows the G4
    keyring's revocations where it has one (module doc, :mod:`.tier_revoked`). Raises ConfigError naming
    ``g4.keyring`` when the keyring its config names does not open, and naming ``g3.enabled`` when G3 is off (before
    anything opens; before 2026-12-01 it opened G3 anyway). Logs a WARNING at start when it runs the ``frequency``
    admission policy (it skips most chunks here: :func:`.extra_config.tier_config`)."""

    pool_tier = "G3"
    default_locality = "LOCAL"
    drop_unreadable = True
    look_past_gaps = True

    def _make_pool(self, cfg: KvbmBackendConfig, namespace: Namespace):
        return open_pool(cfg.g3, namespace)

    def _start(self, offloading_spec: Any, tier_type: str, *rest: Any) -> None:
        kr = own_keyring(self.config)  # before any thread starts: a keyring that does not open leaves none running
        try:
            super()._start(offloading_spec, tier_type, *rest)
        except BaseException:
            if kr is not None:
                kr.close()
            raise
        self._counters.update(dict.fromkeys(COUNTERS, 0))
        adm = self.config.g3.admission
        if adm.policy == "frequency" and adm.min_sightings > 1:
            log.warning("%s: g3.admission.policy is frequency (min_sightings=%d): vLLM's CPU tier hands a chunk to "
                        "its secondary tiers once per residency, so G3 skips every chunk's first %d offloads "
                        "(chunks_skipped) and stores a chunk only after it left the CPU tier and was computed and "
                        "offloaded again that often; the native tiers' default is all (leave g3.admission.policy "
                        "unset, or set all) unless that is what you want", tier_type, adm.min_sightings,
                        adm.min_sightings - 1)
        if kr is not None:
            self.follow_keyring(kr, owned=True, source="g4.keyring.path")
        else:  # a G4Tier of ours built before this one over the same primary buffer (G4 above G3)
            share_keyrings(self, self._lookup.above())

    def follow_keyring(self, keyring: Any, *, owned: bool, source: str) -> bool:
        """Follow ``keyring``'s revocations (``owned``: this tier opened it and closes it) unless it follows one
        already; ``source`` says where it came from (the log line). True if it follows ``keyring`` now."""
        if self._revoked is not None or self._closed:
            return False
        self._revoked = TierRevocation(keyring, self.pool, self._count, owned=owned)
        log.info("%s: follows the revocations of keyring %s (from %s): a revoked tenant's G3 chunks are neither "
                 "served nor stored, and are deleted", self.tier_type, keyring.path, source)
        return True


class G4Tier(KvbmSecondaryTier):
    """G4 (shared S3 / shared POSIX, per-tenant encrypted) pool as a vLLM secondary tier (``type: G4Tier``). Hands
    its keyring to the G3Tiers of ours built before it over the same primary buffer that follow none. ``g4.enabled``
    unset counts as on (the tier is the opt-in); set false it raises ConfigError naming it, before anything opens
    (before 2026-12-01 it opened G4 anyway), as without ``g4.url``."""

    pool_tier = "G4"
    default_locality = "REMOTE"

    def _make_pool(self, cfg: KvbmBackendConfig, namespace: Namespace):
        # cfg.g4 is on with a url here: tier_config(tier="G4") refused g4.enabled set false and a missing g4.url
        return open_pool(cfg.g4, namespace, default_tenant=self._tenant)  # the tier's ``tenant``, else the config's

    def _start(self, offloading_spec: Any, tier_type: str, *rest: Any) -> None:
        super()._start(offloading_spec, tier_type, *rest)
        share_keyrings(self, self._lookup.above())
