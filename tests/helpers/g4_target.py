"""G4 pool settings for one store kind of a ``params=["fs", "s3"]`` fixture: a file:// store in ``tmp_path`` or a
prefix of the session's SeaweedFS server (requested only for "s3", so fs runs need no server), a keyring in
``tmp_path``."""
from __future__ import annotations

from typing import Any


def g4_target(request: Any, tmp_path: Any, s3_prefix: str, timeout_s: float = 60.0, dir_fanout: int = 16,
              keyring_path: Any = None, **keyring_opts: Any) -> dict:
    """``G4Config`` keyword arguments for ``request.param`` ("fs" or "s3"). ``timeout_s``: the load bound (60 s
    where a test checks bytes and counters, not speed: a read the busy CI VM froze for 13-31 s must not turn into a
    miss, 2026-11-29). ``keyring_path`` (default ``tmp_path/keys/keyring.json``) and ``keyring_opts`` (e.g.
    ``reload_interval_s``): the ``g4.keyring`` section."""
    keyring = {"path": str(keyring_path or tmp_path / "keys" / "keyring.json"), **keyring_opts}
    kw: dict = {"keyring": keyring, "timeout_s": timeout_s, "dir_fanout": dir_fanout}
    if request.param == "fs":
        kw["url"] = f"file://{tmp_path / 'store'}"
    else:
        sw = request.getfixturevalue("seaweed")
        kw.update(url=sw.url(s3_prefix), endpoint_url=sw.endpoint)
    return kw
