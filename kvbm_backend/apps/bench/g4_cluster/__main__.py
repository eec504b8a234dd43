"""``python -m kvbm_backend.apps.bench.g4_cluster up|clean|bench`` (``ci/g4_cluster.sh``), and the
``worker`` / ``relay`` processes a :class:`~.cluster.G4Cluster` starts."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from . import __doc__ as _doc
from .bench import bench, check_options
from .cluster import G4Cluster
from .hosts import clean_stale
from .worker import relay_main, worker_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbm_backend.apps.bench.g4_cluster", description=_doc.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("index", type=int)
    r = sub.add_parser("relay")
    r.add_argument("listen_port", type=int)
    r.add_argument("host")
    r.add_argument("port", type=int)
    up = sub.add_parser("up", help="start a cluster and keep it until Ctrl-C / SIGTERM")
    up.add_argument("--dir", required=True)
    up.add_argument("--workers", type=int, default=4)
    up.add_argument("--volumes", type=int, default=3)
    sub.add_parser("clean", help="remove namespaces/bridges/processes of runs whose owner died")
    b = sub.add_parser("bench", help="aggregate G4 GB/s for 1..N workers vs plain S3 PUT/GET (JSON + plot)")
    b.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    b.add_argument("--blocks", type=int, default=16, help="blocks per worker")
    b.add_argument("--layout", default="llama-3.1-8b")
    b.add_argument("--page-size", type=int, default=16)
    b.add_argument("--inflight", type=int, default=4, help="G4 max_inflight per worker")
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--no-encrypt", action="store_true")
    b.add_argument("--replication", default="001", help="SeaweedFS replica placement 00z (001: 2 copies)")
    b.add_argument("--volumes", type=int, default=3, help="volume servers (>= 1 + z)")
    b.add_argument("--read-passes", type=int, default=3,
                   help="each worker reads the next worker's blocks this often (one worker: its own)")
    b.add_argument("--out", help="JSON file to write")
    b.add_argument("--plot", help="PNG to write (kvbm-backend plot)")
    b.add_argument("--out-dir", help="write g4_cluster-<mode>-<date>.json and .png here (mode as it ran)")
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        return worker_main(a.index)
    if a.cmd == "relay":
        return relay_main(a.listen_port, a.host, a.port)
    if a.cmd == "clean":
        print(json.dumps({"cleaned": clean_stale()}))
        return 0
    if a.cmd == "up":
        try:
            cl = G4Cluster(a.dir, workers=a.workers, volumes=a.volumes)
        except ValueError as e:  # names the option; nothing was started
            ap.error(f"up: {e}")
        cl.start()
        print(json.dumps(cl.info(), indent=1), flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            cl.stop()
        return 0
    if not (a.out or a.out_dir):
        ap.error("bench: --out FILE.json or --out-dir DIR")
    try:
        counts = sorted({int(x) for x in a.workers.split(",") if x.strip()})
    except ValueError:
        ap.error(f"bench: --workers: expected comma-separated worker counts such as 1,2,4, got {a.workers!r}")
    try:  # every option is checked before any server starts
        check_options(counts, a.blocks, a.layout, a.page_size, a.inflight, a.rounds, a.read_passes, a.replication,
                      a.volumes)
    except ValueError as e:
        ap.error(f"bench: {e}")
    res = bench(counts, a.blocks, a.layout, a.page_size, not a.no_encrypt, a.inflight, rounds=a.rounds,
                replication=a.replication, volumes=a.volumes, read_passes=a.read_passes, progress=lambda s: print(s, file=sys.stderr, flush=True))
    if a.out_dir:
        stem = Path(a.out_dir) / f"g4_cluster-{res['mode']}-{time.strftime('%Y-%m-%d', time.gmtime())}"
        a.out, a.plot = a.out or f"{stem}.json", a.plot or f"{stem}.png"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("mode", "fallback_reason", "workers", "series", "ratio")}, indent=1))
    if a.plot:
        from kvbm_backend.apps.report import plot_results
        plot_results([a.out], a.plot)
    print(f"wrote {a.out}" + (f" {a.plot}" if a.plot else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
