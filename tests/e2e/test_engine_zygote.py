"""The tests' engine zygote (:mod:`tests.helpers.engine_zygote`): an engine forked from it is the engine a new
interpreter runs (same greedy outputs, G3 blocks saved by one loaded by the next), and a run that hangs is
killed with its whole process group at ``run_engine``'s hang guard while the zygote serves the next run; a change of
the test process's environment starts a new zygote with it."""
from __future__ import annotations

import os

import pytest

from tests.helpers import vllm_runner
from tests.helpers.vllm_runner import connector_extra, prompts, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY, write_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(900)]
_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

KW = dict(dtype="float32", num_gpu_blocks=48)


def test_forked_and_new_interpreter_engines_agree_and_a_hung_run_is_killed(tmp_path, monkeypatch):
    model = write_model_dir(tmp_path / "model", TINY, dtype="float32")
    ps = prompts(2, 200, seed=3)
    extra = {"extra": connector_extra(tmp_path / "w")}
    a = run_engine(tmp_path, "forked", model, ps, extra, **KW)
    z = vllm_runner._zygote_state.get("z")
    assert z is not None and z.alive(), vllm_runner._zygote_state
    assert (tmp_path / "forked.log").is_file()  # only a forked run writes its output there
    assert a["connector_stats"].get("g3_put_written_blocks", 0) >= 12, a["connector_stats"]
    # VLLM_LOGGING_LEVEL is read when vLLM is imported: the zygote cannot honour it, a new interpreter runs
    b = run_engine(tmp_path, "interpreter", model, ps, extra, env={"VLLM_LOGGING_LEVEL": "INFO"}, **KW)
    assert not (tmp_path / "interpreter.log").exists()
    assert b["outputs"] == a["outputs"]
    assert b["cached_tokens"] == [192, 192], b["cached_tokens"]  # loaded from the G3 the forked engine wrote
    assert "INFO" in b["log"]

    # a run that never ends (paused before its first prompt, never resumed) meets the hang guard
    with pytest.raises(RuntimeError, match="hang guard"):
        run_engine(tmp_path, "hung", model, ps, extra, timeout=5, pause_before=[0],
                   pause_dir=str(tmp_path), pause_max_s=3600, **KW)
    with pytest.raises(ProcessLookupError):
        os.killpg(z.last_pid, 0)  # the engine and everything in its session are gone
    c = run_engine(tmp_path, "after", model, ps, extra, **KW)
    assert vllm_runner._zygote_state["z"] is z and (tmp_path / "after.log").is_file()
    assert c["outputs"] == a["outputs"] and c["cached_tokens"] == [192, 192]

    # this process's environment changes (as importing vLLM here changes it): a new zygote, started with it,
    # forks the next engine (in CI the old zygote's runs went to new interpreters for good, 2026-11-28)
    monkeypatch.setenv("KVBM_TEST_ZYGOTE_IMPORT_ENV", "x")  # ours: read late, the zygote stays
    run_engine(tmp_path, "lazy-env", model, ps, extra, **KW)
    assert vllm_runner._zygote_state["z"] is z and (tmp_path / "lazy-env.log").is_file()
    monkeypatch.setenv("TEST_ZYGOTE_IMPORT_ENV", "x")  # anything else may be read at import
    d = run_engine(tmp_path, "new-env", model, ps, extra, **KW)
    z2 = vllm_runner._zygote_state["z"]
    assert z2 is not z and z2.alive() and not z.alive() and (tmp_path / "new-env.log").is_file()
    assert d["outputs"] == a["outputs"] and d["cached_tokens"] == [192, 192]
