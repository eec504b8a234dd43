"""Operator mistakes on the command line (issue 10): every one is a single ``error:`` line on stderr that
names the argument, exit code 2, and no traceback. Runs the CLI in-process (typer's CliRunner), like
``tests/apps/test_bench_cli.py``; the commands here all fail before any I/O beyond a stat."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)


@pytest.fixture()
def files(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    (tmp_path / "ok").mkdir()
    (tmp_path / "not.json").write_text("not json {")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "bench.json").write_text(json.dumps({"write_gbps": 1.0, "baseline_write_gbps": 1.0}))
    (tmp_path / "trace.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1,
                                                      "hash_ids": [1]}) + "\n")
    (tmp_path / "used-wd" / "g3-run").mkdir(parents=True)  # a demo workdir of an earlier run
    (tmp_path / "dir.png").mkdir()  # a directory where an output file is named
    return tmp_path


# (arguments, text the one error line must contain); {d} is a temporary directory holding the files above
CASES = [
    # layouts
    (["layouts", "--page-size", "0"], "error: --page-size: must be >= 1 (got 0)"),
    (["layouts", "--tp", "0"], "error: --tp: must be >= 1 (got 0)"),
    (["layouts", "--tp", "-3"], "error: --tp: must be >= 1 (got -3)"),
    (["layouts", "--page-size", "abc"], "'--page-size'"),
    # bench
    (["bench", "--tier", "g3", "--path", "{d}/a-file", "--layout", "tiny"], "error: --path: {d}/a-file: is a file"),
    (["bench", "--tier", "g3", "--path", "{d}/ok,{d}/a-file/sub", "--layout", "tiny"], "error: --path: {d}/a-file/sub"),
    (["bench", "--tier", "vllm-tiers", "--path", "{d}/a-file", "--layout", "tiny"], "error: --path:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--blocks", "-1"],
     "error: --blocks: must be >= 1 (got -1)"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--page-size", "0"], "error: --page-size:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--tp", "0"], "error: --tp:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "qwen3-8b", "--tp", "3"],
     "error: --tp: qwen3-8b has 8 KV heads"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "no-such-model"], "error: --layout: no preset"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--engine", "spdk"], "error: --engine:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--threads", "0"], "error: --threads:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--io-size", "100"], "error: --io-size:"),
    (["bench", "--tier", "g5", "--layout", "tiny"], "error: --tier: expected g3, g4, vllm-tiers or index (got 'g5')"),
    (["bench", "--tier", "g4", "--url", "ftp://host/x", "--layout", "tiny"], "error: --url 'ftp://host/x'"),
    (["bench", "--tier", "g4", "--url", "s3://bkt/p", "--endpoint-url", "not-a-url", "--layout", "tiny"],
     "error: --endpoint-url:"),
    (["bench", "--tier", "g3", "--layout", "tiny", "--bogus", "1"], "No such option: --bogus"),
    (["bench", "--tier", "g3", "--path", "{d}/no-dir", "--layout", "tiny"], "error: --path: {d}/no-dir: no such directory"),
    (["bench", "--tier", "vllm-tiers", "--path", "{d}/ok,{d}/no-dir", "--layout", "tiny"],
     "error: --path: {d}/no-dir: no such directory"),
    (["bench", "--tier", "g4", "--url", "file://{d}/no-store", "--layout", "tiny"],
     "error: --url: {d}/no-store: no such directory"),
    # replay
    (["replay", "--layout", "tiny", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1"], "Missing option '--trace'"),
    # a URL where a G3 directory is expected: file:/x was the relative directory "file:" + x under the current
    # one (replay wrote there and reported success; a config's g3.paths opened the pool there)
    (["replay", "--trace", "{d}/trace.jsonl", "--layout", "tiny", "--g3-path", "file:{d}/g3", "--g3-capacity-gb", "1"],
     "error: --g3-path: file:{d}/g3: a file: URL, not a directory path; give the directory {d}/g3"),
    (["replay", "--trace", "{d}/trace.jsonl", "--layout", "tiny", "--g3-path", "file:///{d}/g3", "--g3-capacity-gb",
      "1"], "error: --g3-path: file:///{d}/g3: a file: URL, not a directory path"),
    (["bench", "--tier", "g3", "--path", "s3:/bucket/p", "--layout", "tiny"],
     "error: --path: s3:/bucket/p: a s3: URL, not a directory path"),
    (["doctor", "--config", '{"g3": {"paths": ["file:{d}/g3"]}}'],
     "error: g3.paths[0]: a file: URL, not a directory path; give the directory {d}/g3"),
    (["replay", "--trace", "{d}/missing.jsonl", "--layout", "tiny", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1"],
     "error: --trace:"),
    (["replay", "--trace", "{d}/not.json", "--layout", "tiny", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1"],
     "error: --trace {d}/not.json line 1: not a Mooncake record"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "inf"],
     "error: --g3-capacity-gb: must be a finite number (got inf)"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "nan"],
     "error: --g3-capacity-gb: must be a finite number (got nan)"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "0"],
     "error: --g3-capacity-gb: must be > 0 (got 0)"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/a-file", "--g3-capacity-gb", "1"],
     "error: --g3-path: {d}/a-file: is a file"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1", "--page-size", "0"],
     "error: --page-size:"),
    # a capacity below one block: refused alike by a real and a simulated replay, and by plan (G3 and G4)
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/ok", "--g3-capacity-gb", "1e-6", "--simulate"],
     "error: --g3-capacity-gb: 1e-06 GB holds no block"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/ok", "--g3-capacity-gb", "1e-6"],
     "error: --g3-capacity-gb: 1e-06 GB holds no block"),
    (["plan", "--synthetic", "--users", "2", "--turns", "2", "--g3-capacity-gb", "1e-6"],
     "error: --g3-capacity-gb: 1e-06 GB holds no block"),
    (["plan", "--synthetic", "--users", "2", "--turns", "2", "--g4-capacity-gb", "0,1e-6"],
     "error: --g4-capacity-gb: 1e-06 GB holds no block"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1", "--limit", "-1"],
     "error: --limit:"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1", "--layout", "nope"],
     "error: --layout: no preset 'nope'"),
    # plot
    (["plot", "{d}/missing.json"], "error: FILES: {d}/missing.json: No such file"),
    (["plot", "{d}/not.json"], "error: FILES: {d}/not.json: not JSON"),
    (["plot", "{d}/list.json"], "error: FILES: {d}/list.json: expected a JSON object"),
    (["plot", "{d}/other.json", "--out", "{d}/p.png"], "error: FILES: other.json: neither demo"),
    (["plot", "{d}/bench.json", "--out", "{d}/a-file/p.png"], "error: --out: {d}/a-file: is a file"),
    (["plot", "{d}/bench.json", "--out", "{d}/p.txt"], "error: --out: unknown image format '.txt'"),
    # gc
    (["gc", "--url", "file://{d}/store", "--max-age-s", "-1"], "error: --max-age-s: must be >= 0 (got -1)"),
    (["gc", "--url", "file://{d}/store", "--max-age-s", "nan"], "error: --max-age-s: must be a finite number"),
    (["gc", "--url", "file://{d}/store", "--target-gb", "-1"], "error: --target-gb: must be >= 0 (got -1)"),
    (["gc", "--url", "file://{d}/store", "--target-gb", "inf"], "error: --target-gb: must be a finite number"),
    (["gc", "--url", "file://{d}/store", "--max-age-s", "5", "--temp-grace-s", "-5"], "error: --temp-grace-s:"),
    (["gc", "--url", "file://{d}/store", "--max-age-s", "5", "--announce-ttl-s", "-5"], "error: --announce-ttl-s:"),
    (["gc", "--url", "ftp://host/x", "--max-age-s", "5"], "error: --url: 'ftp://host/x': scheme 'ftp' not supported"),
    (["gc", "--url", "s3://bkt/p", "--endpoint-url", "not-a-url", "--max-age-s", "5"], "error: --endpoint-url:"),
    (["gc", "--url", "file://{d}/store", "--max-age-s", "soon"], "'--max-age-s'"),
    (["gc", "--url", "file://{d}/no-store", "--max-age-s", "5"], "error: --url: {d}/no-store: no such directory"),
    # keys
    (["keys", "create", "--keyring", "{d}/a-file/kr.json", "--tenant", "t"], "error: --keyring: {d}/a-file/kr.json"),
    (["keys", "list", "--keyring", "{d}"], "error: --keyring: {d}: is a directory"),
    (["keys", "list"], "Missing option '--keyring'"),
    # demo: all refused before the engine starts
    (["demo", "--requests", "1"], "error: --requests: must be >= 2 (got 1)"),
    (["demo", "--engine", "sglang"], "error: --engine: expected dynamo or direct (got 'sglang')"),
    (["demo", "--trace", "{d}/missing.jsonl"], "error: --trace: no file {d}/missing.jsonl"),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "http://x/y"], "error: --g4:"),
    # an S3 endpoint without an S3 G4 was accepted and ignored (review 2026-11-30)
    (["demo", "--trace", "{d}/trace.jsonl", "--endpoint-url", "http://127.0.0.1:8333"],
     "error: --endpoint-url needs --g4 s3://..."),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "file:///tmp/g4", "--endpoint-url", "http://127.0.0.1:8333"],
     "error: --endpoint-url needs --g4 s3://..."),
    # file:/abs and file://localhost/abs are g4.url's own forms (RFC 8089): accepted as file:///abs is (the
    # next check refuses), not "--g4: expected ..."; file:relative, mem:// and a bad bucket are refused up front
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "file:/tmp/g4", "--endpoint-url", "http://127.0.0.1:8333"],
     "error: --endpoint-url needs --g4 s3://..."),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "file://localhost/tmp/g4", "--endpoint-url", "http://127.0.0.1:8333"],
     "error: --endpoint-url needs --g4 s3://..."),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "file:relative"],
     "error: --g4: file URLs must be absolute, file:///path (got 'file:relative')"),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "mem://x"], "error: --g4: expected s3://BUCKET/PREFIX or file:///path"),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "s3://My_Bucket/p"], "error: --g4: s3:// URL: bucket 'My_Bucket'"),
    (["demo", "--trace", "{d}/trace.jsonl", "--workdir", "{d}/a-file"], "error: --workdir: {d}/a-file: is a file"),
    (["demo", "--trace", "{d}/not.json"], "error: --trace {d}/not.json line 1: not a Mooncake record"),
    (["demo", "--trace", "{d}/trace.jsonl", "--requests", "50"],
     "error: --requests 50: --trace {d}/trace.jsonl has only 0 multi-turn requests"),
    (["demo", "--trace", "{d}/trace.jsonl", "--workdir", "{d}/used-wd"],
     "error: --workdir {d}/used-wd: holds tier directories of an earlier run (g3-run)"),
    # numbers out of any sane range (issue 26 item 13): one line naming the flag, before any work
    (["layouts", "--tp", "100000"], "error: --tp: must be <= 1,024 (got 100,000)"),
    (["layouts", "--page-size", "1000000000"], "error: --page-size: must be <= 4,096 (got 1,000,000,000)"),
    (["bench", "--tier", "index", "--blocks", "1000000000000"],
     "error: --blocks: must be <= 100,000,000 (got 1,000,000,000,000)"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--blocks", "1000000000000"],
     "error: --blocks: 1,000,000,000,000 blocks need"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--page-size", "1000000000"],
     "error: --page-size: must be <= 4,096"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--threads", "100000"], "error: --threads:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "tiny", "--io-size", str(1 << 40)], "error: --io-size:"),
    (["bench", "--tier", "g3", "--path", "{d}/g3", "--layout", "deepseek-r1", "--tp", str(10 ** 18)], "error: --tp:"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1e300", "--simulate"],
     "error: --g3-capacity-gb: must be <= 10,000,000 (got 1e+300)"),
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1", "--page-size", "99999"],
     "error: --page-size: must be <= 4,096"),
    (["plan", "--synthetic", "--g3-capacity-gb", "1e300"], "error: --g3-capacity-gb: must be <= 10,000,000"),
    (["plan", "--synthetic", "--g4-capacity-gb", "0,1e300"], "error: --g4-capacity-gb: must be <= 10,000,000"),
    (["plan", "--synthetic", "--g3-capacity-gb", "1,inf"], "error: --g3-capacity-gb: must be a finite number"),
    (["plan", "--synthetic", "--seed", "-1"], "error: --seed: must be >= 0 (got -1)"),
    (["plan", "--synthetic", "--nodes", "1000000000"], "error: --nodes: must be <= 10,000"),
    (["plan", "--synthetic", "--workers-per-node", "1000000"], "error: --workers-per-node: must be <= 256"),
    (["plan", "--synthetic", "--tp", "100000"], "error: --tp: must be <= 1,024"),
    (["plan", "--synthetic", "--page-size", "100000"], "error: --page-size: must be <= 4,096"),
    (["plan", "--synthetic", "--system-prompt-tokens", "100000000000"], "error: --users: the synthetic trace"),
    (["plan", "--synthetic", "--users", "1000000000", "--turns", "1000"], "error: --users: the synthetic trace"),
    (["plan", "--synthetic", "--arrival-rate", "inf"], "error: --arrival-rate: must be a finite number"),
    (["gc", "--url", "file://{d}/store", "--target-gb", "1e300"], "error: --target-gb: must be <= 10,000,000"),
    (["doctor", "--config", '{"g3": {"capacity_gb": 1e300}}'], "error: g3.capacity_gb: Input should be less than"),
    (["doctor", "--config", '{"g3": {"capacity_gb": true}}'], "error: g3.capacity_gb: expected a number, not a bool"),
    (["doctor", "--config", '{"metrics": {"port": true}}'], "error: metrics.port: expected a number, not a boolean"),
    # output files: checked before the work, their directory never created (was: accepted, failed when written)
    (["plot", "{d}/bench.json", "--out", "{d}/nodir/x.png"],
     "error: --out: {d}/nodir/x.png: no directory {d}/nodir (create it first)"),
    (["plot", "{d}/bench.json", "--out", "{d}/dir.png"], "error: --out: {d}/dir.png: is a directory"),
    (["demo", "--trace", "{d}/trace.jsonl", "--json", "{d}/nodir/r.json"],
     "error: --json: {d}/nodir/r.json: no directory {d}/nodir"),
    (["demo", "--trace", "{d}/trace.jsonl", "--plot", "{d}/dir.png"], "error: --plot: {d}/dir.png: is a directory"),
    # doctor, unknown command
    (["doctor", "--config", "{d}/missing.yaml"], "error: config file {d}/missing.yaml: not found"),
    (["doctor", "--config", '{"g3": {"paths": [""]}}'], "error: g3.paths[0]: empty path"),
    (["no-such-command"], "No such command 'no-such-command'"),
]


@pytest.mark.parametrize("args,expect", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_cli_error_is_one_line_exit_2(files, args, expect):
    d = str(files)
    r = CliRunner().invoke(app, [a.replace("{d}", d) for a in args])
    out = r.output
    assert r.exit_code == 2, f"exit {r.exit_code}, exception {r.exception!r}\n{out}"
    assert "Traceback" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith("error: "), out
    assert expect.replace("{d}", d) in lines[0], out


def test_keys_rewrap_new_kek_file_problems_name_the_option(tmp_path, monkeypatch):
    """``keys rewrap --new-kek-file`` under a file, or naming a directory: one error line naming the option; in
    a missing directory the KEK file is created there (0700 directory, as ``keys create`` makes the keyring's).
    Before, the missing directory failed with ``[Errno 2] ... .new.kek.vm.<pid>....tmp``, an internal temp file."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kr = str(tmp_path / "kr.json")
    (tmp_path / "a-file").write_text("x")
    assert CliRunner().invoke(app, ["keys", "create", "--keyring", kr, "--tenant", "t"]).exit_code == 0
    for target, expect in ((tmp_path / "a-file" / "new.kek", f"error: --new-kek-file: {tmp_path}/a-file/new.kek: "
                                                              f"directory {tmp_path}/a-file: "),
                           (tmp_path, f"error: --new-kek-file: {tmp_path}: is a directory")):
        r = CliRunner().invoke(app, ["keys", "rewrap", "--keyring", kr, "--new-kek-file", str(target)])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(expect), r.output
    new = tmp_path / "nodir" / "sub" / "new.kek"
    r = CliRunner().invoke(app, ["keys", "rewrap", "--keyring", kr, "--new-kek-file", str(new), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["rewrapped_keys"] == 1
    assert new.stat().st_mode & 0o777 == 0o600 and new.parent.stat().st_mode & 0o777 == 0o700


def test_gc_and_bench_create_no_missing_path(tmp_path):
    """Issue 22 item 7: a mistyped path is refused (one line naming the flag, exit 2), not created."""
    for args in (["gc", "--url", f"file://{tmp_path / 'typo'}", "--max-age-s", "0"],
                 ["bench", "--tier", "g3", "--path", str(tmp_path / "typo"), "--layout", "tiny", "--blocks", "1"],
                 ["bench", "--tier", "g4", "--url", f"file://{tmp_path / 'typo'}", "--layout", "tiny", "--blocks", "1",
                  "--no-encrypt"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "no such directory" in r.output, (args, r.output)
        assert not (tmp_path / "typo").exists(), args


def test_a_failed_replay_leaves_no_run_directory(files, monkeypatch):
    """A real replay that fails after creating ``replay-<id>`` under --g3-path (here: buffers that cannot be
    allocated once the pool is open) removes it, as a finished one does."""
    import kvbm_backend.memory

    def no_memory(*a, **k):
        raise MemoryError("test: no buffers")
    monkeypatch.setattr(kvbm_backend.memory, "aligned_empty", no_memory)
    r = CliRunner().invoke(app, ["replay", "--trace", str(files / "trace.jsonl"), "--layout", "tiny", "--g3-path",
                                 str(files / "ok"), "--g3-capacity-gb", "0.01"])
    assert r.exit_code == 2 and "error: replay: out of memory (test: no buffers)" in r.output, r.output
    assert list((files / "ok").iterdir()) == []


def test_gc_zero_thresholds_are_explicit_not_errors(tmp_path):
    # 0 means "everything older than now" / "empty it", which an operator may mean; -1 never is
    (tmp_path / "store").mkdir()
    r = CliRunner().invoke(app, ["gc", "--url", f"file://{tmp_path / 'store'}", "--max-age-s", "0", "--target-gb",
                                 "0", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["deleted_objects"] == 0


def test_layouts_tp_not_dividing_some_presets_lists_the_rest():
    r = CliRunner().invoke(app, ["layouts", "--tp", "3", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert "not divisible by tp=3" in rows["qwen3-8b"]["error"]
    assert rows["deepseek-r1"]["bytes_per_block"] > 0  # MLA: replicated on every rank, any --tp


def test_layouts_lists_a_malformed_preset_file_with_its_error_and_the_rest(tmp_path, monkeypatch):
    """A broken preset under $KVBM_BACKEND_LAYOUTS (invalid TOML, a missing field) is an entry naming the
    file and what is wrong; every other preset is still listed (was: a traceback, nothing listed)."""
    import shutil
    d = tmp_path / "layouts"
    shutil.copytree(Path(__file__).resolve().parents[2] / "layouts", d)
    (d / "broken.toml").write_text("num_layers = [\n")
    (d / "partial.toml").write_text("num_layers = 2\n")
    monkeypatch.setenv("KVBM_BACKEND_LAYOUTS", str(d))
    r = CliRunner().invoke(app, ["layouts", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert "broken.toml" in rows["broken"]["error"] and "partial.toml" in rows["partial"]["error"]
    assert "missing field" in rows["partial"]["error"]
    assert rows["qwen3-8b"]["bytes_per_block"] > 0
    r = CliRunner().invoke(app, ["layouts"])
    assert r.exit_code == 0 and "broken" in r.output and "qwen3-8b" in r.output, r.output

def test_a_missing_presets_directory_is_one_line_naming_it_and_its_source(tmp_path, monkeypatch):
    """KVBM_BACKEND_LAYOUTS naming no directory: `layouts` and every --layout user fail with one line naming
    the directory and the variable, exit 2 (was: `layouts` printed {} with exit 0 and plan said
    "no preset 'llama-3.1-8b'; known:" with an empty list). A package without the repository's layouts/
    and no variable: the same, saying to set it."""
    nope = tmp_path / "nope"
    monkeypatch.setenv("KVBM_BACKEND_LAYOUTS", str(nope))
    why = f"presets directory {nope}: no such directory (set by KVBM_BACKEND_LAYOUTS)"
    for args, expect in ((["layouts", "--json"], f"error: {why}"),
                         (["plan", "--synthetic", "--users", "2", "--turns", "2"], f"error: --layout: {why}"),
                         (["replay", "--trace", "t.jsonl", "--simulate", "--g3-capacity-gb", "1"],
                          f"error: --layout: {why}")):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and r.output.strip().splitlines() == [expect], r.output
    monkeypatch.delenv("KVBM_BACKEND_LAYOUTS")
    import shutil
    site = tmp_path / "site"  # the package alone, as installed: no layouts/ two levels above it
    shutil.copytree(REPO / "kvbm_backend", site / "kvbm_backend", ignore=shutil.ignore_patterns("__pycache__"))
    e = {k: v for k, v in os.environ.items() if k != "KVBM_BACKEND_LAYOUTS"}
    e["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "layouts"], capture_output=True, text=True,
                       timeout=HANG_S, cwd=str(tmp_path), env=e)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: presets directory {site / 'layouts'}: no such directory (the repository's layouts/; set "
        "KVBM_BACKEND_LAYOUTS to the directory of preset .toml files)"], r.stderr


# --- hostile config inputs (issue 26 item 7), through the real entry point in a subprocess -------------

REPO = Path(__file__).resolve().parents[2]
MAX_OUT = 2500  # bytes: one error line naming the file/field, whatever the input expands to


def _cli_subprocess(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m kvbm_backend.apps.cli ARGS`` from the repo root; a generous timeout (it guards a hang,
    not speed: the old code took minutes and printed hundreds of MB for these inputs)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND__", "DYN_KVBM_"))}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], capture_output=True, text=True,
                          timeout=HANG_S, cwd=str(REPO), env=e)


def _assert_one_bounded_error_line(r: subprocess.CompletedProcess, expect: str) -> None:
    out = r.stdout + r.stderr
    assert len(out) < MAX_OUT, f"{len(out)} bytes of output: {out[:500]}"
    assert r.returncode == 2, out
    assert "Traceback" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert expect in lines[0], out


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _laughs(levels: int) -> str:
    """A YAML "billion laughs": each level is 9 aliases of the previous one (9**levels strings)."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


HOSTILE_FILES = [
    # (file name, text, the start of the error line; {f} is the file's path)
    ("laughs.yaml", _laughs(6), "error: config file {f}: line 1: YAML anchors and aliases (&name, *name) are not"),
    ("laughs-in-field.yaml", "x: &a [1, 2]\ng3:\n  paths: *a\n", "error: config file {f}: line 1: YAML anchors"),
    ("merge.yaml", "base: &b {capacity_gb: 2}\ng3:\n  <<: *b\n", "error: config file {f}: line 1: YAML anchors"),
    ("deep.yaml", f"g3:\n  paths: {_deep(5000)}\n", "error: config file {f}: line 2: nested deeper than 16 levels"),
    ("deep.toml", f"[g3]\npaths = {_deep(5000)}\n", "error: config file {f}: nested deeper than 16 levels"),
    ("deep.json", '{"g3": {"paths": ' + _deep(5000) + "}}", "error: config file {f}: nested deeper than 16 levels"),
    ("deep-500.json", '{"g3": {"paths": ' + _deep(500) + "}}", "error: config file {f}: nested deeper than 16"),
    # no aliases, no nesting, but values whose quoted repr alone would be megabytes
    ("big-list.yaml", "g3:\n  paths: [" + ",".join(["1"] * 200_000) + "]\n",
     "error: g3.paths[0]: Input should be a valid string (got 1); g3.paths[1]: "),
    ("big-key.json", json.dumps({"g3": {"x" * 1_000_000: ["y" * 1_000_000] * 10}}),
     "error: g3.xxxxxxxx"),
]


@pytest.mark.parametrize("name,text,expect", HOSTILE_FILES, ids=[h[0] for h in HOSTILE_FILES])
def test_hostile_config_file_is_one_bounded_line(tmp_path, name, text, expect):
    f = tmp_path / name
    f.write_text(text)
    r = _cli_subprocess("doctor", "--config", str(f))
    _assert_one_bounded_error_line(r, expect.replace("{f}", str(f)))
    assert r.stderr.startswith(expect.replace("{f}", str(f)))


def test_inline_json_nested_5000_deep_is_one_line():
    _assert_one_bounded_error_line(_cli_subprocess("doctor", "--config", '{"g3": {"paths": ' + _deep(5000) + "}}"),
                                   "error: inline JSON config: nested deeper than 16 levels")


def test_env_json_nested_5000_deep_is_one_line():
    r = _cli_subprocess("doctor", env={"KVBM_BACKEND__G3__PATHS": _deep(5000)})
    _assert_one_bounded_error_line(r, "error: KVBM_BACKEND__G3__PATHS: nested deeper than 16 levels")


def test_extra_config_dict_nested_deep_is_refused():
    # vLLM hands kv_connector_extra_config over as a parsed dict: nesting is refused there too
    from kvbm_backend.config import ConfigError, load_config
    deep: list = []
    cur = deep
    for _ in range(900):
        cur.append([])
        cur = cur[0]
    with pytest.raises(ConfigError, match=r"^config: nested deeper than 16 levels"):
        load_config({"g3": {"paths": deep}}, use_env=False)


# the cases of issue 26 item 13 through the real entry point (they were tracebacks, exit 1)
ISSUE_13 = [
    (["replay", "--trace", "{d}/trace.jsonl", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1e300"],
     "error: --g3-capacity-gb: must be <= 10,000,000 (got 1e+300)"),
    (["plan", "--synthetic", "--users", "2", "--turns", "2", "--g3-capacity-gb", "1e300"],
     "error: --g3-capacity-gb: must be <= 10,000,000 (got 1e+300)"),
    (["bench", "--tier", "index", "--blocks", "1000000000000"], "error: --blocks: must be <="),
    (["bench", "--tier", "g3", "--layout", "tiny", "--path", "{d}/g3", "--page-size", "1000000000"],
     "error: --page-size: must be <= 4,096"),
    (["doctor", "--config", '{"g3": {"capacity_gb": 1e300, "files_per_path": true}}'],
     "error: g3.capacity_gb: Input should be less than or equal to 10000000 (got 1e+300); g3.files_per_path: "
     "expected a number, not a boolean (got True)"),
]


@pytest.mark.parametrize("args,expect", ISSUE_13, ids=[" ".join(a)[:50] for a, _ in ISSUE_13])
def test_absurd_numbers_through_the_entry_point(files, args, expect):
    d = str(files)
    _assert_one_bounded_error_line(_cli_subprocess(*[a.replace("{d}", d) for a in args]), expect.replace("{d}", d))


# --- help text (issue 22 item 10) --------------------------------------------------------------------

def _commands(group, path=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group (typer vendors click: no isinstance on click's classes)
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_every_flag_has_help_and_help_is_plain_text():
    import re

    import typer.main
    group = typer.main.get_command(app)
    cmds = list(_commands(group))
    assert {("bench",), ("replay",), ("plan",), ("doctor",), ("layouts",), ("gc",), ("keys", "create")} <= {
        p for p, _ in cmds}
    for path, cmd in cmds:
        for p in cmd.params:
            if p.param_type_name == "option":
                assert p.help, f"{' '.join(path)} {p.opts[0]}: no help"
        r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert not re.search(r"``|:(class|func|mod|meth|data):|`[^`\s]+`", r.output), (path, r.output)


@pytest.mark.parametrize("src,hint", [({"g3": {"capcity_gb": 1}}, "did you mean 'capacity_gb'?"),
                                      ({"g4": {"keyring": {"pth": "x"}}}, "did you mean 'path'?"),
                                      ({"gg3": {}}, "did you mean 'g3'?"),
                                      ({"g3": {"admission": {"polcy": "all"}}}, "did you mean 'policy'?")])
def test_unknown_config_key_did_you_mean(src, hint):
    r = CliRunner().invoke(app, ["doctor", "--config", json.dumps(src)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "Extra inputs are not permitted; " + hint in lines[0], r.output
    r = CliRunner().invoke(app, ["doctor", "--config", json.dumps({"g3": {"zzzzzz": 1}})])
    assert "did you mean" not in r.output and "g3.zzzzzz: Extra inputs are not permitted (got 1)" in r.output
