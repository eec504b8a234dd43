"""``benchmarks/layerwise_bench.py --smoke-cpu`` (issue 24 item 5): the layer-wise overlap bench runs on the
CPU (tiny Llama, a real G3 pool) and writes its JSON: every hit fraction timed six ways (the default
whole-request path among them), and the forwards over loaded KV computed exactly what the forward over
resident KV did."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

pytestmark = [pytest.mark.slow]

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def test_layerwise_bench_smoke_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "layerwise_bench.py"), "--smoke-cpu",
                        "--out", str(tmp_path), "--workdir", str(tmp_path), "--switch-ms", "5,0.5"],
                       capture_output=True, text=True, timeout=HANG_S, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "layerwise_bench.json").read_text())["layerwise"]
    assert res["device"] == "cpu" and res["tokens"] == 512
    cases = res["cases"]
    assert [c["hit_fraction"] for c in cases] == [0.25, 0.5, 0.75]
    # the loads ran under CPython's 5 ms switch interval, then under load_gil_switch_ms's (the default's cases)
    assert res["load_gil_switch_ms"] == 0.5 and list(res["by_switch_ms"]) == ["5", "0.5"]
    assert res["by_switch_ms"]["0.5"] == cases and len(res["by_switch_ms"]["5"]) == 3
    for c in cases:
        assert c["hit_tokens"] % res["page"] == 0 and 0 < c["hit_tokens"] < res["tokens"]
        for k in ("load_s", "compute_s", "serial_s", "overlap_s", "default_load_s", "default_serial_s"):
            assert c[k] > 0, (k, c)
        assert c["ratio"] == pytest.approx(c["overlap_s"] / c["serial_s"], rel=1e-2)
        # the default path (whole hit through G3Pool.get, then the forward) is the baseline layer-wise must beat
        assert c["overlap_vs_default"] == pytest.approx(c["overlap_s"] / c["default_serial_s"], rel=1e-2)
        assert c["default_load_s"] < c["default_serial_s"]
        assert c["max_abs_diff"] == 0.0 and c["serial_max_abs_diff"] == 0.0, c  # loaded KV == computed KV
        assert c["default_max_abs_diff"] == 0.0, c
    assert not any(p.name.startswith("kvbm-layerwise-") for p in tmp_path.iterdir())  # the pool dir is removed
