"""``kvbm-backend bench`` (and the ``engines`` / ``g4_load`` bench modules): a flag a tier does not use is
refused, every error is one line naming the flag (exit 2), an unreachable S3 store fails fast, SIGTERM cleans
up. Hang guards only, no wall-clock assertions."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app

HANG_S = 120.0  # a hang guard, not a bound
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _one_line_error(r, *names: str) -> str:
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.output, r.output
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_flags_a_tier_does_not_use_are_refused(tmp_path):
    store = tmp_path / "g4"
    store.mkdir()
    for flag, value in (("--io-size", "4096"), ("--engine", "posix")):
        r = CliRunner().invoke(app, ["bench", "--tier", "g4", "--url", f"file://{store}", "--layout", "tiny",
                                     "--blocks", "1", flag, value])
        _one_line_error(r, flag, "g4")
    for flag, value in (("--engine", "posix"), ("--io-size", "4096"), ("--threads", "2"), ("--layout", "tiny"),
                        ("--page-size", "32"), ("--tp", "2"), ("--path", str(tmp_path)), ("--s3-client", "boto3")):
        r = CliRunner().invoke(app, ["bench", "--tier", "index", "--blocks", "10", flag, value])
        _one_line_error(r, flag, "index")
    r = CliRunner().invoke(app, ["bench", "--tier", "g4", "--url", f"file://{store}", "--path", str(tmp_path)])
    _one_line_error(r, "--path", "g4")
    for tier in ("g3", "vllm-tiers"):  # G4's options: these tiers write G3 slab files
        for extra in (["--url", f"file://{store}"], ["--endpoint-url", "http://127.0.0.1:1"], ["--no-encrypt"],
                      ["--encrypt"], ["--s3-client", "boto3"]):
            r = CliRunner().invoke(app, ["bench", "--tier", tier, "--path", str(tmp_path), "--layout", "tiny",
                                         "--blocks", "1", *extra])
            _one_line_error(r, extra[0].split("-no-")[-1].lstrip("-"), tier)


@pytest.mark.parametrize("url,names", [("s3://kvbm-bench/x", ("--url", "--endpoint-url")),
                                       ("s3://b/x", ("--url", "bucket"))])  # a bucket name S3 refuses
def test_unreachable_s3_endpoint_fails_fast_naming_the_flags(url, names):
    try:
        p = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "bench", "--tier", "g4", "--url",
                            url, "--endpoint-url", "http://127.0.0.1:1", "--blocks", "1", "--layout", "tiny",
                            "--json"], capture_output=True, text=True, timeout=HANG_S, cwd=ROOT,
                           env={**ENV, "AWS_ACCESS_KEY_ID": "kvbm-test", "AWS_SECRET_ACCESS_KEY": "kvbm-test"})
    except subprocess.TimeoutExpired:
        pytest.fail("hang guard: an unreachable endpoint was not refused")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and p.stdout == "", p.stderr
    assert all(n in lines[0] for n in names) and "Traceback" not in p.stderr, lines[0]


def test_run_errors_are_one_line(tmp_path, monkeypatch):
    import kvbm_backend.pool.g3.slabs as slabs
    (tmp_path / "g3").mkdir()
    total = 100 << 30  # a filesystem with room for a dozen tiny slots past g3.min_free_fraction
    monkeypatch.setattr(slabs, "fs_space", lambda d: (int(total * 0.02) + 12 * 36864, total))
    r = CliRunner().invoke(app, ["bench", "--tier", "g3", "--path", str(tmp_path / "g3"), "--layout", "tiny",
                                 "--blocks", "64", "--json"])
    _one_line_error(r, "--path", "--blocks", "no room")
    monkeypatch.undo()
    import kvbm_backend.apps.bench.g3 as g3

    def boom(_opts):
        raise RuntimeError("bench: pool lost a block")
    monkeypatch.setattr(g3, "run", boom)
    r = CliRunner().invoke(app, ["bench", "--tier", "g3", "--path", str(tmp_path / "g3"), "--layout", "tiny"])
    _one_line_error(r, "bench --tier g3", "lost a block")


def test_engine_that_cannot_run_here_is_one_line(tmp_path):
    from kvbm_backend.io import make_engine
    try:
        make_engine("kvikio", threads=1).close()
        pytest.skip("kvikio runs on this host")
    except (RuntimeError, ImportError, OSError):
        pass
    r = CliRunner().invoke(app, ["bench", "--tier", "g3", "--path", str(tmp_path), "--layout", "tiny", "--blocks",
                                 "4", "--engine", "kvikio"])
    _one_line_error(r, "--engine kvikio")


@pytest.mark.parametrize("args,flag", [
    (["--total-mib", "0"], "--total-mib"), (["--io-kib", "3"], "--io-kib"), (["--inflight", "0"], "--inflight"),
    (["--repeats", "0"], "--repeats"), (["--inflight", "x"], "--inflight")])
def test_engines_module_bad_values_are_one_line(tmp_path, args, flag):
    p = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.bench.engines", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=HANG_S, env=ENV, cwd=ROOT)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and flag in lines[0] and p.stdout == "", p.stderr


def test_engines_module_missing_dir_and_g4_load_threads_are_one_line(tmp_path):
    for mod, args, name in (("engines", [str(tmp_path / "missing")], "missing"),
                            ("g4_load", ["--dir", str(tmp_path), "--threads", "a"], "--threads"),
                            ("g4_load", ["--dir", str(tmp_path), "--blocks", "x"], "--blocks")):
        p = subprocess.run([sys.executable, "-m", f"kvbm_backend.apps.bench.{mod}", *args], capture_output=True,
                           text=True, timeout=HANG_S, env=ENV, cwd=ROOT)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and name in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_sigterm_during_bench_g3_removes_its_files(tmp_path):
    """A real ``bench --tier g3`` stopped by SIGTERM while its baseline file exists removes it and the pool's
    directories, as Ctrl-C does."""
    d = tmp_path / "g3"
    d.mkdir()
    from tests.helpers.sigterm import sigterm_when
    rc, out, err = sigterm_when([sys.executable, "-m", "kvbm_backend.apps.cli", "bench", "--tier", "g3", "--path", str(d),
                                 "--layout", "llama-3.1-8b", "--blocks", "32", "--json"],
                                lambda: any(d.glob(".kvbm-baseline-*")),  # the first baseline point runs
                                "no baseline file", HANG_S, poll_s=0.005, env=ENV, cwd=ROOT)
    assert rc != 0 and out == "", err  # interrupted, not finished
    assert list(d.iterdir()) == []


def test_a_baseline_interrupted_right_after_making_its_file_leaves_nothing(tmp_path, monkeypatch):
    """The window test_sigterm_during_bench_g3_removes_its_files aims at (its SIGTERM goes the moment a baseline
    file appears; CI 2026-12-01 caught it there): the interrupt lands after ``mkstemp`` made the file and before
    the baseline had noted it. Its cleanup removes every file this process made in the directory."""
    import tempfile

    from kvbm_backend.apps.bench import baseline as b
    real = tempfile.mkstemp

    def made_then_interrupted(*a, **k):
        fd, path = real(*a, **k)
        if ".kvbm-baseline-" in k.get("prefix", ""):
            os.close(fd)
            raise KeyboardInterrupt("SIGTERM just after the file was made")
        return fd, path
    monkeypatch.setattr(b.tempfile, "mkstemp", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        b.odirect_baseline([str(tmp_path)], 4 << 20, 1 << 20, 2)
    assert list(tmp_path.iterdir()) == []


def test_a_baseline_interrupted_in_its_first_o_direct_probe_leaves_nothing(tmp_path, monkeypatch):
    """The same run of CI (2026-12-01) left ``.kvbm-odirect-probe-<pid>-*``: the interrupt landed in the O_DIRECT
    probe the baseline runs before its first file (after the probe made its file, before its own cleanup)."""
    import tempfile

    from kvbm_backend.apps.bench import baseline as b
    from kvbm_backend.io import probe
    real = tempfile.mkstemp

    def made_then_interrupted(*a, **k):
        fd, path = real(*a, **k)
        os.close(fd)
        raise KeyboardInterrupt("SIGTERM just after the probe's file was made")
    monkeypatch.setattr(probe.tempfile, "mkstemp", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        b.odirect_baseline([str(tmp_path)], 4 << 20, 1 << 20, 2)
    assert list(tmp_path.iterdir()) == []


_HELD_LOCK = """
import os, signal, threading, time
from kvbm_backend.apps.bench.baseline import Sweep
from kvbm_backend.apps.signals import sigterm_as_interrupt

sigterm_as_interrupt()
cond = threading.Condition()  # a Python-level lock, as a ThreadPoolExecutor's semaphore uses
with cond:
    os.kill(os.getpid(), signal.SIGTERM)  # lands while the lock is held
    t = time.monotonic()
    while time.monotonic() - t < 0.5:
        pass
    print("the locked block ran to its end", flush=True)
print("the lock is free:", cond.acquire(blocking=False), flush=True)
done = []
Sweep("points", [{"n": 1}, {"n": 2}], lambda p: done.append(p["n"]) or {"write_gbps": 1.0, "read_gbps": 1.0}).measure(True)
print("measured", done, flush=True)
"""


def test_a_sigterm_stops_the_bench_at_its_next_step_never_inside_the_code_it_lands_in(tmp_path):
    """CI 2026-12-02: ``bench --tier g3`` stopped by SIGTERM deadlocked (stacks from tests/helpers/sigterm.py): the
    handler raised KeyboardInterrupt inside a ThreadPoolExecutor's ``submit`` while it held its semaphore's lock
    (raised in a Python-level ``__enter__``, the lock is never released); the main thread then joined a worker
    waiting for that lock. Now the handler only records the SIGTERM and the command raises KeyboardInterrupt at
    its next step (here: before the baseline sweep's first point). A real SIGTERM lands inside a locked block:
    the block runs to its end, the lock is free after it, and the sweep measures nothing (before 2026-12-02 the
    interrupt was raised inside the block)."""
    p = subprocess.run([sys.executable, "-c", _HELD_LOCK], capture_output=True, text=True, timeout=HANG_S,
                       env=ENV, cwd=ROOT)
    assert "the locked block ran to its end" in p.stdout, (p.stdout, p.stderr)
    assert "the lock is free: True" in p.stdout, (p.stdout, p.stderr)
    assert "measured" not in p.stdout and p.returncode != 0, (p.stdout, p.stderr)
    assert "KeyboardInterrupt: SIGTERM" in p.stderr, p.stderr
