"""``benchmarks/g3_restart.py`` runs as a script and writes its JSON: a real G3 pool reopened with its journal
and by the header scan, against the reads a restart cannot avoid, in the same run. Small (3,000 blocks): this
checks the script and that both reopens restore every block (the script exits non-zero otherwise), not the
numbers (benchmarks/README.md has those)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.side  # ~15 s on the 2-core VM; no wall-clock assertion
def test_g3_restart_bench_writes_its_json(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "g3_restart.py"), "--blocks", "3000", "--rounds", "1",
                        "--threads", "2", "--path", str(tmp_path / "fill"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path), check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    d = json.loads((tmp_path / "g3_restart.json").read_text())
    assert d["blocks"] == 3000 and d["scanned_slots"] >= 3000
    for k in ("journal_reopen_s", "scan_reopen_s", "read_floor_s", "journal_ratio", "scan_ratio"):
        assert d[k] > 0, (k, d)
    assert not (tmp_path / "fill" / "g3").exists()  # the filled directory is removed


def test_g3_restart_bench_refuses_a_bad_count(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "g3_restart.py"), "--blocks", "0"],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path), check=False)
    assert r.returncode == 2 and "--blocks: must be >= 1, got 0" in r.stderr, r.stderr
