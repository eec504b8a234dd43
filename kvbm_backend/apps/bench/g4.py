"""``kvbm-backend bench --tier g4``: write then read N blocks through :class:`~kvbm_backend.pool.g4.pool.G4Pool`
on ``s3://BUCKET/PREFIX`` (``--endpoint-url``) or ``file:///path``, against a baseline of the same bytes
taken in the same run:

* S3: plain ``PUT``/``GET`` of objects of the same size (header + payload) with the same client
  (``g4.s3_client``: obstore by default; ``BenchOptions.s3_client``) and configuration and the same number
  of requests in flight (``--threads``).
* file: plain O_DIRECT I/O (:func:`kvbm_backend.apps.bench.baseline.odirect_baseline`), same I/O size
  and in-flight count.

Both pool modes run in every invocation, encrypted (AES-256-GCM, per-tenant key from a throwaway
keyring) and unencrypted (xxh3_128 checksums), alternating with the baseline for ``ROUNDS`` rounds; the
best of each is kept. ``write_gbps``/``read_gbps`` are for the mode ``--encrypt/--no-encrypt`` selects;
``encrypted_read_gbps``, ``unencrypted_read_gbps`` and their ratio are reported too, with
``aes_gcm_gbps_per_core`` (single-thread seal/open measured in-run). GB = 1e9 bytes; throughputs count
payload bytes; ``cpu_s_per_gb`` is this process's user+system CPU (all its threads:
``getrusage(RUSAGE_SELF)``; the store server is another process, so its CPU is not included) per GB moved
by the selected mode, both directions together; ``put_cpu_s_per_gb`` / ``get_cpu_s_per_gb`` split it by
direction (CPU of the put or the get phase per GB of payload written or read; least of the rounds), and
``encrypted_*`` / ``unencrypted_*`` give both modes. ``client`` names the S3 client the pool used.
Every block read is verified against what was written.
"""
from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import numpy as np

from kvbm_backend.config import G4Config, io_size_problem
from kvbm_backend.crypto.aead import gcm_gbps_per_core
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model.frame import HEADER_BYTES, slot_bytes
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.model.presets import load_preset
from . import BenchOptions, rounds_progress
from .baseline import random_aligned

ROUNDS = 2
BENCH_TIMEOUT_S = 120.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cfg(url: str, opts: BenchOptions, encrypt: bool, keyring: str, n: int) -> G4Config:
    return G4Config(enabled=True, url=url, endpoint_url=opts.endpoint_url, encrypt=encrypt,
                    keyring={"path": keyring}, timeout_s=BENCH_TIMEOUT_S, max_inflight=opts.threads,
                    write_queue_blocks=max(n, 1), retries=1, s3_client=opts.s3_client)


def _cleanup(url: str, opts: BenchOptions) -> None:
    from kvbm_backend.pool.g4.factory import open_store
    u = urlparse(url)
    if u.scheme == "file":
        shutil.rmtree(u.path, ignore_errors=True)
        return
    st = open_store(url, endpoint_url=opts.endpoint_url, max_inflight=opts.threads)
    try:
        names = [o.name for o in st.list("")]
        with ThreadPoolExecutor(opts.threads) as ex:
            list(ex.map(st.delete, names))
    finally:
        st.close()


def _drop_page_cache(url: str) -> None:
    """file:// stores: drop the (fsynced, clean) pages of every object so reads come from storage."""
    u = urlparse(url)
    if u.scheme != "file":
        return
    for d, _, files in os.walk(u.path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _pool_round(url: str, ns: Namespace, opts: BenchOptions, encrypt: bool, keyring: str,
                src: np.ndarray, dst: np.ndarray) -> dict:
    from kvbm_backend.pool.g4.pool import G4Pool

    bb, n = ns.layout.bytes_per_block, opts.blocks
    pool = G4Pool(_cfg(url, opts, encrypt, keyring, n), ns)
    try:
        keys = ns.keys(range(1, n + 1), tenant="bench-tenant")
        blocks = [src[i * bb:(i + 1) * bb] for i in range(n)]
        outs = [dst[i * bb:(i + 1) * bb] for i in range(n)]
        dst[:] = 0
        c0, t0 = _cpu(), time.perf_counter()
        res = pool.put(keys, blocks).result()
        write_s, c1 = time.perf_counter() - t0, _cpu()
        if res.written != n:
            raise RuntimeError(f"bench: pool wrote {res.written} of {n} blocks ({res}); stats {pool.stats()}")
        _drop_page_cache(url)
        c2, t0 = _cpu(), time.perf_counter()
        got = pool.get(keys, outs).result()
        read_s, c3 = time.perf_counter() - t0, _cpu()
        if not all(got.ok) or not np.array_equal(src[:n * bb], dst[:n * bb]):
            raise RuntimeError(f"bench: pool read back {sum(got.ok)} of {n} verified blocks; stats {pool.stats()}")
        client = getattr(pool.store, "client_name", "posix")  # g4.s3_client for S3 stores
        if pool.stats()["encrypted"] != encrypt:
            raise RuntimeError("bench: pool encryption mode differs from the one asked for")
        return {"write_s": write_s, "read_s": read_s, "cpu_s": (c1 - c0) + (c3 - c2), "put_cpu_s": c1 - c0,
                "get_cpu_s": c3 - c2, "client": client}
    finally:
        pool.close()
        _cleanup(url, opts)


def _s3_baseline(url: str, opts: BenchOptions, object_bytes: int, n: int) -> dict:
    """Plain PUT then GET of ``n`` objects of ``object_bytes`` with the pool's client config."""
    from kvbm_backend.pool.g4.factory import open_store
    st = open_store(url, endpoint_url=opts.endpoint_url, timeout_s=BENCH_TIMEOUT_S, max_inflight=opts.threads,
                    retries=1, s3_client=opts.s3_client)
    data = os.urandom(object_bytes)
    names = [f"obj-{i:08d}" for i in range(n)]
    try:
        with ThreadPoolExecutor(opts.threads) as ex:
            t0 = time.perf_counter()
            list(ex.map(lambda nm: st.put(nm, data), names))
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = list(ex.map(st.get, names))
            read_s = time.perf_counter() - t0
        if any(g is None or bytes(g) != data for g in got):
            raise RuntimeError("bench: S3 baseline read back different bytes than it wrote")
    finally:
        st.close()
        _cleanup(url, opts)
    total = object_bytes * n
    return {"write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9, "total_bytes": total}


def run(opts: BenchOptions) -> dict:
    """Run the G4 benchmark. Returns the JSON-able result (see module doc).

    Raises:
        ValueError: no/bad ``--url``, ``blocks`` < 1, bad layout, I/O size not a multiple of 4 KiB.
        RuntimeError: blocks lost or corrupted (never expected).
    """
    if not opts.url:
        raise ValueError("--url: bench --tier g4 needs s3://BUCKET/PREFIX (with --endpoint-url) or file:///path")
    if opts.blocks < 1:
        raise ValueError(f"--blocks: must be >= 1, got {opts.blocks}")
    if io_size_problem(opts.io_size_bytes):
        raise ValueError(f"--io-size: {io_size_problem(opts.io_size_bytes)} (got {opts.io_size_bytes})")
    u = urlparse(opts.url)
    if u.scheme not in ("s3", "file"):
        raise ValueError(f"--url {opts.url!r}: expected s3://BUCKET/PREFIX or file:///path")
    if u.scheme == "file" and not u.path.startswith("/"):
        raise ValueError(f"--url {opts.url!r}: file URLs must be absolute, file:///path")
    lay = load_preset(opts.layout).layout(page_size=opts.page_size, tp=opts.tp)
    ns = Namespace(model=f"bench/{opts.layout}", layout=lay, tp_world_size=opts.tp)
    bb, n = lay.bytes_per_block, opts.blocks
    src = random_aligned(-(-n * bb // 4096) * 4096, seed=11)
    dst = aligned_empty(src.nbytes)
    base = opts.url.rstrip("/")
    kdir = tempfile.mkdtemp(prefix="kvbm-bench-keys-")
    keyring = os.path.join(kdir, "keyring.json")
    runs: dict[bool, list] = {True: [], False: []}
    base_runs = []
    try:
        gcm = gcm_gbps_per_core()
        with rounds_progress(opts.progress, "bench g4", 3 * ROUNDS) as advance:
            for _ in range(ROUNDS):
                for enc in (opts.encrypt, not opts.encrypt):
                    runs[enc].append(_pool_round(f"{base}/kvbm-bench-g4-{uuid.uuid4().hex[:8]}", ns, opts, enc,
                                                 keyring, src, dst))
                    advance()
                if u.scheme == "s3":
                    base_runs.append(_s3_baseline(f"{base}/kvbm-bench-g4-base-{uuid.uuid4().hex[:8]}", opts,
                                                  HEADER_BYTES + bb, n))
                else:
                    from .baseline import odirect_baseline
                    os.makedirs(u.path, exist_ok=True)
                    io = opts.io_size_bytes
                    total = -(-n * slot_bytes(bb) // io) * io
                    base_runs.append(odirect_baseline(u.path, total, io, opts.threads))
                advance()
    finally:
        shutil.rmtree(kdir, ignore_errors=True)
    payload = n * bb

    def best(enc: bool, what: str) -> float:
        return payload / min(r[f"{what}_s"] for r in runs[enc]) / 1e9

    def cpu(enc: bool, what: str) -> float:  # client CPU seconds per GB of payload moved one way
        return min(r[f"{what}_cpu_s"] for r in runs[enc]) / (payload / 1e9)

    sel = opts.encrypt
    client = runs[sel][0]["client"]
    bw = max(r["write_gbps"] for r in base_runs)
    br = max(r["read_gbps"] for r in base_runs)
    enc_r, plain_r = best(True, "read"), best(False, "read")
    return {
        "tier": "g4",
        "url": opts.url,
        "store": u.scheme,
        "layout": opts.layout,
        "page_size": opts.page_size,
        "tp": opts.tp,
        "block_bytes": bb,
        "object_bytes": HEADER_BYTES + bb,
        "blocks": n,
        "payload_bytes": payload,
        "io_size_bytes": HEADER_BYTES + bb if u.scheme == "s3" else opts.io_size_bytes,
        "inflight": opts.threads,
        "engine": client if u.scheme == "s3" else "posix",
        "client": client if u.scheme == "s3" else "posix",
        "encrypt": sel,
        "page_cache": "dropped before pool reads (posix_fadvise DONTNEED)" if u.scheme == "file" else None,
        "rounds": ROUNDS,
        "write_gbps": best(sel, "write"),
        "read_gbps": best(sel, "read"),
        "baseline_write_gbps": bw,
        "baseline_read_gbps": br,
        "baseline": "plain PUT/GET, same client and concurrency" if u.scheme == "s3" else "plain O_DIRECT I/O",
        "write_ratio": best(sel, "write") / bw if bw else None,
        "read_ratio": best(sel, "read") / br if br else None,
        "cpu_s_per_gb": min(r["cpu_s"] for r in runs[sel]) / (2 * payload / 1e9),
        "encrypted_write_gbps": best(True, "write"),
        "encrypted_read_gbps": enc_r,
        "unencrypted_write_gbps": best(False, "write"),
        "unencrypted_read_gbps": plain_r,
        "encrypted_over_unencrypted_read": enc_r / plain_r if plain_r else None,
        "put_cpu_s_per_gb": cpu(sel, "put"),
        "get_cpu_s_per_gb": cpu(sel, "get"),
        "encrypted_put_cpu_s_per_gb": cpu(True, "put"),
        "encrypted_get_cpu_s_per_gb": cpu(True, "get"),
        "unencrypted_put_cpu_s_per_gb": cpu(False, "put"),
        "unencrypted_get_cpu_s_per_gb": cpu(False, "get"),
        "encrypted_cpu_s_per_gb": min(r["cpu_s"] for r in runs[True]) / (2 * payload / 1e9),
        "unencrypted_cpu_s_per_gb": min(r["cpu_s"] for r in runs[False]) / (2 * payload / 1e9),
        "aes_gcm_gbps_per_core": gcm["open_gbps"],
        "aes_gcm_seal_gbps_per_core": gcm["seal_gbps"],
        "aes_gcm_open_gbps_per_core": gcm["open_gbps"],
        "pool_read_s": {"encrypted": [r["read_s"] for r in runs[True]],
                        "unencrypted": [r["read_s"] for r in runs[False]]},
        "baseline_read_gbps_runs": [r["read_gbps"] for r in base_runs],
    }
