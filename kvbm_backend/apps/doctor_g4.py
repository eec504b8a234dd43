"""``kvbm-backend doctor``'s G4 section: what the configured shared store and keyring do when asked, probed
the way a worker uses them, never created or changed (a probe object is written and removed).

Checks, in order (a check that cannot run because an earlier one failed is reported as not checked):

* ``url``: ``g4.url`` opens as a store (scheme and form; a ``file://`` root must exist: doctor creates
  nothing, and a missing shared directory usually means a missing mount).
* ``endpoint`` (``s3://``): a TCP connection to the S3 endpoint (``g4.endpoint_url``, else the AWS
  client's) within the timeout.
* ``credentials`` (``s3://``): the AWS client finds credentials (and the store accepts them: a 403 on
  the bucket is reported here).
* ``bucket`` (``s3://``): HEAD bucket answers (kvbm-backend never creates buckets).
* ``probe``: a probe object (``kvbm-doctor-probe-HOST-PID-UUID``) is published create-exclusive (the
  conditional put every block write uses), a second create-exclusive put of the same name is refused,
  then it is deleted and is gone (``file://``: a file created with ``link()`` and unlinked).
* ``keyring`` (``g4.encrypt``, or ``g4.keyring.path`` set: a plaintext pool with a keyring opens it too, to
  name tenants by keyed pseudonyms, open encrypted blocks and refuse revoked tenants, and does not start when it
  does not open): the keyring file loads and every key unwraps with its KEK (read-only: no lock file, nothing
  written), in a directory and with files the worker would trust (owner, mode, links:
  :func:`kvbm_backend.fsmodes.open_trusted`); file modes are in doctor's ``modes`` section. A keyring not there
  yet (the first worker creates it): the KEK it would be created with (``$kek_env``, else an existing KEK file)
  must be a valid one. A ``g4.keyring.kek_env`` other than the default ``KVBM_BACKEND_KEK`` must be set: a worker
  refuses to start without it (before 2026-12-03 it used a node-local KEK file, making one with a keyring of its
  own; doctor said "OK", the KEK a new file). Before 2026-12-03 a keyring with ``g4.encrypt: false`` and a malformed ``$kek_env``
  beside a keyring not yet made were "OK" (workers failed to start). No keyring at all (``g4.encrypt: false``, no
  ``g4.keyring.path``): not checked, but ``$kek_env`` set to a value that is no KEK is a problem (the variable is
  unused here, and unusable by any worker: a mistake, likely a configuration meant to encrypt).
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Any
from urllib.parse import urlparse

PROBE_PREFIX = "kvbm-doctor-probe-"
PROBE_BYTES = b"kvbm-backend doctor probe\n"


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class _Checks:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, check: str, ok: bool | None, detail: str) -> bool:
        """One row: ``ok`` True (passed), False (a problem), None (not checked / not applicable)."""
        self.rows.append({"check": check, "ok": ok, "detail": detail})
        return bool(ok)

    def skip(self, checks: tuple[str, ...], why: str) -> None:
        for c in checks:
            self.add(c, None, f"not checked: {why}")


def _reachable(endpoint: str, timeout_s: float) -> str | None:
    """None when a TCP connection to ``endpoint``'s host and port opens within ``timeout_s``, else why."""
    u = urlparse(endpoint)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{u.hostname}:{port}: {e.strerror or _err(e)}"


def _probe(store, rows: _Checks) -> None:
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    where = f"{store.url}/{name}"
    try:
        if not store.put_if_absent(name, PROBE_BYTES):
            rows.add("probe", False, f"create-exclusive put of {where} reported the new name as existing")
            return
        try:
            again = store.put_if_absent(name, PROBE_BYTES + b"again")
            if again:
                rows.add("probe", False, f"a second create-exclusive put of {where} replaced it: the store does "
                                         "not refuse existing names (concurrent writers could overwrite blocks)")
                return
        finally:
            store.delete(name)
        if store.head(name) is not None:
            rows.add("probe", False, f"{where} still exists after delete")
            return
    except OSError as e:
        rows.add("probe", False, f"create-exclusive put/delete of {where} failed: {e}")
        return
    cond = getattr(store, "supports_conditional_put", True)
    rows.add("probe", True, f"{where}: created exclusively, second put refused, deleted"
             + ("" if cond else " (the server has no conditional put: HEAD-then-PUT fallback, racy)"))


def _s3_checks(store, cfg, timeout_s: float, rows: _Checks) -> bool:
    """endpoint, credentials, bucket. True when the probe may run."""
    from kvbm_backend.pool.g4.store import BucketMissing, StoreUnavailable
    from kvbm_backend.store_url import redact_url
    later = ("credentials", "bucket", "probe")
    endpoint = getattr(store.client.meta, "endpoint_url", None) or cfg.endpoint_url
    why = _reachable(endpoint, timeout_s)
    shown = redact_url(endpoint)  # user:secret@ in an endpoint URL never reaches a report
    if why is not None:
        rows.add("endpoint", False, f"S3 endpoint {shown} not reachable ({why})")
        rows.skip(later, "endpoint not reachable")
        return False
    rows.add("endpoint", True, f"{shown} accepts connections")
    import boto3
    creds = boto3.session.Session().get_credentials()  # the chain the store's client uses
    if creds is None:
        rows.add("credentials", False, "no S3 credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                                       "~/.aws/credentials or an instance role)")
        rows.skip(("bucket", "probe"), "no credentials")
        return False
    method = getattr(creds, "method", "?")
    try:
        store.probe()
    except BucketMissing as e:
        rows.add("credentials", True, f"found ({method}), accepted by the store")
        rows.add("bucket", False, f"{e} (kvbm-backend never creates buckets: create it)")
        rows.skip(("probe",), "no bucket")
        return False
    except StoreUnavailable as e:
        rows.add("credentials", None, f"found ({method}); not checked: the store did not answer")
        rows.add("bucket", False, f"no answer: {e}")
        rows.skip(("probe",), "the store did not answer")
        return False
    except OSError as e:
        if "403" in str(e) or "AccessDenied" in str(e) or "Forbidden" in str(e):
            rows.add("credentials", False, f"found ({method}) but refused by the store: {e}")
            rows.skip(("bucket", "probe"), "credentials refused")
        else:
            rows.add("credentials", True, f"found ({method})")
            rows.add("bucket", False, str(e))
            rows.skip(("probe",), "bucket check failed")
        return False
    rows.add("credentials", True, f"found ({method}), accepted by the store")
    rows.add("bucket", True, f"{store.bucket!r} exists")
    return True


def _keyring_check(kc, rows: _Checks, encrypt: bool) -> None:
    from kvbm_backend.crypto.kek import check_kek_env, provider_for, trusted_dir
    from kvbm_backend.crypto.keyring import Keyring, KeyringError
    if not kc.path:
        rows.add("keyring", False, "g4.keyring.path: required when g4.encrypt is true")
        return
    from kvbm_backend.fsmodes import abspath
    # g4.encrypt false: the pool still opens the keyring, and does not start when it does not open (G4Pool)
    why = "" if encrypt else (" (g4.encrypt is false, but a G4 pool opens the keyring g4.keyring.path names: it "
                              "names tenants and opens encrypted blocks with it, and does not start without it)")
    for field, p in (("g4.keyring.path", kc.path), ("g4.keyring.kek_file", kc.kek_file)):
        try:  # relative while the working directory is removed: names no file (as `config effective` says)
            if p:
                abspath(os.path.expanduser(p))
        except ValueError as e:
            rows.add("keyring", False, f"{field}: {e}{why}")
            return
    # `~` is the home directory, in the KEK file's name too, as the workers read both (Keyring.from_config; before
    # 2026-12-03 doctor checked ~/k.json while workers made a keyring ./~/k.json of their own)
    kf = kc.kek_file and os.path.expanduser(kc.kek_file)
    kc = kc.model_copy(update={"path": os.path.expanduser(kc.path), "kek_file": kf})
    path = os.path.abspath(kc.path)
    try:
        check_kek_env(kc)  # a kek_env the config names must be set: the worker refuses to start otherwise
        # the worker's rule (kvbm_backend.fsmodes.open_trusted): a directory others can write is refused
        trusted_dir(os.path.dirname(path), "keyring")
    except KeyringError as e:
        rows.add("keyring", False, f"{e}{why}")
        return
    if not os.path.exists(path):
        from kvbm_backend.config import dir_problem
        if dir_problem(os.path.dirname(path)) is not None or kc.read_only is True:
            rows.add("keyring", False, f"{path}: not found, and its directory cannot be written here (create it "
                                       "with `kvbm-backend keys create` where it is writable, then mount it)")
            return
        try:
            kek = _new_keyring_kek(kc, path)
        except KeyringError as e:
            rows.add("keyring", False, f"{e}: the first worker creates keyring {path} with this KEK and would "
                                       f"fail to start{why}")
            return
        rows.add("keyring", True, f"{path}: absent; the first worker creates it (KEK: {kek})")
        return
    try:
        prov = provider_for(path, kc.kek_env, kc.kek_file, create=False)
        kr = Keyring(path, prov, create=False, read_only=True)
    except KeyringError as e:
        rows.add("keyring", False, f"{e}{why}")
        return
    try:
        n, revoked = len(kr.info()), len(kr.revoked())
    finally:
        close = getattr(kr, "close", None)
        if close is not None:
            close()
    rows.add("keyring", True, f"{path}: loads, every key unwraps with the KEK from {getattr(prov, 'source', '?')} "
                              f"({n} tenants, {revoked} revoked)" + ("" if encrypt else "; g4.encrypt is false: "
                              "blocks are written unencrypted, tenants named under this keyring"))


def _new_keyring_kek(kc, path: str) -> str:
    """Where the KEK of keyring ``path`` (absent: the first worker creates it) comes from, checked as
    :func:`kvbm_backend.crypto.kek.provider_for` reads it, nothing created: ``$kek_env`` when set (valid base64 of
    32 bytes), else an existing KEK file (a trusted, private file holding such a key), else a KEK file the worker
    generates (in a directory it would trust). Raises KeyringError naming the variable or file."""
    from kvbm_backend.crypto.kek import provider_for, trusted_dir
    kf = kc.kek_file or f"{path}.kek"
    if os.environ.get(kc.kek_env) or os.path.lexists(kf):
        return getattr(provider_for(path, kc.kek_env, kc.kek_file, create=False), "source", "?")
    trusted_dir(os.path.dirname(os.path.abspath(kf)), "KEK file")
    return f"{kf}, generated by that worker"


def _unused_kek(kc) -> tuple[bool | None, str]:
    """The ``keyring`` row of a G4 without a keyring (``g4.encrypt`` false, no ``g4.keyring.path``): not checked,
    unless ``$kek_env`` holds a value that is no KEK (a problem: set for nothing, and usable by nothing)."""
    from kvbm_backend.crypto.kek import LocalKek
    from kvbm_backend.crypto.keyring import KeyringError
    text = "g4.encrypt is false and no g4.keyring.path: blocks are stored unencrypted, tenants named unkeyed"
    if not os.environ.get(kc.kek_env):
        return None, text
    try:
        LocalKek.from_env(kc.kek_env)
    except KeyringError as e:
        return False, (f"{e}: no worker can use it, and this configuration uses none ({text}); unset "
                       f"${kc.kek_env}, or set it to a base64 32-byte key with g4.encrypt: true and g4.keyring.path "
                       "if blocks were meant to be encrypted")
    return None, f"{text}; ${kc.kek_env} is set but unused here"


def g4_info(cfg, timeout_s: float = 5.0) -> dict:
    """Probe the G4 store and keyring ``cfg`` (a :class:`kvbm_backend.config.KvbmBackendConfig`) names.

    Args:
        cfg: the loaded config; nothing is checked when ``g4.enabled`` is false.
        timeout_s: bound of each network step (TCP connect, each S3 request), seconds.
    Returns:
        ``{"enabled": bool, "url": str | None, "checks": [{"check", "ok", "detail"}], "problems": [str]}``:
        ``ok`` True passed, False a problem (also in ``problems``, as ``"g4 CHECK: DETAIL"``), None not
        checked. Never raises.
    """
    from kvbm_backend.store_url import redact_url
    g4 = cfg.g4
    out: dict[str, Any] = {"enabled": bool(g4.enabled), "url": redact_url(g4.url) if g4.url else None}
    rows = _Checks()
    if not g4.enabled:
        out.update(checks=[], problems=[])
        return out
    _store_checks(g4, timeout_s, rows)
    if g4.encrypt or g4.keyring.path:  # a plaintext pool opens its keyring too (G4Pool): checked the same way
        _keyring_check(g4.keyring, rows, bool(g4.encrypt))
    else:
        rows.add("keyring", *_unused_kek(g4.keyring))
    out["checks"] = rows.rows
    out["problems"] = [f"g4 {r['check']}: {r['detail']}" for r in rows.rows if r["ok"] is False]
    return out


def _store_checks(g4, timeout_s: float, rows: _Checks) -> None:
    from kvbm_backend.pool.g4.factory import open_store
    url = g4.url or ""
    u = urlparse(url)
    if u.scheme == "file" and u.path.startswith("/") and not os.path.isdir(u.path):
        rows.add("url", False, f"g4.url {url}: directory {u.path} does not exist (a shared store's directory "
                               "must be there before workers start: is the mount missing? else mkdir -m 700 it)")
        rows.skip(("probe",), "no store directory")
        return
    try:
        store = open_store(url, endpoint_url=g4.endpoint_url, region=g4.region, timeout_s=timeout_s, retries=0,
                           max_inflight=1, fsync=g4.fsync)
    except (ValueError, OSError) as e:
        rows.add("url", False, str(e))
        rows.skip(("probe",), "the URL does not open")
        return
    try:
        rows.add("url", True, f"{store.url} opens ({type(store).__name__})")
        if u.scheme == "s3" and not _s3_checks(store, g4, timeout_s, rows):
            return
        _probe(store, rows)
    except Exception as e:  # noqa: BLE001 - doctor reports, never raises
        rows.add("probe", False, f"unexpected {_err(e)}")
    finally:
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass
