"""Which S3 client should G4 use? PUT/GET GB/s and client CPU s/GB of each candidate, one run, one server.

``python -m kvbm_backend.apps.bench.s3_clients --endpoint-url URL --bucket B [--object-mib 2] [--objects 64]
[--inflight 8] [--runs 3] [--json]``

Candidates (each skipped with its reason when it cannot run here):

* ``boto3``: :class:`kvbm_backend.pool.g4.s3_store.S3Store` exactly as G4Pool drives it: one client,
  ``inflight`` pooled connections, calls from a thread pool of ``inflight`` threads.
* ``obstore``: the Rust ``object_store`` crate via ``obstore`` (``pip install obstore``), sync API
  from the same thread pool (how a store class would use it).
* ``obstore-async``: the same client through its asyncio API, ``inflight`` requests at once.
* ``nixl-obj``: NIXL's OBJ backend (aws-sdk-cpp) as an engine: DRAM buffers registered once, one
  transfer of all objects per phase (NIXL sets its own concurrency; ``inflight`` does not apply).

Every client PUTs ``objects`` objects of ``object-mib`` MiB (create-exclusive where the client can
say so: ``If-None-Match: *``) under its own fresh prefix, then GETs them all; the bytes read are
compared with those written after the timed part. Runs alternate the clients; the result holds each
client's per-run numbers and medians. GB = 1e9 bytes. ``cpu_s_per_gb`` is this process's user+system
CPU (all threads, the client's native threads included; the server's CPU is not) per GB moved in the
phase. Also checked per client, untimed: a second create-exclusive PUT of an existing key reports
"exists" (``conditional_put``), a ranged GET returns the right bytes (``ranged_get``), and whether a
per-request timeout can be set (``timeouts``).

Credentials: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_DEFAULT_REGION`` from the environment
(``ci/seaweedfs.sh start`` sets them for the loopback test server).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

CLIENTS = ("boto3", "obstore", "obstore-async", "nixl-obj")
TIMEOUT_S = 60.0


class Skip(Exception):
    """This client cannot run here (reason in the message)."""


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _creds() -> tuple[str, str, str]:
    return (os.environ.get("AWS_ACCESS_KEY_ID", ""), os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
            os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1")


# ---- clients: each returns an object with put_all(names, datas), get_all(names) -> list, checks(), close()
class _Boto3:
    name = "boto3"

    def __init__(self, endpoint: str, bucket: str, prefix: str, inflight: int):
        from kvbm_backend.pool.g4.s3_store import S3Store
        self.st = S3Store(bucket, prefix, endpoint_url=endpoint, timeout_s=TIMEOUT_S, max_inflight=inflight)
        self.ex = ThreadPoolExecutor(inflight)

    def put_all(self, names, datas):
        res = list(self.ex.map(self.st.put_if_absent, names, datas))
        if not all(res):
            raise RuntimeError("boto3: a fresh key was reported as existing")

    def get_all(self, names):
        return list(self.ex.map(self.st.get, names))

    def checks(self, name: str, data: bytes) -> dict:
        return {"conditional_put": self.st.put_if_absent(name, data) is False,
                "ranged_get": (got := self.st.get(name, 4096, 8192)) is not None
                and bytes(got) == data[4096:4096 + 8192],
                "timeouts": "botocore connect_timeout/read_timeout per request"}

    def close(self):
        self.ex.shutdown()
        self.st.close()


class _Obstore:
    name = "obstore"

    def __init__(self, endpoint: str, bucket: str, prefix: str, inflight: int):
        try:
            import obstore  # noqa: F401
            from obstore.store import S3Store
        except ImportError as e:
            raise Skip(f"obstore not installed ({e}); pip install obstore") from None
        ak, sk, region = _creds()
        self.prefix = prefix
        self.store = S3Store(bucket, endpoint=endpoint, access_key_id=ak, secret_access_key=sk, region=region,
                             virtual_hosted_style_request=False,
                             client_options={"allow_http": True, "timeout": f"{int(TIMEOUT_S)}s",
                                             "connect_timeout": f"{int(TIMEOUT_S)}s",
                                             "pool_max_idle_per_host": str(inflight)})
        self.inflight = inflight
        self.ex = ThreadPoolExecutor(inflight)

    def _k(self, n: str) -> str:
        return f"{self.prefix}/{n}"

    def _put(self, name, data):
        import obstore
        obstore.put(self.store, self._k(name), data, mode="create", use_multipart=False)

    def put_all(self, names, datas):
        list(self.ex.map(self._put, names, datas))

    def _get(self, name):
        import obstore
        return obstore.get(self.store, self._k(name)).bytes()

    def get_all(self, names):
        return list(self.ex.map(self._get, names))

    def checks(self, name: str, data: bytes) -> dict:
        import obstore
        try:
            self._put(name, data)
            cond = False
        except Exception as e:  # noqa: BLE001 - obstore raises AlreadyExistsError (a subclass of its base error)
            cond = "AlreadyExists" in type(e).__name__ or "exists" in str(e).lower()
        rng = bytes(obstore.get_range(self.store, self._k(name), start=4096, length=8192))
        return {"conditional_put": cond, "ranged_get": rng == data[4096:4096 + 8192],
                "timeouts": "client_options timeout/connect_timeout per request"}

    def close(self):
        self.ex.shutdown()


class _ObstoreAsync(_Obstore):
    name = "obstore-async"

    def _run(self, coro_fn, items):
        import asyncio

        async def main():
            sem = asyncio.Semaphore(self.inflight)

            async def one(*a):
                async with sem:
                    return await coro_fn(*a)
            return await asyncio.gather(*(one(*a) for a in items))
        return asyncio.run(main())

    def put_all(self, names, datas):
        import obstore
        self._run(lambda n, d: obstore.put_async(self.store, self._k(n), d, mode="create", use_multipart=False),
                  list(zip(names, datas)))

    def get_all(self, names):
        import obstore

        async def g(n):
            r = await obstore.get_async(self.store, self._k(n))
            return await r.bytes_async()
        return self._run(g, [(n,) for n in names])


class _NixlObj:
    name = "nixl-obj"

    def __init__(self, endpoint: str, bucket: str, prefix: str, inflight: int):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise Skip(f"nixl not installed ({e})") from None
        from urllib.parse import urlparse
        u = urlparse(endpoint)
        ak, sk, region = _creds()
        self.prefix = prefix
        self.agent_name = f"kvbm-s3bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        try:
            self.agent.create_backend("OBJ", {"bucket": bucket, "endpoint_override": endpoint,
                                              "scheme": u.scheme or "http", "region": region, "access_key": ak,
                                              "secret_key": sk, "use_virtual_addressing": "false"})
        except Exception as e:  # noqa: BLE001
            raise Skip(f"NIXL OBJ backend did not start: {type(e).__name__}: {e}") from None
        self.regs: list[Any] = []

    def _xfer(self, op: str, bufs, names) -> None:
        local = [(b.ctypes.data, b.nbytes, 0) for b in bufs]
        objs = [(0, b.nbytes, i, f"{self.prefix}/{n}") for i, (b, n) in enumerate(zip(bufs, names))]
        reg_o = self.agent.register_memory(objs, "OBJ")
        try:
            h = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, "DRAM"),
                                           self.agent.get_xfer_descs([(0, b.nbytes, i) for i, b in enumerate(bufs)],
                                                                     "OBJ"),
                                           self.agent_name)
            st = self.agent.transfer(h)
            t_end = time.monotonic() + TIMEOUT_S
            while st not in ("DONE", "ERR"):
                if time.monotonic() > t_end:
                    raise RuntimeError(f"nixl-obj {op}: not done after {TIMEOUT_S} s")
                time.sleep(0.0005)
                st = self.agent.check_xfer_state(h)
            self.agent.release_xfer_handle(h)
            if st == "ERR":
                raise RuntimeError(f"nixl-obj {op}: transfer failed")
        finally:
            self.agent.deregister_memory(reg_o)

    def _bufs(self, datas):
        import numpy as np
        from kvbm_backend.memory import aligned_empty
        bufs = [aligned_empty(len(d)) for d in datas]
        for b, d in zip(bufs, datas):
            b[:] = np.frombuffer(d, np.uint8)
        return bufs

    def prepare(self, datas):
        """Register DRAM once (outside the timed part), as an engine keeps registrations."""
        self.wbufs = self._bufs(datas)
        self.rbufs = [b.copy() for b in self.wbufs]
        for b in self.rbufs:
            b[:] = 0
        self.regs.append(self.agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in self.wbufs + self.rbufs],
                                                    "DRAM"))

    def put_all(self, names, datas):
        self._xfer("WRITE", self.wbufs, names)

    def get_all(self, names):
        self._xfer("READ", self.rbufs, names)
        return [memoryview(b) for b in self.rbufs]

    def checks(self, name: str, data: bytes) -> dict:
        return {"conditional_put": False, "ranged_get": "offset reads (remote addr = object offset)",
                "timeouts": "none per request in the OBJ backend parameters"}

    def close(self):
        for r in self.regs:
            self.agent.deregister_memory(r)


_MAKERS: dict[str, Callable] = {"boto3": _Boto3, "obstore": _Obstore, "obstore-async": _ObstoreAsync,
                                "nixl-obj": _NixlObj}


def _delete_prefix(endpoint: str, bucket: str, prefix: str) -> None:
    from kvbm_backend.pool.g4.s3_store import S3Store
    st = S3Store(bucket, prefix, endpoint_url=endpoint, timeout_s=TIMEOUT_S)
    try:
        names = [o.name for o in st.list("")]
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(st.delete, names))
    finally:
        st.close()


def _one(client: str, endpoint: str, bucket: str, datas: list[bytes], inflight: int, run_prefix: str) -> dict:
    prefix = f"{run_prefix}/{client}-{uuid.uuid4().hex[:8]}"
    names = [f"obj-{i:06d}" for i in range(len(datas))]
    total = sum(len(d) for d in datas)
    c = _MAKERS[client](endpoint, bucket, prefix, inflight)
    try:
        if hasattr(c, "prepare"):
            c.prepare(datas)
        c0, t0 = _cpu(), time.perf_counter()
        c.put_all(names, datas)
        put_s, c1 = time.perf_counter() - t0, _cpu()
        c2, t0 = _cpu(), time.perf_counter()
        got = c.get_all(names)
        get_s, c3 = time.perf_counter() - t0, _cpu()
        bad = sum(1 for g, d in zip(got, datas) if g is None or bytes(g) != d)
        if bad:
            raise RuntimeError(f"{client}: {bad} of {len(datas)} objects read back wrong")
        checks = c.checks(names[0], datas[0])
    finally:
        c.close()
        _delete_prefix(endpoint, bucket, prefix)
    return {"put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9,
            "put_cpu_s_per_gb": (c1 - c0) / (total / 1e9), "get_cpu_s_per_gb": (c3 - c2) / (total / 1e9),
            **checks}


def run(endpoint: str, bucket: str, *, object_mib: float = 2, objects: int = 64, inflight: int = 8, runs: int = 3,
        clients=CLIENTS, prefix: str = "kvbm-s3-clients") -> dict:
    """Measure every client in ``clients``; returns the JSON-able result described in the module doc.

    Raises ValueError for non-positive sizes/counts or an unknown client name.
    """
    if object_mib <= 0 or objects < 1 or inflight < 1 or runs < 1:
        raise ValueError(f"object_mib ({object_mib}), objects ({objects}), inflight ({inflight}) and runs ({runs}) "
                         "must be positive")
    for c in clients:
        if c not in _MAKERS:
            raise ValueError(f"client {c!r}: unknown; choose from {', '.join(CLIENTS)}")
    size = int(object_mib * (1 << 20))
    base = os.urandom(size)
    datas = [i.to_bytes(8, "little") + base[8:] for i in range(objects)]  # distinct objects, cheap to make
    per: dict[str, list] = {c: [] for c in clients}
    skipped: dict[str, str] = {}
    run_prefix = f"{prefix}/{uuid.uuid4().hex[:8]}"
    for _ in range(runs):
        for c in clients:
            if c in skipped:
                continue
            try:
                per[c].append(_one(c, endpoint, bucket, datas, inflight, run_prefix))
            except Skip as e:
                skipped[c] = str(e)
            except Exception as e:  # noqa: BLE001 - one client failing does not hide the others' numbers
                skipped[c] = f"failed: {type(e).__name__}: {e}"
    out: dict = {"endpoint": endpoint, "bucket": bucket, "object_bytes": size, "objects": objects,
                 "inflight": inflight, "runs": runs, "clients": {}, "skipped": skipped}
    for c, rs in per.items():
        if c in skipped or not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("put_gbps", "get_gbps", "put_cpu_s_per_gb",
                                                                  "get_cpu_s_per_gb")}
        out["clients"][c] = {**med, "conditional_put": rs[0]["conditional_put"], "ranged_get": rs[0]["ranged_get"],
                             "timeouts": rs[0]["timeouts"], "runs": rs}
    if "boto3" in out["clients"]:
        b = out["clients"]["boto3"]
        for r in out["clients"].values():
            r["get_vs_boto3"] = r["get_gbps"] / b["get_gbps"]
            r["put_vs_boto3"] = r["put_gbps"] / b["put_gbps"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbm_backend.apps.bench.s3_clients",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--endpoint-url", default=os.environ.get("KVBM_TEST_S3_ENDPOINT"),
                    help="S3 endpoint, e.g. http://127.0.0.1:8333 (default: $KVBM_TEST_S3_ENDPOINT)")
    ap.add_argument("--bucket", default="kvbm-test")
    ap.add_argument("--object-mib", type=float, default=2)
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset of " + ",".join(CLIENTS))
    ap.add_argument("--json", action="store_true", help="print the full JSON result")
    a = ap.parse_args(argv)
    if not a.endpoint_url:
        ap.error("--endpoint-url: required (or set KVBM_TEST_S3_ENDPOINT)")
    # NIXL logs INFO lines to stdout: keep stdout for the result (fd level, native code writes there too)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        res = run(a.endpoint_url, a.bucket, object_mib=a.object_mib, objects=a.objects, inflight=a.inflight,
                  runs=a.runs, clients=[c for c in a.clients.split(",") if c])
    except ValueError as e:
        ap.error(str(e))
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if a.json:
        print(json.dumps(res, indent=2, sort_keys=True))
    else:
        for c, r in res["clients"].items():
            print(f"{c:14s} PUT {r['put_gbps']:.3f} GB/s ({r['put_cpu_s_per_gb']:.2f} CPU s/GB)  "
                  f"GET {r['get_gbps']:.3f} GB/s ({r['get_cpu_s_per_gb']:.2f} CPU s/GB)  "
                  f"cond_put={r['conditional_put']} ranged={r['ranged_get']}")
        for c, why in res["skipped"].items():
            print(f"{c:14s} skipped: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
