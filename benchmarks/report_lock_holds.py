"""How long the scheduler's step can wait while a big G3 report is applied: the longest hold of the
:class:`~kvbm_backend.integrations.vllm.kv_events.G3KvEvents` lock (the step's ``take_events`` needs it) and of the
:class:`~kvbm_backend.integrations.vllm.g3_mirror.G3Mirror` lock (the step's G3 lookups need it), beside each
operation's whole time in the same run (the baseline: before 2026-12-02 each held its lock for all of it).

Operations, with ``--blocks`` blocks held by each of two TP ranks: both ranks' snapshots applied to the events and
to the mirror; a re-snapshot of rank 1 (its report channel failed) with ``--published`` blocks published; a
``republish`` (vLLM's ``AllBlocksCleared``) of those. The report channel applies reports on its own thread, so
a step waits only while a lock is held.

``python benchmarks/report_lock_holds.py --blocks 1000000 --published 300000 [--out DIR]`` prints and writes
``report_lock_holds.json`` (seconds; ``hold_over_total``: longest hold / whole operation). Needs vLLM importable.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class HoldTimer:
    """A lock that times each hold."""

    def __init__(self) -> None:
        self._l = threading.Lock()
        self.holds: list[float] = []
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._l.acquire()
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.holds.append(time.perf_counter() - self._t0)
        self._l.release()


def _timed(obj, fn) -> dict:
    lock = obj._lock = HoldTimer()
    t0 = time.perf_counter()
    fn()
    total = time.perf_counter() - t0
    mx = max(lock.holds, default=0.0)
    return {"total_s": total, "max_hold_s": mx, "holds": len(lock.holds), "hold_over_total": mx / total}


def run(blocks: int, published: int) -> dict:
    from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.pool.g3.index import tag_of
    t = tag_of("")
    seqs = [(i * 0x9E3779B97F4A7C15 + 12345) & (2**64 - 1) for i in range(blocks)]
    snaps = [KvbmWorkerMeta(added=[(t, r, s) for s in seqs], snapshot=True) for r in range(2)]
    out: dict = {"bench": "report_lock_holds", "blocks": blocks, "tp": 2, "ops": {}}
    ev = G3KvEvents(2, 4)
    out["ops"]["events_snapshots"] = _timed(ev, lambda: [ev.apply(m, rank=r) for r, m in enumerate(snaps)])
    p = min(published, blocks)
    req = SimpleNamespace(block_hashes=[i.to_bytes(8, "little") for i in range(p)], all_token_ids=list(range(p * 4)),
                          lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None,
                          num_prompt_tokens=p * 4)
    ev.learn("", req, seqs[:p], 0, p)
    ev.take()
    out["published"] = ev.published()
    out["ops"]["events_resnapshot"] = _timed(ev, lambda: ev.apply(snaps[1], rank=1))
    out["ops"]["events_republish"] = _timed(ev, ev.republish)
    m = G3Mirror(SimpleNamespace(fingerprint="f" * 16, layout=SimpleNamespace(page_size=16), tp_world_size=2))
    out["ops"]["mirror_snapshots"] = _timed(m, lambda: [m.apply(s, rank=r) for r, s in enumerate(snaps)])
    assert len(m) == 2 * blocks and ev.published() == p, (len(m), ev.published())  # the mirror: per rank
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--published", type=int, default=300_000)
    ap.add_argument("--out", default=None, help="directory for report_lock_holds.json (default: print only)")
    a = ap.parse_args(argv)
    res = run(a.blocks, a.published)
    print(json.dumps(res))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "report_lock_holds.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
