"""``kvbm-backend bench --tier g4``: write then read N blocks through :class:`~kvbm_backend.pool.g4.pool.G4Pool`
on ``s3://BUCKET/PREFIX`` (``--endpoint-url``) or ``file:///path``, against a baseline of the same bytes
taken in the same run:

* S3: plain ``PUT``/``GET`` of objects of the same size (header + payload) with the same client
  (``g4.s3_client``: obstore by default; ``BenchOptions.s3_client``) and configuration, best of 1, 4, 8
  and 16 requests in flight (whatever the pool's ``--threads``).
* file: the store's own I/O done plainly (:func:`kvbm_backend.apps.bench.baseline.object_files_sweep`):
  one file per object of the stored size, written whole with one ``pwrite`` + ``fsync`` and read whole
  (O_DIRECT where taken), best of 1, 4, 8 and 16 threads.

``baseline_sweep`` lists every point measured and the best of each direction; the ratios are against
those bests. Every object is moved whole, so ``io_size_bytes`` is the object size (``--io-size`` does not
apply; the CLI refuses it). The S3 store is probed first (a bucket HEAD with a short timeout), so an
unreachable ``--endpoint-url`` fails in seconds.

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

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.aead import gcm_gbps_per_core
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.model.presets import load_preset
from . import BenchOptions, rounds_progress
from ..signals import raise_if_terminated
from .baseline import SWEEP_THREADS, Sweep, object_files_sweep, random_aligned

ROUNDS = 2
BENCH_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 5.0  # the store's first answer (bucket HEAD): an unreachable endpoint fails this fast


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
            u = urlparse(url)
            if u.scheme == "file" and shutil.disk_usage(os.path.dirname(u.path)).free < (n - res.written) * (bb + 8192):
                raise OSError(f"--url: no room for --blocks {n} in {os.path.dirname(u.path)}: the pool wrote "
                              f"{res.written}; free space there or use fewer --blocks")
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


def probe_s3(url: str, opts: BenchOptions) -> None:
    """HEAD the bucket with the pool's client and a :data:`PROBE_TIMEOUT_S` timeout, no retry. Raises
    ValueError naming ``--url`` / ``--endpoint-url`` when the store does not answer or refuses."""
    from kvbm_backend.pool.g4.factory import open_store
    try:
        st = open_store(url, endpoint_url=opts.endpoint_url, timeout_s=PROBE_TIMEOUT_S, retries=0,
                        s3_client=opts.s3_client)
    except ValueError as e:  # a bad bucket name, ...: the message names g4.url, the option is --url
        raise ValueError(f"--url {url}: {str(e).removeprefix(f'g4.url {url!r}: ')}") from None
    try:
        st.probe()
    except OSError as e:
        raise ValueError(f"--url {url} / --endpoint-url {opts.endpoint_url}: the store did not answer a bucket "
                         f"HEAD within {PROBE_TIMEOUT_S:g} s or refused it ({type(e).__name__}: {e})") from None
    finally:
        st.close()


def plain_s3_phase(st, ex: ThreadPoolExecutor, op: str, names: list[str], data: bytes) -> float:
    """One timed phase of the plain S3 baseline: ``op`` "put" PUTs ``data`` under every name in ``names``,
    "get" GETs every name, both through ``st`` (an opened store) from the threads of ``ex`` (its size is the
    requests in flight). Returns the wall seconds of the requests alone. Raises RuntimeError when a GET
    returns bytes other than ``data`` (checked after the timed part), OSError for a failed request."""
    t0 = time.perf_counter()
    if op == "put":
        list(ex.map(lambda nm: st.put(nm, data), names))
        return time.perf_counter() - t0
    got = list(ex.map(st.get, names))
    elapsed = time.perf_counter() - t0
    if any(g is None or bytes(g) != data for g in got):
        raise RuntimeError("bench: S3 baseline read back different bytes than it wrote")
    return elapsed


def _s3_baseline(url: str, opts: BenchOptions, object_bytes: int, n: int, threads: int) -> dict:
    """Plain PUT then GET of ``n`` objects of ``object_bytes`` with the pool's client config, ``threads`` requests
    in flight."""
    from kvbm_backend.pool.g4.factory import open_store
    st = open_store(url, endpoint_url=opts.endpoint_url, timeout_s=BENCH_TIMEOUT_S, max_inflight=threads,
                    retries=1, s3_client=opts.s3_client)
    data = os.urandom(object_bytes)
    names = [f"obj-{i:08d}" for i in range(n)]
    try:
        with ThreadPoolExecutor(threads) as ex:
            write_s = plain_s3_phase(st, ex, "put", names, data)
            read_s = plain_s3_phase(st, ex, "get", names, data)
    finally:
        st.close()
        _cleanup(url, opts)
    total = object_bytes * n
    return {"write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9, "total_bytes": total}


def run(opts: BenchOptions) -> dict:
    """Run the G4 benchmark. Returns the JSON-able result (see module doc).

    Raises:
        ValueError: no/bad ``--url``, ``blocks`` < 1, bad layout, an S3 store that does not answer.
        RuntimeError: blocks lost or corrupted (never expected).
    """
    if not opts.url:
        raise ValueError("--url: bench --tier g4 needs s3://BUCKET/PREFIX (with --endpoint-url) or file:///path")
    if opts.blocks < 1:
        raise ValueError(f"--blocks: must be >= 1, got {opts.blocks}")
    u = urlparse(opts.url)
    if u.scheme not in ("s3", "file"):
        raise ValueError(f"--url {opts.url!r}: expected s3://BUCKET/PREFIX or file:///path")
    if u.scheme == "file" and not u.path.startswith("/"):
        raise ValueError(f"--url {opts.url!r}: file URLs must be absolute, file:///path")
    lay = load_preset(opts.layout).layout(page_size=opts.page_size, tp=opts.tp)
    ns = Namespace(model=f"bench/{opts.layout}", layout=lay, tp_world_size=opts.tp)
    bb, n = lay.bytes_per_block, opts.blocks
    base = opts.url.rstrip("/")
    obj = HEADER_BYTES + bb
    if u.scheme == "s3":
        probe_s3(base, opts)
        sweep = Sweep("plain PUT/GET, same client", [{"threads": t, "object_bytes": obj} for t in sorted({min(t, n) for t in SWEEP_THREADS})],
                      lambda p: _s3_baseline(f"{base}/kvbm-bench-g4-base-{uuid.uuid4().hex[:8]}", opts, obj, n,
                                             p["threads"]), bytes=obj * n)
    else:
        sweep = object_files_sweep(u.path, obj, n)
    src = random_aligned(-(-n * bb // 4096) * 4096, seed=11)
    dst = aligned_empty(src.nbytes)
    kdir = tempfile.mkdtemp(prefix="kvbm-bench-keys-")
    keyring = os.path.join(kdir, "keyring.json")
    runs: dict[bool, list] = {True: [], False: []}
    try:
        gcm = gcm_gbps_per_core()
        with rounds_progress(opts.progress, "bench g4", 3 * ROUNDS) as advance:
            for rnd in range(ROUNDS):
                for enc in (opts.encrypt, not opts.encrypt):
                    raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
                    runs[enc].append(_pool_round(f"{base}/kvbm-bench-g4-{uuid.uuid4().hex[:8]}", ns, opts, enc,
                                                 keyring, src, dst))
                    advance()
                sweep.measure(full=rnd == 0)
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
    bw, br = sweep.best_gbps("write"), sweep.best_gbps("read")
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
        "io_size_bytes": obj,  # every object is written and read whole
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
        "baseline": ("best of plain PUT/GET, same client (1-16 requests in flight)" if u.scheme == "s3" else
                     f"best of plain {'O_DIRECT ' if sweep.o_direct else ''}file per object, written whole + fsync"
                     ", read whole (1-16 threads)"),
        "baseline_o_direct": sweep.o_direct if u.scheme == "file" else None,
        "baseline_sweep": sweep.result(),
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
    }
