"""The S3 client bench (``python -m kvbm_backend.apps.bench.s3_clients``) run briefly against the real
SeaweedFS fixture server: its JSON has numbers for every client that can run here, and each client
read back exactly what it wrote (the bench raises otherwise)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbm_backend.apps.bench.s3_clients import CLIENTS, run

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)


def test_s3_clients_bench_json(seaweed):
    env = {**os.environ}
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.bench.s3_clients", "--endpoint-url", seaweed.endpoint,
                        "--bucket", seaweed.bucket, "--object-mib", "0.25", "--objects", "4", "--inflight", "2",
                        "--runs", "1", "--json"], capture_output=True, text=True, timeout=HANG_S, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)  # stdout is only the JSON (NIXL's log lines go to stderr)
    assert d["object_bytes"] == 256 << 10 and d["objects"] == 4 and d["inflight"] == 2 and d["runs"] == 1
    assert set(d["clients"]) | set(d["skipped"]) == set(CLIENTS)
    assert "boto3" in d["clients"], d["skipped"]
    for name, c in d["clients"].items():
        for k in ("put_gbps", "get_gbps", "put_cpu_s_per_gb", "get_cpu_s_per_gb", "get_vs_boto3"):
            assert isinstance(c[k], float) and c[k] > 0, (name, k, c[k])
        assert len(c["runs"]) == 1
    b = d["clients"]["boto3"]
    assert b["conditional_put"] is True and b["ranged_get"] is True and b["get_vs_boto3"] == 1.0
    if "obstore" in d["clients"]:
        assert d["clients"]["obstore"]["conditional_put"] is True and d["clients"]["obstore"]["ranged_get"] is True
    for why in d["skipped"].values():
        assert why  # every skip names its reason


def test_s3_clients_bad_input(seaweed):
    with pytest.raises(ValueError, match="objects"):
        run(seaweed.endpoint, seaweed.bucket, objects=0)
    with pytest.raises(ValueError, match="client 'aws-cli'"):
        run(seaweed.endpoint, seaweed.bucket, clients=["aws-cli"])
