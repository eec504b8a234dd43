"""A native G3 tier (:class:`~.tiering.G3Tier`) follows the G4 keyring's revocations, as the connector's G3 does.

``kvbm-backend keys revoke`` crypto-shreds a tenant's G4 data; G3 (local plaintext) has no key to shred. The
connector's workers follow the keyring (:mod:`kvbm_backend.integrations.revoked_tenants`); before 2026-12 the
tiering form's G3Tier opened no keyring and served a revoked tenant's G3 chunks until evicted, across restarts too.
Now a G3Tier follows a keyring through the same :class:`~kvbm_backend.integrations.revoked_tenants.RevokedTenants`
(one over the tier's pool: its checks every ``reload_interval_s`` of that keyring on the ``kvbm-revoke`` thread,
its purges, its INFO line).

Which keyring (:func:`own_keyring`, :func:`share_keyrings`):

* the one the G3Tier's own config names (``g4.keyring.path``: its ``config`` file, the environment or its own
  ``g4`` key), opened as G4Tier opens it (:meth:`~kvbm_backend.crypto.keyring.Keyring.from_config`: created, with
  its KEK file, when absent and writable; read-only on a read-only mount). One that does not open refuses the
  tier (ConfigError naming ``g4.keyring``): a keyring named and not followed would serve revoked tenants;
* else the keyring of a G4Tier of ours over the same CPU primary buffer (the same tiering manager:
  :func:`.tier_lookup.tiers_above`), whichever of the two vLLM builds first (it builds them in the configured order);
* neither: the tier follows no revocation (docs/configuration.md "Revocation and G3").

What the tier does for a tenant the keyring refuses (:meth:`RevokedTenants.refused`: revoked, or re-created and not
purged yet): its lookups are misses without asking G3 (a verdict cached before included; counted
``lookup_g3_revoked`` once per request), its loads read nothing (the job fails, every chunk a miss the engine
recomputes: ``load_g3_revoked_blocks``, blocks), its stores are not put (``save_g3_revoked_blocks``, blocks; the
chunks count ``chunks_skipped`` and are not published), the tiers below ours count none of its chunks as held here
(:meth:`KvbmSecondaryTier._serves`), and its G3 blocks are deleted once per revocation (``g3_revoked_purges``,
``g3_revoked_deleted_blocks``). The counters are the tier's (``kvbm_stats()["tier"]``), named as the connector's.
A tenant is the tier's ``tenant`` or a request's ``kv_transfer_params["kvbm_tenant"]``, as G3's keys carry it.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from ...config import ConfigError, KvbmBackendConfig
from ...crypto.keyring import Keyring, KeyringError
from ..revoked_tenants import RevokedTenants, keyring_of

if TYPE_CHECKING:
    from .tier_base import KvbmSecondaryTier

log = logging.getLogger("kvbm_backend.integrations.vllm.tiering")

__all__ = ["COUNTERS", "TierRevocation", "own_keyring", "share_keyrings"]

#: a G3Tier's revocation counters (``kvbm_stats()["tier"]``), 0 while it follows no keyring
COUNTERS = ("lookup_g3_revoked", "load_g3_revoked_blocks", "save_g3_revoked_blocks", "g3_revoked_purges",
            "g3_revoked_deleted_blocks", "g3_revoked_purges_retried", "g3_tenant_label_errors")
MAX_LOOKUPS = 65536  # live requests remembered as counted ``lookup_g3_revoked`` (more: counted again)


def own_keyring(cfg: KvbmBackendConfig) -> Keyring | None:
    """The keyring ``cfg`` names (``g4.keyring.path``) opened as G4 opens it, or None when it names none.
    Raises ConfigError naming ``g4.keyring`` when it does not open (no KEK, an unreadable or insecure file...)."""
    if not cfg.g4.keyring.path:
        return None
    try:
        return Keyring.from_config(cfg.g4.keyring)
    except (KeyringError, OSError) as e:
        msg = str(e)
        raise ConfigError(f"{msg if msg.startswith('g4.') else f'g4.keyring: {msg}'} (G3Tier follows the revocations "
                          "of the keyring its config names)") from None


class TierRevocation:
    """The revocations one G3Tier follows: a :class:`RevokedTenants` over its ``pool``, and the tier's counting.

    Args:
        keyring: the keyring followed.
        pool: the tier's G3 pool (purged of refused tenants).
        count: the tier's counter adder, ``count(name, n)``.
        owned: the tier opened ``keyring`` (closed by :meth:`close`); False: a G4Tier's, closed by its pool.
        start: run the keyring checks on their thread (False: only ``gate.check_now``, for tests).

    :meth:`lookup_refused` and :meth:`request_finished` run on vLLM's scheduler thread; the rest on any thread.
    """

    def __init__(self, keyring: Keyring, pool: Any, count: Callable[[str, int], None], *, owned: bool,
                 start: bool = True) -> None:
        self.keyring, self._owned, self._count = keyring, owned, count
        self.gate = RevokedTenants(keyring, [pool], interval_s=keyring.reload_every_s, start=start,
                                   count=self._count_named)
        self._lookups: set[str] = set()  # requests counted lookup_g3_revoked, until they finish

    def _count_named(self, **counts: int) -> None:
        """``RevokedTenants``' counting (``name=n``) into the tier's counters."""
        for name, n in counts.items():
            self._count(name, n)

    def refused(self, tenant: str) -> bool:
        """True while ``tenant``'s G3 chunks are neither served nor stored (no keyring call, no I/O)."""
        return self.gate.refused(tenant)

    def lookup_refused(self, tenant: str, req_id: str) -> bool:
        """:meth:`refused`; a refused request is counted ``lookup_g3_revoked`` once. Scheduler thread."""
        if not self.gate.refused(tenant):
            return False
        if req_id not in self._lookups:
            if len(self._lookups) >= MAX_LOOKUPS:
                self._lookups.clear()
            self._lookups.add(req_id)
            self._count("lookup_g3_revoked", 1)
        return True

    def load_refused(self, tenant: str, blocks: int) -> bool:
        """:meth:`refused`; a refused load's ``blocks`` are counted ``load_g3_revoked_blocks``."""
        if not self.gate.refused(tenant):
            return False
        self._count("load_g3_revoked_blocks", blocks)
        return True

    def put(self, tenant: str, put: Callable[[], Future], n: int) -> Future | None:
        """``put()`` (a G3 put of ``n`` blocks) unless ``tenant`` is refused: None, counted ``save_g3_revoked_blocks``
        (:meth:`RevokedTenants.put_g3`: no block of it is published after its purge)."""
        return self.gate.put_g3(tenant, put, n)

    def request_finished(self, req_id: str) -> None:
        self._lookups.discard(req_id)

    def close(self) -> None:
        """Stop the checks (a purge running finishes first); close the keyring if the tier opened it. Never raises
        for the keyring's flush (logged)."""
        self.gate.close()
        if self._owned:
            try:
                self.keyring.close()
            except (OSError, KeyringError) as e:
                log.warning("G3Tier: keyring %s: could not persist its use counts at shutdown: %s", self.keyring.path, e)


def share_keyrings(tier: KvbmSecondaryTier, above: list[KvbmSecondaryTier]) -> None:
    """Meet the tiers of ours built before ``tier`` over the same primary buffer (``above``): a G3Tier that follows
    no keyring takes the first G4 keyring among them; a G4Tier with a keyring hands it to those that follow none
    (:meth:`~.tiering.G3Tier.follow_keyring`; other tiers ignore it)."""
    mine = keyring_of(getattr(tier, "pool", None))
    for u in above:
        theirs = keyring_of(getattr(u, "pool", None))
        if mine is None and theirs is not None and tier.follow_keyring(theirs, owned=False, source=u.tier_type):
            return
        if mine is not None:
            u.follow_keyring(mine, owned=False, source=tier.tier_type)
