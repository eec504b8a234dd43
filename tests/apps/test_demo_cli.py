"""``kvbm-backend demo`` around its engines: the real CLI and ``run_demo`` with ``_run_engines`` swapped for a
stub that returns chosen outputs and TTFTs at once (no vLLM engine starts; the tiny model keeps the model
directory small and ``vllm_version`` is stubbed so vLLM is not imported). What is checked: the exit status
and the JSON's ``ok``, the workdir rules, the wording of the TTFT ratios, the dtype recorded, the plot's
labels, the clean-up of the demo's own temporary directory, and (with a stand-in process) each engine's
start-up and serving timeouts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvbm_backend.apps.demo as demo
from kvbm_backend.apps.cli import app
from kvbm_backend.apps.engine_model import TINY


def _trace(path: Path) -> Path:
    """Three conversations of three turns (each extends the last), interleaved: 4 requests at the CLI's
    defaults (64 tokens per trace block; turns of >= 256 scaled tokens)."""
    rows = []
    for turn in range(3):
        for conv in range(3):
            ids = [1000 * conv + k for k in range(5 + 2 * turn)]
            rows.append({"timestamp": 100 * len(rows), "input_length": 512 * len(ids), "output_length": 4,
                         "hash_ids": ids})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


class FakeEngines:
    """Stands in for ``demo._run_engines``: every config answers ``[1, 2, 3, 4]`` in ``ttft`` seconds, except
    the configs named in ``differ`` (a different first output) and ``ttft`` overrides per config."""

    def __init__(self):
        self.differ: set[str] = set()
        self.ttft: dict[str, float] = {}
        self.calls = 0
        self.raise_: BaseException | None = None
        self.workdirs: list[Path] = []
        self.dtypes: dict[str, str | None] = {}

    def __call__(self, runs, workdir, env_extra, progress, tasks, phases=None):
        self.calls += 1
        self.workdirs.append(Path(workdir))
        self.runs = list(runs)
        if self.raise_ is not None:
            raise self.raise_
        out = {}
        for name, spec in runs:
            self.dtypes[name] = spec.get("dtype")
            n = len(spec["prompts"])
            outs = [[1, 2, 3, 4]] * n
            if name in self.differ:
                outs = [[9, 9, 9, 9]] + outs[1:]
            out[name] = {"outputs": outs, "ttft_s": [self.ttft.get(name, 1.0)] * n,
                         "prompt_tokens": [len(p) for p in spec["prompts"]], "cached_tokens": [0] * n, "init_s": 1.0}
        return out


@pytest.fixture()
def fake(monkeypatch, tmp_path):
    import kvbm_backend.integrations.vllm.engine_run as engine_run
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engine_run, "vllm_version", lambda: "0.test")
    monkeypatch.setattr(demo, "DEMO", TINY)
    f = FakeEngines()
    monkeypatch.setattr(demo, "_run_engines", f)
    _trace(tmp_path / "t.jsonl")
    return f


def _cli(tmp_path, *extra):
    args = ["demo", "--engine", "direct", "--trace", str(tmp_path / "t.jsonl"), "--requests", "4",
            "--json", str(tmp_path / "demo.json"), "--plot", "", *extra]
    return CliRunner().invoke(app, args)


def test_outputs_that_differ_exit_1_with_ok_false_after_writing_the_json(fake, tmp_path):
    fake.differ = {"native_tiers"}
    r = _cli(tmp_path)
    assert r.exit_code == 1, (r.exit_code, r.exception, r.output[-2000:])
    data = json.loads((tmp_path / "demo.json").read_text())  # written before the exit
    assert data["ok"] is False
    assert data["configs"]["native_tiers"]["outputs_identical"] is False
    assert "OUTPUTS DIFFER" in r.output and "native_tiers" in r.output.split("OUTPUTS DIFFER")[1]


def test_identical_outputs_exit_0_with_ok_true(fake, tmp_path):
    r = _cli(tmp_path)
    assert r.exit_code == 0, (r.exit_code, r.exception, r.output[-2000:])
    assert json.loads((tmp_path / "demo.json").read_text())["ok"] is True


@pytest.mark.parametrize("leftover", ["g3-run", "g3-restart", "g4", "g3-native", "g4-native", "vllm-fs"])
def test_a_workdir_holding_an_earlier_runs_tiers_is_refused_and_kept(fake, tmp_path, leftover):
    wd = tmp_path / "wd"
    (wd / leftover).mkdir(parents=True)
    (wd / leftover / "block.slab").write_bytes(b"earlier run")
    with pytest.raises(ValueError, match=f"--workdir {wd}: holds tier directories of an earlier run \\({leftover}\\)"):
        demo.run_demo(json_path=str(tmp_path / "demo.json"), plot=None, trace=str(tmp_path / "t.jsonl"), requests=4,
                      workdir=str(wd), model=TINY, engine="direct")
    assert fake.calls == 0  # refused before any engine
    assert (wd / leftover / "block.slab").read_bytes() == b"earlier run"  # never deleted
    assert not (tmp_path / "demo.json").exists()


def test_a_fresh_or_unrelated_workdir_is_used(fake, tmp_path):
    wd = tmp_path / "wd"
    (wd / "notes").mkdir(parents=True)  # other things in it are fine
    res = demo.run_demo(json_path=None, plot=None, trace=str(tmp_path / "t.jsonl"), requests=4, workdir=str(wd),
                        model=TINY, engine="direct")
    assert res["ok"] and fake.workdirs == [wd] and (wd / "notes").is_dir()


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), RuntimeError("demo: engine kvbm_backend failed")])
def test_a_failed_or_interrupted_demo_removes_its_own_temp_dir(fake, tmp_path, monkeypatch, failure):
    import tempfile
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where mkdtemp puts the demo's workdir
    fake.raise_ = failure
    with pytest.raises(type(failure)):
        demo.run_demo(json_path=None, plot=None, trace=str(tmp_path / "t.jsonl"), requests=4, model=TINY,
                      engine="direct")
    assert fake.workdirs and fake.workdirs[0].parent == tmp_path / "tmp"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_keep_workdir_keeps_it_and_says_where_on_stderr(fake, tmp_path, monkeypatch, capsys):
    import tempfile
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    fake.raise_ = RuntimeError("demo: engine restart failed")
    with pytest.raises(RuntimeError):
        demo.run_demo(json_path=None, plot=None, trace=str(tmp_path / "t.jsonl"), requests=4, model=TINY,
                      engine="direct", keep_workdir=True)
    wd = fake.workdirs[0]
    assert wd.is_dir() and (wd / "model").is_dir()
    assert f"workdir kept: {wd}" in capsys.readouterr().err


def test_ttft_ratios_say_lower_or_higher(fake, tmp_path):
    fake.ttft = {"baseline": 1.0, "kvbm_backend": 0.4, "native_tiers": 2.0}  # 2.5x faster, 2x slower
    r = _cli(tmp_path)
    assert r.exit_code == 0, r.output[-2000:]
    line = " ".join(r.output.split()).split("storage vs recompute")[1].split("all greedy outputs")[0]
    assert "kvbm_backend 2.5x lower" in line and "native_tiers 2.0x higher" in line and "restart 1.0x lower" in line
    assert "below" not in line
    ratios = json.loads((tmp_path / "demo.json").read_text())["storage_vs_recompute_p50"]["in_process"]
    assert ratios["native_tiers"] == pytest.approx(0.5)  # the JSON keeps baseline p50 / config p50


def test_the_json_records_the_dtype_the_engines_ran(fake, tmp_path):
    assert _cli(tmp_path).exit_code == 0
    data = json.loads((tmp_path / "demo.json").read_text())
    assert set(fake.dtypes.values()) == {"float32"}  # every engine's spec
    assert data["model"]["torch_dtype"] == "float32"


def test_the_plot_marks_the_baseline_reference_not_equal_to_itself(fake, tmp_path, monkeypatch):
    from matplotlib.axes import Axes
    labels: list[str] = []
    real = Axes.annotate

    def record(self, text, *a, **k):
        labels.append(text)
        return real(self, text, *a, **k)
    monkeypatch.setattr(Axes, "annotate", record)
    fake.differ = {"native_tiers"}
    res = demo.run_demo(json_path=None, plot=str(tmp_path / "demo.png"), trace=str(tmp_path / "t.jsonl"),
                        requests=4, model=TINY, engine="direct")
    names = list(res["configs"])
    assert names[0] == "baseline" and (tmp_path / "demo.png").stat().st_size > 0
    assert labels[:len(names)] == ["reference", "outputs = baseline", "outputs = baseline", "outputs = baseline",
                                   "OUTPUTS DIFFER"]


class _Proc:
    """A stand-in engine process: running for ``polls`` polls, then exits 0 (``None``: runs until killed)."""

    def __init__(self, polls: int | None):
        self.polls, self.returncode, self.killed = polls, None, False

    def poll(self):
        if self.returncode is None and self.polls is not None:
            if self.polls <= 0:
                self.returncode = 0
            self.polls -= 1
        return self.returncode

    def kill(self):
        self.killed, self.returncode = True, -9


def _handle(tmp_path: Path, proc: _Proc, started_s_ago: float, loaded: bool = True) -> dict:
    import time
    spec = {"pause_dir": str(tmp_path / "e.pause"), "progress_file": str(tmp_path / "e.progress"),
            "out": str(tmp_path / "e.result.json"), "prompts": [[1]]}
    (tmp_path / "e.pause").mkdir(parents=True)
    if loaded:
        (tmp_path / "e.pause" / "paused-0").write_text("1")
    (tmp_path / "e.progress").write_text("")
    (tmp_path / "e.result.json").write_text('{"served": true}')
    return {"name": "restart", "proc": proc, "spec": spec, "log": tmp_path / "e.log", "t0": time.monotonic() - started_s_ago}


def test_serving_timeout_counts_from_the_engines_own_turn(tmp_path):
    """An engine that loaded 1000 s ago and waited while the others served is not past its 900 s: its serving
    time counts from its resume. Its serving and its start-up are each still bounded."""
    from kvbm_backend.apps.demo_engines import _serve_engine, _wait_loaded
    h = _handle(tmp_path / "a", _Proc(polls=2), started_s_ago=1000.0)
    assert _serve_engine(h, timeout_s=900) == {"served": True}
    assert (tmp_path / "a" / "e.pause" / "resume-0").exists()
    h = _handle(tmp_path / "b", _Proc(polls=None), started_s_ago=0.0)
    with pytest.raises(RuntimeError, match="engine restart: serving its requests ran past 0.3 s"):
        _serve_engine(h, timeout_s=0.3)
    assert h["proc"].killed
    h = _handle(tmp_path / "c", _Proc(polls=None), started_s_ago=1000.0, loaded=False)
    with pytest.raises(RuntimeError, match=r"engine restart: start-up \(load and warm-up\) ran past 900 s"):
        _wait_loaded(h, 900)
    assert h["proc"].killed


def test_each_run_keeps_its_g4_blocks_under_its_own_prefix_of_the_users_store(fake, tmp_path, capsys):
    """Two runs with the same --g4 store: each config of a run reads and writes one sub-prefix of it, a new one per
    run (the second run's cold configs must not find the first run's blocks), reported in the JSON and on stderr
    with the command that removes it."""
    store = tmp_path / "shared-g4"
    store.mkdir()
    seen = []
    for _ in range(2):
        res = demo.run_demo(json_path=None, plot=None, trace=str(tmp_path / "t.jsonl"), requests=4,
                            g4=f"file://{store}/", model=TINY, engine="direct")
        assert res["ok"]
        runs = [spec for _, spec in fake.runs]
        urls = {spec["connector"]["extra"]["kvbm_backend"]["g4"]["url"] for spec in runs if spec.get("connector")}
        native = {t["g4"]["url"] for spec in runs if spec.get("native")
                  for t in spec["native"]["secondary_tiers"] if "g4" in t}
        assert urls == {res["g4_url"]} and native == {res["g4_url"] + "-native"}, (urls, native)
        assert res["g4_url"].startswith(f"file://{store}/kvbm-demo-")
        err = " ".join(capsys.readouterr().err.split())
        for u in (res["g4_url"], res["g4_url"] + "-native"):
            assert f"kvbm-backend gc --url {u} --max-age-s 0" in err, err[-2000:]
        seen.append(res["g4_url"])
    assert seen[0] != seen[1]
