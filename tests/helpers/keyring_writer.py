"""A worker process stopped inside a keyring write: after its read of the file and the fsync of its temp
file, before the publish (the check of the path and the rename), until the test lets it go on. Places an
operator's action (``rm``, ``mv``, ``keys destroy``) inside a change without timing: tests/crypto/test_keyring_shred.py,
tests/apps/test_keys_cli.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HANG_S = 600.0  # a hang guard, not a bound: the child reports as soon as it is in its write

ROOT = str(Path(__file__).resolve().parents[2])

_WRITER = r"""
import json, logging, os, sys
sys.path.insert(0, sys.argv[3])
from kvbm_backend.crypto.keyring import Keyring, provider_for
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
path, mode = sys.argv[1], sys.argv[2]
kr = Keyring(path, provider_for(path), create=False, reload_every_s=0.0,
             persist_every_s=0.0 if mode == "persist" else 3600.0)
real_fsync, d, paused = os.fsync, os.path.dirname(path), []

def fsync(fd):
    real_fsync(fd)
    name = os.readlink(f"/proc/self/fd/{fd}")
    if not paused and os.path.dirname(name) == d and os.path.basename(name).startswith("." + os.path.basename(path) + "."):
        paused.append(1)  # the temp file is complete and on disk: only the check and the rename are left
        print("IN_WRITE", flush=True)
        assert sys.stdin.readline() == "go\n"

os.fsync = fsync
out = {}
try:
    if mode == "create":
        kr.write_key("newcomer")  # an implicit tenant creation (a new cache_salt's first offload)
    else:
        dk = kr.write_key("acme")  # counts a use and starts the background persist
        kr._uses.wait()
        out["serves_key_after"] = kr.read_key(dk.key_id, dk.version, tenant="acme") is not None
    out["result"] = "ok"
except Exception as e:
    out["result"] = f"{type(e).__name__}: {e}"
out["paused"] = bool(paused)
print(json.dumps(out), flush=True)
"""


class PausedKeyringWriter:
    """Start a writer of keyring ``path`` (its KEK from ``$KVBM_BACKEND_KEK`` or ``PATH.kek``) and return once
    it is inside its write, holding ``PATH.lock``. ``mode``: ``create`` (``write_key`` of a new tenant,
    ``newcomer``: an implicit creation) or ``persist`` (``write_key("acme")`` with ``persist_every_s=0``:
    the background use-count persist writes). :meth:`finish` lets it go on and returns its report:
    ``{"result": "ok" | "<Error>: <message>", "paused": bool, "serves_key_after" (persist), "stderr"}``."""

    def __init__(self, path: Path, mode: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), mode, ROOT], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.p.stdout is not None
        line = self.p.stdout.readline()  # blocks until the writer is inside its write (or has died)
        if line != "IN_WRITE\n":
            self.kill()
            raise AssertionError(f"the keyring writer never reached its write: {line!r} {self.p.stderr.read()}")

    def finish(self) -> dict:
        out, err = self.p.communicate("go\n", timeout=HANG_S)
        assert self.p.returncode == 0, err
        return dict(json.loads(out.strip().splitlines()[-1]), stderr=err)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=HANG_S)
