"""Small pool / layout setups shared by tests in several folders (docs/testing.md "Layout").

``TINY_LAYOUT`` is the layout most pool and connector tests use: 2 layers, K and V, 16 tokens a page, 64
values a token, bfloat16 (8 KiB blocks; the same as ``tests.helpers.crash_writer.LAYOUT``).
``tiny_ns(model)`` is a namespace on it. ``g3_config(path, **kw)`` is a small G3 configuration on one
directory (50 MB, one slab file, every block admitted) and ``open_g3(path, ns, **kw)`` an open pool on it;
keyword arguments override any :class:`~kvbm_backend.config.G3Config` field.

``G3_LOAD_S``, ``G4_TIMEOUT_S`` and ``LOOKUP_S``: the load and lookup deadlines of a test that checks bytes, hits or
counts, not a bound (``g3.load_timeout_s``, ``g4.timeout_s``, the scheduler side's ``lookup_timeout_s``; the serving
defaults are 5 s, 2 s (a G4 load bound of 4.05 s) and 2 s): at ``nice 19`` beside the engine lanes on the busy 2-core
CI VM a read can be frozen for 13-31 s (2026-11-29), and a correct hit then turns into a ``timeout`` miss. Only a
real hang misses these; tests of a bound pass their own."""
from __future__ import annotations

from typing import Any

from kvbm_backend.config import LOAD_TIMEOUT_MAX_S, G3Config
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace

TINY_LAYOUT = KvLayout(2, 2, 16, 64, "bfloat16")
G3_LOAD_S = LOAD_TIMEOUT_MAX_S  # g3.load_timeout_s (120 s, its largest) of a test that is not about the bound
G4_TIMEOUT_S = 60.0  # g4.timeout_s of such a test: a load bound of 60 x (1 + retries) s (120.05 s at retries 1)
LOOKUP_S = 120.0  # SchedulerSide(lookup_timeout_s=) of such a test (the class default: 2 s; the wiring's: the G4 bound)


def tiny_ns(model: str = "test/tiny", **kw: Any) -> Namespace:
    """A namespace of ``model`` on :data:`TINY_LAYOUT` (``kw``: Namespace's other fields, e.g. tp_world_size)."""
    return Namespace(model, TINY_LAYOUT, **kw)


def g3_config(path, **kw: Any) -> G3Config:
    """G3 on the one directory ``path``: capacity 0.05 GB, 1 slab file, admission ``all``, load bound 120 s; ``kw``
    overrides. The load bound is the maximum (the default is 5 s): tests that check bytes must not see a read the
    busy CI VM froze for 13-31 s (2026-11-29) as a timeout; tests of the bound pass their own."""
    base: dict[str, Any] = dict(paths=[str(path)], capacity_gb=0.05, files_per_path=1, admission={"policy": "all"},
                                load_timeout_s=G3_LOAD_S)
    base.update(kw)
    return G3Config(**base)


def open_g3(path, ns: Namespace, *, engine=None, registry=None, **kw: Any):
    """``G3Pool(g3_config(path, **kw), ns, engine=engine, registry=registry)`` (close it, or use ``with``)."""
    from kvbm_backend.pool.g3 import G3Pool
    return G3Pool(g3_config(path, **kw), ns, engine=engine, registry=registry)


def flip_g3_payload(g3, key, block_bytes: int) -> None:
    """Flip one byte near the end of the stored payload of ``key`` in G3 pool ``g3`` (its last layer; the checksum
    no longer verifies), written through to the disk. ``block_bytes``: the layout's bytes per block."""
    import os

    from kvbm_backend.model.frame import HEADER_BYTES
    ls = g3.lease([key])[0]
    g3.release([ls])
    with open(ls.path, "r+b") as f:
        pos = ls.offset + HEADER_BYTES + block_bytes - 5
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 1]))
        f.flush()
        os.fsync(f.fileno())
