"""G4's default S3 client (g4.s3_client: obstore) comes with a plain install, and an environment without it gets an
error naming the field. Review finding (2026-11-29): obstore was an optional extra, so the k8s image (a plain
``pip install``) could not open an S3 G4 (ModuleNotFoundError at engine start)."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from kvbm_backend.config import G4Config

HANG_S = 600.0  # a hang guard, not a bound: waits for a process that must end; returns as soon as it does

REPO = Path(__file__).resolve().parents[3]


def test_the_default_s3_client_is_a_core_dependency():
    assert G4Config.model_fields["s3_client"].default == "obstore"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "obstore" for d in deps), deps


def test_without_obstore_opening_s3_names_the_field():
    code = ("import sys; sys.modules['obstore'] = None\n"
            "from kvbm_backend.pool.g4.factory import open_store\n"
            "try:\n"
            "    open_store('s3://bucket/pfx', endpoint_url='http://127.0.0.1:1')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, cwd=str(REPO),
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("g4.s3_client: obstore is not installed") and "boto3" in r.stdout, r.stdout
