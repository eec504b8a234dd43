"""S3-compatible object store on boto3 (any S3 server: AWS, SeaweedFS, MinIO, Ceph RGW, VAST, ...); its block
traffic is on obstore with ``g4.s3_client: obstore``, the default (:mod:`.s3_obstore`), see "Client choice" below.

* Endpoint, region and credentials: ``endpoint_url``/``region`` arguments, else the standard AWS
  chain (env ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles, IMDS).
* One thread-safe client with ``max_inflight`` pooled connections; callers run requests from their
  own thread pool so that many are in flight.
* Bounded time: botocore connect and read timeouts = ``timeout_s``; up to ``retries`` extra attempts of a
  request that failed in transit (connection error, timeout, a body cut short) or with 500/502/503/504 or
  ``RequestTimeout``, made here at once (:meth:`S3Store._call`); what still fails raises StoreUnavailable.
* Throttling ("slow down": ``SlowDown``, HTTP 429, ``Throttling``, ``RequestLimitExceeded``... see
  :data:`THROTTLE_CODES`; a bodyless 503 to a HEAD, which is how S3 throttles HEADs) raises
  :class:`~kvbm_backend.pool.g4.store.StoreThrottled` at once: the G4 pool retries it after a full-jitter
  backoff inside its own bound (:mod:`kvbm_backend.pool.g4.throttle`); gc's LIST pages
  (:meth:`S3Store.list_patient`) and DELETEs are retried the same way a bounded number of times.
  botocore's retries are off (``total_max_attempts`` 1) because its ``standard`` mode would own that
  wait instead: it retries throttles (and every 503) after ``rand() * 2**i`` seconds, up to 20 s, longer still when the server
  sends ``x-amz-retry-after``, sleeping inside the request where no load bound can cut it, and its
  client-wide retry quota (500 tokens, 5-14 per retry), once a throttling burst has spent it, stops the
  retries of connection errors too. Its retry conditions are not settable through ``Config``.
* Create-exclusive publish: ``PUT`` with ``If-None-Match: *``; 412 PreconditionFailed (or 409
  ConditionalRequestConflict) means another writer published it first, which is success. A 412 on a *retried* PUT may
  be this call's own first attempt (the server stored it, its answer came after the read timeout): then a HEAD
  compares the object's ETag with the MD5 of the bytes sent (S3's ETag of a single-part PUT), and an equal one counts
  as created by this call, so ``written`` counters stay true on a slow store (a sealed frame has a fresh nonce:
  another writer's copy never matches). Servers that reject the header (501 NotImplemented) fall back to
  HEAD-then-PUT (whole-object PUTs are atomic on S3, so even then no reader sees a torn object). A PUT answered "no
  room" (HTTP 507, a full or bucket-quota code: :mod:`.s3_full`) raises :class:`~.store.StoreFull` at once, unretried
  (settled first as below after an attempt that got no answer).
* A PUT whose last attempt got no answer (timeouts, a connection cut) or a 5xx / ``RequestTimeout`` may
  still have landed: before it counts as failed a HEAD settles it (:meth:`S3Store._settle_put`): the
  object holding these very bytes (ETag = MD5) counts as written by this call, another writer's bytes
  as already there (``put_if_absent`` False), and an absent object raises StoreUnavailable; a HEAD that
  fails too raises :class:`~.store.PutUnsettled` (a StoreUnavailable carrying the MD5), which the G4
  writer settles later with :meth:`S3Store.settle` (:mod:`.settle`), as it does a retried PUT's 412 whose
  HEAD failed: a landed block is never counted lost, a lost one never counted written (invariant 2). This is what keeps the counters true when the worker or the server is too slow for ``timeout_s``
  (obstore's bound covers the whole request, upload included; see :mod:`.s3_obstore`).
* A frame that fails verification is dropped only when :meth:`S3Store.stored_matches` (HEAD: length and
  MD5 ETag of the bytes read) confirms the server holds those very bytes; a proxy or endpoint that
  answers 200 with a wrong body never gets a good object deleted. The DELETE then carries ``If-Match:`` that
  ETag (:meth:`S3Store.delete_if_matches`), so a good copy another writer published after the HEAD is kept
  (SeaweedFS 4.x honours it: 412; a server that ignores the header deletes whatever the name holds).
* A ranged GET reads no more than it asked for, from a server that ignores ``Range`` too (:func:`_read_body`): a
  load asks for one frame and a byte more (:mod:`.reader`), so an oversized object never costs more.
* botocore's region redirector is kept (a wrong ``region``: one redirect to the region the answer names),
  but a HEAD bucket answered with a redirect that names no region is not looked up again
  (:func:`_no_region_lookup_loop`): such an answer (an http endpoint sent to https) raises an OSError.
* botocore's optional CRC checksums are off (``when_required``): each frame's xxh3 or GCM tag is verified.

Client choice (issue 3: "pick the S3 client by measurement"): boto3 stayed then. Measured with
``python -m kvbm_backend.apps.bench.s3_clients --endpoint-url $KVBM_TEST_S3_ENDPOINT --bucket kvbm-test
--object-mib 2 --objects 64 --inflight 8 --json`` (3 runs per invocation, medians; loopback SeaweedFS
from ``ci/seaweedfs.sh`` on the 2-vCPU CI VM, server and client sharing the cores), two invocations on
fresh servers, GB/s (client CPU s/GB):

==============  =========================  =========================  ==============================
client          PUT (If-None-Match: *)     GET                        notes
==============  =========================  =========================  ==============================
boto3           0.121 / 0.117 (2.0 / 2.0)  0.507 / 0.548 (1.3 / 1.4)  thread pool of 8, as G4Pool
obstore 0.12.1  0.133 / 0.139 (1.0 / 0.9)  0.680 / 0.615 (0.7 / 0.9)  sync API in the same pool
obstore async   0.119 / 0.107 (1.1 / 1.1)  0.220 / 0.214 (3.9 / 3.8)  asyncio, 8 at once
NIXL OBJ 1.5.1  0.089 / 0.084 (1.2 / 1.1)  0.471 / 0.383 (0.8 / 1.0)  one transfer of all objects
==============  =========================  =========================  ==============================

That comparison kept boto3 (obstore's GET was not > 1.3x faster). Issue 25 then chooses by client CPU
per GB, where obstore costs less: its data path is :class:`~.s3_obstore.ObstoreS3Store`
(``g4.s3_client: obstore``, the default); this class is ``g4.s3_client: boto3`` and makes the control
calls of both. Through the pool (``kvbm-backend bench --tier g4 --json``, 64 encrypted 2 MiB blocks,
loopback SeaweedFS, 2-core dev VM shared with other jobs at load average 5-7, four invocations each,
after the PUT settle of :meth:`S3Store._settle_put`), CPU-s/GB: boto3 PUT 2.49 / 2.33 / 2.65 / 2.90,
GET 1.35 / 1.10 / 1.54 / 1.65; obstore PUT 0.78 / 0.64 / 0.79 / 0.69, GET 1.02 / 0.93 / 1.03 / 0.92. Again on
2026-11-26, load 2.5-3, interleaved, a fresh server per pair (benchmarks/results/g4_client_cpu-2026-11-26.json),
medians of four: obstore PUT 0.66, GET 0.90; boto3 PUT 2.27, GET 1.20. obstore is therefore the default:
both its directions are under the issue's 1.0 CPU-s/GB, boto3's PUT is not. Its GET margin is small: the
body is collected into a fresh Rust buffer (one copy past the kernel's), then opened into a staging frame
and copied into the caller's buffer (:mod:`.reader`: a miss leaves that buffer untouched); device loads
(``get_staged``) open it straight into their scratch row. NIXL's OBJ backend has no conditional PUT (a racing
writer silently overwrites) and no per-request timeout in its parameters, and was slower here.
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar
from urllib.parse import ParseResult

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from ...store_url import redact_url, redact_urls
from .s3_full import full_error, may_have_landed
from .s3_list import list_pages
from .store import BucketMissing, ObjectInfo, ObjectStore, PutUnsettled, StoreThrottled, StoreUnavailable, byte_view

if TYPE_CHECKING:
    from .factory import StoreOptions
    from .store import Blob, DataIn

_T = TypeVar("_T")
COND_DELETE_RECHECK_S = 600.0  # seconds a 501 to a DELETE with If-Match turns them off before one is tried again

_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchObject"}
#: the name is taken; a 409 (a conflicting operation in flight) stores nothing: before 2026-12-02 it was "taken" too
_EXISTS = {"412", "PreconditionFailed"}
#: Error codes that mean "slow down" (with HTTP 429 whatever its code): botocore's throttling list
#: (``botocore.retries.standard.ThrottledRetryableChecker``) and the S3 and S3-compatible ones.
THROTTLE_CODES = frozenset({
    "SlowDown", "SlowDownRead", "SlowDownWrite", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestThrottledException", "TooManyRequests", "TooManyRequestsException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException", "PriorRequestNotComplete",
    "ProvisionedThroughputExceededException", "EC2ThrottledException"})
_TRANSIENT_STATUS = {500, 502, 503, 504}
_TRANSIENT_CODES = {"RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable"}


def _retried(e: ClientError) -> bool:
    """An earlier attempt of the call that ended in ``e`` failed in transit (:meth:`S3Store._call` marks
    it; ``ResponseMetadata.RetryAttempts`` > 0 for a client that retries on its own)."""
    return bool(getattr(e, "kvbm_retried", False)) or \
        int(e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0) > 0


def _code(e: ClientError) -> tuple[str, int]:
    return (str(e.response.get("Error", {}).get("Code", "")),
            int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))


class S3Store(ObjectStore):
    client_name = "boto3"  # the client of the block traffic (g4.s3_client)
    """Objects under ``s3://bucket/prefix/``.

    Args:
        bucket: bucket name. prefix: key prefix (no leading/trailing ``/``), may be empty.
        endpoint_url: e.g. ``http://127.0.0.1:8333``; None for AWS or ``AWS_ENDPOINT_URL``.
        timeout_s: connect and read timeout per request, seconds.
        max_inflight: requests in flight per direction (reads, writes): the pool keeps twice as many connections.
        retries: extra attempts per request.
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, region: str | None = None,
                 timeout_s: float = 2.0, max_inflight: int = 32, retries: int = 1, client: Any = None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url, self.retries = endpoint_url, retries
        # one attempt per botocore call: _call retries transient failures and leaves throttles to the pool
        cfg = Config(connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=2 * max_inflight,
                     retries={"total_max_attempts": 1, "mode": "standard"},
                     request_checksum_calculation="when_required", response_checksum_validation="when_required",
                     s3={"addressing_style": "path"} if endpoint_url else None)
        self.client = client or boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region,
                                                                config=cfg)
        events = getattr(getattr(self.client, "meta", None), "events", None)  # a botocore client's (not a stand-in's)
        if events is not None:
            events.register_first("needs-retry.s3", _no_region_lookup_loop)
        self.supports_conditional_put = True
        self.supports_conditional_delete = True  # DELETE with If-Match (False for a while once answered 501)
        self._cond_delete_retry_at = 0.0  # time.monotonic() from which a DELETE with If-Match is tried again
        self.listed_outside_prefix = 0  # listed keys outside the prefix asked for, skipped (:mod:`.s3_list`)
        self._mu = threading.Lock()

    @classmethod
    def from_url(cls, url: str, parsed: ParseResult, opts: StoreOptions) -> "S3Store":
        """``s3://BUCKET[/PREFIX]`` with ``opts`` (:class:`~kvbm_backend.pool.g4.factory.StoreOptions`).
        Raises ValueError naming ``g4.url`` without a bucket."""
        if not parsed.netloc:
            raise ValueError(f"g4.url {url!r}: s3:// URL needs a bucket (s3://BUCKET/PREFIX)")
        if opts.s3_client == "obstore":  # g4.s3_client: the data path on obstore
            try:
                from .s3_obstore import ObstoreS3Store
            except ImportError as e:  # a dependency since 2026-11-30; an older environment may lack it
                raise ValueError(f"g4.s3_client: obstore is not installed ({e}); pip install 'obstore>=0.12' "
                                 "or set g4.s3_client: boto3") from None
            return ObstoreS3Store.from_url(url, parsed, opts)
        return cls(parsed.netloc, parsed.path.strip("/"), endpoint_url=opts.endpoint_url, region=opts.region,
                   timeout_s=opts.timeout_s, max_inflight=opts.max_inflight, retries=opts.retries)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _unavailable(self, op: str, name: str, e: Exception) -> StoreUnavailable:  # the text names URLs: redacted
        return StoreUnavailable(redact_urls(f"{op} {self.url}/{name}: {type(e).__name__}: {e}"))

    def _call(self, op: str, name: str, fn: Callable[[bool], _T]) -> _T:
        """``fn(retried)``: one S3 request (and the read of its body), made up to ``1 + retries`` times.

        A throttled answer raises :class:`StoreThrottled` at once (never retried or slept on here). A
        failure in transit (botocore connection errors and timeouts; a body cut short, which botocore raises as
        ResponseStreamingError, an HTTPClientError, or IncompleteReadError) or a 500/502/503/504 or
        ``RequestTimeout`` answer is retried at once while attempts remain; ``retried`` tells ``fn`` that an
        earlier attempt failed so (its request may have reached the server). Anything else, and the last
        transient failure, is raised as botocore raised it (a ClientError carries ``kvbm_retried``)."""
        for attempt in range(self.retries + 1):
            try:
                return fn(attempt > 0)
            except ClientError as e:
                code, status = _code(e)
                if code in THROTTLE_CODES or status == 429 or (op.startswith("head") and status == 503):
                    raise StoreThrottled(f"{op} {self.url}/{name}: throttled ({code or '-'}, HTTP {status})") from None
                if attempt == self.retries or not (status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES):
                    e.kvbm_retried = attempt > 0
                    raise
            except (BotoConnectionError, HTTPClientError, IncompleteReadError):  # the last: a bounded read cut short
                if attempt == self.retries:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def put_if_absent(self, name: str, data: DataIn) -> bool:
        key, body = self._key(name), _body(data)
        if self.supports_conditional_put:
            try:
                self._call("put", name, lambda _r: self.client.put_object(Bucket=self.bucket, Key=key, Body=body,
                                                                          IfNoneMatch="*"))
                return True
            except ClientError as e:
                code, status = _code(e)
                if code in _EXISTS or str(status) in _EXISTS:
                    return _retried(e) and self._holds_these_bytes(name, body)
                if status == 501 or code == "NotImplemented":
                    self.supports_conditional_put = False
                else:
                    err = self._err("put", name, e)
                    if may_have_landed(err, _retried(e)):  # 5xx / RequestTimeout, or "no room" to a retry
                        return self._settle_put(name, body, err)
                    raise err from None
            except BotoCoreError as e:  # no answer: it may have landed
                return self._settle_put(name, body, self._unavailable("put", name, e))
        if self.head(name) is not None:
            return False
        self.put(name, body)
        return True

    def _stored_etag(self, name: str) -> str | None:
        """ETag of the object ``name`` (lower-case, unquoted; "" when the server sends none), None if
        absent. Raises StoreUnavailable, StoreThrottled or OSError as :meth:`head` does."""
        info = self.stat(name)
        return None if info is None else (info.version or "").strip('"').lower()

    def _settle_put(self, name: str, data: DataIn, failure: OSError) -> bool:
        """A PUT of ``data`` under ``name`` failed with ``failure`` (no answer, 5xx, RequestTimeout; "no room" to a
        retry: StoreFull) and may have landed anyway: ask the server (one HEAD, retried as any request).

        Returns True when the object holds these bytes (its ETag is the MD5 of ``data``, S3's single-part
        ETag; a sealed frame has a fresh nonce, so another writer's copy never matches): this call wrote
        it. False when it holds other bytes: another writer's copy (``put_if_absent``'s "already there").
        Raises ``failure`` when the object is absent, and :class:`~.store.PutUnsettled` (a StoreUnavailable)
        when the HEAD fails as well: what the server does not confirm is never counted written, and the
        caller may settle it later (:meth:`settle`)."""
        md5 = _md5(data)
        try:
            landed = self.settle(name, md5)
        except OSError as e:  # unavailable, throttled, denied: cannot tell now
            raise PutUnsettled(f"{failure}; a HEAD to see whether it landed failed too: {e}", name, md5) from None
        if landed is None:
            raise failure
        return landed

    def _holds_these_bytes(self, name: str, data: DataIn) -> bool:
        """A retried PUT of ``data`` met 412/409: True when the object ``name`` has the ETag of ``data`` (MD5
        hex, S3's single-part ETag: the PUT's own first attempt landed), False when it holds other bytes or
        is gone (another writer's copy; also where the ETag is not an MD5: multipart, some gateways). The
        HEAD is retried as any request; when it still fails (unavailable, throttled, denied) raises
        :class:`~.store.PutUnsettled`: a HEAD that timed out on a loaded machine must not count this
        worker's own block as another writer's copy (CI, 2026-11-26), nor as written."""
        md5 = _md5(data)
        try:
            return bool(self.settle(name, md5))
        except OSError as e:
            raise PutUnsettled(f"put {self.url}/{name}: a retried PUT met 412 and a HEAD to see whose copy it "
                               f"is failed: {e}", name, md5) from None

    def settle(self, name: str, md5_hex: str) -> bool | None:
        """See :meth:`~.store.ObjectStore.settle` (one HEAD, retried as any request; its ETag against
        ``md5_hex``). Raises StoreUnavailable, StoreThrottled or OSError as :meth:`head` does."""
        etag = self._stored_etag(name)
        return None if etag is None else etag == md5_hex

    def _err(self, op: str, name: str, e: ClientError) -> OSError:
        code, status = _code(e)
        if code == "NoSuchBucket":
            return self._bucket_missing()
        if (full := full_error(op, self.url, name, status, code)) or status >= 500 or code in _TRANSIENT_CODES:
            return full or self._unavailable(op, name, e)  # full: a PUT answered "no room" (:mod:`.s3_full`)
        return OSError(f"{op} {self.url}/{name}: {code} (HTTP {status})")

    def put(self, name: str, data: DataIn) -> None:
        body = _body(data)
        try:
            self._call("put", name, lambda _r: self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body))
        except ClientError as e:
            if not may_have_landed(fail := self._err("put", name, e), _retried(e)):
                raise fail from None
        except BotoCoreError as e:
            fail = self._unavailable("put", name, e)
        else:
            return
        if not self._settle_put(name, body, fail):  # landed only if the server holds these very bytes
            raise fail

    def get(self, name: str, offset: int = 0, length: int | None = None) -> Blob | None:
        kw: dict[str, str] = {}
        if offset or length is not None:
            kw["Range"] = f"bytes={offset}-" + (str(offset + length - 1) if length is not None else "")
        try:
            body: bytes = self._call("get", name, lambda _r: _read_body(self.client.get_object(
                Bucket=self.bucket, Key=self._key(name), **kw)["Body"], length))
            return body
        except ClientError as e:
            code, status = _code(e)
            if code in _MISSING or status == 404:
                return None
            if code == "InvalidRange" or status == 416:
                return b""
            raise self._err("get", name, e) from None
        except BotoCoreError as e:
            raise self._unavailable("get", name, e) from None

    def stored_matches(self, name: str, data: DataIn, size: int) -> bool:
        """True only when a HEAD of ``name`` says ``size`` bytes and an ETag equal to the MD5 of ``data``
        (all of it: S3's ETag of a single-part PUT, as every G4 object is written). A body rewritten on the
        way (short, garbage, another object's bytes, an error page) never matches, so the good object stays.
        False on any error, or where the ETag is not a plain MD5 (multipart copies, SSE-KMS): unconfirmed."""
        want = byte_view(data)
        if len(want) != size:
            return False
        try:
            h = self._call("head", name, lambda _r: self.client.head_object(Bucket=self.bucket, Key=self._key(name)))
        except (ClientError, BotoCoreError, OSError):
            return False
        etag = str(h.get("ETag", "")).strip('"').lower()
        if int(h.get("ContentLength", -1)) != size or len(etag) != 32:
            return False
        return etag == hashlib.md5(want, usedforsecurity=False).hexdigest()

    def stat(self, name: str) -> ObjectInfo | None:
        """One HEAD (boto3, as the other ETag checks): size, LastModified and the ETag (quoted) that
        :meth:`delete_if_listed` sends as ``If-Match``. Raises as :meth:`head`."""
        try:
            h: dict[str, Any] = self._call("head", name, lambda _r: self.client.head_object(Bucket=self.bucket,
                                                                                          Key=self._key(name)))
        except ClientError as e:
            code, status = _code(e)
            if code in _MISSING or status == 404:
                return None
            raise self._err("head", name, e) from None
        except BotoCoreError as e:
            raise self._unavailable("head", name, e) from None
        mtime = h.get("LastModified")
        return ObjectInfo(name, int(h["ContentLength"]), mtime.timestamp() if mtime else 0.0, h.get("ETag") or None)

    def head(self, name: str) -> int | None:
        info = self.stat(name)
        return None if info is None else info.size

    def delete(self, name: str) -> None:
        try:
            self._call("delete", name, lambda _r: self.client.delete_object(Bucket=self.bucket, Key=self._key(name)))
        except ClientError as e:
            code, status = _code(e)
            if code in _MISSING or status == 404:
                return
            raise self._err("delete", name, e) from None
        except BotoCoreError as e:
            raise self._unavailable("delete", name, e) from None

    def delete_if_matches(self, name: str, data: DataIn, size: int) -> bool:
        """DELETE ``name`` with ``If-Match:`` the ETag of ``data`` (its MD5: the ETag :meth:`stored_matches`
        proved the server holds), so a copy another writer published since that proof is kept (412): see
        :meth:`~.store.ObjectStore.delete_if_matches`. False when ``data`` is not the whole object (``size``
        bytes: no ETag to name), on 412/409 (other bytes, or absent: SeaweedFS 4.x answers 412) and on 404.
        A server that answers 501 is then sent a plain DELETE after a fresh :meth:`stored_matches` (racy; once
        seen, for this store's life). A server that ignores ``If-Match`` on DELETE deletes unconditionally
        (the race stays open there: docs/operations.md "Reasons"). A DELETE whose answer was lost and whose
        retry met 412/404 returns False although it deleted. Raises StoreUnavailable, StoreThrottled, OSError."""
        want = byte_view(data)
        if len(want) != size:
            return False
        done = self._delete_if_etag(name, f'"{_md5(want)}"')
        return super().delete_if_matches(name, data, size) if done is None else done

    def _delete_if_etag(self, name: str, etag: str) -> bool | None:
        """DELETE ``name`` with ``If-Match: etag`` (quoted). True: deleted; False: 412/409 (another object, or
        absent: SeaweedFS 4.x answers 412) or 404; None: the server does not do conditional deletes (501, now or in
        the last :data:`COND_DELETE_RECHECK_S`), the caller falls back. Raises StoreUnavailable,
        StoreThrottled, OSError."""
        if not self.supports_conditional_delete:  # tried again after COND_DELETE_RECHECK_S: before 2026-12-02 one
            if time.monotonic() < self._cond_delete_retry_at:  # 501 (a flaky gateway) left every later drop racy
                return None
            self.supports_conditional_delete = True
        try:
            self._call("delete", name, lambda _r: self.client.delete_object(Bucket=self.bucket, Key=self._key(name),
                                                                            IfMatch=etag))
            return True
        except ClientError as e:
            code, status = _code(e)
            if code in _EXISTS or str(status) in _EXISTS or code in _MISSING or status == 404:
                return False
            if not (status == 501 or code == "NotImplemented"):
                raise self._err("delete", name, e) from None
            self.supports_conditional_delete = False
            self._cond_delete_retry_at = time.monotonic() + COND_DELETE_RECHECK_S
            return None
        except BotoCoreError as e:
            raise self._unavailable("delete", name, e) from None

    def delete_if_listed(self, info: ObjectInfo) -> bool:
        """DELETE with ``If-Match:`` the ETag the listing gave (:meth:`~.store.ObjectStore.delete_if_listed`;
        412/409/404 as :meth:`delete_if_matches`: False). A server that answers 501: a HEAD compares the ETag,
        then a plain DELETE (racy). A lost answer whose retry met 412/404 returns False although it deleted."""
        if info.version is None:
            return super().delete_if_listed(info)
        etag = info.version if info.version.startswith('"') else f'"{info.version}"'
        done = self._delete_if_etag(info.name, etag)
        if done is not None:
            return done
        if self._stored_etag(info.name) != etag.strip('"').lower():
            return False
        self.delete(info.name)
        return True

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.list_patient(prefix, attempts=1)  # a throttled page: StoreThrottled at once

    def list_patient(self, prefix: str = "", attempts: int = 10) -> Iterator[ObjectInfo]:
        """ListObjectsV2 pages (:func:`.s3_list.list_pages`: keys outside the prefix skipped, a repeated
        continuation token :class:`~.store.ListIncomplete`), each throttled page tried ``attempts`` times."""
        return list_pages(self, prefix, attempts)

    def _bucket_missing(self) -> BucketMissing:
        where = f" at {redact_url(self.endpoint_url)}" if self.endpoint_url else ""
        return BucketMissing(f"{self.url}: bucket {self.bucket!r} does not exist{where}", self.bucket)

    def probe(self) -> None:
        """HEAD the bucket: 404 is :class:`BucketMissing`, 403 an OSError, no answer StoreUnavailable."""
        try:
            self._call("head-bucket", "", lambda _r: self.client.head_bucket(Bucket=self.bucket))
        except ClientError as e:
            code, status = _code(e)
            if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                raise self._bucket_missing() from None
            raise self._err("head-bucket", "", e) from None
        except BotoCoreError as e:
            raise self._unavailable("head-bucket", "", e) from None

    def server_time(self) -> float | None:
        """The server's clock from the ``Date`` header of a HEAD bucket (whole seconds), or None."""
        from email.utils import parsedate_to_datetime
        try:
            date = self.client.head_bucket(Bucket=self.bucket)["ResponseMetadata"]["HTTPHeaders"]["date"]
            return parsedate_to_datetime(date).timestamp()
        except Exception:  # noqa: BLE001 - no answer, no header, unparsable: the caller falls back
            return None

    def close(self) -> None:
        self.client.close()


def _no_region_lookup_loop(request_dict: dict[str, Any], response: Any, operation: Any, **_: Any) -> None:
    """botocore hook (``needs-retry.s3``, ahead of its region redirector): a HEAD bucket answered with a
    redirect or 400 that names no region is not redirected. The redirector looks an unnamed region up with a
    HEAD bucket, whose own redirect it looks up again: a front end that redirects every request (an http
    endpoint sent to https) made each store call ~80 requests deep and raise RecursionError. Now that
    lookup fails once and the call raises the server's answer (a ClientError, an OSError here)."""
    if response is None or getattr(operation, "name", "") != "HeadBucket":
        return
    parsed = response[1]
    if "x-amz-bucket-region" in parsed.get("ResponseMetadata", {}).get("HTTPHeaders", {}) \
            or parsed.get("Error", {}).get("Region"):
        return  # the answer names the region: botocore's one redirect to it stands
    redirect = request_dict.get("context", {}).get("s3_redirect")
    if isinstance(redirect, dict):
        redirect["redirected"] = True  # what the redirector checks before redirecting (once per request)


def _read_body(body: Any, length: int | None) -> bytes:
    """A GET's streaming ``body``, whole, or at most ``length`` bytes of it: a server or gateway that ignores the
    Range header and sends the whole object is not read past them (the connection is then dropped). Read to the
    body's end otherwise, where botocore checks its Content-Length: a body cut short raises (IncompleteReadError)."""
    if length is None:
        return bytes(body.read())
    parts, got = [], 0
    try:
        while got < length:
            part = body.read(length - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        body.close()  # a body read to its end went back to the connection pool already; else the connection is dropped


def _md5(data: DataIn) -> str:
    """Lower-case hex MD5 of ``data`` (S3's ETag of a single-part PUT)."""
    return hashlib.md5(byte_view(data), usedforsecurity=False).hexdigest()


def _body(data: DataIn) -> bytes | bytearray:
    """``data`` as botocore takes a body (bytes, bytearray; a memoryview or array is copied once)."""
    return data if isinstance(data, (bytes, bytearray)) else bytes(byte_view(data))
