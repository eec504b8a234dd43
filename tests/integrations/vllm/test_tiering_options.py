"""A native tier's own keys (``G3Tier``/``G4Tier`` in vLLM's ``secondary_tiers``) are checked by type and range,
through vLLM's real TieringOffloadingSpec (out of tree via ``module_path``) with real G3/G4 pools on tmp_path.

Review finding (2026-11-30): ``"enable_kv_events": "false"`` (a string) turned events on, and ``"locality":
"local"``, ``"io_threads": "4"``, ``"job_timeout_s": "60"``, ``"staging_mb": "64"`` raised errors that did not name
the key (``'local' is not a valid Locality``, ``'<' not supported between instances of 'str' and 'int'``), though
the class docstring promised errors naming the field."""
from __future__ import annotations

import re
import threading

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import Locality  # noqa: E402

from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, MOD, g3_tier  # noqa: E402

pytestmark = [pytest.mark.vllm]

BAD = [  # (key, value): each refused with a ValueError whose message starts with the key
    ("enable_kv_events", "false"), ("enable_kv_events", "true"), ("enable_kv_events", 0), ("enable_kv_events", None),
    ("locality", "local"), ("locality", "remote"), ("locality", ""), ("locality", 1),
    ("io_threads", "4"), ("io_threads", 0), ("io_threads", 2.0), ("io_threads", True),
    ("job_timeout_s", "60"), ("job_timeout_s", 0), ("job_timeout_s", True), ("job_timeout_s", float("nan")),
    ("job_timeout_s", float("inf")),
    ("staging_mb", "64"), ("staging_mb", -1), ("staging_mb", True), ("staging_mb", float("inf")),
    ("mla", "false"), ("mla", 0),
    ("num_kv_heads", "2"), ("num_kv_heads", True), ("num_kv_heads", 0),
    ("head_dim", "64"), ("head_dim", 64.0), ("head_dim", 0),
    ("config", 123), ("config", ["/etc/kvbm-backend.yaml"]),
    ("tenant", 7), ("revision", 1.0), ("layout", 5), ("kv_cache_layout", 3),
]


def _make(tier: dict, events: bool = True) -> TieringHarness:
    return TieringHarness(offloading_config(secondary_tiers=[tier], chunks=8, enable_kv_cache_events=events, **GEO))


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_a_bad_tier_key_is_refused_naming_it_before_anything_opens(tmp_path, key, value):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match=rf"^{key}: .*got {re.escape(repr(value))} \({type(value).__name__}\)"):
        _make(g3_tier(tmp_path / "g3", **{key: value}))
    assert not (tmp_path / "g3").exists()  # refused before the pool opened: no directory, no lock, no thread
    assert not {t.name for t in threading.enumerate()} - before


def test_a_bad_g4_tier_key_is_refused_naming_it(tmp_path):
    tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
            "g4": {"url": f"file://{tmp_path / 'g4'}"}, "locality": "remote"}
    with pytest.raises(ValueError, match=r"^locality: LOCAL or REMOTE, got 'remote' \(str\)"):
        _make(tier)
    tier["locality"] = "REMOTE"
    tier["enable_kv_events"] = "false"
    with pytest.raises(ValueError, match=r"^enable_kv_events: true or false"):
        _make(tier)


def test_good_tier_keys_are_taken_as_given(tmp_path):
    """The accepted spellings still work: booleans, LOCAL/REMOTE, integers for the float keys."""
    h = _make(g3_tier(tmp_path / "a", enable_kv_events=False, locality="REMOTE", job_timeout_s=60, staging_mb=0,
                      mla=False, tenant="t", revision="r1", kv_cache_layout="LBNHC"))
    try:
        assert h.tier._events is None and h.tier.locality is Locality.REMOTE
        assert h.tier._job_timeout_s == 60.0 and isinstance(h.tier._job_timeout_s, float)
    finally:
        h.shutdown()
    h = _make(g3_tier(tmp_path / "b", enable_kv_events=True, job_timeout_s=0.5, staging_mb=0.5))
    try:
        assert h.tier._events == [] and h.tier.locality is Locality.LOCAL  # G3's default
    finally:
        h.shutdown()



def test_g4_layout_canonical_is_refused_by_g4tier_naming_the_field(tmp_path):
    """``g4.layout: canonical`` (the connector's TP-independent G4: one object per KV head) is refused when vLLM
    builds a G4Tier, with an error naming ``g4.layout`` (``open_pool``: the tier cuts per-rank blocks), whether set
    in the tier's ``g4`` key or in the config file it names, leaving nothing open or written: an operator who set
    it is never left believing engines of other TP sizes share the tier's G4. ``per-rank`` (set) starts."""
    store = tmp_path / "g4"
    tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
            "g4": {"url": f"file://{store}", "encrypt": False, "layout": "canonical"}}
    cfg_file = tmp_path / "kvbm.yaml"
    cfg_file.write_text(f"g4:\n  url: file://{store}\n  encrypt: false\n  layout: canonical\n")
    from_file = {k: v for k, v in tier.items() if k != "g4"} | {"config": str(cfg_file)}
    before = {t.name for t in threading.enumerate()}
    for t in (tier, from_file):
        with pytest.raises(ValueError, match=r"^g4\.layout: canonical is served through the vLLM connector "
                                             r"\(KvbmBackendConnector.*set g4\.layout: per-rank"):
            _make(t)
    assert not store.exists() or not any(store.rglob("*"))  # nothing written
    assert not {t.name for t in threading.enumerate()} - before  # no pool thread left running
    h = _make({**tier, "g4": {**tier["g4"], "layout": "per-rank"}})
    try:
        assert h.tier.pool is not None
    finally:
        h.shutdown()
