"""S3 store whose block traffic (create-exclusive PUT, GET, ranged GET, HEAD) goes through ``obstore``
(the Rust ``object_store`` crate): ``g4.s3_client: obstore``, the default (see "Client choice" in
:mod:`.s3_store` for the figures and why).

Why (issue 25 item 1, "client cost"): per GB moved, obstore costs about half of boto3's client CPU
(``apps/bench/s3_clients.py``; and through the pool, ``kvbm-backend bench --tier g4``, see
docs/configuration.md for the figures). It takes the frame's buffer without a copy and returns the
body as a Rust-owned buffer (read-only, no copy into Python bytes).

Same contract as :class:`~kvbm_backend.pool.g4.s3_store.S3Store` (this is a subclass; its module doc
describes the behaviour), kept request by request:

* create-exclusive publish: ``PUT`` with ``If-None-Match: *`` (``mode="create"``); 412/409 is another
  writer's copy (a retried PUT compares the stored ETag with the MD5 of its bytes, as boto3's path does,
  and raises :class:`~.store.PutUnsettled` when that HEAD fails);
  501 falls back to HEAD-then-PUT;
* ranged GETs (``get_range``); HEAD for lookups; no LIST on the serving path;
* per-request bounds: obstore's ``connect_timeout`` = ``timeout_s``, its ``timeout`` (whole request) =
  ``timeout_s`` for HEAD, ``timeout_s x (2 + retries)`` for GET (``get_timeout_s``: past the pool's load bound,
  which resolves the load first; a GET still out then is judged by the pool's silence check,
  :mod:`.silence`) and :func:`put_timeout_s` (``max(30, 10 x timeout_s)``) for PUT. Before 2026-12-02 a GET's
  whole request was bounded by ``timeout_s``: on a link slower than ``max_inflight x block_bytes / timeout_s``
  (32 MB/s for 2 MiB blocks) every read of a batch was cut, retried from byte 0, and counted a breaker failure
  (32 in one batch: the breaker opened, every G4 load and store refused; reviewer 2026-12-02: 0 of 32 1 MiB blocks
  at 8 MB/s, where boto3, which bounds each socket wait, loaded 32 of 32 at 12 MB/s);
  obstore's own retries are off (``max_retries`` 0): :meth:`_ocall` makes the ``1 + retries``
  attempts of a request that failed in transit or with 500/502/503/504 / ``RequestTimeout``, at once (a GET only
  when its failed attempt took less than ``timeout_s``: one cut after that is past its load);
* a PUT whose last attempt failed so is settled by a HEAD before it counts as failed
  (:meth:`~.s3_store.S3Store._settle_put`: these very bytes there = written by this call). This is how
  obstore is safe where boto3's bound differs: boto3's ``read_timeout`` bounds each socket wait, so a
  slow upload or a process that stalls (CPU starvation) with a PUT in flight still sees its answer,
  while obstore's ``timeout`` bounds the whole request, upload included, and fires on a stall although
  the body landed (CI: the Dynamo G4 handoff counted 8 of 111 landed blocks dropped). obstore 0.12's
  ``read_timeout`` cannot stand in for boto3's either: reqwest applies it from the request's start to
  the answer's head, upload included (measured: a 2 MiB PUT through a 1 MB/s link fails with
  ``read_timeout`` 1 s exactly as with ``timeout`` 1 s);
* "slow down" answers (a code in :data:`~.s3_store.THROTTLE_CODES`, HTTP 429, a bodyless 503 to a
  HEAD) raise :class:`~.store.StoreThrottled` at once, unretried and unslept (the pool's backoff owns the
  wait, :mod:`.throttle`).
* a PUT answered "no room" (HTTP 507, a full or bucket-quota code: :mod:`.s3_full`) raises
  :class:`~.store.StoreFull` at once, ahead of the 5xx rule: never retried, never a circuit-breaker failure.

* SigV4 with ``UNSIGNED-PAYLOAD`` (the request is signed, its body's SHA-256 is not computed): hashing
  every 2 MiB body was a third of the client's PUT CPU (perf, dev VM). The body is still protected: by
  TLS on https endpoints (where boto3 does the same by default), and end to end by each frame's own GCM
  tag or xxh3, verified where a read lands, so an altered body is a miss, never served.

obstore reports a failed request as an exception whose message carries the HTTP status
(``non-2xx status code: 503``) and the S3 error body (``<Code>SlowDown</Code>``); :func:`status_and_code`
reads both; no status means the request did not complete (connect error, timeout, a body cut short).
obstore follows a redirect itself (reqwest: up to 10 hops); one it cannot follow (``error following
redirect``: a loop; ``Received redirect without LOCATION``) is the server's answer, an OSError ``... Redirect
(HTTP 3xx ...)``, never retried nor a StoreUnavailable (not a circuit-breaker failure), as boto3's 301 is.
A redirect to a place that does not answer (an https origin refusing connections) still reads as a
connect error, StoreUnavailable: obstore's message does not say a redirect led there.
Control-plane calls (probe, the server's clock, LIST for ``gc``, DELETE, the ETag checks) stay on the
boto3 client the base class builds; credentials come from the same boto3 session chain
(``obstore.auth.boto3.Boto3CredentialProvider``), the endpoint and region from that client.
"""
from __future__ import annotations

import datetime
import re
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TypeVar
from urllib.parse import ParseResult

import boto3
import obstore
from obstore.exceptions import AlreadyExistsError, PreconditionError

from ...store_url import redact_urls
from .s3_full import full_error, may_have_landed
from .s3_store import _TRANSIENT_CODES, _TRANSIENT_STATUS, THROTTLE_CODES, S3Store
from .store import StoreThrottled, StoreUnavailable, byte_view

if TYPE_CHECKING:
    from obstore import Bytes

    from .factory import StoreOptions
    from .store import Blob, DataIn

_T = TypeVar("_T")

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")


#: reqwest's words for a redirect it could not follow (a loop past 10 hops, a 3xx with no Location): an answer
_REDIRECT = re.compile(r"error following redirect|redirect without LOCATION", re.IGNORECASE)
#: the status given to such an answer (reqwest does not say which 3xx it was)
REDIRECT_STATUS = 300


def status_and_code(e: BaseException) -> tuple[int | None, str]:
    """``(HTTP status or None, S3 error code or "")`` of an obstore exception (None: no answer). A redirect
    obstore could not follow is an answer: ``(REDIRECT_STATUS, "Redirect")``."""
    msg = str(e)
    st, code = _STATUS.search(msg), _CODE.search(msg)
    if st is None and _REDIRECT.search(msg):
        return REDIRECT_STATUS, "Redirect"
    return (int(st.group(1)) if st else None), (code.group(1) if code else "")


class _Failed(Exception):
    """One obstore request's failure after :meth:`ObstoreS3Store._ocall`: status, code, whether retried."""

    def __init__(self, op: str, status: int | None, code: str, retried: bool, msg: str):
        super().__init__(msg)
        self.op, self.status, self.code, self.retried = op, status, code, retried


#: obstore's error for a ranged GET answered 200 (the endpoint or a gateway ignored ``Range``): before 2026-12-02 it
#: was taken for an unanswered request (no status): retried, counted towards the breaker, which then refused every
#: G4 load and store of the worker; now an answered error (``miss_error``, logged naming the cause)
_RANGE_IGNORED = "non-partial response when range requested"


def _unanswered(f: _Failed) -> bool:
    """The request got no answer (timeout, connection cut) or a 5xx / transient one: the store is
    unavailable, and a PUT may have landed all the same."""
    return f.code != "NoSuchBucket" and (f.status is None or f.status >= 500 or f.code in _TRANSIENT_CODES)


#: seconds a PUT's whole request may take at least (obstore's ``timeout`` for PUTs: :func:`put_timeout_s`)
PUT_TIMEOUT_FLOOR_S = 30.0


def put_timeout_s(timeout_s: float) -> float:
    """obstore's whole-request bound for a PUT: ``max(30, 10 x g4.timeout_s)`` seconds. obstore (reqwest) has no
    per-socket-wait bound for an upload (see the module doc), and with ``timeout_s`` itself a link merely slower
    than ``max_inflight x block_bytes / timeout_s`` (32 MiB/s for 2 MiB blocks at the defaults) failed every PUT
    mid-upload, its retry too: every offload dropped (``dropped_unavailable``), each a breaker failure, the
    breaker open and loads of stored blocks missed (reviewer 2026-12-01: 16 of 24 dropped through a 96 KiB/s link
    where boto3 wrote 24 of 24). This bound only ends an upload that stalls; a slow link is back-pressure
    (``g4.write_queue_blocks``), not a failure. ``g4.put_timeout_s`` sets it instead."""
    return max(PUT_TIMEOUT_FLOOR_S, 10 * timeout_s)


class ObstoreS3Store(S3Store):
    """:class:`~.s3_store.S3Store` with its data path on obstore (same arguments; see the module doc)."""

    client_name = "obstore"

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, region: str | None = None,
                 timeout_s: float = 2.0, max_inflight: int = 32, retries: int = 1, client: Any = None,
                 put_timeout: float | None = None):
        super().__init__(bucket, prefix, endpoint_url=endpoint_url, region=region, timeout_s=timeout_s,
                         max_inflight=max_inflight, retries=retries, client=client)
        from obstore.store import S3Store as _ObsS3
        endpoint: str = self.client.meta.endpoint_url  # what boto3 resolved (argument, AWS_ENDPOINT_URL, AWS)
        t = f"{max(1, int(timeout_s * 1000))}ms"
        kw: dict[str, Any] = {}
        session = boto3.session.Session()
        if session.get_credentials() is not None:
            from obstore.auth.boto3 import Boto3CredentialProvider
            kw["credential_provider"] = Boto3CredentialProvider(session)
        else:
            kw["skip_signature"] = True

        def obs_client(total: str) -> Any:
            return _ObsS3(bucket, endpoint=endpoint, region=self.client.meta.region_name or "us-east-1",
                          virtual_hosted_style_request=not endpoint_url,
                          unsigned_payload=True,
                          client_options={"allow_http": endpoint.startswith("http://"), "timeout": total,
                                          "connect_timeout": t, "pool_max_idle_per_host": str(2 * max_inflight)},
                          retry_config={"max_retries": 0, "retry_timeout": datetime.timedelta(0)}, **kw)
        self.timeout_s = timeout_s
        self._obs = obs_client(t)  # HEAD: the whole request within timeout_s (the pool's deadline bounds it too)
        self.get_timeout_s = timeout_s * (2 + retries)  # GET: past the pool's load bound (module doc)
        self._obs_get = obs_client(f"{max(1, int(self.get_timeout_s * 1000))}ms")
        self.put_timeout_s = put_timeout if put_timeout is not None else put_timeout_s(timeout_s)
        self._obs_put = obs_client(f"{max(1, int(self.put_timeout_s * 1000))}ms")  # PUT: the upload's backstop

    @classmethod
    def from_url(cls, url: str, parsed: ParseResult, opts: StoreOptions) -> "ObstoreS3Store":
        if not parsed.netloc:
            raise ValueError(f"g4.url {url!r}: s3:// URL needs a bucket (s3://BUCKET/PREFIX)")
        return cls(parsed.netloc, parsed.path.strip("/"), endpoint_url=opts.endpoint_url, region=opts.region,
                   timeout_s=opts.timeout_s, max_inflight=opts.max_inflight, retries=opts.retries,
                   put_timeout=opts.put_timeout_s)

    def _ocall(self, op: str, name: str, fn: Callable[[], _T]) -> _T | None:
        """``fn()``: one obstore request, made up to ``1 + retries`` times (see the module doc). Returns
        its result, or None for 404 (absent; a PUT answered 404 fails). Raises StoreThrottled, or :class:`_Failed` for anything else
        (AlreadyExists / Precondition answers as status 412)."""
        for attempt in range(self.retries + 1):
            t0 = time.monotonic()
            try:
                return fn()
            except FileNotFoundError as e:  # obstore's NotFound: 404 (NoSuchKey, or NoSuchBucket)
                if _CODE.search(str(e)) and status_and_code(e)[1] == "NoSuchBucket":
                    raise _Failed(op, 404, "NoSuchBucket", attempt > 0, str(e)) from None
                if op == "put":  # nothing stored (a proxy or gateway path that does not exist): never "written"
                    raise _Failed(op, 404, status_and_code(e)[1], attempt > 0, str(e)) from None
                return None
            except (AlreadyExistsError, PreconditionError) as e:
                status, code = status_and_code(e)
                if status == 409:  # obstore's AlreadyExists for a 409 too: a conflict, nothing stored (s3_store._EXISTS)
                    raise _Failed(op, 409, code, attempt > 0, f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
                raise _Failed(op, 412, "PreconditionFailed", attempt > 0, str(e)) from None
            except Exception as e:  # noqa: BLE001 - obstore's errors: classified by status and code
                if _RANGE_IGNORED in str(e):  # answered (200, the whole object): no outage, never retried
                    raise _Failed(op, 200, "RangeIgnored", attempt > 0, str(e).splitlines()[0]) from None
                status, code = status_and_code(e)
                if code in THROTTLE_CODES or status == 429 or (op == "head" and status == 503):
                    raise StoreThrottled(f"{op} {self.url}/{name}: throttled ({code or '-'}, HTTP {status})") from None
                transient = status is None or status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES
                if op == "get" and time.monotonic() - t0 >= self.timeout_s:  # its load is over: no second one
                    transient = False
                if attempt == self.retries or not transient:
                    raise _Failed(op, status, code, attempt > 0, f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _unavailable_error(self, f: _Failed, name: str) -> StoreUnavailable:
        return StoreUnavailable(redact_urls(f"{f.op} {self.url}/{name}: {f}"))  # obstore's text names the URL

    def _raise(self, f: _Failed, name: str) -> NoReturn:
        if f.code == "NoSuchBucket":
            raise self._bucket_missing() from None
        if _unanswered(f):
            raise self._unavailable_error(f, name) from None
        if f.code == "Redirect":
            raise OSError(f"{f.op} {self.url}/{name}: Redirect (HTTP 3xx, not followed: {f})") from None
        if f.code == "RangeIgnored":
            raise OSError(f"{f.op} {self.url}/{name}: the endpoint (or a gateway before it) ignored Range: a ranged "
                          "GET was answered 200 with the whole object; G4 reads need Range support") from None
        raise OSError(f"{f.op} {self.url}/{name}: {f.code or '-'} (HTTP {f.status})") from None

    def _put_failure(self, f: _Failed, name: str) -> OSError:
        """The error of a PUT of ``name`` that failed with ``f`` and may have landed all the same (a HEAD settles it,
        :meth:`~.s3_store.S3Store._settle_put`): no answer or a 5xx (StoreUnavailable), "no room" to a retry
        (StoreFull). Raises the others: "no room" to a first attempt (:class:`~.store.StoreFull`, :mod:`.s3_full`: an
        answer, checked ahead of the 5xx rule, so a 507 is never a breaker failure) and any other answered error."""
        fail = full_error(f.op, self.url, name, f.status, f.code) or \
            (self._unavailable_error(f, name) if _unanswered(f) else None)
        if fail is None:
            self._raise(f, name)
        if not may_have_landed(fail, f.retried):
            raise fail from None
        return fail

    def put_if_absent(self, name: str, data: DataIn) -> bool:
        key, body = self._key(name), byte_view(data)
        if self.supports_conditional_put:
            try:
                self._ocall("put", name, lambda: obstore.put(self._obs_put, key, body, mode="create", use_multipart=False))
                return True
            except _Failed as f:
                if f.status == 412:  # taken (a 409 stores nothing: s3_store._EXISTS)
                    return f.retried and self._holds_these_bytes(name, data)
                if f.status == 501 or f.code == "NotImplemented":
                    self.supports_conditional_put = False
                else:  # it may have landed (no answer, a 5xx): the server says; an answered error is raised
                    return self._settle_put(name, data, self._put_failure(f, name))
        if self.head(name) is not None:
            return False
        self.put(name, data)
        return True

    def put(self, name: str, data: DataIn) -> None:
        body = byte_view(data)
        try:
            self._ocall("put", name, lambda: obstore.put(self._obs_put, self._key(name), body, use_multipart=False))
            return
        except _Failed as f:
            fail = self._put_failure(f, name)
        if not self._settle_put(name, data, fail):  # landed only if the server holds these very bytes
            raise fail

    def _stored_etag(self, name: str) -> str | None:
        try:
            meta = self._ocall("head", name, lambda: obstore.head(self._obs, self._key(name)))
        except _Failed as f:
            self._raise(f, name)
        return None if meta is None else str(meta.get("e_tag") or "").strip('"').lower()

    def get(self, name: str, offset: int = 0, length: int | None = None) -> Blob | None:
        """A read-only bytes-like (obstore ``Bytes``, no copy), None if absent, ``b""`` past the end."""
        key = self._key(name)
        fn: Callable[[], Bytes]
        if offset or length is not None:
            if length is None:
                fn = lambda: obstore.get(self._obs_get, key, options={"range": {"offset": offset}}).bytes()  # noqa: E731
            else:
                fn = lambda: obstore.get_range(self._obs_get, key, start=offset, length=length)  # noqa: E731
        else:
            fn = lambda: obstore.get(self._obs_get, key).bytes()  # noqa: E731
        try:
            return self._ocall("get", name, fn)
        except _Failed as f:
            if f.status == 416 or f.code == "InvalidRange":
                return b""
            self._raise(f, name)

    def head(self, name: str) -> int | None:
        try:
            meta = self._ocall("head", name, lambda: obstore.head(self._obs, self._key(name)))
        except _Failed as f:
            self._raise(f, name)
        return None if meta is None else int(meta["size"])
