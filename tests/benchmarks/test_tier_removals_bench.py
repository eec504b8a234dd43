"""``benchmarks/tier_removals.py`` runs as a script and writes its JSON: the tiering tier's removal check
from G3's removal log and by the index scan it replaced, in the same run. Small (3,000 chunks): this checks
the script and that both ways report the same removals, not the numbers (benchmarks/README.md has those)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side]  # ~20 s; no wall-clock assertion

REPO = Path(__file__).resolve().parents[2]


def test_tier_removals_bench_writes_its_json(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tier_removals.py"), "--chunks", "3000",
                        "--evictions", "100", "--rounds", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path), check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    d = json.loads((tmp_path / "tier_removals.json").read_text())
    assert d["removed_per_check"] == {"scan": [100, 100], "log": [100, 100]}
    assert d["ms_per_check"]["scan"] > 0 and d["ms_per_check"]["log"] > 0 and d["scan_over_log"] > 0
    assert not (tmp_path / "kvbm-g3").exists()
