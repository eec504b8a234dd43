"""``benchmarks/tier_interface.py`` (issue 21 item 6) runs as a script and writes its JSON: both tiers'
GB/s both ways through vLLM's tiering manager with the same durability, the ratios, and the scheduler
step latency per tier with and without offloading in flight. Small (tiny layout, 8 chunks): this checks
the script, not the numbers (those are in benchmarks/README.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]


def test_tier_interface_bench_writes_its_json(tmp_path):
    (tmp_path / "disk").mkdir()
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tier_interface.py"), "--path", str(tmp_path / "disk"),
                        "--layout", "tiny", "--blocks", "8", "--chunks-per-step", "2", "--threads", "2", "--rounds", "2",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600, cwd=str(REPO), check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    d = json.loads((tmp_path / "out" / "tier_interface.json").read_text())
    t = d["throughput"]
    for name in ("vllm_fs", "ours", "ours_nofsync"):
        assert t[f"{name}_write_gbps"] > 0 and t[f"{name}_read_gbps"] > 0, name
        assert t[f"{name}_read_verified"], name  # every chunk read back byte for byte
    # same durability: neither flushes, both take O_DIRECT alike (vLLM's own probe of the directory)
    assert t["same_durability"] and t["vllm_fs_o_direct"] == t["ours_nofsync_o_direct"]
    assert t["write_ratio"] == t["ours_nofsync_write_gbps"] / t["vllm_fs_write_gbps"]
    assert t["read_ratio"] == t["ours_nofsync_read_gbps"] / t["vllm_fs_read_gbps"]
    assert "without fsync" in d["durability"]
    assert len(t["write_ratio_rounds"]) == len(t["read_ratio_rounds"]) == 2 and t["write_ratio_paired_median"] > 0
    assert all(t[f"{n}_{d}_cpu_s_per_gb"] > 0 for n in ("vllm_fs", "ours", "ours_nofsync") for d in ("write", "read"))
    for name in ("vllm_fs", "ours", "ours_nofsync"):
        s = d["step"][name]
        assert s["idle"]["steps"] == 200 and s["store"]["steps"] >= 4 and s["load"]["steps"] >= 4, s
        assert s["load"]["chunks_loaded"] == 8 * d["step_rounds"], s
        assert s["tier_get_finished_jobs"]["steps"] >= s["idle"]["steps"] and s["tier_submit_store"]["steps"] >= 1
        for phase in ("idle", "store", "load", "tier_get_finished_jobs", "tier_submit_store", "tier_submit_load"):
            assert 0 < s[phase]["p50_ms"] <= s[phase]["p99_ms"] <= s[phase]["max_ms"], (name, phase, s[phase])
    assert set(d["goals"]) == {"write_ge_1x", "read_ge_1x"}
    assert "write GB/s" in r.stdout and "step p99 ms" in r.stdout
