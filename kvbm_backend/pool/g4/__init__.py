"""G4: the persistent, shared, per-tenant encrypted tier on S3-compatible stores and shared POSIX mounts.

:class:`~kvbm_backend.pool.g4.pool.G4Pool` is the BlockPool, a facade (:mod:`.pool`) over parts that own
their state: offloads in :mod:`.writer`, loads in :mod:`.reader`, lookups in :mod:`.lookup`, names in
:mod:`.tenant_names`, counters and operator log lines in :mod:`.events`; stores are opened by ``g4.url`` scheme in
:mod:`.factory` (:mod:`.s3_store`, :mod:`.fs_store`, :mod:`.memory_store` for tests); retention in
:mod:`.gc`; the ``gc`` and ``keys`` commands in the CLI.
"""
from .pool import G4Pool

__all__ = ["G4Pool"]
