"""Prefill -> decode handoff through the shared tiers (G4, or a G3 both workers mount): the "cache-mediated"
form of disaggregated serving, no KV transport between the engines.

The prefill worker computes the prompt and its connector offloads the prompt's full blocks as usual (G3 and
G4, write-behind); the decode worker's connector onboards them like any G3/G4 hit. The only thing that
crosses from prefill to decode is a hint in vLLM's ``kv_transfer_params`` (Dynamo passes it from the
prefill response to the decode request):

* the prefill request carries ``{"kvbm_backend_handoff": true}`` (set by Dynamo's PD protocol for our
  connector, :mod:`kvbm_backend.integrations.dynamo.pd_protocol`, or by any router);
* when it finishes, the prefill connector answers ``{"kvbm_backend_handoff": {"blocks": N, "block_size": B}}``:
  N = the prompt's full blocks of B tokens it has offloaded;
* the decode connector, seeing that, waits (without blocking the scheduler: vLLM's "ask me again" ``None``
  from ``get_num_new_matched_tokens``) until its tiers show those N blocks, at most ``wait_s`` from the first
  look; past it, it takes what is there and the engine computes the rest (counted ``handoff_timeouts`` and
  logged once per request at WARNING, with the request id and the blocks found).

Never wrong KV: the decode side loads only blocks whose frames check (the ordinary load path); the wait
only decides *when* it looks. The write-behind that makes blocks visible is the prefill side's ordinary
publish-after-durable path.
"""
from __future__ import annotations

import logging
import reprlib
import time
from typing import Any

from . import stats
from .log_limits import LimitedLog

KEY = "kvbm_backend_handoff"
DEFAULT_WAIT_S = 5.0
log = logging.getLogger("kvbm_backend.handoff")
#: the hand-off's per-request WARNINGs, one per kind per minute (:mod:`.log_limits`)
LOG = LimitedLog(log)


def _params(request: Any) -> dict:
    p = getattr(request, "kv_transfer_params", None)
    return p if isinstance(p, dict) else {}


def requested(request: Any) -> bool:
    """The prefill side: the request asks for a handoff (``kv_transfer_params[KEY] is True``)."""
    return _params(request).get(KEY) is True


_warned_nothing_offloaded = False


def finished_params(request: Any, block_size: int, offloads: bool = True) -> dict | None:
    """``kv_transfer_params`` for a finished prefill request that asked for a handoff, else None:
    ``{KEY: {"blocks": N, "block_size": tokens per block}}`` with N = ``(prompt tokens - 1) // block_size``,
    the full blocks another engine can load for this prompt (vLLM computes at least the prompt's last token
    itself, so a block ending on it is never loaded). ``offloads`` False (this connector saves nothing:
    ``save`` off, or neither G3 nor G4): N = 0, so the decode worker computes the prompt at once instead of
    waiting ``handoff_wait_s`` for blocks that never come; logged once per process at WARNING."""
    global _warned_nothing_offloaded
    if not requested(request):
        return None
    n = max(0, len(getattr(request, "prompt_token_ids", None) or []) - 1) // block_size if offloads else 0
    if not offloads and not _warned_nothing_offloaded:
        _warned_nothing_offloaded = True
        log.warning("kvbm_backend handoff: request %s asked for a prefill->decode handoff, but this worker offloads "
                    "nothing (connector save off, or no G3/G4 tier): it answers 0 blocks and the decode worker "
                    "computes the prompt", getattr(request, "request_id", "?"))
    stats.add(handoff_offered_requests=1, handoff_offered_blocks=n)
    return {KEY: {"blocks": n, "block_size": block_size}}


def remote_prefill(request: Any) -> bool:
    """Another connector supplies this request's prompt KV (NixlConnector's ``do_remote_prefill``): a G3/G4
    lookup for it would only hold the request back (MultiConnector waits for every child's answer)."""
    return _params(request).get("do_remote_prefill") is True


def _count(x: Any) -> int | None:
    """``x`` if it is a plain int (not bool, float, string: a client's JSON ``1e999`` is a float ``inf``)."""
    return x if type(x) is int else None


def expected_blocks(request: Any, block_size: int) -> int | None:
    """The decode side: how many leading blocks the prefill worker offloaded for this request, or None when
    the request carries no handoff (or one for another block size, which cannot be matched: then the
    request is served like any other, no wait). Values come from the client's request: anything but a
    plain int >= 0 (and >= 1 for ``block_size``) is malformed, served without waiting and logged with a
    bounded description. Called once per request (the scheduler keeps the answer)."""
    v = _params(request).get(KEY)
    if not isinstance(v, dict):
        return None
    n, bs = _count(v.get("blocks")), _count(v.get("block_size"))
    if n is None or bs is None or n < 0 or bs < 1:
        LOG.warning("malformed", "kvbm_backend handoff: malformed %s %s in request %s; served without waiting", KEY,
                    reprlib.repr(v), getattr(request, "request_id", "?"))
        return None
    if bs != block_size:
        LOG.warning("block_size", "kvbm_backend handoff: request %s was prefilled with %d-token blocks, this "
                    "engine uses %d; served without waiting", getattr(request, "request_id", "?"), bs, block_size)
        return None
    return n


class HandoffWaits:
    """Per decode request, when it was first looked up, so the wait is bounded by ``wait_s`` (seconds)."""

    def __init__(self, wait_s: float = DEFAULT_WAIT_S, clock=time.monotonic):
        if wait_s < 0:
            raise ValueError(f"handoff_wait_s: expected >= 0 seconds, got {wait_s!r}")
        self.wait_s, self._clock = float(wait_s), clock
        self._first: dict[str, float] = {}

    def should_wait(self, request_id: str, found_blocks: int, expected: int) -> bool:
        """True while fewer than ``expected`` blocks are found and ``wait_s`` has not passed since the first
        look at ``request_id``; False once they are all there (counted ``handoff_complete_requests``) or the
        wait is over (``handoff_timeouts``, logged once)."""
        now = self._clock()
        first = self._first.setdefault(request_id, now)
        if found_blocks >= expected:
            if self._first.pop(request_id, None) is not None:
                stats.add(handoff_complete_requests=1, handoff_wait_s=now - first)
            return False
        if now - first < self.wait_s:
            return True
        if self._first.pop(request_id, None) is not None:
            stats.add(handoff_timeouts=1, handoff_wait_s=now - first)
            LOG.warning("timeout", "kvbm_backend handoff: request %s found %d of the %d blocks its prefill worker offloaded "
                        "after %.1f s (handoff_wait_s); the engine computes the rest. Is G4 shared by both workers "
                        "and reachable, and is the prefill worker's G4 write-behind keeping up?", request_id,
                        found_blocks, expected, now - first)
        return False

    def forget(self, request_id: str) -> None:
        self._first.pop(request_id, None)
