"""The shared test set-ups give the pools they open load deadlines only a hang misses, not the serving defaults
(``g3.load_timeout_s`` 5 s, ``g4.timeout_s`` 2 s: a 4.05 s load bound): the tests count hits, loads and bytes, and
on the busy 2-core CI VM (the unit lane at ``nice 19``, the side lane at ``nice 10``) a read frozen past the serving
bound turned a correct hit into a ``timeout`` miss (CI 2026-12-03: ``bench --tier g3`` read 32 of 32 blocks past
5 s). A test of a bound passes its own, and the set-ups keep it."""
from __future__ import annotations

from pathlib import Path

from kvbm_backend.config import LOAD_TIMEOUT_MAX_S, G3Config, G4Config, load_config
from tests.helpers.pools import G3_LOAD_S, G4_TIMEOUT_S, LOOKUP_S, g3_config
from tests.helpers.vllm_runner import connector_extra, native_extra


def test_the_constants_are_generous_bounds():
    assert G3_LOAD_S == LOAD_TIMEOUT_MAX_S == G3Config(load_timeout_s=G3_LOAD_S).load_timeout_s  # the largest allowed
    assert G4Config(timeout_s=G4_TIMEOUT_S).load_bound_s >= LOAD_TIMEOUT_MAX_S  # at the default g4.retries (1)
    assert G4Config(timeout_s=G4_TIMEOUT_S, retries=0).load_bound_s >= 60
    assert LOOKUP_S >= 60
    assert G3Config().load_timeout_s < 30 and G4Config().load_bound_s < 30  # the serving defaults they replace


def test_g3_config_takes_the_largest_load_bound_unless_told(tmp_path):
    assert g3_config(tmp_path).load_timeout_s == LOAD_TIMEOUT_MAX_S
    assert g3_config(tmp_path, load_timeout_s=0.3).load_timeout_s == 0.3


def test_engine_connector_config_loads_within_generous_bounds(tmp_path):
    """``connector_extra``: what the vLLM engine tests (tests/e2e) run the connector with. Before: the G3 default 5 s
    and the G4 default 2 s."""
    ext = connector_extra(tmp_path / "w", f"file://{tmp_path / 'g4'}")
    cfg = load_config(ext["kvbm_backend"], use_env=False)
    assert cfg.g3.load_timeout_s == LOAD_TIMEOUT_MAX_S
    assert cfg.g4.load_bound_s >= LOAD_TIMEOUT_MAX_S  # the scheduler's lookup bound is built from it too
    own = connector_extra(tmp_path / "w", f"file://{tmp_path / 'g4'}", timeout_s=0.5, retries=0)  # a bound's test
    assert load_config(own["kvbm_backend"], use_env=False).g4.timeout_s == 0.5


def test_engine_native_tiers_load_within_generous_bounds(tmp_path: Path):
    """``native_extra``: our G3Tier and G4Tier under vLLM's OffloadingConnector in the engine tests. Before: the G3
    default 5 s and the G4 default 2 s."""
    g3, g4 = native_extra(tmp_path / "w", f"file://{tmp_path / 'g4'}")["secondary_tiers"]
    assert G3Config(**g3["g3"]).load_timeout_s == LOAD_TIMEOUT_MAX_S
    assert G4Config(enabled=True, **g4["g4"]).load_bound_s >= LOAD_TIMEOUT_MAX_S
    _, own = native_extra(tmp_path / "w", f"file://{tmp_path / 'g4'}", timeout_s=0.5)["secondary_tiers"]
    assert own["g4"]["timeout_s"] == 0.5
