"""The device loader's staging ring (:class:`kvbm_backend.pool.g3.read.passes.PassReader`): a pass whose reads
partly timed out keeps its buffer until the loader has completed it (checked and copied out its rows that did
arrive). Review finding (2026-11-29): ``reap`` of the next pass handed the timed-out pass's buffer back to the
process-wide staging pool as soon as its late read ended, before the loader verified and copied that pass's good
rows; on the host path the buffer is the staging itself, so another load taking it could overwrite rows
between their check and their copy-out: wrong KV. Real reads of a real slab file on the reader's threads; the
timeout is made certain by a task that holds the reader's only thread (no wall-clock window)."""
from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import torch

from kvbm_backend.deadlines import Deadline
from kvbm_backend.gpu.staging import host_staging_pool
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.base import SlotLease
from kvbm_backend.pool.g3.read.passes import PassReader, _Pass

SLOT = 8192  # bytes per slot (a 4 KiB multiple)


def test_a_pass_with_a_timed_out_read_keeps_its_buffer_until_it_is_completed(tmp_path):
    path = tmp_path / "slab0"
    data = np.random.default_rng(1).integers(0, 256, 4 * SLOT, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    os.sync()
    key = Namespace("m", KvLayout(1, 2, 16, 64, "bfloat16")).keys([1], "t", 0)[0]
    r = PassReader("host", torch.device("cpu"), SLOT, 1, Counter())
    try:
        gate = threading.Event()

        def make_pass(ring: int, offsets: list[int]) -> _Pass:
            staging, host = r.buffers(ring, len(offsets), SLOT)
            return _Pass(list(range(len(offsets))), [SlotLease(key, str(path), o, SLOT) for o in offsets], SLOT,
                         staging, host, ring, [], ["io_error"] * len(offsets),
                         np.empty((len(offsets), 4096), np.uint8))

        # pass p: row 0 is read at once, row 1's read waits behind a task holding the reader's only thread
        p = make_pass(0, [0, 2 * SLOT])
        assert r.pool is not None and p.host is not None and p.headers is not None
        f0 = r.pool.submit(r._read_bounce, str(path), p.host.numpy()[0:1], p.headers[0:1], 0)
        f0.result()
        blocker = r.pool.submit(gate.wait)
        f1 = r.pool.submit(r._read_bounce, str(path), p.host.numpy()[1:2], p.headers[1:2], 2 * SLOT)
        p.futs = [(0, 1, f0), (1, 1, f1)]
        r.reap(p, Deadline(0))  # the call's load bound has passed: row 1 times out, row 0 arrived
        assert p.status == [None, "timeout"]
        assert bytes(p.staging[0].numpy()) == data[:SLOT].tobytes()
        gate.set()
        blocker.result()
        f1.result()  # the late read has ended

        # the loader reaps the next pass before it completes p (its pipeline: reap k, then complete k - 1)
        q = make_pass(1, [SLOT])
        q.futs = [(0, 1, r.pool.submit(r._read_bounce, str(path), q.host.numpy()[0:1], q.headers[0:1], SLOT))]
        r.reap(q, Deadline(60))
        assert q.status == [None]

        # p is not completed: its buffer must not be handed to anyone (another load would read into it)
        other = host_staging_pool(False).take(2 * SLOT)
        try:
            assert not np.shares_memory(other, p.staging.numpy()), "p's staging handed out before p completed"
        finally:
            host_staging_pool(False).give(other)
        assert bytes(p.staging[0].numpy()) == data[:SLOT].tobytes()

        # once the loader completed p, the buffer goes back to the pool (and is not leaked)
        r.finished(p)
        again = host_staging_pool(False).take(2 * SLOT)
        try:
            assert np.shares_memory(again, p.staging.numpy())
        finally:
            host_staging_pool(False).give(again)
    finally:
        r.close()
