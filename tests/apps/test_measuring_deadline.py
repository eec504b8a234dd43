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


@pytest.mark.parametrize("fsync", [True, False], ids=["ours", "ours_nofsync"])
def test_bench_vllm_tiers_g3_tier_reads_with_the_largest_load_timeout(tmp_path, fsync):
    """``bench --tier vllm-tiers`` measures our G3 tier through vLLM's tiering manager: its tier config (what
    ``G3Tier`` opens its pool with) reads with ``LOAD_TIMEOUT_MAX_S``. Before, the tier took the 5 s serving default:
    with every load deadline cut short (a starved CPU), the bench's JSON read ``ours_read_verified: false`` and a
    read throughput of failed chunk loads."""
    from kvbm_backend.apps.bench import BenchOptions
    from kvbm_backend.apps.bench.vllm_tiers import g3_tier
    opts = BenchOptions(tier="vllm-tiers", path=str(tmp_path), layout="tiny", blocks=2)
    tier = g3_tier(str(tmp_path / "g3"), opts, heads=2, threads=1, capacity_gb=1.0, fsync=fsync, o_direct="off")
    assert tier["type"] == "G3Tier"
    assert G3Config(**tier["g3"]).load_timeout_s == LOAD_TIMEOUT_MAX_S


def test_demo_native_tiers_load_with_the_measuring_deadlines(tmp_path):
    """``kvbm-backend demo``'s ``native_tiers`` config: our G3Tier reads with ``LOAD_TIMEOUT_MAX_S`` and our G4Tier's
    load bound is at least that, not the serving 5 s / 5 s x 2 (a demo on a busy machine counted a slowed read a miss:
    fewer chunks loaded from our tiers, a lower hit rate, than the trace gives)."""
    from kvbm_backend.apps.demo_native import native_extra
    from kvbm_backend.apps.engine_model import TINY
    from kvbm_backend.config import G4Config
    nat = native_extra("native_tiers", tmp_path, TINY, cpu_bytes=1 << 20, g3_capacity_gb=0.1,
                       g4_url=f"file://{tmp_path / 'g4'}", keyring=str(tmp_path / "kr.json"))
    g3, g4 = nat["secondary_tiers"]
    assert (g3["type"], g4["type"]) == ("G3Tier", "G4Tier")
    assert G3Config(**g3["g3"]).load_timeout_s == LOAD_TIMEOUT_MAX_S
    assert G4Config(enabled=True, **g4["g4"]).load_bound_s >= LOAD_TIMEOUT_MAX_S


def test_demo_connector_configs_load_with_the_measuring_deadlines(tmp_path):
    """The demo's ``kvbm_backend`` and ``restart`` configs (the connector, in-process or a Dynamo worker): G3 reads with
    ``LOAD_TIMEOUT_MAX_S``, G4's load bound and the scheduler's lookup bound built from it are at least that. Before:
    the 5 s G3 default and G4 ``timeout_s`` 5 (a 10.05 s bound)."""
    from kvbm_backend.apps.demo_native import connector_extra
    from kvbm_backend.apps.engine_model import TINY
    from kvbm_backend.config import load_config
    ext = connector_extra("g3-run", tmp_path, TINY, g3_capacity_gb=0.1, g4_url=f"file://{tmp_path / 'g4'}",
                          keyring=str(tmp_path / "kr.json"))
    cfg = load_config(ext["kvbm_backend"], use_env=False)
    assert cfg.g3.paths == [str(tmp_path / "g3-run")] and cfg.g4.enabled
    assert cfg.g3.load_timeout_s == LOAD_TIMEOUT_MAX_S and cfg.g4.load_bound_s >= LOAD_TIMEOUT_MAX_S
