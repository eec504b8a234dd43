"""What a native tier (``G3Tier``/``G4Tier`` under vLLM's real TieringOffloadingSpec and manager, loaded out of tree
by ``module_path``, real pools on tmp_path) makes of the config's ``g3``/``g4`` switches.

Review finding (2026-12-01): the tiers ignored ``g3.enabled: false`` / ``g4.enabled: false``: a G3Tier opened G3
whatever the config said (the example scripts' default paths, 800 GB, unchecked: docs/configuration.md promises "no
G3 pool (its paths are then not checked)"), a G4Tier forced ``g4.enabled`` on. Now a tier whose own section is off
refuses to start, naming the field and the fix, before anything opens (a G4Tier's ``g4.enabled`` left unset still
counts as on: the tier is the opt-in)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend.config import ConfigError  # noqa: E402
from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, MOD, g3_tier  # noqa: E402

pytestmark = [pytest.mark.vllm]


def _make(tiers: list[dict]) -> TieringHarness:
    return TieringHarness(offloading_config(secondary_tiers=tiers, chunks=8, **GEO))


def _g4_tier(store: Path, **g4) -> dict:
    return {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
            "g4": {"url": f"file://{store}", "encrypt": False, "timeout_s": 60.0, **g4}}


def _refused(tier: dict, field: str, must_not_exist: Path) -> None:
    """Building ``tier`` raises ConfigError naming ``field`` and the fix, leaving nothing open or written."""
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError) as e:
        _make([tier])
    msg = str(e.value)
    name = field.split(".")[0].upper()
    assert msg.startswith(f"{field}: false, but secondary_tiers has a {name}Tier"), msg
    assert f"set {field}: true" in msg and f"remove the {name}Tier from secondary_tiers" in msg, msg
    assert not must_not_exist.exists()  # refused before the pool opened: no directory, no lock, no slab
    assert not {t.name for t in threading.enumerate()} - before  # no pool or I/O thread left running


@pytest.mark.parametrize("source", ["tier key", "config file", "environment"])
def test_a_g3_tier_with_g3_disabled_refuses_to_start_naming_the_field(tmp_path, monkeypatch, source):
    """Before: the G3Tier opened a G3Pool at g3.paths (slab files, journal, lock) with g3.enabled false."""
    g3 = tmp_path / "g3"
    tier = g3_tier(g3)
    if source == "tier key":
        tier["g3"]["enabled"] = False
    elif source == "config file":
        cfg = tmp_path / "kvbm.yaml"
        cfg.write_text("g3:\n  enabled: false\n")
        tier["config"] = str(cfg)
    else:
        monkeypatch.setenv("KVBM_BACKEND__G3__ENABLED", "false")
    _refused(tier, "g3.enabled", g3)


@pytest.mark.parametrize("source", ["tier key", "config file", "environment"])
def test_a_g4_tier_with_g4_set_disabled_refuses_to_start_naming_the_field(tmp_path, monkeypatch, source):
    """Before: the G4Tier forced g4.enabled on and opened the G4 store. Unset, g4.enabled counts as on (the G4Tier
    is the opt-in, as every G4Tier configured with a url alone relies on)."""
    store = tmp_path / "g4"
    tier = _g4_tier(store)
    if source == "tier key":
        tier["g4"]["enabled"] = False
    elif source == "config file":
        cfg = tmp_path / "kvbm.yaml"
        cfg.write_text("g4:\n  enabled: false\n")
        tier["config"] = str(cfg)
    else:
        monkeypatch.setenv("KVBM_BACKEND__G4__ENABLED", "false")
    _refused(tier, "g4.enabled", store)
    monkeypatch.delenv("KVBM_BACKEND__G4__ENABLED", raising=False)
    tier = _g4_tier(store)  # g4.enabled unset: on
    h = _make([tier])
    try:
        assert type(h.tier.pool).__name__ == "G4Pool" and h.tier.config.g4.enabled
    finally:
        h.shutdown()
