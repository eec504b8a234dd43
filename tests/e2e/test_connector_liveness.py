"""Liveness of the connector when a load fails (issue 26 A), on the real vLLM CPU engine.

vLLM (``kv_load_failure_policy=recompute``) reschedules a request whose load failed and asks the connector
for its match again; a connector that offers the same hit again makes the same load fail again, forever
(seen: 37,845 reschedules in 2.6 min with the G3 directory gone). Each test makes the first loaded block
of a request fail in a different way (corrupt G3 payloads, G3 slab files truncated under the running
pool, G4 objects overwritten) and checks that every request completes with the outputs of the engine that
computed the KV, and that the connector counted each failed load once. A run that loops never returns:
the engine process is bounded by ``run_engine``'s timeout, which then fails the test.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.vllm_runner import connector_extra, mirrored_blocks, prompts, read_stats, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY, write_model_dir  # noqa: E402
from kvbm_backend.model import frame  # noqa: E402

# a hang guard: each test runs two engines, each guarded by run_engine at ENGINE_HANG_S (was 600 with 400 s engines)
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(1500)]
ENGINE_HANG_S = 600.0  # run_engine's hang guard, not a bound (was 400: a start took 60-280 s on the busy CI VM)
IDLE_HANG_S = 300.0  # a hang guard, not a bound: under ENGINE_HANG_S, so a channel that never delivers ends in the
#                      test's assertions (the engine is paused meanwhile), not in the engine's guard

_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

NUM_BLOCKS = 48  # engine KV budget (blocks of 32 tokens)
DTYPE = "float32"  # see test_connector_e2e: float32 makes cached and full prefill agree bit for bit


def _run(*args, **kw) -> dict:
    kw.setdefault("dtype", DTYPE)
    return run_engine(*args, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"), TINY)


def _corrupt_every_slot(g3_dir: Path, block_bytes: int) -> int:
    """Flip one payload byte in every slot of every slab file; returns the slots touched."""
    slot = frame.slot_bytes(block_bytes)
    n = 0
    for f in sorted(g3_dir.glob("*.slab")):
        with open(f, "r+b") as fh:
            for s in range(f.stat().st_size // slot):
                off = s * slot + frame.HEADER_BYTES + 100
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ 0x5A]))
                n += 1
    return n


def _run_with_pauses(tmp: Path, name: str, model_dir: Path, ps, connector, actions: dict, **kw) -> dict:
    """``run_engine`` with the engine paused before prompt ``i`` while ``actions[i]()`` runs."""
    pause = tmp / f"{name}-pauses"
    pause.mkdir()
    box: dict = {}

    def engine():
        try:
            box["res"] = _run(tmp, name, model_dir, ps, connector, pause_before=sorted(actions),
                              pause_dir=str(pause), **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["err"] = e

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    for i in sorted(actions):
        while not (pause / f"paused-{i}").exists() and t.is_alive():
            time.sleep(0.05)
        if not t.is_alive():
            break
        actions[i]()
        (pause / f"resume-{i}").touch()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["res"]


def test_failed_g3_loads_are_recomputed_not_offered_again(tmp_path, model_dir):
    """Corrupt payloads (the reader's first request) and slab files truncated under the running pool (its
    second): each request's first loaded block fails; both complete with the writer's outputs."""
    ps = prompts(2, 700, seed=21)
    extra = connector_extra(tmp_path / "w")
    a = _run(tmp_path, "writer", model_dir, ps, {"extra": extra}, num_gpu_blocks=NUM_BLOCKS)
    bpb = a["connector_info"]["bytes_per_block"]
    g3 = tmp_path / "w" / "g3"
    assert _corrupt_every_slot(g3, bpb) >= 2 * 21

    def truncate_slabs():
        for f in g3.glob("*.slab"):
            os.truncate(f, 0)

    b = _run_with_pauses(tmp_path, "reader", model_dir, ps, {"extra": extra}, {1: truncate_slabs},
                         num_gpu_blocks=NUM_BLOCKS, timeout=ENGINE_HANG_S, warmup=False)
    sb = b["connector_stats"]
    assert b["outputs"] == a["outputs"]
    assert sb.get("load_planned_requests") == 2, sb       # each request was offered its G3 hit once ...
    assert sb.get("load_failed_requests") == 2, sb        # ... whose load failed at its first block ...
    assert sb.get("load_blocks_ok", 0) == 0, sb
    assert sb.get("load_failed_blocks_cooled") == 2, sb   # ... and that block is not offered for a while


def test_failed_g4_load_is_recomputed_not_offered_again(tmp_path, model_dir, seaweed, s3_prefix):
    """G4 objects overwritten with another object's bytes: the reader (no G3) finds them, its load fails
    verification, the request is recomputed once."""
    import boto3
    ps = prompts(1, 700, seed=22)
    g4 = seaweed.url(s3_prefix)
    extra = connector_extra(tmp_path / "w", g4, endpoint_url=seaweed.endpoint)
    a = _run(tmp_path, "writer", model_dir, ps, {"extra": extra}, num_gpu_blocks=NUM_BLOCKS)
    s3 = boto3.client("s3", endpoint_url=seaweed.endpoint)
    keys = sorted(o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=seaweed.bucket,
                                                                                    Prefix=s3_prefix)
                  for o in page.get("Contents", []) if not o["Key"].endswith(".json"))
    assert len(keys) >= 21, keys
    bodies = [s3.get_object(Bucket=seaweed.bucket, Key=k)["Body"].read() for k in keys]
    for k, body in zip(keys, bodies[1:] + bodies[:1]):  # every object now holds another block's frame
        s3.put_object(Bucket=seaweed.bucket, Key=k, Body=body)
    reader = connector_extra(tmp_path / "r", g4, keyring=tmp_path / "g4-keyring.json", endpoint_url=seaweed.endpoint)
    reader["kvbm_backend"]["g3"]["enabled"] = False
    b = _run(tmp_path, "reader", model_dir, ps, {"extra": reader}, num_gpu_blocks=NUM_BLOCKS, timeout=ENGINE_HANG_S,
             warmup=False)
    sb = b["connector_stats"]
    assert b["outputs"] == a["outputs"]
    assert sb.get("load_planned_g4_blocks", 0) >= 1, sb
    assert sb.get("load_failed_requests") == 1, sb
    assert sb.get("load_blocks_ok", 0) == 0, sb


def test_blocks_offloaded_after_the_last_step_are_found_by_the_next_request(tmp_path, model_dir):
    """Issue 26 B: with the worker in its own process (the mp executor, as ``vllm serve`` on CPU and every
    Dynamo worker run), the scheduler learnt of stored blocks only from reports in later steps' outputs: a
    request whose offloads completed after its last step (one prefill step, max_tokens=1) left G3 unknown to
    the scheduler while the engine idled, and the same prompt later recomputed. The worker now reports by
    the report channel; after an idle pause (no engine step) and an emptied engine prefix cache, the same
    prompt is served from G3."""
    ps = prompts(1, 700, seed=23) * 2
    extra = connector_extra(tmp_path / "w")
    stats_file = Path(extra["stats_path"])

    sched_file = stats_file.with_name(stats_file.stem + ".scheduler" + stats_file.suffix)

    def idle():
        # the engine is idle (paused between requests): wait until the worker wrote the 21 blocks (its stats
        # file) and the scheduler's G3 mirror holds them (the scheduler's own stats file, written every 0.5 s:
        # pools.g3 is the G3Mirror's stats(), "blocks" what apply() took from the report channel; with no
        # engine step, only the channel can bring them). Polled, not 120 s then a fixed 2 s sleep (windows on
        # the busy CI VM, processes frozen 13-31 s); at IDLE_HANG_S the engine resumes and the assertions
        # below say what was missing.
        end = time.monotonic() + IDLE_HANG_S
        while time.monotonic() < end:
            if read_stats(stats_file).get("g3_put_written_blocks", 0) >= 21 and mirrored_blocks(sched_file) >= 21:
                break
            time.sleep(0.2)

    b = _run_with_pauses(tmp_path, "idle", model_dir, ps, {"extra": extra}, {1: idle},
                         num_gpu_blocks=NUM_BLOCKS, multiprocessing=True, max_tokens=1, warmup=False,
                         reset_prefix_cache_before=[1], timeout=ENGINE_HANG_S)
    ss = b["scheduler_stats"]
    assert b["outputs"][0] == b["outputs"][1]
    assert ss.get("load_planned_g3_blocks", 0) == 21, ss   # the whole prompt (21 full blocks) from G3
    assert b["cached_tokens"][1] == 21 * 32, b["cached_tokens"]
    assert ss.get("g3_reports_by_channel", 0) > 0, ss
