"""Fast checks of the G4 cluster test bed's plumbing (no SeaweedFS): forced fallback, stale-run cleanup
that never kills a reused pid, and the scaling plot of the bench JSON."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

from kvbm_backend.apps.bench.g4_cluster import hosts as g

HANG_S = 600.0  # a hang guard, not a bound: waits for a killed process to end; returns as soon as it does


def test_forced_loopback_is_reported(monkeypatch):
    monkeypatch.setenv(g.MODE_ENV, "loopback")
    assert g.netns_unavailable_reason() == f"{g.MODE_ENV}=loopback"


def test_clean_stale_removes_dead_runs_and_never_kills_a_reused_pid():
    g.STATE_DIR.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        run = uuid.uuid4().hex[:6]
        st = {"run_id": run, "owner": dead.pid, "owner_start": 1, "bridge": None, "netns": [],
              # `victim` stands for an unrelated process that got a recorded pid: wrong start time
              "pids": [[victim.pid, (g._start_time(victim.pid) or 0) + 1], [mine.pid, g._start_time(mine.pid)]]}
        f = g.STATE_DIR / f"{run}.json"
        f.write_text(json.dumps(st))
        assert run in g.clean_stale()
        assert not f.exists()
        assert mine.wait(HANG_S) is not None  # ours: killed
        assert victim.poll() is None  # not ours any more: left alone
    finally:
        for p in (victim, mine):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_cluster_bench_rejects_zero_rounds_before_starting_a_cluster(tmp_path):
    """``rounds=0`` started the cluster, measured nothing and then indexed the best round, None (TypeError,
    found by mypy); now a ValueError naming the option, and no cluster is started."""
    import pytest

    from kvbm_backend.apps.bench.g4_cluster.bench import bench
    with pytest.raises(ValueError, match="--rounds: must be >= 1, got 0"):
        bench([1], 2, "tiny", 16, encrypt=False, inflight=1, workdir=str(tmp_path), rounds=0)
    assert list(tmp_path.iterdir()) == []


def test_scaling_json_plots(tmp_path):
    from kvbm_backend.apps.report import plot_results
    d = {"kind": "scaling", "tier": "g4-cluster", "x": "workers", "workers": [1, 2, 4], "mode": "netns",
         "series": {"write GB/s": [0.05, 0.06, 0.06], "read GB/s": [0.2, 0.25, 0.3]}}
    (tmp_path / "s.json").write_text(json.dumps(d))
    plot_results([str(tmp_path / "s.json")], str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 1000
