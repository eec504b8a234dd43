"""A G3 writer process held inside a journal compaction, for the SIGKILL tests of
``tests/pool/g3/test_g3_journal_compaction.py``.

``python tests/helpers/compaction_child.py DIR POINT`` opens a small G3 pool on DIR (fsync on, the compaction
threshold lowered to 200 records) and writes batches of 40 blocks (keys 1, 2, ...; payloads
``crash_writer.payload``), printing ``ACK <last key>`` after each put's Future completed. The journal module's
``_write_all`` is wrapped (it calls through) so that the compaction thread stops at its POINT-th file write:
1 = the snapshot (the index's records), 2 = the appends made meanwhile (written without the catalog's lock).
More batches are written while it is held there (published into the old journal and remembered), then the
child prints ``HELD <seq hashes the index holds, comma-separated>`` and waits to be killed (SIGKILL).
"""
from __future__ import annotations

import sys
import threading

from tests.helpers.crash_writer import NS, open_pool, payload
from kvbm_backend.pool.g3 import catalog, journal as jr

HANG_S = 600.0  # hang guard only


def main() -> None:
    d, point = sys.argv[1], int(sys.argv[2])
    catalog.COMPACT_MIN_RECORDS = 200
    pool = open_pool(d, capacity_gb=0.002, write_queue_blocks=10_000)  # ~160 slots: the LRU evicts
    reached = {1: threading.Event(), 2: threading.Event()}
    release = threading.Event()
    calls = [0]
    real = jr._write_all

    def held(fd: int, data: bytes) -> int:
        if threading.current_thread().name == "g3-journal-compaction":
            calls[0] += 1
            n = calls[0]
            if n in reached:
                reached[n].set()
                if n == point:
                    threading.Event().wait()  # held until the kill
                release.wait(HANG_S)
        return real(fd, data)

    jr._write_all = held
    k = 1

    def batch() -> None:
        nonlocal k
        keys = NS.keys(range(k, k + 40))
        r = pool.put(keys, [payload(x.seq_hash) for x in keys]).result(timeout=HANG_S)
        assert r.written == 40, r
        k += 40
        print(f"ACK {k - 1}", flush=True)

    while not reached[1].is_set():
        batch()
    for _ in range(3):  # published while the snapshot is being written
        batch()
    if point == 2:
        release.set()
        assert reached[2].wait(HANG_S), "the compaction never copied the appends made meanwhile"
        for _ in range(3):  # published while those appends are being copied
            batch()
    print("HELD " + ",".join(str(x.seq_hash) for x in pool.keys()), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
