"""Open the :class:`~kvbm_backend.pool.g4.store.ObjectStore` a ``g4.url`` names, chosen by URL scheme.

The store ABC (:mod:`.store`) knows no implementation; this module holds the one registry
``scheme -> "module:Class"`` (:data:`SCHEMES`, kept in :mod:`kvbm_backend.store_url`, whose rules the
config model applies to ``g4.url`` at load), imports the class only when its scheme is opened (boto3
is imported only for ``s3://``), and calls its ``from_url(url, parsed, opts)`` classmethod, which checks
the URL's form. Built in:

* ``s3://BUCKET[/PREFIX]``: :class:`~kvbm_backend.pool.g4.s3_store.S3Store` (S3-compatible servers; its
  block traffic on obstore, :class:`~kvbm_backend.pool.g4.s3_obstore.ObstoreS3Store`, unless
  ``g4.s3_client`` is ``boto3``);
* ``file:///abs/path``: :class:`~kvbm_backend.pool.g4.fs_store.FsStore` (shared POSIX mounts);
* ``mem://NAME``: :class:`~kvbm_backend.pool.g4.memory_store.MemoryStore` (in this process only, for
  unit tests: every store opened on one NAME shares its objects, like pools sharing a real store).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from ...store_url import SCHEMES, url_problem
from .store import ObjectStore

if TYPE_CHECKING:
    from ...config import G4Config

S3_CLIENT_DEFAULT = "obstore"  # g4.s3_client's default (kvbm_backend.config.G4Config)

__all__ = ["SCHEMES", "StoreOptions", "open_store", "register_scheme"]


@dataclass(frozen=True)
class StoreOptions:
    """What a store may take from the ``g4`` config besides the URL (each store uses what applies).

    Attributes:
        endpoint_url: S3 endpoint (``http://host:port``); None for AWS / ``AWS_ENDPOINT_URL``.
        region: S3 region, or None.
        timeout_s: per-attempt request bound, seconds (S3 connect and read timeouts).
        max_inflight: pooled connections (S3).
        retries: extra attempts per request (S3).
        fsync: fsync object and directory before publishing (``file://``).
        s3_client: ``"obstore"`` or ``"boto3"``: the client of S3 block traffic (``g4.s3_client``).
        put_timeout_s: obstore's whole-request bound of a PUT, seconds (``g4.put_timeout_s``); None: the default.
    """

    endpoint_url: str | None = None
    region: str | None = None
    timeout_s: float = 2.0
    max_inflight: int = 32
    retries: int = 1
    fsync: bool = True
    s3_client: str = S3_CLIENT_DEFAULT
    put_timeout_s: float | None = None

    @classmethod
    def from_config(cls, cfg: G4Config) -> "StoreOptions":
        """The options of a :class:`kvbm_backend.config.G4Config`."""
        return cls(endpoint_url=cfg.endpoint_url, region=cfg.region, timeout_s=cfg.timeout_s,
                   max_inflight=cfg.max_inflight, retries=cfg.retries, fsync=cfg.fsync,
                   s3_client=getattr(cfg, "s3_client", S3_CLIENT_DEFAULT), put_timeout_s=cfg.put_timeout_s)


def register_scheme(scheme: str, target: str) -> None:
    """Add or replace the store class of ``scheme`` (``target``: ``"module:Class"``)."""
    SCHEMES[scheme] = target


def open_store(url: str, cfg: G4Config | None = None, *, endpoint_url: str | None = None, region: str | None = None,
               timeout_s: float = 2.0, max_inflight: int = 32, retries: int = 1, fsync: bool = True,
               s3_client: str = S3_CLIENT_DEFAULT) -> ObjectStore:
    """Build the store ``url`` names (``s3://BUCKET[/PREFIX]``, ``file:///abs/path`` or ``mem://NAME``).

    Args:
        url: the ``g4.url`` value.
        cfg: a :class:`kvbm_backend.config.G4Config` whose endpoint, region, timeout_s, max_inflight,
            retries, fsync and s3_client are used; None: the keyword arguments (defaults as in the config).
    Raises:
        ValueError: naming ``g4.url``: empty URL, a scheme not in :data:`SCHEMES` (the message names
            the scheme), or a URL of the wrong form for its store
            (:func:`kvbm_backend.store_url.url_problem`, then the store's own ``from_url``).
    """
    if not url:
        raise ValueError("g4.url: empty; expected s3://BUCKET/PREFIX, file:///path or mem://NAME")
    opts = (StoreOptions.from_config(cfg) if cfg is not None else
            StoreOptions(endpoint_url=endpoint_url, region=region, timeout_s=timeout_s, max_inflight=max_inflight,
                         retries=retries, fsync=fsync, s3_client=s3_client))
    problem = url_problem(url)  # the rules the config applies at load, for callers that bypass it
    if problem:
        raise ValueError(f"g4.url {url!r}: {problem}")
    u = urlparse(url)
    target = SCHEMES[u.scheme]
    mod, _, name = target.partition(":")
    cls: type[ObjectStore] = getattr(importlib.import_module(mod), name)
    return cls.from_url(url, u, opts)
