"""The test bed's hosts and processes: network namespaces on a bridge (or loopback), SeaweedFS's binary,
free ports, process groups, and the per-user state files that :func:`clean_stale` uses to remove what a
run whose owner died left behind (``ci/g4_cluster.sh clean``). See the package doc."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

MODE_ENV = "KVBM_G4_CLUSTER_MODE"  # auto (default) | netns | loopback
STATE_DIR = Path(f"/tmp/kvbm-g4c-{os.getuid()}")  # per user: a root-made one would refuse others
# netns mode: every host has its own address, so servers keep SeaweedFS's default ports
PORTS = {"master": 9333, "volume": 8080, "filer": 8888, "s3": 8333}


def weed_binary() -> str | None:
    """``weed`` next to this interpreter (the venv), else on PATH; None if absent."""
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which("weed")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def netns_unavailable_reason() -> str | None:
    """None when this process can make network namespaces, a bridge and veth pairs; else why not."""
    if os.environ.get(MODE_ENV, "auto") == "loopback":
        return f"{MODE_ENV}=loopback"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found"
    tag = uuid.uuid4().hex[:6]
    ns, br, veth = f"kvprobe-{tag}", f"kvpb{tag}", f"kvpv{tag}"
    try:
        for args in (("netns", "add", ns), ("link", "add", br, "type", "bridge"),
                     ("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns),
                     ("netns", "exec", ns, "ip", "link", "set", "lo", "up")):
            r = _ip(*args, check=False)
            if r.returncode:
                return f"`ip {' '.join(args)}` failed: {r.stderr.strip()} (no CAP_NET_ADMIN / CAP_SYS_ADMIN here?)"
        return None
    finally:
        _ip("link", "del", veth, check=False)
        _ip("link", "del", br, check=False)
        _ip("netns", "del", ns, check=False)


def _free_ports(n: int) -> list[int]:
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            if p < 50000 and p not in ports:  # weed's default gRPC port is port + 10000: keep clear
                ports.append(p)
                socks.append(s)
            else:
                s.close()
    finally:
        for s in socks:
            s.close()
    return ports


def _start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot): with the pid, names one process even
    after the pid is reused. None when there is no such process, or it is a zombie (dead)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if f[0] == "Z" else int(f[19])
    except (OSError, IndexError, ValueError):
        return None


def _kill_group(pid: int, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def clean_stale() -> list[str]:
    """Remove the namespaces, bridge and processes of runs whose owner process is gone. Returns their ids."""
    done: list[str] = []
    if not STATE_DIR.is_dir():
        return done
    for f in STATE_DIR.glob("*.json"):
        try:
            st = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        owner, started = st.get("owner", 0), st.get("owner_start")
        if _start_time(owner) == started:
            continue
        _teardown(st)
        f.unlink(missing_ok=True)
        done.append(st.get("run_id", f.stem))
    return done


def _teardown(st: dict) -> None:
    for pid, started in st.get("pids", []):
        if _start_time(pid) == started:  # still the process we started (not a reused pid)
            _kill_group(pid, signal.SIGCONT)
            _kill_group(pid)
    for ns in st.get("netns", []):
        _ip("netns", "del", ns, check=False)
    if st.get("bridge"):
        _ip("link", "del", st["bridge"], check=False)


class Host:
    """One "host": a network namespace on the bridge (netns mode) or 127.0.0.1 (loopback)."""

    def __init__(self, name: str, ip: str, ns: str | None, port_if: str | None):
        self.name, self.ip, self.ns, self.port_if = name, ip, ns, port_if

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns] if self.ns else []
