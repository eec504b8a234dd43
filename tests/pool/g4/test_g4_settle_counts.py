"""G4 late settling (``pool/g4/settle.py``): every outcome is counted under one start. Reviewer (2026-11-30): a
PUT that came back unsettled after close() (the writer was still running it) was counted ``dropped_unsettled``
but never ``unsettled_puts``, so the drops could exceed the total. Real timer wheel, real breaker, a real
file store (never reached: the settler is closed)."""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

from kvbm_backend.deadlines import Deadlines
from kvbm_backend.pool.g4.breaker import CircuitBreaker
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.settle import LateSettler


def test_a_put_unsettled_after_close_counts_in_both_totals(tmp_path):
    counts: collections.Counter[str] = collections.Counter()
    ends: list[str] = []
    dl = Deadlines("test-settle")
    with ThreadPoolExecutor(1) as ex:
        s = LateSettler(store=FsStore(tmp_path / "store"), executor=ex, deadlines=dl, breaker=CircuitBreaker(),
                        count=lambda name, n=1: counts.update({name: n}), first_delay_s=60.0, bound_s=600.0)
        s.start("a", "00" * 16, 10, ends.append)
        s.close()
        s.start("b", "00" * 16, 10, ends.append)  # came back unsettled after close
    dl.close()
    assert ends == ["dropped", "dropped"]
    assert counts["unsettled_puts"] == 2 and counts["dropped_unsettled"] == 2, counts
