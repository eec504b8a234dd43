"""What a native tier (``G3Tier``/``G4Tier`` under vLLM's real TieringOffloadingSpec and manager, loaded out of tree
by ``module_path``, real pools on tmp_path) makes of the config's ``g3``/``g4`` switches and of G3 admission.

Review findings (2026-12-01):

1. The tiers ignored ``g3.enabled: false`` / ``g4.enabled: false``: a G3Tier opened G3 whatever the config said (the
   example scripts' default paths, 800 GB, unchecked: docs/configuration.md promises "no G3 pool (its paths are then
   not checked)"), a G4Tier forced ``g4.enabled`` on. Now a tier whose own section is off refuses to start, naming the
   field and the fix, before anything opens (a G4Tier's ``g4.enabled`` left unset still counts as on: the tier is the
   opt-in).
2. The example YAML (``examples/kvbm-backend.yaml``), which every example script loads, spelled ``policy:
   frequency``: vLLM's CPU tier hands a chunk down once per residency, so the native G3 stored nothing at first
   offload. The example leaves the policy unset now (the tiers' default ``all``; the connector's stays KVBM's
   ``frequency``), a G3Tier running ``frequency`` says so in a WARNING at start, and only ``g3.admission.policy``
   itself chooses the tier's policy (a ``min_sightings`` alone switched it to ``frequency``)."""
from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend.config import ConfigError  # noqa: E402
from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, MOD, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]

EXAMPLE_YAML = Path(__file__).resolve().parents[3] / "examples" / "kvbm-backend.yaml"
TIER_LOG = "kvbm_backend.integrations.vllm.tiering"
FREQ_WARNING = "g3.admission.policy is frequency"


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


def _example_tier(tmp_path: Path, monkeypatch, **g3) -> dict:
    """A G3Tier reading examples/kvbm-backend.yaml as the example scripts hand it over (``config``), G3 moved to
    tmp_path and small, the keyring it names (a G3Tier follows its revocations) in tmp_path, metrics off."""
    monkeypatch.setenv("KVBM_BACKEND_KEK", base64.b64encode(os.urandom(32)).decode())
    monkeypatch.setenv("KVBM_BACKEND__METRICS__ENABLED", "false")
    (tmp_path / "keys").mkdir(mode=0o700)
    return {"type": "G3Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
            "config": str(EXAMPLE_YAML),
            "g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "load_timeout_s": 120.0, **g3},
            "g4": {"keyring": {"path": str(tmp_path / "keys" / "keyring.json")}}}


def test_the_example_yaml_stores_every_chunk_at_first_offload_through_the_g3_tier(tmp_path, monkeypatch, caplog):
    """Before: the example's ``policy: frequency`` made the G3Tier skip all 4 chunks (chunks_stored 0,
    chunks_skipped 4): vLLM's CPU tier hands a chunk down once per residency, so a chunk's second sighting needs
    it evicted and computed again."""
    with caplog.at_level("WARNING", logger=TIER_LOG):
        h = TieringHarness(offloading_config(secondary_tiers=[_example_tier(tmp_path, monkeypatch)], chunks=8, **GEO))
    try:
        assert h.tier.config.g3.admission.policy == "all"
        keys, data = keys_for(4, "example-yaml"), payloads(h, 4, seed=3)
        h.store(keys, data)
        h.wait_idle(timeout=HANG_S)
        t = h.tier.kvbm_stats()["tier"]
        assert (t["chunks_stored"], t["chunks_skipped"]) == (4, 0), t
    finally:
        h.shutdown()
    assert FREQ_WARNING not in caplog.text, caplog.text


def test_a_g3_tier_running_frequency_warns_at_start_naming_the_field(tmp_path, monkeypatch, caplog):
    """The operator who chose ``frequency`` (here in the tier's g3 key, over the example YAML) gets it, and one
    WARNING at start naming g3.admission.policy and what it costs (the first offloads of every chunk skipped).
    Before: silence, and G3 stayed empty."""
    tier = _example_tier(tmp_path, monkeypatch, admission={"policy": "frequency"})
    with caplog.at_level("WARNING", logger=TIER_LOG):
        h = TieringHarness(offloading_config(secondary_tiers=[tier], chunks=8, **GEO))
    try:
        warned = [r for r in caplog.records if r.name == TIER_LOG and FREQ_WARNING in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelname == "WARNING", caplog.text
        msg = warned[0].getMessage()
        assert "min_sightings=2" in msg and "chunks_skipped" in msg and "default is all" in msg, msg
        keys, data = keys_for(2, "freq"), payloads(h, 2, seed=5)
        h.store(keys, data)
        h.wait_idle(timeout=HANG_S)
        t = h.tier.kvbm_stats()["tier"]
        assert (t["chunks_stored"], t["chunks_skipped"]) == (0, 2), t  # what the warning said
    finally:
        h.shutdown()


@pytest.mark.parametrize("source", ["tier key", "environment"])
def test_min_sightings_alone_does_not_switch_the_tier_to_frequency(tmp_path, monkeypatch, caplog, source):
    """Only g3.admission.policy chooses the tier's policy. Before: any g3.admission field did, so a shared YAML or
    variable tuning the connector's filter (``KVBM_BACKEND__G3__ADMISSION__MIN_SIGHTINGS=3``) starved the G3Tier."""
    tier = g3_tier(tmp_path / "g3")
    if source == "tier key":
        tier["g3"]["admission"] = {"min_sightings": 3}
    else:
        monkeypatch.setenv("KVBM_BACKEND__G3__ADMISSION__MIN_SIGHTINGS", "3")
    with caplog.at_level("WARNING", logger=TIER_LOG):
        h = _make([tier])
    try:
        adm = h.tier.config.g3.admission
        assert (adm.policy, adm.min_sightings) == ("all", 3)
        keys, data = keys_for(2, "ms"), payloads(h, 2, seed=7)
        h.store(keys, data)
        h.wait_idle(timeout=HANG_S)
        assert h.tier.kvbm_stats()["tier"]["chunks_stored"] == 2
    finally:
        h.shutdown()
    assert FREQ_WARNING not in caplog.text, caplog.text
