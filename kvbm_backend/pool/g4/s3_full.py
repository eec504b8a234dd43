"""S3 answers to a PUT that mean "no room": the store is full or the bucket over its quota.

Such an answer is the server's, not an outage: the PUT raises :class:`~.store.StoreFull` (the G4 writer drops the
block as ``dropped_full``, never a circuit-breaker failure, and loads go on), as a ``file://`` store's ENOSPC /
EDQUOT does. Before 2026-12 a 507 was a StoreUnavailable (the breaker opened and every load missed although reads
worked) and a quota code a plain OSError (``dropped_error``, logged as a credentials problem). Both S3 clients
(:mod:`.s3_store`'s boto3 and :mod:`.s3_obstore`) check every PUT's error answer here, ahead of their "5xx is an
outage" rule, so it is neither retried nor counted against the breaker. Other requests (GET, HEAD, LIST, DELETE)
are never mapped: no server answers them for room. A retried PUT answered so (its earlier attempt got no answer or a
5xx, and may have stored the bytes) is settled by a HEAD first (:func:`may_have_landed`): these very bytes there
count as written, as after any PUT that got no answer.

Not recognisable: SeaweedFS (4.48) enforcing ``s3.bucket.quota`` answers a PUT ``500 InternalError``, which
reads as an outage (docs/operations.md).
"""
from __future__ import annotations

import errno

from .store import StoreFull, StoreUnavailable

#: HTTP 507 Insufficient Storage: the store is out of capacity whatever its code (ENOSPC)
FULL_STATUS = 507
#: error codes of a store out of capacity (ENOSPC): MinIO (HTTP 507), S3 on Outposts, the generic one
CAPACITY_CODES = frozenset({"XMinioStorageFull", "XMinioStorageBackendFull", "InsufficientCapacity",
                            "InsufficientStorage"})
#: error codes of a bucket over its quota (EDQUOT): MinIO's bucket quota (HTTP 400), Ceph RGW's (HTTP 403)
QUOTA_CODES = frozenset({"XMinioAdminBucketQuotaExceeded", "QuotaExceeded"})


def full_error(op: str, url: str, name: str, status: int | None, code: str) -> StoreFull | None:
    """The :class:`~.store.StoreFull` of a ``"put"`` ``op`` (a PUT or create-exclusive PUT of ``name`` under ``url``,
    ``s3://bucket/prefix``) answered HTTP ``status`` (None: no answer) with S3 error ``code`` that means no room:
    ``errno`` EDQUOT for a :data:`QUOTA_CODES` code, ENOSPC for :data:`FULL_STATUS` or a :data:`CAPACITY_CODES`
    code; its text names the object, the status and the code. None for any other answer or ``op``."""
    if op != "put":
        return None
    if code in QUOTA_CODES:
        eno, why = errno.EDQUOT, "bucket over its quota"
    elif status == FULL_STATUS or code in CAPACITY_CODES:
        eno, why = errno.ENOSPC, "store out of space"
    else:
        return None
    return StoreFull(OSError(eno, f"{why}: {code or '-'} (HTTP {status})"), f"{op} {url}/{name}")


def may_have_landed(err: OSError, retried: bool) -> bool:
    """Whether a PUT that failed with ``err`` (``retried``: after an earlier attempt that got no answer or a 5xx) may
    have stored its bytes all the same, so that a HEAD settles it before it counts as failed: an outage
    (:class:`~.store.StoreUnavailable`), or a no-room answer (:class:`~.store.StoreFull`) to a retry."""
    return isinstance(err, StoreUnavailable) or (retried and isinstance(err, StoreFull))
