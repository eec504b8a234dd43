"""The connector's per-request WARNING lines, at most one per kind per minute (docs/operations.md "Logs an
operator sees": once per state change, never once per request).

Some conditions are found per request: a decode request whose prefill worker's blocks did not all arrive within
``handoff_wait_s`` (or whose wait G4's open circuit breaker or a cooling failed block cut short), hand-off parameters a client sent malformed or for another block size, a layer-wise load with
failed blocks. Each used to log one WARNING per request, so a slow G4 or a misbehaving client grew the log at the
request rate (found in review, 2026-11-29: 100 lines for 50 timed-out and 50 malformed requests). Now the first
of a kind is logged with its request, later ones within :data:`LOG_EVERY_S` are counted, and the next line logged
says how many were left out. The connector's counters (``handoff_timeouts``, ``load_blocks_failed``...) count
every one.

The helper itself lives below every layer, in :mod:`kvbm_backend.log_limits` (since 2026-12-03: the G3 pool
limits its per-call WARNINGs with it too, and a pool never imports the integrations); re-exported here.
"""
from __future__ import annotations

from ...log_limits import LOG_EVERY_S, LimitedLog

__all__ = ["LOG_EVERY_S", "LimitedLog"]
