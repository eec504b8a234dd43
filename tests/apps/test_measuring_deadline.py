"""``bench --tier g3`` and ``replay`` (real mode) are measuring tools: their G3 pool reads with the largest
``g3.load_timeout_s`` (``LOAD_TIMEOUT_MAX_S``), not the 5 s serving default, so a read slowed by a busy
machine is measured (bench) or counted a hit (replay) instead of turning into a ``timeout`` miss. CI
2026-12-03: on a loaded 2-core runner ``bench --tier g3 --blocks 32`` read every block past 5 s and failed
with "pool read back 0 of 32 verified blocks" (``misses_by_reason {'timeout': 32}``)."""
from __future__ import annotations

from pathlib import Path

import pytest

import kvbm_backend.pool as pool_mod
from kvbm_backend.apps.bench import g3 as bench_g3
from kvbm_backend.apps.replay import run_replay
from kvbm_backend.config import LOAD_TIMEOUT_MAX_S, G3Config

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


class _Opened(Exception):
    pass


@pytest.fixture
def opened(monkeypatch):
    """The G3Config each ``open_pool`` call receives; the first call raises :class:`_Opened` (nothing is
    written)."""
    seen: list[G3Config] = []

    def capture(cfg, *a, **k):
        seen.append(cfg)
        raise _Opened

    monkeypatch.setattr(pool_mod, "open_pool", capture)
    return seen


def test_the_serving_default_is_below_the_measuring_deadline():
    assert G3Config().load_timeout_s < LOAD_TIMEOUT_MAX_S  # else the tools below would change nothing
    assert G3Config(load_timeout_s=LOAD_TIMEOUT_MAX_S).load_timeout_s == LOAD_TIMEOUT_MAX_S  # accepted


def test_bench_g3_pool_reads_with_the_largest_load_timeout(tmp_path, opened):
    from kvbm_backend.apps.bench import BenchOptions
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.model.presets import load_preset
    lay = load_preset("tiny").layout(page_size=16, tp=1)
    opts = BenchOptions(tier="g3", path=str(tmp_path), layout="tiny", blocks=2)
    with pytest.raises(_Opened):
        bench_g3._pool_round([str(tmp_path)], Namespace(model="bench/tiny", layout=lay, tp_world_size=1), opts,
                             None, None)
    assert [c.load_timeout_s for c in opened] == [LOAD_TIMEOUT_MAX_S]


@pytest.mark.skipif(not TRACE.is_file(), reason=f"trace {TRACE} not present")
def test_replay_real_mode_reads_with_the_largest_load_timeout(tmp_path, opened):
    with pytest.raises(_Opened):
        run_replay(str(TRACE), "tiny", 16, str(tmp_path / "g3"), 0.01, admit_all=True, limit=2)
    assert [c.load_timeout_s for c in opened] == [LOAD_TIMEOUT_MAX_S]
    assert not (tmp_path / "g3").exists()  # the directories it made are removed on the error
