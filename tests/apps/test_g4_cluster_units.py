"""Fast checks of the G4 cluster test bed's plumbing (no SeaweedFS): forced fallback, stale-run cleanup
that never kills a reused pid, and the scaling plot of the bench JSON."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

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


def _tripwire(monkeypatch):
    """A started cluster fails the test at once (an option check must come before any server)."""
    from kvbm_backend.apps.bench.g4_cluster import cluster

    def started(self, *a, **kw):
        raise AssertionError("a cluster was started before the options were checked")
    monkeypatch.setattr(cluster.G4Cluster, "start", started)


BAD_BENCH_OPTIONS = [
    (["--workers", "0"], "--workers: every worker count must be >= 1, got 0"),
    (["--workers=-2,4"], "--workers: every worker count must be >= 1, got -2"),
    (["--workers", "1,x"], "--workers: expected comma-separated worker counts"),
    (["--workers", ","], "--workers: no worker count given"),
    (["--blocks", "0", "--read-passes", "0"], "--blocks: must be >= 1, got 0"),
    (["--blocks=-3"], "--blocks: must be >= 1, got -3"),
    (["--read-passes", "0"], "--read-passes: must be >= 1, got 0"),
    (["--inflight", "0"], "--inflight: must be >= 1, got 0"),
    (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["--page-size", "0"], "--page-size: must be >= 1, got 0"),
    (["--layout", "no-such-model"], "--layout:"),
    (["--volumes", "1"], "--volumes: replication 001 keeps 2 copies on different volume servers"),
    (["--volumes", "2", "--replication", "002"], "--volumes: replication 002 keeps 3 copies"),
    (["--volumes", "0", "--replication", "000"], "--volumes: replication 000 keeps 1 copies"),
    (["--replication", "010"], "--replication: the test bed has one data center and one rack"),
    (["--replication", "1"], "--replication: expected 3 digits"),
]


@pytest.mark.parametrize("args,message", BAD_BENCH_OPTIONS, ids=[" ".join(a) for a, _ in BAD_BENCH_OPTIONS])
def test_cluster_bench_refuses_bad_options_before_starting_a_cluster(tmp_path, monkeypatch, capsys, args, message):
    """``--blocks 0 --read-passes 0`` ran and reported 0.0 GB/s, ``--workers 0`` started SeaweedFS and then
    died with an IndexError, negatives and impossible replica placements were taken: each is now an
    argparse error (exit 2) naming the option, and no server starts."""
    from kvbm_backend.apps.bench.g4_cluster.__main__ import main
    _tripwire(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workers", "1", "--blocks", "2", "--layout", "tiny", "--rounds", "1", *args,
              "--out", str(out / "b.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not out.exists()


def test_good_cluster_bench_options_pass_the_checks():
    """The checks refuse only what cannot run: one volume server holds replication 000, three hold 002."""
    from kvbm_backend.apps.bench.g4_cluster.bench import check_options
    check_options([1, 2], 1, "tiny", 16, 1, rounds=1, read_passes=1, replication="000", volumes=1)
    check_options([8], 4, "llama-3.1-8b", 16, 4, replication="002", volumes=3)


def test_cluster_up_refuses_too_few_volume_servers_before_making_anything(tmp_path, monkeypatch, capsys):
    from kvbm_backend.apps.bench.g4_cluster import G4Cluster
    from kvbm_backend.apps.bench.g4_cluster.__main__ import main
    _tripwire(monkeypatch)
    with pytest.raises(ValueError, match="--volumes: replication 001 keeps 2 copies"):
        G4Cluster(tmp_path / "a", workers=1, volumes=1)
    with pytest.raises(ValueError, match="--workers: must be >= 0, got -1"):
        G4Cluster(tmp_path / "a", workers=-1)
    assert not (tmp_path / "a").exists()
    with pytest.raises(SystemExit) as e:
        main(["up", "--dir", str(tmp_path / "b"), "--volumes", "1"])
    assert e.value.code == 2 and "--volumes" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_the_one_worker_point_says_it_reads_its_own_blocks():
    """With one worker the bench's reader is the writer (``seqs[(w + 1) % n]``) while the JSON said every
    worker read "the blocks the next worker wrote"; the point and the text now say which."""
    from kvbm_backend.apps.bench.g4_cluster.bench import _reads_from
    assert _reads_from(1) == "its own blocks (one worker: no other host to read from)"
    assert _reads_from(2) == "the blocks the next worker wrote (another host)"
