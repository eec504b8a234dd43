"""The G4 worker process of the test bed (``python -m kvbm_backend.apps.bench.g4_cluster worker I``): one
G4Pool driven by JSON lines on stdin; and, in loopback mode, each worker's "link", a TCP relay to the
S3 gateway that a partition SIGSTOPs (``... relay``). See the package doc."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any


# ---- the worker process ----------------------------------------------------------------------------
def payload(seq: int, tenant: str, nbytes: int):
    """Deterministic block content for (seq, tenant): any worker can check what another wrote."""
    import numpy as np
    rng = np.random.default_rng([seq, sum(tenant.encode())])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


class _WorkerState:
    def __init__(self):
        self.pool = None
        self.ns = None
        self.base = None  # the bench baseline's plain store and its thread pool (base_put .. base_delete)
        self.base_ex = None

    def open(self, cfg: dict, layout: str, page_size: int) -> dict:
        from kvbm_backend.config import G4Config
        from kvbm_backend.pool.g4.pool import G4Pool
        from kvbm_backend.model.namespace import Namespace
        from kvbm_backend.model.presets import resolve_layout
        if self.pool is not None:
            self.pool.close()
        self.ns = Namespace(f"kvbm-cluster/{layout}", resolve_layout(layout, page_size=page_size))
        self.pool = G4Pool(G4Config(**cfg), self.ns)
        return {"bytes_per_block": self.ns.layout.bytes_per_block}

    def write(self, seqs: list[int], tenant: str = "t", interval_s: float = 0.0, batch: bool = False,
              start_at: float | None = None, timeout: float = 600.0) -> dict:
        """``batch``: one put of every block (the bench). Else one put per block, ``interval_s`` apart,
        so each block's acknowledgement is known (``acked``: written or already there)."""
        bpb = self.ns.layout.bytes_per_block
        keys = self.ns.keys(seqs, tenant=tenant)
        blocks = [payload(s, tenant, bpb) for s in seqs]
        if start_at:
            while time.time() < start_at:
                time.sleep(0.0005)
        t0 = time.time()
        if batch:
            cpu0 = time.process_time()  # this process, every thread: the client side of the offload
            r = self.pool.put(keys, blocks).result(timeout)
            end = time.time()
            return {"written": r.written, "skipped": r.skipped, "dropped": r.dropped, "t0": t0, "end": end,
                    "elapsed_s": end - t0, "put_cpu_s": time.process_time() - cpu0}
        futs: list[Any] = []
        done_at: dict[int, float] = {}
        for i, (k, b) in enumerate(zip(keys, blocks)):
            f = self.pool.put([k], [b])
            f.add_done_callback(lambda _f, i=i: done_at.__setitem__(i, time.time()))
            futs.append(f)
            if interval_s:
                time.sleep(interval_s)
        acked, dropped, acked_at = [], [], []
        for i, (s, f) in enumerate(zip(seqs, futs)):
            r = f.result(timeout)
            if r.written + r.skipped == 1:
                acked.append(s)
                acked_at.append(done_at.get(i, time.time()))
            else:
                dropped.append(s)
        end = time.time()
        return {"acked": acked, "acked_at": acked_at, "dropped": dropped, "t0": t0, "end": end,
                "elapsed_s": end - t0, "stats": self.pool.stats()}

    def read(self, seqs: list[int], tenant: str = "t", lookup: bool = True, start_at: float | None = None,
             timeout: float = 600.0) -> dict:
        import numpy as np
        bpb = self.ns.layout.bytes_per_block
        keys = self.ns.keys(seqs, tenant=tenant)
        out = [np.zeros(bpb, np.uint8) for _ in seqs]
        if start_at:
            while time.time() < start_at:
                time.sleep(0.0005)
        res = {}
        t0 = time.time()
        if lookup:
            res["lookup"] = self.pool.lookup_prefix(keys).result(timeout)
            res["lookup_s"] = time.time() - t0
        t1 = time.time()
        cpu0 = time.process_time()  # the get alone (every thread), not the bench's check of the bytes below
        ok = self.pool.get(keys, out).result(timeout).ok
        end = time.time()
        get_cpu_s = time.process_time() - cpu0
        # a miss leaves the buffer as it was (zeros); a hit must be exactly what the writer stored
        correct = [bool(o and np.array_equal(b, payload(s, tenant, bpb))) for o, b, s in zip(ok, out, seqs)]
        untouched = [bool(o or not b.any()) for o, b in zip(ok, out)]
        res.update(ok=ok, correct=correct, untouched_misses=all(untouched), t0=t0, get_t0=t1, end=end,
                   get_s=end - t1, get_cpu_s=get_cpu_s, elapsed_s=end - t0, stats=self.pool.stats())
        return res

    def delete(self, seqs: list[int], tenant: str = "t") -> dict:
        return {"deleted": self.pool.delete(self.ns.keys(seqs, tenant=tenant)).result(120)}

    # the bench's baseline: plain S3 PUT / GET of objects of a block's stored size, no G4 in between, with
    # the store the pool's own config opens (same client, timeouts, retries) and as many requests in flight
    # as the pool (g4.max_inflight threads); every object of one writer holds the same bytes (seeded)
    def base_put(self, cfg: dict, names: list[str], object_bytes: int, seed: int,
                 start_at: float | None = None) -> dict:
        from concurrent.futures import ThreadPoolExecutor

        from kvbm_backend.apps.bench.g4 import plain_s3_phase
        from kvbm_backend.config import G4Config
        from kvbm_backend.pool.g4.factory import open_store
        self.base_delete([])
        c = G4Config(**cfg)
        self.base, self.base_ex = open_store(c.url or "", c), ThreadPoolExecutor(c.max_inflight)
        data = bytes(payload(seed, "baseline", object_bytes))
        if start_at:
            while time.time() < start_at:
                time.sleep(0.0005)
        t0, cpu0 = time.time(), time.process_time()
        plain_s3_phase(self.base, self.base_ex, "put", names, data)
        return {"t0": t0, "end": time.time(), "cpu_s": time.process_time() - cpu0,
                "client": getattr(self.base, "client_name", "?")}

    def base_get(self, names: list[str], object_bytes: int, seed: int, start_at: float | None = None) -> dict:
        """GET ``names`` (written by the worker whose ``base_put`` had ``seed``) and check every byte (after
        the timed part; RuntimeError for different bytes)."""
        from kvbm_backend.apps.bench.g4 import plain_s3_phase
        data = bytes(payload(seed, "baseline", object_bytes))
        if start_at:
            while time.time() < start_at:
                time.sleep(0.0005)
        t0 = time.time()
        elapsed = plain_s3_phase(self.base, self.base_ex, "get", names, data)
        return {"t0": t0, "end": t0 + elapsed}  # at the last GET's answer: the byte check after it is not timed

    def base_delete(self, names: list[str]) -> dict:
        if self.base is not None:
            list(self.base_ex.map(self.base.delete, names))
            self.base_ex.shutdown()
            self.base.close()
        self.base = self.base_ex = None
        return {"deleted": len(names)}


def worker_main(index: int) -> int:
    """JSON lines in, JSON lines out. Ops: open, write, read, delete, stats, time, quit."""
    st = _WorkerState()
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the reply channel
    out.write(json.dumps({"ready": index, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "quit":
                break
            if op == "stats":
                resp = st.pool.stats() if st.pool else {}
            elif op == "time":
                resp = {"time": time.time()}
            else:
                resp = getattr(st, op)(**req)
        except Exception as e:  # noqa: BLE001 - reported to the driver
            resp = {"error": f"{op}: {e!r}\n{traceback.format_exc()}"}
        out.write(json.dumps(resp) + "\n")
        out.flush()
    if st.pool is not None:
        st.pool.close()
    return 0


# ---- loopback "link": a TCP relay that a partition SIGSTOPs ---------------------------------------------
def relay_main(listen_port: int, host: str, port: int) -> int:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", listen_port))
    srv.listen(128)

    def pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                d = a.recv(1 << 20)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    while True:
        c, _ = srv.accept()
        try:
            u = socket.create_connection((host, port), timeout=10)
            u.settimeout(None)
        except OSError:
            c.close()
            continue
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()
