"""Helper process for multi-process G4 tests (run as ``python tests/helpers/g4_writer.py JSON``).

Modes:
  ``write``: open a G4Pool and put blocks ``seqs`` for ``tenant`` (payload = :func:`payload`), flush.
  ``read``:  open a fresh G4Pool, lookup + get ``seqs``, print JSON {"lookup", "ok", "correct"}.
  ``race``:  wait until ``start_at`` (epoch s), then ``store.put_if_absent(name, bytes([writer]) * size)``;
             print JSON {"created": bool}.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvbm_backend.config import G4Config  # noqa: E402
from kvbm_backend.pool.g4.pool import G4Pool  # noqa: E402
from kvbm_backend.pool.g4.factory import open_store  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402
from kvbm_backend.model.presets import resolve_layout  # noqa: E402


def payload(seq: int, tenant: str, nbytes: int) -> np.ndarray:
    """Deterministic block content for (seq, tenant)."""
    rng = np.random.default_rng([seq, sum(tenant.encode())])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def namespace() -> Namespace:
    return Namespace("kvbm-test/tiny", resolve_layout("tiny"))


def put_blocks(pool, seqs, tenant):
    """Put the :func:`payload` blocks of ``seqs`` for ``tenant``; the PutResult."""
    ns = namespace()
    return pool.put(ns.keys(seqs, tenant=tenant), [payload(s, tenant, ns.layout.bytes_per_block) for s in seqs]
                    ).result(timeout=HANG_S)


def read_checked(pool, seqs, tenant) -> list[bool]:
    """Get ``seqs`` for ``tenant``; ``ok`` per block, asserting every block served holds its :func:`payload`."""
    ns = namespace()
    out = [np.zeros(ns.layout.bytes_per_block, np.uint8) for _ in seqs]
    ok = pool.get(ns.keys(seqs, tenant=tenant), out).result(timeout=HANG_S).ok
    for o, b, s in zip(ok, out, seqs):
        if o:
            assert np.array_equal(b, payload(s, tenant, ns.layout.bytes_per_block)), "wrong bytes served"
    return ok


def main(spec: dict) -> dict:
    if spec["mode"] == "race":
        store = open_store(spec["url"], endpoint_url=spec.get("endpoint_url"))
        while time.time() < spec["start_at"]:
            time.sleep(0.001)
        created = store.put_if_absent(spec["name"], bytes([spec["writer"]]) * spec["size"])
        return {"created": created}
    ns = namespace()
    cfg = G4Config(**spec["cfg"])
    pool = G4Pool(cfg, ns)
    tenant = spec.get("tenant", "")
    keys = ns.keys(spec["seqs"], tenant=tenant)
    bpb = ns.layout.bytes_per_block
    try:
        if spec["mode"] == "write":
            if spec.get("start_at"):
                while time.time() < spec["start_at"]:
                    time.sleep(0.001)
            res = pool.put(keys, [payload(s, tenant, bpb) for s in spec["seqs"]]).result()
            pool.flush()
            return {"written": res.written, "skipped": res.skipped, "dropped": res.dropped}
        look = pool.lookup_prefix(keys).result()
        out = [np.zeros(bpb, np.uint8) for _ in keys]
        ok = pool.get(keys, out).result().ok
        correct = [bool(o and np.array_equal(b, payload(s, tenant, bpb))) for o, b, s in zip(ok, out, spec["seqs"])]
        return {"lookup": look, "ok": ok, "correct": correct, "stats": pool.stats()}
    finally:
        pool.close()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
