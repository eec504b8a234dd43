"""What the connector's scheduler keeps of an errored request's load for its ranks' later failure reports stays
bounded (review of 8f2f1f3, 2026-12-03), measured with ``tracemalloc`` on the real :class:`FailedBlockCount` and
through vLLM's real ``Scheduler``.

Under ``kv_load_failure_policy: fail`` (vLLM's default) a request whose load failed is errored before the connector
sees the failure reports, so its load was kept (1024 at most) with the request's whole sequence-hash array. With
block-level load errors (the common case) no ``failed_recving`` ever ended one, so the 1024 stayed, each 8 bytes a
block of its prompt (64 KiB at a 128K-token prompt of 16-token blocks); and a request errored for another reason
(grammar, encoder, another connector's load) while its load ran was kept the same way.
"""
from __future__ import annotations

import gc
import tracemalloc
from array import array

import pytest

from kvbm_backend.integrations.vllm import load_failures as lf
from kvbm_backend.integrations.vllm import stats

PROMPT_BLOCKS = 8192  # a 128K-token prompt of 16-token blocks
FIRST = 64  # the load: blocks FIRST.. of the prompt (vLLM had the first ones)
CAP = 16 << 20  # lf.ENDED_KEEP_BYTES


def _hashes(i: int) -> array:
    """Request i's sequence hashes, as the scheduler keeps them (``_Req.hashes``: array of uint64)."""
    return array("Q", range(i << 20, (i << 20) + PROMPT_BLOCKS))


def _failed() -> int:
    return stats.get(lf.FAILED_BLOCKS) or 0


def _held(run) -> int:
    """Bytes still allocated after ``run()`` (whose own references are gone), by tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        keep = run()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del keep
    return held


def test_errored_loads_of_long_prompts_keep_only_what_a_report_can_still_count():
    """300 requests of 128K-token prompts, each errored with its 8128-block load unsettled, one a step: a third
    errored for another reason (no report of the load in the output that errored it), a third failed from the
    load's first block on (every block counted: nothing left to count), a third failed from its 101st block on
    (rank 0; rank 1 still loading). Held after: the 100 blocks of each last load a rank's later report can count
    (100 x 8 bytes), not the prompts' hashes. Before: all 300 whole arrays, 300 x 64 KiB = 19 MiB."""
    c = lf.FailedBlockCount()
    before = _failed()

    def run():
        for i in range(300):
            rid = f"r{i}"
            c.planned(rid, 0, range(FIRST, PROMPT_BLOCKS))
            hs = _hashes(i)
            c.forget(rid, hs)  # vLLM errored it (request_finished), then hands over the step's reports
            if i % 3 == 1:
                assert c.failed(rid, 0, None, hs[FIRST]) == PROMPT_BLOCKS - FIRST
            elif i % 3 == 2:
                assert c.failed(rid, 0, None, hs[FIRST + 100]) == PROMPT_BLOCKS - FIRST - 100
            del hs
            c.step({})  # the next step
        return c

    held = _held(run)
    assert held < 1 << 20, held  # before: 19.7 MB
    assert _failed() - before == 100 * (PROMPT_BLOCKS - FIRST) + 100 * (PROMPT_BLOCKS - FIRST - 100)
    # rank 1's later reports still count: each load's blocks 40..99 (the hashes kept)
    for i in range(2, 300, 3):
        assert c.failed(f"r{i}", 0, None, _hashes(i)[FIRST + 40]) == 60
        assert c.failed(f"r{i}", 0, None, _hashes(i)[FIRST + 50]) == 0  # past what is left to count
    assert c.failed("r0", 0, None, _hashes(0)[FIRST]) == 0  # errored for another reason: not kept
    assert c.ended_bytes < 1 << 20


def test_kept_loads_are_capped_in_bytes():
    """400 errored requests of 128K-token prompts whose loads failed at their last block only (8127 blocks each a
    later report may count): the loads kept hold at most ``ENDED_KEEP_BYTES``, the oldest dropped first; the newest
    still count their ranks' later reports. Before: all 400 prompts' arrays, 26 MB."""
    c = lf.FailedBlockCount()

    def run():
        for i in range(400):
            rid = f"r{i}"
            c.planned(rid, 0, range(FIRST, PROMPT_BLOCKS))
            hs = _hashes(i)
            c.forget(rid, hs)
            assert c.failed(rid, 0, None, hs[PROMPT_BLOCKS - 1]) == 1
            del hs
            c.step({})
        return c

    held = _held(run)
    assert held <= CAP + (1 << 20), held  # before: 26.4 MB
    assert lf.ENDED_KEEP_BYTES <= CAP and c.ended_bytes <= lf.ENDED_KEEP_BYTES
    assert c.failed("r399", 0, None, _hashes(399)[FIRST + 7]) == PROMPT_BLOCKS - FIRST - 1 - 7  # the newest: kept
    assert c.failed("r0", 0, None, _hashes(0)[FIRST]) == 0  # the oldest: dropped for the cap


def test_a_kept_load_counts_later_reports_until_it_expires():
    """A load kept after its request errored (rank 0 failed from block 5 of 8) counts rank 1's report while every
    rank's load may still run (``ENDED_KEEP_S``, longer than the longest ``g3.load_timeout_s``), and is dropped
    after (the clock given: seconds)."""
    from kvbm_backend.config import G3Config

    most = max(m.le for m in G3Config.model_fields["load_timeout_s"].metadata if getattr(m, "le", None) is not None)
    assert lf.ENDED_KEEP_S > most
    now = [1000.0]
    c = lf.FailedBlockCount(clock=lambda: now[0])
    hs = list(range(100, 110))
    for rid in ("A", "B"):
        c.planned(rid, 0, range(0, 8))
        c.forget(rid, hs)
        assert c.failed(rid, 0, None, hs[5]) == 3
        c.step({})
        assert c.ended_bytes > 0
    now[0] += lf.ENDED_KEEP_S - 1
    c.step({})
    assert c.failed("A", 0, None, hs[2]) == 3  # rank 1's report, within the time
    now[0] += 2
    c.step({})
    assert c.ended_bytes == 0  # dropped: every rank's report is in by now
    assert c.failed("B", 0, None, hs[2]) == 0


def test_kept_load_counts_each_block_once_across_ranks_and_groups():
    """The hashes kept are enough for every count: a report from a block past the ones left counts 0, one from an
    earlier block the difference; a second group's report and ``failed_recving`` (the whole load) after it."""
    c = lf.FailedBlockCount()
    hs = list(range(200, 220))
    before = _failed()
    c.planned("A", 0, range(4, 16))
    c.planned("A", 1, [12, 13, 14, 15])
    c.forget("A", hs)
    assert c.failed("A", 0, None, hs[10]) == 6  # blocks 10..15
    assert c.failed("A", 0, None, hs[12]) == 0  # past what is left
    assert c.failed("A", 1, None, hs[14]) == 2  # group 1's blocks 14, 15
    assert c.failed("A", 0, None, hs[6]) == 4  # blocks 6..9
    assert c.loaded_none("A") == 2 + 2  # group 0's 4, 5 and group 1's 12, 13
    assert _failed() - before == 6 + 2 + 4 + 4
    assert c.ended_bytes == 0 and c.failed("A", 0, None, hs[4]) == 0
    c.planned("B", 0, range(0, 8))
    c.forget("B", hs)
    assert c.failed("B", 0, None, 999) == 8  # a report naming none of its blocks: the whole load, as before


@pytest.mark.vllm
def test_a_request_errored_for_another_reason_keeps_nothing(tmp_path):
    """vLLM's Scheduler (``kv_load_failure_policy: fail``), TP 2: A waits for its 8-block G3 load when vLLM errors it
    for another reason (its encoder cache: ``FINISHED_ERROR``). The scheduler keeps nothing of A's load after the
    next step; the ranks' loads then end (rank 0's failed from block 5): A's blocks count neither loaded nor failed.
    Before: A's load and hashes were kept (until 1024 more), and rank 0's report counted 3 failed."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta
    from tests.helpers.vllm_sched import runner_output
    from tests.helpers.vllm_g3_load import PromCounters, g3_scheduler, our_loads, ours, request_a_held_in_g3, step_until

    s = g3_scheduler(tmp_path, "fail")
    try:
        a, hs = request_a_held_in_g3(s)
        s.add_request(a)
        so = step_until(s, lambda so: bool(our_loads(so)))
        (job,) = our_loads(so)
        agg, idle, prom = KVOutputAggregator(expected_finished_count=2), KVConnectorOutput(), PromCounters(s)

        def step(outs):
            sched_out = s.schedule()
            prom.observe(s.update_from_output(sched_out, agg.aggregate([runner_output(s, sched_out, o) for o in outs])))

        s.update_from_output(so, agg.aggregate([runner_output(s, so, idle), runner_output(s, so, idle)]))
        s.encoder_cache_mismatch_reqs.add("A")  # vLLM errors A in the next step's output
        step([idle, idle])
        assert a.status == RequestStatus.FINISHED_ERROR
        counts = ours(s).sched.failed_counts
        step([idle, idle])
        assert "A" not in counts._ended  # before: kept, with A's hashes
        late = KVConnectorOutput(finished_recving={"A"}, invalid_block_ids=set(job.block_ids[5:]),
                                 kv_connector_worker_meta=KvbmWorkerMeta(failed=[FailedLoad("A", "", hs[5], "miss")]))
        step([late, KVConnectorOutput(finished_recving={"A"})])
        for _ in range(2):
            step([idle, idle])
        assert prom.counts() in ((None, None), (0, 0)), prom.counts()  # before: (0, 3)
    finally:
        s.connector.shutdown()
