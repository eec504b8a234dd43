"""The fault campaign's own bookkeeping (benchmarks/faults.py): what it counts as an acknowledged block lost.

A put's :class:`PutResult` counts blocks; it does not say which of a batch were written. The throttle kind
once counted block 0 lost when block 0 was the one dropped (throttled to its bound, documented) and block 1
the one written and served (landing CI: ``PutResult(written=1, skipped=0, dropped=1)``, ``acknowledged_then_lost``
1 while nothing was lost)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def faults():
    spec = importlib.util.spec_from_file_location("kvbm_faults_campaign", ROOT / "benchmarks" / "faults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_written_block_is_lost_only_when_fewer_blocks_are_served_than_were_written():
    acked_lost = faults().acked_lost
    assert acked_lost(1, [False, True]) == 0  # the second block was the one written: served
    assert acked_lost(1, [True, False]) == 0
    assert acked_lost(2, [True, False]) == 1  # both written, one not served: lost
    assert acked_lost(2, [False, False]) == 2
    assert acked_lost(0, [False, False]) == 0
    assert acked_lost(0, [True, True]) == 0  # served more than acknowledged (another writer's copy): nothing lost
