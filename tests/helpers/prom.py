"""Test helpers for the Prometheus endpoint (``metrics.port``): a free local port and one scrape parsed into
``{series with labels: value}``."""
from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 120) -> dict[str, float]:
    """GET ``/metrics`` on 127.0.0.1:``port``: every sample line as ``{'name{labels}': value}``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
