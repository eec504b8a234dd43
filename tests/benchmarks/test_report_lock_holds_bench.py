"""``benchmarks/report_lock_holds.py`` runs as a script and writes its JSON: the longest hold of the KV events'
and G3 mirror's locks while big G3 reports are applied, beside each operation's whole time. Small (3 report
chunks of blocks): this checks the script and that every operation took its lock more than once, not the
numbers (a wall-clock bound would turn load into failures)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side]  # ~15 s; no wall-clock assertion

REPO = Path(__file__).resolve().parents[2]


def test_report_lock_holds_bench_writes_its_json(tmp_path):
    from kvbm_backend.integrations.vllm.kv_events import APPLY_CHUNK
    n = 3 * APPLY_CHUNK
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "report_lock_holds.py"), "--blocks", str(n),
                        "--published", "3000", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path), check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    d = json.loads((tmp_path / "report_lock_holds.json").read_text())
    assert (d["blocks"], d["published"]) == (n, 3000)
    ops = d["ops"]
    assert set(ops) == {"events_snapshots", "events_resnapshot", "events_republish", "mirror_snapshots"}
    for name, o in ops.items():
        assert o["holds"] >= 3 and 0 < o["max_hold_s"] <= o["total_s"] and 0 < o["hold_over_total"] <= 1, (name, o)
