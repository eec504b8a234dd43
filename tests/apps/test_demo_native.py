"""The demo's native-path helpers (issue 21 item 4) without an engine: the CPU budget every engine gets,
the per-tier hit rates from an ``engine_run`` native result, bytes on disk, and the tier configs."""
from __future__ import annotations

import os

import pytest

from kvbm_backend.apps.demo_native import (cpu_budget_env, disk_bytes, native_extra, native_g4_url,
                                           native_tier_summary, tier_dirs)
from kvbm_backend.apps.engine_model import TINY


def test_cpu_budget_env_gives_every_engine_all_cpus_and_no_reserved_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert cpu_budget_env(2) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "2"}
    assert cpu_budget_env()["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the caller's choice is kept (for every config alike)
    assert cpu_budget_env(2)["OMP_NUM_THREADS"] == "1"


def test_native_tier_summary_splits_hits_by_source_tier():
    res = {"prompt_tokens": [1000, 1000], "cached_tokens": [0, 900],
           "native_loads": {"chunks_by_source": {"CPU": 2, "G3Tier": 10, "G4Tier": 0}, "chunk_tokens": 64},
           "tier_stats": [{"type": "G3Tier", "tier": {"chunks_stored": 30, "chunks_loaded": 10}, "pool": {"hits": 10}},
                          {"type": "G4Tier", "tier": {"chunks_stored": 30, "chunks_loaded": 0}, "pool": {}}]}
    s = native_tier_summary(res)
    assert s["hit_rate_by_tier"] == pytest.approx({"engine": (900 - 12 * 64) / 2000, "CPU": 128 / 2000,
                                                   "G3": 640 / 2000, "G4": 0.0})
    assert s["chunks_loaded_by_tier"] == {"CPU": 2, "G3": 10, "G4": 0}
    assert s["tier_counters"]["G3"]["chunks_stored"] == 30 and s["tier_counters"]["G3"]["pool_hits"] == 10
    fs = native_tier_summary({"prompt_tokens": [100], "cached_tokens": [64], "tier_stats": [{"type": "fs"}],
                              "native_loads": {"chunks_by_source": {"CPU": 0, "fs": 1}, "chunk_tokens": 64}})
    assert fs["hit_rate_by_tier"] == pytest.approx({"engine": 0.0, "CPU": 0.0, "fs": 0.64})
    assert fs["tier_counters"] == {}  # vLLM's fs tier has no counters of ours


def test_disk_bytes_and_tier_dirs(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x" * 10_000)
    assert disk_bytes(tmp_path / "a") >= 10_000
    assert disk_bytes(tmp_path / "missing") == 0 and disk_bytes(None) is None
    d = tier_dirs("native_tiers", tmp_path, f"file://{tmp_path}/g4")
    assert d == {"G3": tmp_path / "g3-native", "G4": tmp_path / "g4-native"}
    assert tier_dirs("kvbm_backend", tmp_path, "s3://b/p")["G4"] is None  # remote: not measured
    assert tier_dirs("vllm_fs", tmp_path, "s3://b/p") == {"fs": tmp_path / "vllm-fs"}
    assert native_g4_url("s3://b/p/") == "s3://b/p-native"
    # every file URL form --g4 takes names the same absolute directory (file://localhost/p was measured as the
    # relative localhost/p, file:/p as nothing: the disk bytes of the demo's G4 tier were those of another path)
    for url in (f"file:{tmp_path}/g4", f"file://localhost{tmp_path}/g4"):
        assert tier_dirs("kvbm_backend", tmp_path, url)["G4"] == tmp_path / "g4", url
        assert tier_dirs("native_tiers", tmp_path, url)["G4"] == tmp_path / "g4-native", url


def test_native_extra_configs():
    fs = native_extra("vllm_fs", __import__("pathlib").Path("/w"), TINY, cpu_bytes=1 << 20, g3_capacity_gb=0.1,
                      g4_url="file:///w/g4", keyring="/w/k.json")
    assert fs["secondary_tiers"] == [{"type": "fs", "root_dir": "/w/vllm-fs"}]
    assert fs["spec_name"] == "CpuTieringOffloadingSpec" and fs["cpu_bytes_to_use"] == 1 << 20
    ours = native_extra("native_tiers", __import__("pathlib").Path("/w"), TINY, cpu_bytes=1 << 20,
                        g3_capacity_gb=0.1, g4_url="file:///w/g4", keyring="/w/k.json", endpoint_url="http://s3")
    g3, g4 = ours["secondary_tiers"]
    assert (g3["type"], g3["g3"]["capacity_gb"], g3["g3"]["paths"]) == ("G3Tier", 0.1, ["/w/g3-native"])
    assert (g4["type"], g4["g4"]["url"], g4["g4"]["endpoint_url"]) == ("G4Tier", "file:///w/g4-native", "http://s3")
    with pytest.raises(ValueError, match="native config"):
        native_extra("lmcache", __import__("pathlib").Path("/w"), TINY, cpu_bytes=1, g3_capacity_gb=1, g4_url="",
                     keyring="")
