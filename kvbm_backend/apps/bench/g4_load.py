"""G4 loads into host staging: GB/s and client CPU per GB, encrypted vs plain, by I/O thread count
(issue 24 item 4, the CPU-measurable half of "G4 into HBM").

``python -m kvbm_backend.apps.bench.g4_load [--dir /dev/shm] [--blocks 256] [--layout llama-3.1-8b]
[--threads 1,2,4,8,16] [--rounds 3] [--json]``

Writes ``--blocks`` blocks with a :class:`~kvbm_backend.pool.g4.pool.G4Pool` on ``file://DIR/...`` (tmpfs by
default: the storage is then memory speed and the pool's own work is what is measured), once encrypted
(AES-256-GCM) and once plain (xxh3_128), then for each thread count ``N`` (``g4.max_inflight``) loads them
all into one host staging buffer, best of ``--rounds``, through each of ``--paths``: ``staged``
(``G4Pool.get_staged``, what :func:`kvbm_backend.gpu.host_path.load_via_host` does before its
host-to-device copies) and ``get`` (``G4Pool.get``: bounce buffer, verify, copy; device loads went this
way before). Every block is verified by the pool and
compared with what was written. Reports, per mode and N: ``gbps`` (payload GB/s, GB = 1e9 bytes),
``cpu_s_per_gb`` (this process's user+system CPU, all threads, per GB loaded), ``cores_busy``
(CPU seconds per wall second), ``minflt_per_block`` (minor page faults per block loaded: a
payload-sized buffer allocated per block would show as ~512 per 2 MiB block) and ``vcsw_per_block`` (voluntary
context switches per block: a thread that sleeps waiting for the GIL, a lock or a queue counts one) under ``results[path][mode][N]``, and ``encrypted_over_plain[path][N]``. The page cache of a tmpfs store is
the store itself, so nothing is dropped between rounds.

``--engine-busy F`` (0 < F <= 1) also measures the ``staged`` loads with an engine's step loop stepping in
this process (:class:`~kvbm_backend.apps.bench.busy_engine.BusyEngine`: F of each 10 ms step running Python),
once per ``--switch-ms`` value (the interpreter's switch interval while loads run, as ``load_gil_switch_ms``
sets it; 5 is CPython's own): ``engine_busy["by_switch_ms"][ms][mode][N]`` holds ``gbps`` and the engine's
``step_ms_p50`` / ``step_ms_p99`` (its step alone: ``engine_busy["step_ms_alone"]``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

from kvbm_backend.config import G4Config
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.model.presets import load_preset


def _cpu() -> tuple[float, int, int]:
    """(user + system CPU seconds, minor page faults, voluntary context switches) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_nvcsw


def run(directory: str = "/dev/shm", blocks: int = 256, layout: str = "llama-3.1-8b", threads=(1, 2, 4, 8),
        rounds: int = 3, paths=("staged", "get"), engine_busy: float = 0.0, switch_ms=(5.0, 0.5)) -> dict:
    """Run the benchmark (see the module doc). Returns the JSON-able result.

    Raises ValueError for ``blocks``, ``rounds`` or a thread count < 1, a missing ``directory``, ``engine_busy``
    outside [0, 1] or a ``switch_ms`` value <= 0; RuntimeError if a block does not load back verified and equal
    (never expected)."""
    if not 0 <= engine_busy <= 1 or (engine_busy and (not switch_ms or min(switch_ms) <= 0)):
        raise ValueError(f"g4_load: --engine-busy must be in [0, 1] ({engine_busy}) and --switch-ms values > 0 "
                         f"({switch_ms})")
    from kvbm_backend.pool.g4.pool import G4Pool
    if rounds < 1:
        raise ValueError(f"g4_load: --rounds: must be >= 1, got {rounds}")
    if set(paths) - {"staged", "get"} or not paths:
        raise ValueError(f"g4_load: --paths: 'staged' and/or 'get', got {paths}")
    if blocks < 1 or not threads or min(threads) < 1:
        raise ValueError(f"g4_load: --blocks ({blocks}) and every --threads value must be >= 1")
    if not os.path.isdir(directory):
        raise ValueError(f"g4_load: --dir {directory!r} is not a directory")
    lay = load_preset(layout).layout(page_size=16, tp=1)
    ns = Namespace(model=f"bench/{layout}", layout=lay, tp_world_size=1)
    bpb = lay.bytes_per_block
    src = np.random.default_rng(5).integers(0, 256, blocks * bpb, dtype=np.uint8)
    staging = aligned_empty(blocks * bpb)
    rows = [staging[i * bpb:(i + 1) * bpb] for i in range(blocks)]
    keys = ns.keys(range(1, blocks + 1), tenant="bench")
    root = tempfile.mkdtemp(prefix="kvbm-g4-load-", dir=directory)
    out: dict = {"bench": "g4_load", "store": f"file://{root}", "layout": layout, "block_bytes": bpb,
                 "blocks": blocks, "payload_bytes": blocks * bpb, "rounds": rounds, "cpu_count": os.cpu_count(),
                 "results": {}}
    try:
        for enc in (True, False):
            mode = "encrypted" if enc else "plain"
            base = G4Config(enabled=True, url=f"file://{root}/{mode}", encrypt=enc, fsync=False, timeout_s=120,
                            keyring={"path": os.path.join(root, "kr.json")}, write_queue_blocks=blocks)
            with G4Pool(base, ns) as p:
                r = p.put(keys, [src[i * bpb:(i + 1) * bpb] for i in range(blocks)]).result()
                if r.written != blocks:
                    raise RuntimeError(f"g4_load: wrote {r.written} of {blocks} blocks")
            for path in paths:
                res = out["results"].setdefault(path, {}).setdefault(mode, {})
                for n in threads:
                    res[str(n)] = _measure(G4Pool(base.model_copy(update={"max_inflight": n}), ns), path, keys, rows,
                                           staging, src, rounds)
            if engine_busy:
                _busy(out, engine_busy, switch_ms, mode, base, ns, threads, keys, rows, staging, src, rounds)
        out["encrypted_over_plain"] = {path: {str(n): r["encrypted"][str(n)]["gbps"] / r["plain"][str(n)]["gbps"]
                                              for n in threads} for path, r in out["results"].items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _busy(out: dict, fraction: float, switch_ms, mode: str, base, ns, threads, keys, rows, staging, src,
          rounds: int) -> None:
    """``staged`` loads of ``mode`` with a :class:`BusyEngine` stepping, per switch interval, each load run as the
    connector runs it (:func:`kvbm_backend.integrations.load_priority.loading`, configured to that interval,
    from CPython's 5 ms; see the module doc)."""
    import sys

    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations import load_priority
    from kvbm_backend.pool.g4.pool import G4Pool

    from .busy_engine import BusyEngine
    eng = BusyEngine(fraction)
    eb = out.setdefault("engine_busy", {"busy_fraction": fraction, "step_ms": eng.step_ms,
                                        "step_ms_alone": round(eng.step_ms_alone, 3), "by_switch_ms": {}})
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        for ms in switch_ms:
            load_priority.configure(ms)
            res = eb["by_switch_ms"].setdefault(f"{ms:g}", {}).setdefault(mode, {})
            for n in threads:
                pool = G4Pool(base.model_copy(update={"max_inflight": n}), ns)
                with eng, load_priority.loading():
                    r = _measure(pool, "staged", keys, rows, staging, src, rounds)
                rep = eng.report()
                res[str(n)] = {"gbps": r["gbps"], "step_ms_p50": rep["step_ms_p50"], "step_ms_p99": rep["step_ms_p99"]}
    finally:
        load_priority.configure(KvbmBackendConfig().load_gil_switch_ms)
        sys.setswitchinterval(old)


def _measure(pool, path: str, keys, rows, staging, src, rounds: int) -> dict:
    """Best of ``rounds`` loads of every key into ``rows`` through ``path``; closes ``pool``."""
    blocks = len(keys)
    best: tuple[float, float, int, int] | None = None
    with pool as p:
        for _ in range(rounds):
            staging[:] = 0
            (c0, f0, v0), t0 = _cpu(), time.perf_counter()
            if path == "staged":
                ok = p.get_staged(list(keys), rows).future.result().ok
            else:
                ok = p.get(list(keys), rows).result().ok
            wall, (c1, f1, v1) = time.perf_counter() - t0, _cpu()
            if not all(ok) or not np.array_equal(staging, src):
                raise RuntimeError(f"g4_load: {path}: {sum(ok)} of {blocks} verified; {p.stats()}")
            if best is None or wall < best[0]:
                best = (wall, c1 - c0, f1 - f0, v1 - v0)
    gb = staging.nbytes / 1e9
    assert best is not None  # rounds >= 1 (run checks it)
    return {"gbps": gb / best[0], "cpu_s_per_gb": best[1] / gb, "cores_busy": best[1] / best[0],
            "minflt_per_block": best[2] / blocks, "vcsw_per_block": best[3] / blocks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def usage_error(msg: str) -> None:  # argparse's usage errors as one line too
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(2)
    ap.error = usage_error  # type: ignore[method-assign,assignment]
    ap.add_argument("--dir", default="/dev/shm", help="directory of the file:// store (tmpfs by default)")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--layout", default="llama-3.1-8b")
    ap.add_argument("--threads", default="1,2,4,8", help="comma-separated I/O thread counts (g4.max_inflight)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default="staged,get",
                    help="staged: G4Pool.get_staged (the device-load path); get: G4Pool.get into the same rows "
                         "(bounce buffer, verify, copy: the path device loads took before)")
    ap.add_argument("--engine-busy", type=float, default=0.0,
                    help="also load with an engine step loop running Python this share of each 10 ms step (0: off)")
    ap.add_argument("--switch-ms", default="5,0.5",
                    help="with --engine-busy: switch intervals (ms) to load under (load_gil_switch_ms; 5: CPython's)")
    ap.add_argument("--json", action="store_true", help="print the JSON result")
    a = ap.parse_args(argv)
    def nums(flag: str, text: str, kind: type) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{flag}: expected comma-separated {kind.__name__} values (got {text!r})") from None

    try:
        threads = nums("--threads", a.threads, int)
        switch_ms = nums("--switch-ms", a.switch_ms, float)
        d = run(a.dir, a.blocks, a.layout, threads, a.rounds, tuple(x for x in a.paths.split(",") if x),
                a.engine_busy, switch_ms)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(d, indent=1))
    else:
        for path, modes in d["results"].items():
            for mode, res in modes.items():
                for n, r in res.items():
                    print(f"{path:6s} {mode:9s} N={n:>2s}  {r['gbps']:6.2f} GB/s  {r['cpu_s_per_gb']:5.2f} CPU-s/GB  "
                          f"{r['cores_busy']:4.1f} cores  {r['minflt_per_block']:5.1f} faults/block  "
                          f"{r['vcsw_per_block']:4.2f} sleeps/block")
            print(f"{path}: encrypted / plain", {n: round(v, 2) for n, v in d["encrypted_over_plain"][path].items()})
        eb = d.get("engine_busy")
        if eb:
            print(f"engine busy {eb['busy_fraction']:g} of each {eb['step_ms']:g} ms step (alone: {eb['step_ms_alone']} ms):")
            for ms, modes in eb["by_switch_ms"].items():
                for mode, res in modes.items():
                    for n, r in res.items():
                        print(f"  switch {ms:>4s} ms {mode:9s} N={n:>2s}  {r['gbps']:6.2f} GB/s  engine step p50 "
                              f"{r['step_ms_p50']} ms p99 {r['step_ms_p99']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
