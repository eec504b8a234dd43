"""``load_gil_switch_ms``: while a load is in flight the interpreter's thread switch interval is shortened,
so the loading threads get the GIL back sooner from an engine's step loop
(:mod:`kvbm_backend.integrations.load_priority`; the throughput it buys is measured by
``python -m kvbm_backend.apps.bench.g4_load --engine-busy 1.0``, not timed here)."""
from __future__ import annotations

import sys
import time

import pytest
import torch

from kvbm_backend.config import load_config
from kvbm_backend.integrations import load_priority
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.integrations.vllm.kv_io import EngineKv
from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
from kvbm_backend.integrations.vllm.worker_side import WorkerSide
from kvbm_backend.model.namespace import Namespace

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a flush, a load in flight, its end); returns as soon as it does

NB, BS, H, D, L = 16, 16, 2, 64, 2
DEFAULT_S = 0.005  # CPython's own switch interval


@pytest.fixture(autouse=True)
def _interpreter_default():
    """Each test starts from CPython's interval with nothing configured, and leaves it so."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT_S)
    load_priority.configure(None)
    try:
        yield
    finally:
        load_priority.configure(None)
        sys.setswitchinterval(old)


def _cfg(tmp_path, **top):
    return load_config({"model": "m", "g3": {"enabled": False},
                        "g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "timeout_s": 30, "retries": 0,
                               "keyring": {"path": str(tmp_path / "kr.json")}}, **top}, use_env=False)


def _engine():
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(2, NB, BS, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    return EngineKv.from_tensors(ts, NB, BS, H, D)


def _held_g4_load(tmp_path, cfg, during):
    """Open the tiers of ``cfg`` (the public wiring: ``open_tiers`` configures the interval), save three blocks
    to G4 through a worker, then load them while their object opens are held in the kernel (as on a hung
    mount): ``during()`` runs while the load is in flight. Returns once the load ended, with its errors."""
    from tests.helpers.held_open import HeldOpen
    kv = _engine()
    ns = Namespace(model="test/load-priority", revision="r1", layout=kv.layout, tp_world_size=1)
    g3, g4 = open_tiers(cfg, ns)
    assert g3 is None and g4 is not None
    w = WorkerSide(ns, 0, None, g4, load_timeout_s=60)
    try:
        w.register(kv)
        seqs = [11, 12, 13]
        w.save([SaveJob("s", [1, 2, 3], seqs, "acme")])
        assert g4.flush(timeout=HANG_S)
        held = HeldOpen([g4.store._path(g4.object_name(k)) for k in w.offloads.g4_keys(ns.keys(seqs, "acme", 0))])
        try:
            w.start_loads([LoadJob("r", [4, 5, 6], seqs, ["G4"] * 3, "acme")])
            end = time.monotonic() + HANG_S
            while load_priority.stats()["loads_in_flight"] == 0 and time.monotonic() < end:
                time.sleep(0.005)
            during()
        finally:
            held.release()
        end = time.monotonic() + HANG_S
        while "r" not in w.get_finished():
            assert time.monotonic() < end, "the load never ended"
            time.sleep(0.01)
        return w.load_errors()
    finally:
        w.shutdown()
        g4.close()


def test_the_interval_is_shortened_while_a_worker_load_is_in_flight_and_restored_after(tmp_path):
    seen = {}
    errs = _held_g4_load(tmp_path, _cfg(tmp_path, load_gil_switch_ms=0.25),
                         lambda: seen.update(iv=sys.getswitchinterval(), st=load_priority.stats()))
    assert errs == set()  # the held opens answered once released: every block loaded
    assert seen["iv"] == pytest.approx(0.00025) and seen["st"]["loads_in_flight"] == 1, seen
    assert seen["st"]["load_gil_switch_ms"] == pytest.approx(0.25)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)  # restored when the load ended
    st = load_priority.stats()
    assert st["loads_in_flight"] == 0 and st["loads_prioritized"] >= 1


def test_the_default_shortens_it_and_null_leaves_the_interpreter_alone(tmp_path):
    assert load_config({}, use_env=False).load_gil_switch_ms == 0.5
    seen = {}
    _held_g4_load(tmp_path / "default", _cfg(tmp_path / "default"),
                  lambda: seen.update(default=sys.getswitchinterval()))
    _held_g4_load(tmp_path / "off", _cfg(tmp_path / "off", load_gil_switch_ms=None),
                  lambda: seen.update(off=sys.getswitchinterval()))
    assert seen == {"default": pytest.approx(0.0005), "off": pytest.approx(DEFAULT_S)}, seen


def test_overlapping_loads_restore_once_the_last_ends_and_never_lengthen_or_undo_anothers_interval():
    load_priority.configure(0.5)
    load_priority.hold()
    load_priority.hold()  # two loads in flight
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    load_priority.release()
    assert sys.getswitchinterval() == pytest.approx(0.0005)  # one still loading
    load_priority.release()
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    sys.setswitchinterval(0.0001)  # the engine's own, shorter: kept
    with load_priority.loading():
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    sys.setswitchinterval(DEFAULT_S)
    with load_priority.loading():
        sys.setswitchinterval(0.002)  # someone else changed it during the load: left as they set it
    assert sys.getswitchinterval() == pytest.approx(0.002)
    sys.setswitchinterval(DEFAULT_S)
    load_priority.configure(0.5)
    with load_priority.loading():  # tiers opened with the setting off while a load runs: still restored after
        load_priority.configure(None)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    with pytest.raises(RuntimeError, match="without hold"):
        load_priority.release()
    with pytest.raises(ValueError, match="load_gil_switch_ms"):
        load_priority.configure(0)


def test_the_field_is_validated_and_named_in_the_startup_line(tmp_path):
    from kvbm_backend.config import ConfigError
    from kvbm_backend.integrations.tiers import startup_line
    with pytest.raises(ConfigError, match="load_gil_switch_ms"):
        load_config({"load_gil_switch_ms": 0}, use_env=False)
    assert "load_gil_switch_ms=0.5" in startup_line(load_config({}, use_env=False))
    assert "load_gil_switch_ms=off" in startup_line(load_config({"load_gil_switch_ms": None}, use_env=False))
