"""Operator mistakes on the command line (issue 10): every one is a single ``error:`` line on stderr that
names the argument, exit code 2, and no traceback. Runs the CLI in-process (typer's CliRunner), like
``tests/integration/test_bench_cli.py``; the commands here all fail before any I/O beyond a stat."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app


@pytest.fixture()
def files(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    (tmp_path / "not.json").write_text("not json {")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "bench.json").write_text(json.dumps({"write_gbps": 1.0, "baseline_write_gbps": 1.0}))
    (tmp_path / "trace.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1,
                                                      "hash_ids": [1]}) + "\n")
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
    # replay
    (["replay", "--layout", "tiny", "--g3-path", "{d}/g3", "--g3-capacity-gb", "1"], "Missing option '--trace'"),
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
    (["gc", "--url", "ftp://host/x", "--max-age-s", "5"], "error: --url: 'ftp://host/x': scheme 'ftp' not supported"),
    (["gc", "--url", "s3://bkt/p", "--endpoint-url", "not-a-url", "--max-age-s", "5"], "error: --endpoint-url:"),
    (["gc", "--url", "file://{d}/store", "--max-age-s", "soon"], "'--max-age-s'"),
    # keys
    (["keys", "create", "--keyring", "{d}/a-file/kr.json", "--tenant", "t"], "error: --keyring: {d}/a-file/kr.json"),
    (["keys", "list", "--keyring", "{d}"], "error: --keyring: {d}: is a directory"),
    (["keys", "list"], "Missing option '--keyring'"),
    # demo: all refused before the engine starts
    (["demo", "--requests", "1"], "error: --requests: must be >= 2 (got 1)"),
    (["demo", "--engine", "sglang"], "error: --engine: expected dynamo or direct (got 'sglang')"),
    (["demo", "--trace", "{d}/missing.jsonl"], "error: --trace: no file {d}/missing.jsonl"),
    (["demo", "--trace", "{d}/trace.jsonl", "--g4", "http://x/y"], "error: --g4:"),
    (["demo", "--trace", "{d}/trace.jsonl", "--workdir", "{d}/a-file"], "error: --workdir: {d}/a-file: is a file"),
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
