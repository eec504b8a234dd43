"""The forms of ``g4.url`` and ``g4.endpoint_url`` the G4 stores accept, checked without opening anything.

The config model (:mod:`kvbm_backend.config`) runs these checks when a config is loaded, so a typo
(``s3:/bucket``, ``s3://``, ``file://relative``, ``S3://My_Bucket``, an unknown scheme) is one line naming
the field before any engine starts, instead of a ValueError inside a worker process. The store factory
(:mod:`kvbm_backend.pool.g4.factory`) opens stores by the same registry (:data:`SCHEMES`), and each
store's ``from_url`` keeps its own check for callers that bypass the config.

Rules, per scheme (a scheme registered with :func:`kvbm_backend.pool.g4.factory.register_scheme` is
accepted with its form left to its ``from_url``):

* ``s3://BUCKET[/PREFIX]``: BUCKET follows the S3 bucket naming rules (3-63 characters of ``a-z``,
  ``0-9``, ``.``, ``-``; starts and ends with a letter or digit; no ``..``; not an IPv4 address; none of
  the reserved prefixes and suffixes), so no credentials or port in the authority;
* ``file:///abs/path`` (or ``file://localhost/abs/path``, ``file:/abs/path``): an absolute path other
  than ``/``; ``file://relative`` names a host, not a path, and is refused;
* ``mem://NAME``: a name (the in-process store of unit tests);
* none of them takes a query (``?``) or fragment (``#``), and no URL contains whitespace.
"""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlparse, urlsplit

SCHEMES: dict[str, str] = {
    "s3": "kvbm_backend.pool.g4.s3_store:S3Store",
    "file": "kvbm_backend.pool.g4.fs_store:FsStore",
    "mem": "kvbm_backend.pool.g4.memory_store:MemoryStore",
}
"""URL scheme -> ``"module:Class"`` of an ObjectStore subclass with a ``from_url`` classmethod (the store
factory's registry; :func:`kvbm_backend.pool.g4.factory.register_scheme` adds to it)."""

_BUILT_IN = frozenset(("s3", "file", "mem"))
_FORMS = "s3://BUCKET/PREFIX, file:///abs/path or mem://NAME"

# https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html (general purpose buckets)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def bucket_problem(bucket: str) -> str | None:
    """Why ``bucket`` is not a valid S3 bucket name (general purpose bucket rules), or None."""
    if not bucket:
        return "no bucket (s3://BUCKET/PREFIX)"
    if not 3 <= len(bucket) <= 63:
        return f"bucket {bucket!r}: 3 to 63 characters (S3 bucket naming rules)"
    if not _BUCKET.match(bucket):
        return (f"bucket {bucket!r}: only lowercase letters, digits, '.' and '-', starting and ending with a "
                f"letter or digit (S3 bucket naming rules)")
    if ".." in bucket:
        return f"bucket {bucket!r}: two adjacent periods (S3 bucket naming rules)"
    try:
        ipaddress.IPv4Address(bucket)
        return f"bucket {bucket!r}: looks like an IP address; did you mean g4.endpoint_url?"
    except ValueError:
        pass
    bad = next((p for p in _BUCKET_PREFIXES if bucket.startswith(p)), None) or \
        next((s for s in _BUCKET_SUFFIXES if bucket.endswith(s)), None)
    if bad:
        return f"bucket {bucket!r}: {bad!r} is reserved (S3 bucket naming rules)"
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` (a ``g4.url`` value) is not a form any store accepts, or None. Nothing is opened or
    imported. The message does not repeat the URL (the caller names the field and the value)."""
    if not url:
        return f"empty; expected {_FORMS}"
    if any(c.isspace() for c in url):
        return "contains whitespace"
    try:
        u = urlsplit(url)
    except ValueError as e:  # e.g. an unbalanced '[' in the authority
        return f"not a URL ({e})"
    if not u.scheme:
        hint = f"; did you mean file://{url}?" if url.startswith("/") else ""
        return f"no scheme; expected {_FORMS}{hint}"
    if u.scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        return f"scheme {u.scheme!r} not supported; use {known}"
    if u.scheme not in _BUILT_IN:
        return None  # a registered store checks its own form when it opens
    if u.query or u.fragment or url.endswith(("?", "#")):
        return "a store URL takes no query ('?') or fragment ('#')"
    slashes = url[len(u.scheme) + 1:]
    if u.scheme == "s3":
        if not slashes.startswith("//"):
            return f"expected s3://BUCKET/PREFIX (two slashes after 's3:'; did you mean s3://{slashes.lstrip('/')}?)"
        why = bucket_problem(u.netloc)
        if why:
            return f"s3:// URL: {why}"
        segs = u.path.strip("/").split("/") if u.path.strip("/") else []
        bad = next((s for s in segs if s in ("", ".", "..")), None)
        if bad is not None:  # obstore refuses such keys before sending them; servers may collapse them
            what = "an empty path segment" if bad == "" else f"a path segment {bad!r}"
            return (f"s3:// URL: the prefix {u.path!r} has {what} "
                    f"(did you mean s3://{u.netloc}/{'/'.join(s for s in segs if s not in ('', '.', '..'))}?)")
        return None
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            return (f"file URLs must be absolute, file:///path (three slashes; file://{u.netloc}{u.path} names host "
                    f"{u.netloc!r}, not a path)")
        if not u.path.startswith("/"):
            return "file URLs must be absolute, file:///path"
        if u.path.strip("/") == "":
            return "file:/// names the filesystem root; give the store's directory, file:///path"
        return None
    if (u.netloc + u.path).strip("/") == "":  # mem
        return "mem:// URL needs a name (mem://NAME)"
    return None


_SCHEME_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def path_url_scheme(p: str) -> str | None:
    """The URL scheme of ``p`` where a local path is expected (a G3 directory, doctor's ``--path``), or None
    for a path: ``SCHEME://...`` with any scheme, or ``SCHEME:...`` with a store scheme (``file:/abs``,
    ``s3:/bucket``; :data:`SCHEMES`), lowercased. A directory whose name starts so is given as ``./NAME``."""
    m = _SCHEME_PREFIX.match(p)
    if m is None:
        return None
    scheme = m.group(1).lower()
    return scheme if p[m.end():].startswith("//") or scheme in SCHEMES else None


def file_url_path(url: str) -> str | None:
    """The directory a well-formed ``file://`` URL names, or None for other schemes."""
    u = urlsplit(url)
    return u.path if u.scheme == "file" else None


def endpoint_problem(endpoint_url: str) -> str | None:
    """Why ``endpoint_url`` (``g4.endpoint_url``) is not an S3 endpoint botocore accepts
    (``http(s)://HOST[:PORT][/PATH]``), or None. The check is botocore's own (the client would raise
    ``ValueError: Invalid endpoint`` when the pool opens), plus the scheme and the port."""
    if any(c.isspace() for c in endpoint_url):
        return "contains whitespace"
    try:
        u = urlsplit(endpoint_url)
        port = u.port
    except ValueError as e:
        return f"not a URL ({e})"
    if u.scheme not in ("http", "https"):
        hint = f"; did you mean http://{endpoint_url}?" if not u.scheme or not u.netloc else ""
        return f"expected http://HOST[:PORT] or https://HOST[:PORT]{hint}"
    if port == 0:
        return "port 0"
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url
    if not (is_valid_endpoint_url(endpoint_url) or is_valid_ipv6_endpoint_url(endpoint_url)):
        return "not a valid endpoint (host name)"
    return None


def redact_url(url: str | None) -> str:
    """``url`` without credentials or query (``https://user:secret@host/p?X-Amz-Signature=..`` ->
    ``https://host/p``), for log lines and start-up summaries."""
    if not url:
        return ""
    u = urlparse(url)
    host = u.hostname or ""
    if u.port:
        host = f"{host}:{u.port}"
    if u.scheme == "file" or not u.scheme:
        return f"{u.scheme}://{u.path}" if u.scheme else url.split("?")[0]
    return f"{u.scheme}://{host}{u.path}"


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")


def redact_urls(text: str) -> str:
    """``text`` with every URL in it that carries credentials or a query passed through :func:`redact_url`
    (``KVBM_BACKEND__G4__ENDPOINT_URL=http://user:secret@host``, a JSON value or argument holding one); other
    text, and URLs without either, unchanged. For lines that echo environment or config values."""
    return _URL_IN_TEXT.sub(_redact_match, text)


def _redact_match(m: re.Match[str]) -> str:
    """One URL of :func:`redact_urls`; punctuation ending a sentence (``did you mean s3://b/p?``) is not its query."""
    url, tail = m.group(0), ""
    while url and url[-1] in "?.,;:)]}":
        url, tail = url[:-1], url[-1] + tail
    return (redact_url(url) if "@" in url or "?" in url else url) + tail
