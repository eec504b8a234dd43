"""A G4 prefix lookup that reaches its load bound (a HEAD the store never answers) resolves with the leading blocks
it confirmed and the caller takes them as the hit: ``kvbm_matched_tokens`` and the object hit rate count them,
but the pool's ``stats()["lookup_hits"]`` (what ``stats_path`` ``pools.g4`` shows the operator) does not, so the
two surfaces disagreed on the same lookups (G4Pool.lookup_prefix's doc: a counted lookup moves ``lookups``,
``lookup_hits``, matched tokens and the hit rate alike). Review finding 2026-12-02 (old code: lookup_hits absent,
matched tokens 128).

The 0.3 s bound fires only once the first wave's 8 HEADs were answered (the pool's timer is held until the hung HEAD
is out: tests/helpers/held_timer.py): before (2026-12) they raced the bound, and a HEAD the busy CI VM froze past it
ended the lookup with fewer than 8."""
from __future__ import annotations

import threading

from kvbm_backend import metrics
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, payload
from tests.helpers.held_timer import HeldTimer

HANG_S = 600.0  # a hang guard, not a bound


class _HungHeadFs(FsStore):
    """A real file store whose HEAD of one object never answers (until released): a stalled store request."""

    hang_name: str | None = None
    def __init__(self, root):
        super().__init__(root)
        self.release, self.reached = threading.Event(), threading.Event()

    def head(self, name):
        if name == self.hang_name:
            self.reached.set()
            self.release.wait(HANG_S)
        return super().head(name)


def test_an_expired_lookups_confirmed_prefix_counts_in_lookup_hits_as_in_matched_tokens(tmp_path):
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    store = _HungHeadFs(str(tmp_path / "store"))
    reg = metrics.new_registry()
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=False, timeout_s=0.3, retries=0,
                   breaker_failures=1000)
    with G4Pool(cfg, ns, store=store, registry=reg) as p:
        keys = ns.keys(list(range(1, 13)), tenant="t")
        assert p.put(keys, [payload(k.seq_hash, "t", bpb) for k in keys]).result(timeout=HANG_S).written == 12
        assert p.flush(HANG_S)
        store.hang_name = p.names.name(keys[8])  # the 9th block: the first HEAD of the lookup's second wave
        try:
            with HeldTimer(p._deadlines) as timer:
                fut = p.lookup_prefix(keys)
                # the second wave is out only once the first wave's 8 HEADs were answered
                assert store.reached.wait(HANG_S), "hang guard: the lookup's 9th HEAD never went out"
                timer.release()  # now the bound may fire: the 9th HEAD is the one it cuts short
                n = fut.result(timeout=HANG_S)
        finally:
            store.release.set()
        st = p.stats()
        matched = metrics.sample_value(reg, "kvbm_matched_tokens_total") or 0
        assert n == 8  # the first wave's 8 blocks were confirmed; the lookup expired on the 9th
        assert matched == 8 * ns.layout.page_size  # /metrics counts the 8 blocks the caller takes
        assert st.get("lookup_hits", 0) == 8, st  # ... and stats() says the same
        assert st.get("lookup_timeout") == 1, st
