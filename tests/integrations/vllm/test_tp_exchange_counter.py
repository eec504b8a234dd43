"""Review of 942e6c9 (2026-12-03; fixed: counted where a report arrives by the channel, ``on_g3_report``): under ``external_launcher`` with TP > 1 every G3 report the scheduler applies from
the TP group's exchange is counted ``g3_reports_by_channel`` (``ConnectorParts._apply_g3_report``), also the reports
that came in the step output (``_hold_step_g3``) and the other ranks' reports. The counter is documented
(docs/operations.md) as the reports that reached the scheduler through the per-engine report channel; before
942e6c9 a step-output report never counted there. A report of this process's step output, exchanged over a TP group
(one gloo process here, as external_launcher sets vLLM's CPU group up), must not count as a channel report."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import one_rank_group

pytestmark = [pytest.mark.vllm]  # imports the connector's wiring (vLLM)


def test_step_output_g3_report_exchanged_over_tp_group_is_not_counted_as_by_channel():
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    from kvbm_backend.integrations.vllm import report_channel, stats
    from kvbm_backend.integrations.vllm.metadata import KvbmConnectorMetadata, KvbmWorkerMeta
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts

    group, own = one_rank_group()
    try:
        applied = []

        class _Sched:  # the scheduler side's two entry points the parts call
            def apply_g3_report(self, group, meta, rank=None):
                applied.append((group, rank, list(meta.added)))

            def update_connector_output(self, wm):
                pass

            def build_connector_meta(self, so):
                return KvbmConnectorMetadata()

        parts = ConnectorParts()
        parts.sched = _Sched()
        parts.scheduler_role = lambda: parts.sched
        parts._writer = SimpleNamespace(maybe_write=lambda: None)
        parts.exchange = report_channel.TpReportExchange(group, parts._apply_g3_report, 10.0, lambda: None)

        before = stats.get("g3_reports_by_channel") or 0
        entry = (b"\x01" * 16, 0, 12345)
        # this rank's worker report in the step output (no report channel involved)
        parts.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KvbmWorkerMeta(added=[entry]),
                                                      failed_recving=None))
        parts.build_connector_meta(SimpleNamespace())  # the step's exchange applies it
        assert applied == [(0, 0, [entry])]
        assert (stats.get("g3_reports_by_channel") or 0) - before == 0, \
            "a step-output G3 report was counted g3_reports_by_channel"
    finally:
        if own:
            dist.destroy_process_group()
