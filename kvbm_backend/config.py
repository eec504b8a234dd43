"""One pydantic configuration tree for kvbm_backend.

Sources, later wins: defaults < file (YAML/TOML/JSON) or the dict inside vLLM's
``kv_connector_extra_config`` < environment. Environment names:

* KVBM's own: ``DYN_KVBM_DISK_CACHE_DIR`` (G3 directory, ``:``-separated for several),
  ``DYN_KVBM_DISK_CACHE_GB`` (G3 capacity, GB = 1e9 bytes), ``DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER``
  (true: ``g3.admission.policy = all``, KVBM's switch for its disk-offload frequency filter),
  ``DYN_KVBM_DISK_DISABLE_O_DIRECT`` (true: ``g3.o_direct = off``), ``DYN_KVBM_METRICS`` /
  ``DYN_KVBM_METRICS_PORT``. KVBM's settings with no meaning here (:data:`KVBM_ONLY_ENV`) are logged
  once as a warning naming what to use instead.
* Any field: ``KVBM_BACKEND__SECTION__FIELD`` (e.g. ``KVBM_BACKEND__G4__URL=s3://bucket/prefix``); values are
  parsed as JSON when they parse, else taken as strings; a text field (``tenant``: ``=42``) takes the text.

Errors are :class:`ConfigError` naming the field path (``g3.capacity_gb: ...``, list items as
``g3.paths[1]: ...``), and the environment variable when the value came from one.

Strictness: every float must be finite (``inf``/``nan`` are refused everywhere: an infinite timeout
would turn a slow store into a stalled decode); a boolean is never taken as a number (``capacity_gb: true``
is an error, not 1 GB); every number has an upper bound (sizes, counts, timeouts; each field's
description gives it); G3 paths must be non-empty,
and an enabled G3's paths are checked when the config is loaded: an existing path must be a writable
directory, and a path to be created must not lie under a file, its nearest existing ancestor a directory this
process can write.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import reprlib
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from .config_sources import (KVBM_ONLY_ENV, MAX_ERROR_CHARS, MAX_NESTING, ConfigError, _json_loads,  # noqa: F401
                             _kvbm_only_warned, _merge, _nesting_error, _one_value_per_key, _too_deep, _yaml_load,
                             config_file, env_overrides)
from .store_url import redact_urls


MAX_CAPACITY_GB = 10_000_000
"""Largest capacity in GB (10 PB) a config field or ``--*-capacity-gb`` flag takes."""

_NUMBER_TYPES: tuple[object, ...] = (int, float, int | None, float | None)


class _M(BaseModel):
    # allow_inf_nan=False: every float field of the tree is finite (inf / nan are validation errors)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v: Any, info: ValidationInfo) -> Any:
        """A boolean is not a number: pydantic's lax mode takes ``true`` as 1 (``capacity_gb: true``)."""
        name = info.field_name  # None only for a validator outside a field; "*" runs on fields
        if isinstance(v, bool) and name is not None and cls.model_fields[name].annotation in _NUMBER_TYPES:
            raise PydanticCustomError("bool_not_number", "expected a number, not a boolean")
        return v


def dir_problem(path: str) -> str | None:
    """Why ``path`` cannot serve as a directory this process writes (G3 paths, bench ``--path``), or
    None. A URL (``file:/x``, ``file:///x``, ``s3://b``; :func:`kvbm_backend.store_url.path_url_scheme`) is not
    one. An existing path must be a directory this process can write; a missing one is created later,
    so its nearest existing ancestor must be a directory this process can write (before 2026-11-30 only a file
    there was judged: a G3 path under an unwritable parent passed the launchers' preflight and the pool's
    ``makedirs`` failed inside the engine). A relative path once the working directory was removed is one too."""
    if not path.strip():
        return "empty path (it would mean the current directory)"
    from .fsmodes import abspath
    from .store_url import file_url_path, path_url_scheme
    scheme = path_url_scheme(path)
    if scheme is not None:  # else "file:/x" is the relative directory "file:" and "x" under the current one
        local = (file_url_path(path) or "") if scheme == "file" else ""
        return f"a {scheme}: URL, not a directory path" + (f"; give the directory {local}" if local[:1] == "/" else "")
    try:
        target = Path(abspath(path))
    except ValueError as e:  # embedded NUL; relative, the working directory removed (fsmodes.abspath)
        return f"not a usable path: {e}"
    for q in (target, *target.parents):
        try:
            st = q.stat()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            return f"cannot inspect {q}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            kind = "a file" if stat.S_ISREG(st.st_mode) else "not a directory"
            if q == target:
                return f"is {kind}, not a directory"
            return f"{q} is {kind}: the directory cannot be created under it"
        if not os.access(q, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            ro = bool(os.statvfs(q).f_flag & os.ST_RDONLY)
            why = f"not writable by this process ({'read-only filesystem' if ro else f'uid {os.geteuid()}'})"
            return f"directory is {why}" if q == target else f"cannot be created: {q} is {why}"
        return None
    return None  # not reached: / exists


def _check_g3_path(p: str, info: ValidationInfo) -> str:
    """One ``g3.paths`` entry: non-empty always; :func:`dir_problem` when G3 is enabled (and not in ``skip_dirs``)."""
    if not p.strip():
        raise PydanticCustomError("g3_path_empty", "empty path (G3 would open in the current directory)")
    on = info.data.get("enabled", True) and "g3" not in (info.context or {}).get("skip_dirs", ())
    problem = dir_problem(p) if on else None
    if problem:
        raise PydanticCustomError("g3_path", "{problem}", {"problem": problem})
    return p


G3Path = Annotated[str, AfterValidator(_check_g3_path)]


def _distinct_g3_paths(paths: list[str]) -> list[str]:
    """``g3.paths`` name distinct directories (``os.path.realpath``: a trailing ``/``, ``..`` or a symbolic link
    name the same one). Before 2026-12-02 ``[/a, /a/]`` (or ``DYN_KVBM_DISK_CACHE_DIR=/a:/a``) passed every check,
    ``doctor`` included, and the pool failed in the engine: its own second lock said another worker held ``/a``."""
    seen: dict[str, int] = {}
    for i, p in enumerate(paths):
        j = seen.setdefault(os.path.realpath(p), i)
        if j != i:
            raise PydanticCustomError("g3_paths_repeated", "entry {i} ({p}) is the same directory as entry {j} ({q}): "
                                      "list each directory once", {"i": i, "p": repr(p), "j": j, "q": repr(paths[j])})
    return paths

IO_ALIGN = 4096  # bytes: O_DIRECT offsets, lengths and buffers are multiples of this
MAX_IO_SIZE = 1 << 30  # bytes: the largest g3.io_size_bytes (and bench --io-size)
LOAD_TIMEOUT_MAX_S = 120.0  # seconds: the largest g3.load_timeout_s (what bench and replay run with)


def io_size_problem(v: int) -> str | None:
    """Why ``v`` (bytes) cannot be an I/O size (``g3.io_size_bytes``, the benches' ``--io-size``), or None:
    it must be a positive multiple of :data:`IO_ALIGN` (4096), at most :data:`MAX_IO_SIZE` (1 GiB). The one
    copy of the rule: the config validates the field with it, the apps their arguments (the caller
    appends the value it got)."""
    if v <= 0 or v % IO_ALIGN or v > MAX_IO_SIZE:
        return f"must be a positive multiple of {IO_ALIGN} bytes, at most 1 GiB"
    return None


def _check_io_size(v: int) -> int:
    problem = io_size_problem(v)
    if problem:
        raise PydanticCustomError("io_size", "{problem}", {"problem": problem})
    return v


class AdmissionConfig(_M):
    policy: Literal["frequency", "all"] = "frequency"
    """``frequency``: KVBM's default, a block is written on its second sighting; ``all``: every offload."""
    min_sightings: int = Field(default=2, ge=1, le=1000)
    """Sightings of a sequence hash before it is written (1-1000)."""
    tracker_entries: int = Field(default=1_000_000, ge=1024, le=1 << 30)
    """Sequence hashes remembered by the frequency filter (LRU), 1024 to 2**30."""


class G3Config(_M):
    enabled: bool = True
    paths: Annotated[list[G3Path], AfterValidator(_distinct_g3_paths)] = Field(default_factory=lambda: ["./kvbm-g3"],
                                                                               min_length=1)
    """One directory per NVMe drive or mount point; slab files are spread across them. Entries must be
    non-empty and name distinct directories; when G3 is enabled, an existing entry must be a directory this process can write and a
    missing one must not lie under a file (checked at load: ``g3.paths[i]: ...``)."""
    capacity_gb: float = Field(default=10.0, gt=0, le=MAX_CAPACITY_GB)
    """Upper bound of slot bytes (GB = 1e9 bytes), at most 10 PB (``MAX_CAPACITY_GB``)."""
    files_per_path: int = Field(default=4, ge=1, le=256)
    io_size_bytes: Annotated[int, AfterValidator(_check_io_size)] = Field(default=1 << 20, ge=4096, le=MAX_IO_SIZE)
    """Target bytes per I/O per TP rank after coalescing: a multiple of 4096, 4 KiB to 1 GiB (checked here,
    :func:`io_size_problem`; the pool uses it as given)."""
    engine: Literal["auto", "posix", "nixl", "kvikio"] = "auto"
    o_direct: Literal["auto", "on", "off"] = "auto"
    """``auto`` probes each path: O_DIRECT where the filesystem takes it, buffered where not."""
    io_threads: int = Field(default=8, ge=1, le=256)
    write_queue_blocks: int = Field(default=4096, ge=1, le=1 << 26)
    """Pending offload blocks before new offloads are dropped (write-behind bound), at most 2**26."""
    min_free_fraction: float = Field(default=0.05, ge=0, lt=1)
    """statvfs watermark: never fill a filesystem beyond ``1 - min_free_fraction``."""
    fsync: bool = True
    """fdatasync before publishing (invariant 2). Off only for throwaway benchmarks."""
    group_commit_ms: float = Field(default=100.0, ge=0, le=1000)
    """Group commit (with ``fsync``): written offloads wait at most this many ms (and at most as long as
    the previous barrier took) for offloads still being written, so one durability barrier (an
    ``fdatasync`` per slab file written, then one journal append) publishes them all. Bounds the publish
    latency grouping adds; a group never waits once nothing is in flight. 0: a barrier as soon as the
    previous one ended (pieces written meanwhile still share it)."""
    group_commit_bytes: int = Field(default=256 << 20, ge=0, le=1 << 40)
    """Group commit: the barrier starts at once when this many slot bytes are written and waiting
    (bounds the blocks one barrier, or one failed ``fdatasync``, covers), at most 1 TiB. 0: no byte
    bound."""
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    load_timeout_s: float = Field(default=5.0, gt=0, le=LOAD_TIMEOUT_MAX_S)
    """A load not back within this many seconds is a miss (the engine recomputes). At most 120 s: a
    load that waits longer is slower than recomputing any prefill, and decode must never stall."""
    device_path: Literal["auto", "gds", "kvikio-compat", "pinned-bounce"] = "auto"
    """How G3 slots reach a CUDA device on a load (``get`` into device tensors): ``auto`` probes at
    start-up in the first path (kvikio read + compare: ``gds`` where cuFile has GDS, ``kvikio-compat``
    where it runs in compat mode, else ``pinned-bounce``), and logs the choice; ``gds`` /
    ``kvikio-compat`` still probe and fall back (logged) if the probe fails; ``pinned-bounce`` skips
    kvikio (``preadv`` into pinned host memory, then one H2D copy per pass). A CPU device always loads in
    ``host`` mode, whatever is set here."""
    device_io_threads: int = Field(default=16, ge=1, le=256)
    """Reads in flight of a load into a CUDA device: kvikio's (process-wide) pool or ``pinned-bounce``'s reader
    threads (layer-wise loads: their reader threads); a CPU device uses ``io_threads``. 16: H200 host, tmpfs, ``gpu_bench.py --sweep`` (2026-12-04):
    kvikio-compat 23.0 GB/s with 8 threads, 34.6 with 16; pinned-bounce 19.9 and 23.3."""
    device_checksum: Literal["auto", "on", "off"] = "auto"
    """Frames carry the device-verifiable checksum (``FLAG_DEVCHECK``, docs/format.md): ``auto``
    when the engine's KV cache is on a CUDA device (computed there at save time, at no host cost; a
    device load then verifies in HBM), ``on`` always (a CPU engine computes it with torch on the
    host), ``off`` never (device loads then copy each payload back to the host for its xxh3_128)."""
    layerwise_load: bool = False
    """vLLM connector: serve G3-only prefix hits layer by layer inside the step that computes the rest of the
    prompt (vLLM's ``wait_for_layer_load``), so layer ``l`` loads while layer ``l - 1`` computes; payloads are
    verified at the end of the forward and a failed block makes vLLM recompute the request from its valid
    prefix; a stalled G3 read holds that step for at most ``load_timeout_s``. Off: every load is
    asynchronous and whole before the request's first step (it never holds a step). G4 hits stay
    asynchronous either way; hybrid (several KV cache groups) models are always asynchronous."""


class KeyringConfig(_M):
    path: str | None = None
    """Keyring file (created ``0600``; group/world-readable files are refused)."""
    kek_env: str = "KVBM_BACKEND_KEK"
    """Env var with the 32-byte key-encryption key, base64; else the keyring file's own KEK file."""
    kek_file: str | None = None
    """KEK file (base64, mode 0600) used when ``kek_env`` is unset; default ``{path}.kek``."""
    rotate_after_uses: int = Field(default=2 ** 31, ge=1, le=2 ** 32)
    """Encryptions per data key version before automatic rotation (SP 800-38D: <= 2**32, random nonces).
    A read-only keyring cannot rotate: it stops writing with a version after this many encryptions in
    the process (offloads dropped, ``dropped_keyring``) until the operator runs ``keys rotate``."""
    auto_create_tenants: bool = True
    """A worker's first write for an unknown tenant creates its data key (writable keyrings only).
    Never re-creates a revoked tenant, never creates a tenant id over 1024 UTF-8 bytes
    (``crypto.names.MAX_AUTO_TENANT_BYTES``: ``keys create`` adds those). Off: offloads of unknown tenants are dropped
    (``dropped_unknown_tenant``, logged once per tenant pseudonym) and their loads are misses; tenants
    then come only from ``kvbm-backend keys create``."""
    max_auto_tenants: int = Field(default=4096, ge=0, le=1_000_000)
    """Implicit creation (``auto_create_tenants``) stops once the keyring file holds this many tenants:
    the tenant is the client-chosen cache_salt, and each new one rewrites (and every worker re-reads and
    unwraps) the whole file under the keyring's lock (1.4 s per creation at 50,000 tenants, stalling every
    G4 load and offload of the worker). Beyond it offloads of unknown tenants are dropped
    (``dropped_unknown_tenant``). ``keys create`` is not limited. At most 1,000,000."""
    read_only: bool | None = None
    """Never write the keyring (no lock file, no creation, no rotation, use counts per process).
    None: read-only when its directory cannot be written (a read-only mount, a Kubernetes Secret or
    ConfigMap volume)."""
    reload_interval_s: float = Field(default=2.0, gt=0, le=300)
    """The keyring file is re-read when it changed (mtime/ctime/size/inode), checked at most this often:
    a revocation, rotation or new tenant reaches running workers within this many seconds of the file
    changing at ``path``."""


def _check_g4_url(url: str | None, info: ValidationInfo) -> str | None:
    """``g4.url``: required when G4 is enabled; any URL given (G4 enabled or not: a typo is a typo) must
    have a form its store accepts (:func:`kvbm_backend.store_url.url_problem`); an enabled ``file://``
    store's directory is checked like a G3 path (:func:`dir_problem`; not with ``g4`` in ``skip_dirs``)."""
    enabled = info.data.get("enabled", False)
    check_dir = enabled and "g4" not in (info.context or {}).get("skip_dirs", ())
    if not url:
        if enabled:
            raise PydanticCustomError("g4_url_required", "required when g4.enabled is true (s3://BUCKET/PREFIX or"
                                      " file:///path)")
        return url
    from .store_url import file_url_path, url_problem
    problem = url_problem(url) or (dir_problem(file_url_path(url) or "/") if check_dir else None)
    if problem:
        raise PydanticCustomError("g4_url", "{problem}", {"problem": problem})
    return url


def _check_endpoint(url: str | None) -> str | None:
    from .store_url import endpoint_problem
    problem = endpoint_problem(url) if url else None
    if problem:
        raise PydanticCustomError("g4_endpoint_url", "{problem}", {"problem": problem})
    return url


G4_LOAD_SLACK_S = 0.05  # seconds added to timeout_s x (1 + retries): the G4 load bound (G4Config.load_bound_s)


class G4Config(_M):
    enabled: bool = False
    url: Annotated[str | None, AfterValidator(_check_g4_url)] = Field(default=None, validate_default=True)
    """``s3://BUCKET/PREFIX``, ``file:///shared/path`` or ``mem://NAME`` (in this process only, for
    tests: pools on one NAME share its objects). The scheme picks the store
    (:mod:`kvbm_backend.pool.g4.factory`). Checked when the config loads, enabled or not
    (:mod:`kvbm_backend.store_url`: an unknown scheme, ``s3:/b``, ``s3://``, an invalid bucket name,
    ``file://relative``, a query are errors naming ``g4.url``); required when ``enabled``; an enabled
    ``file://`` directory is checked like a G3 path."""
    endpoint_url: Annotated[str | None, AfterValidator(_check_endpoint)] = None
    """S3 endpoint, ``http(s)://HOST[:PORT]`` (checked at load as botocore checks it); None: AWS."""
    region: str | None = None
    encrypt: bool = True
    """Unencrypted G4 only when set false explicitly; stats report it."""
    keyring: KeyringConfig = Field(default_factory=KeyringConfig)
    timeout_s: float = Field(default=2.0, gt=0, le=120)
    """Per-attempt bound, seconds, at most 120. A request makes up to ``1 + retries`` attempts, so the
    load bound is ``timeout_s x (1 + retries)``: a lookup/load resolves within it (the pool's deadline;
    past it the blocks are misses and late replies are discarded). S3: the connect and read timeout
    of each attempt, so an offload whose attempts all time out is dropped. ``file://`` calls have no
    timeout of their own: the deadline bounds loads and lookups, and offloads queued behind a hung
    mount are dropped once ``write_queue_blocks`` are pending."""
    max_inflight: int = Field(default=32, ge=1, le=1024)
    write_queue_blocks: int = Field(default=2048, ge=1, le=1 << 26)
    """Pending offload blocks before new offloads are dropped, at most 2**26."""
    breaker_failures: int = Field(default=5, ge=1, le=1_000_000)
    """Consecutive failures (or expired batches) that open the circuit breaker, at most 1,000,000."""
    breaker_reset_s: float = Field(default=5.0, gt=0, le=3600)
    """While the breaker is open, one probe request per this many seconds (at most an hour)."""
    dir_fanout: int = Field(default=256, ge=1, le=4096)
    retries: int = Field(default=1, ge=0, le=10)
    """Extra attempts for an S3 request that failed in transit or with a 5xx, each bounded by timeout_s:
    the load bound is ``timeout_s x (1 + retries)``. Throttled answers are retried with a backoff inside
    that bound (:mod:`kvbm_backend.pool.g4.throttle`)."""
    fsync: bool = True
    """file:// stores: fsync object and directory before publishing (invariant 2)."""
    s3_client: Literal["obstore", "boto3"] = "obstore"
    """Client of the S3 block traffic (PUT/GET/HEAD): ``boto3`` or ``obstore`` (Rust ``object_store``;
    about half of boto3's client CPU per GB, issue 25). Both keep create-exclusive PUT, ranged GET,
    per-request timeouts and the throttling backoff; control calls (probe, gc's LIST, DELETE) use boto3.
    obstore's ``timeout_s`` bounds a HEAD's whole request, ``timeout_s x (2 + retries)`` a GET's (past the load
    bound: :mod:`kvbm_backend.pool.g4.s3_obstore`), ``put_timeout_s`` a PUT's (boto3's
    ``timeout_s``: each socket wait), so a PUT of a stalled
    process can time out after it landed; with either client a PUT that got no answer is settled by a
    HEAD before it counts dropped (:meth:`~kvbm_backend.pool.g4.s3_store.S3Store._settle_put`). The
    default since its encrypted PUT and GET both measured under the issue's 1.0 CPU-s/GB (boto3's PUT
    costs 2.2-2.3; figures in docs/configuration.md)."""
    put_timeout_s: float | None = Field(default=None, gt=0, le=3600)
    """obstore: the whole-request bound of a PUT (upload included), seconds, at most 3600; None (default):
    ``max(30, 10 x timeout_s)``. With ``timeout_s`` there a link slower than ``max_inflight x block_bytes /
    timeout_s`` dropped every offload and opened the breaker (reviewer, 2026-12-01). boto3 bounds each socket
    wait by ``timeout_s`` instead and ignores this."""
    layout: Literal["per-rank", "canonical"] = "per-rank"
    """How G4 stores a block: ``per-rank`` (one object per TP rank, its KV heads: only engines of the same
    TP size share it) or ``canonical`` (one object per KV head of the model, MLA once: engines of one
    model with any TP size share it; :mod:`kvbm_backend.model.canonical`). The namespace records the
    layout id, so a block of the other layout is a miss. G3 stays per rank."""
    announce: bool = False
    """Announce G4 blocks to every worker, so Dynamo's KV router credits each worker with the blocks any
    of them wrote (:mod:`kvbm_backend.integrations.vllm.g4_announce`): needs vLLM KV events on
    (``--kv-events-config``). Each worker writes sealed record batches of the blocks it published
    (``{ns}/announce/``, encrypted like blocks) and polls them on a background thread."""
    announce_interval_s: float = Field(2.0, gt=0, le=3600)
    """Seconds between a worker's announcement flushes and polls (one LIST of ``{ns}/announce/`` each)."""
    announce_ttl_s: float = Field(3600.0, gt=0, le=30 * 86400)
    """Announcements expire this many seconds after they were written (store mtime, on the store's clock):
    their blocks are withdrawn from the router (``BlockRemoved``) and the objects deleted. One stamped later
    than the poller's clock (a writer's clock ahead) expires this long after a poller first listed it. Keep
    ``gc --max-age-s`` >= it."""

    @property
    def load_bound_s(self) -> float:
        """Seconds within which a G4 lookup or load resolves: ``timeout_s x (1 + retries)`` plus
        :data:`G4_LOAD_SLACK_S` (the pool's deadline; the vLLM connector's lookup timeout and load deadline
        are built from it, so a G4 answer the pool would give in time is never cut short)."""
        return self.timeout_s * (1 + self.retries) + G4_LOAD_SLACK_S


KVBM_METRICS_PORT = 6880  # Dynamo KVBM's default DYN_KVBM_METRICS_PORT
_HOST_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def _check_bind_addr(addr: str) -> str:
    """``metrics.addr``: an IP address, or a host name of valid syntax (RFC 1123 labels; not resolved here)."""
    try:
        ipaddress.ip_address(addr)
        return addr
    except ValueError:
        pass
    labels = (addr[:-1] if addr.endswith(".") else addr).split(".")
    # a numeric last label is no host name (256.1.1.1, 1.2.3: malformed IPv4 addresses)
    if len(addr) <= 253 and all(_HOST_LABEL.match(x) for x in labels) and not labels[-1].isdigit():
        return addr
    raise PydanticCustomError("bind_addr", "expected an IP address (0.0.0.0, ::, 127.0.0.1) or a host name")


class MetricsConfig(_M):
    enabled: bool | None = None
    """Serve Prometheus ``/metrics`` (env ``DYN_KVBM_METRICS``, as in Dynamo KVBM). None: serve when
    ``port`` is set; true without a port: on KVBM's default port 6880; false: never (registry only)."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """Port of the ``/metrics`` endpoint (env ``DYN_KVBM_METRICS_PORT``): one endpoint per pod and port, which
    serves the series of every process of the pod with this port (:mod:`kvbm_backend.metrics_mp`)."""
    addr: Annotated[str, AfterValidator(_check_bind_addr)] = "0.0.0.0"
    """Bind address (an IP address or a host name). All interfaces by default: Prometheus scrapes a pod from elsewhere, at the pod IP
    (the metrics hold counters only, no keys or tenant ids). ``127.0.0.1`` on a shared host where only
    a local agent scrapes."""

    @property
    def serve_port(self) -> int | None:
        """The port to serve on, or None when metrics are not served."""
        if self.enabled is False:
            return None
        return self.port if self.port is not None else (KVBM_METRICS_PORT if self.enabled else None)


class KvbmBackendConfig(_M):
    model: str = "unknown"
    revision: str = "main"
    tenant: str = ""
    """Default tenant when a request carries no cache_salt."""
    g3: G3Config = Field(default_factory=G3Config)
    g4: G4Config = Field(default_factory=G4Config)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    load_gil_switch_ms: float | None = Field(default=0.5, gt=0, le=100)
    """CPython's thread switch interval (ms) while a load is in flight (CPython's own: 5 ms); null: never
    changed (:mod:`kvbm_backend.integrations.load_priority`)."""


def _fmt_loc(loc: tuple) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


_ERRORS_SHOWN = 5


def _short_repr(value: Any) -> str:
    """``repr(value)`` bounded in size and depth (a config input can be a huge or deeply nested value)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = 240
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 6, 6, 6, 6
    return r.repr(value)


def _fmt_error(e: ValidationError, env_sources: dict[tuple, str] | None = None) -> str:
    """``field.path: message (got value)``, ``; ``-joined (the first few, then how many more); ``(from
    ENV_VAR)`` after the field path when the value came from the environment. Quoted values are
    shortened (:func:`_short_repr`), URLs with credentials or a query redacted
    (:func:`~kvbm_backend.store_url.redact_urls`)."""
    parts = []
    errors = e.errors(include_url=False)
    for err in errors[:_ERRORS_SHOWN]:
        loc = tuple(err["loc"])
        src = _env_source(loc, err["type"], env_sources or {})
        where = _fmt_loc(loc)[:200] + (f" (from {src})" if src else "")
        hint = _did_you_mean(loc) if err["type"] == "extra_forbidden" else ""
        # redacted: a refused endpoint_url's USER:SECRET@ or signed query never reaches a worker's start-up log
        parts.append(redact_urls(f"{where}: {err['msg']}{hint} (got {_short_repr(err.get('input'))})"))
    if len(errors) > _ERRORS_SHOWN:
        parts.append(f"and {len(errors) - _ERRORS_SHOWN} more errors")
    return "; ".join(parts)


def _env_source(loc: tuple, kind: str, env_sources: dict[tuple, str]) -> str | None:
    """The variable that set the value at ``loc``: the deepest one naming ``loc`` or a section above it
    (sources are recorded per field); for an unknown key (``extra_forbidden``, e.g. a whole unknown section
    ``KVBM_BACKEND__NOSUCH='{"a": 1}'``), the variables that set fields below it. None: not the environment."""
    hits = [k for k in env_sources if loc[:len(k)] == k]
    if hits:
        return env_sources[max(hits, key=len)]
    below = sorted({v for k, v in env_sources.items() if k[:len(loc)] == loc}) if kind == "extra_forbidden" else []
    return ", ".join(below) or None


def _did_you_mean(loc: tuple) -> str:
    """``; did you mean 'capacity_gb'?`` for an unknown key ``loc[-1]`` close to a field name of the section
    ``loc[:-1]`` names (difflib), else ``""``."""
    import difflib
    model: Any = KvbmBackendConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    if not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def load_config(source: str | Path | dict | None = None, *, environ: dict[str, str] | None = None,
                use_env: bool = True, skip_dirs: tuple[str, ...] = ()) -> KvbmBackendConfig:
    """Build the config from a file path (``.yaml``/``.yml``/``.toml``, any case; anything else is read as
    JSON), a dict (e.g. vLLM's
    ``kv_connector_extra_config["kvbm_backend"]``), a JSON string, or nothing; then apply env.

    ``skip_dirs``: sections (``"g3"``, ``"g4"``) whose directories are not checked (a native tier uses one pool).
    Raises ConfigError naming the field on any invalid value, or the file on a parse error.
    """
    data: dict = {}
    if isinstance(source, dict):
        data = source
    elif isinstance(source, str) and source.lstrip().startswith("{"):
        data = _json_loads(source, "inline JSON config")
    elif source is not None:
        p = config_file(source)  # a file there, named; a relative one in a removed working directory says so
        try:
            suffix = p.suffix.lower()  # config.YAML / .Yml / .TOML are YAML / TOML too, not JSON
            if suffix in (".yaml", ".yml"):
                data = _yaml_load(p.read_text()) or {}
            elif suffix == ".toml":
                data = tomllib.loads(p.read_text())
            else:
                data = json.loads(p.read_text(), object_pairs_hook=_one_value_per_key)
        except RecursionError:
            raise _nesting_error(f"config file {p}") from None
        except Exception as e:  # noqa: BLE001 - any parse error names the file
            raise ConfigError(f"config file {p}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        if _too_deep(data):
            raise _nesting_error(f"config file {p}")
    if isinstance(source, dict) and _too_deep(data):
        raise _nesting_error("config")
    sources: dict[tuple, str] = {}
    if use_env:
        data = _merge(data, env_overrides(environ, sources, KvbmBackendConfig))
    try:
        return KvbmBackendConfig.model_validate(data, context={"skip_dirs": skip_dirs})
    except ValidationError as e:
        raise ConfigError(_fmt_error(e, sources)) from None
