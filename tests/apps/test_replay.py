"""``replay``: hits equal what prefix reuse in the trace allows (computed here independently, from the
trace's hash ids alone, with a plain set), and a capacity limit gives fewer hits with evictions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm_backend.model import frame
from kvbm_backend.model.presets import load_preset
from kvbm_backend.apps.replay import run_replay

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
LIMIT = 80  # the first 40 requests of this trace share no prefix; 80 give ~3,000 hits
PS = 16

pytestmark = pytest.mark.skipif(not TRACE.is_file(), reason=f"trace {TRACE} not present")


def independent_hits(limit: int, page_size: int) -> tuple[int, int]:
    """Page j of a request is identified by the trace ids covering it (all ids up to its 512-token
    block) and its index: equal ids at equal positions give equal tokens. No hashing involved."""
    seen: set = set()
    lookups = hits = 0
    with open(TRACE) as f:
        for n, line in enumerate(f):
            if n >= limit:
                break
            r = json.loads(line)
            ids = r["hash_ids"]
            pages = [(tuple(ids[:(j * page_size) // 512 + 1]), j) for j in range(r["input_length"] // page_size)]
            lookups += len(pages)
            h = 0
            for p in pages:
                if p not in seen:
                    break
                h += 1
            hits += h
            seen.update(pages)
    return lookups, hits


@pytest.fixture(scope="module")
def expected():
    return independent_hits(LIMIT, PS)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A 1-layer, 1-KV-head, head-dim-16 preset (1 KiB blocks at 16 tokens) so real-byte replays stay
    light on 2 cores; the model's geometry does not change which blocks hit."""
    p = tmp_path_factory.mktemp("layouts") / "micro.toml"
    p.write_text('name = "micro"\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 16\ndtype = "bfloat16"\n'
                 'mla = false\nbytes_per_token = 64\n')
    return str(p)


def test_admit_all_ample_capacity_exact(tmp_path, expected, micro):
    lookups, hits = expected
    assert hits > 0
    r = run_replay(str(TRACE), micro, PS, str(tmp_path), 10.0, admit_all=True, limit=LIMIT)
    assert r["requests"] == LIMIT and r["lookup_blocks"] == lookups
    assert r["hit_blocks"] == hits
    assert r["evictions"] == 0 and r["offloads_dropped"] == 0 and r["corrupt_blocks"] == 0
    bb = load_preset(micro).layout(PS).bytes_per_block
    assert r["prefill_tokens_saved"] == hits * PS and r["bytes_read"] == hits * frame.slot_bytes(bb)
    assert r["bytes_written"] > 0 and r["hit_rate"] == pytest.approx(hits / lookups)
    assert list(tmp_path.iterdir()) == []  # the run directory is removed
    s = run_replay(str(TRACE), "tiny", PS, None, 10.0, admit_all=True, limit=LIMIT, simulate=True)
    assert s["hit_blocks"] == hits and s["evictions"] == 0


def test_small_capacity_fewer_hits_and_evictions(tmp_path, expected, micro):
    _, hits = expected
    cap = 5000 * 8192 / 1e9  # 5,000 micro slots (4 KiB header + 1 KiB payload padded to 4 KiB)
    r = run_replay(str(TRACE), micro, PS, str(tmp_path), cap, admit_all=True, limit=LIMIT)
    assert r["hit_blocks"] < hits and r["evictions"] > 0
    s = run_replay(str(TRACE), micro, PS, None, cap, admit_all=True, limit=LIMIT, simulate=True)
    assert s["hit_blocks"] < hits and s["evictions"] > 0


def test_default_admission_and_cli(tmp_path, expected):
    _, hits = expected
    p = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "replay", "--trace", str(TRACE),
                        "--layout", "tiny", "--g3-path", str(tmp_path), "--g3-capacity-gb", "1", "--limit", str(LIMIT),
                        "--simulate", "--json"], capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for k in ("requests", "lookup_blocks", "hit_blocks", "hit_rate", "bytes_written", "bytes_read",
              "prefill_tokens_saved", "offloads_dropped", "evictions"):
        assert k in r
    assert r["admission"] == "frequency" and r["hit_blocks"] <= hits


def test_bad_trace_errors(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"input_length": 10}\n')
    with pytest.raises(ValueError, match="line 1"):
        run_replay(str(bad), "tiny", PS, str(tmp_path), 1.0, simulate=True)
    with pytest.raises(ValueError, match="no file"):
        run_replay(str(tmp_path / "nope"), "tiny", PS, str(tmp_path), 1.0)


def test_simulate_needs_no_g3_path_and_real_mode_removes_the_directories_it_made(tmp_path, micro):
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    base = ["replay", "--trace", str(TRACE), "--layout", "tiny", "--g3-capacity-gb", "1", "--limit", "3", "--json"]
    res = CliRunner().invoke(app, base + ["--simulate"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["requests"] == 3
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 2 and res.output.strip() == "error: --g3-path: a directory is needed unless --simulate"
    (tmp_path / "keep").mkdir()
    r = run_replay(str(TRACE), micro, PS, str(tmp_path / "new" / "g3"), 0.01, admit_all=True, limit=3)
    assert r["bytes_written"] > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    r = run_replay(str(TRACE), micro, PS, str(tmp_path / "keep"), 0.01, admit_all=True, limit=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"] and list((tmp_path / "keep").iterdir()) == []


def test_sigterm_removes_the_run_directory(tmp_path):
    """A real replay stopped by SIGTERM (what a job runner sends) removes its capacity-sized run directory and
    the directory it made for --g3-path, as Ctrl-C does. Hang guards only."""
    from tests.helpers.sigterm import sigterm_when
    g3 = tmp_path / "made" / "g3"
    rc, out, err = sigterm_when([sys.executable, "-m", "kvbm_backend.apps.cli", "replay", "--trace", str(TRACE),
                                 "--layout", "tiny", "--g3-path", str(g3), "--g3-capacity-gb", "2", "--admit-all",
                                 "--json"],
                                lambda: g3.is_dir() and any(g3.glob("replay-*/*")),  # the pool has opened its files
                                "no run directory", HANG_S)
    assert rc != 0 and out == "", err  # interrupted, not finished
    assert not (tmp_path / "made").exists(), list(g3.rglob("*"))


def _replay_cli(*args: str):
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    return CliRunner().invoke(app, ["replay", *args])


def test_a_hybrid_layout_is_warned_about_as_plan_does(tmp_path):
    """replay sizes every layer of a sliding-window preset for every token, as plan does: its result holds
    the same kind of ``warnings`` entry (and a ``warning:`` line on stderr); a dense layout has neither.
    Before: no key, nothing on stderr."""
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n' * 2)
    r = _replay_cli("--trace", str(t), "--simulate", "--g3-capacity-gb", "10", "--layout", "gpt-oss-20b", "--json")
    assert r.exit_code == 0 and "warnings" in json.loads(r.stdout), r.output
    from kvbm_backend.apps.replay import hybrid_warning  # plan's text, naming replay
    want = hybrid_warning(load_preset("gpt-oss-20b"), "replay")
    assert want.startswith("gpt-oss-20b is a hybrid model (") and "replay sizes it as if every layer" in want
    assert json.loads(r.stdout)["warnings"] == [want]
    assert " ".join(r.stderr.split()) == f"warning: {want}"
    r = _replay_cli("--trace", str(t), "--simulate", "--g3-capacity-gb", "10", "--layout", "gpt-oss-20b")
    assert r.exit_code == 0 and "warning: gpt-oss-20b" in r.stderr and "hit_rate" in r.stdout, r.output
    r = _replay_cli("--trace", str(t), "--simulate", "--g3-capacity-gb", "10", "--layout", "tiny", "--json")
    assert r.exit_code == 0 and "warnings" not in json.loads(r.stdout) and r.stderr == "", r.output


@pytest.mark.parametrize("record,expect", [
    ('"input_length": 512, "hash_ids": [1.2]', "hash_ids must be integers >= 0, got 1.2"),
    ('"input_length": 512, "hash_ids": [true]', "hash_ids must be integers >= 0, got True"),
    ('"input_length": 512, "hash_ids": ["7"]', "hash_ids must be integers >= 0, got '7'"),
    ('"input_length": 512, "hash_ids": "12"', "hash_ids must be a list of integers, got '12'"),
    ('"input_length": 512.0, "hash_ids": [1]', "input_length must be an integer, got 512.0"),
    ('"input_length": true, "hash_ids": [1]', "input_length must be an integer, got True"),
])
def test_non_integer_trace_fields_are_refused_not_truncated(tmp_path, record, expect):
    """hash_ids and input_length must be JSON integers: a float, boolean or string is a `--trace FILE line N`
    error in replay and plan. Before: int() truncated them, so ids 1.2 and 1.7 were the same block (the
    second request of the trace below hit every page of the first), and "12" was the ids 1 and 2."""
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n{"timestamp": 1, %s}\n' % record)
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    for cmd in (["replay", "--simulate"], ["plan"]):
        r = CliRunner().invoke(app, cmd + ["--trace", str(t), "--layout", "tiny", "--g3-capacity-gb", "1",
                                           "--admit-all", "--json"])
        assert r.exit_code == 2 and r.output.strip().splitlines() == [f"error: --trace {t} line 2: {expect}"], \
            (cmd, r.output)
    if "1.2" not in record:
        return
    t.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1.2]}\n'
                 '{"timestamp": 1, "input_length": 512, "hash_ids": [1.7]}\n')  # the reviewer's trace: was 32/64 hits
    r = _replay_cli("--trace", str(t), "--simulate", "--admit-all", "--g3-capacity-gb", "1", "--json")
    assert r.exit_code == 2 and r.output.strip() == f"error: --trace {t} line 1: hash_ids must be integers >= 0, got 1.2"
