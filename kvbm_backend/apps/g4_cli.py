"""``kvbm-backend gc``, ``kvbm-backend g4 migrate`` and ``kvbm-backend keys create|rotate|revoke|list|rewrap|destroy``.

No command prints key material: ``keys list`` shows tenants, pseudonyms, key ids, versions, use
counts and creation dates only.
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .cli_checks import error_line, fail as _fail, finite as _finite, named_paths as _named_paths

console = Console(stderr=True)

keys_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Per-tenant G4 data keys: create, rotate, revoke (crypto-shred), list, rewrap, "
                            "destroy (crypto-shred of every tenant).")
g4_app = typer.Typer(add_completion=False, no_args_is_help=True, help="G4 store maintenance: migrate.")


def _out(obj, as_json: bool) -> None:
    """A command's report on stdout (errors alone go to stderr): JSON, a key table (a list of
    :meth:`Keyring.info` rows) or indented JSON."""
    if as_json:
        sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    elif isinstance(obj, list):
        _table(obj)
    else:
        Console().print_json(json.dumps(obj))


#: exit code of a run the store stopped by refusing a write for room (``stopped_full``: full, over quota, read-only)
EXIT_STORE_FULL = 3
#: exit code of a migrate run the store stopped by becoming unavailable after its first write (``stopped_unavailable``)
EXIT_STORE_UNAVAILABLE = 4
#: exit code of a migrate run stopped by a store still answering "slow down" after its retries (``stopped_throttled``)
EXIT_STORE_THROTTLED = 5


def _report(res: dict, as_json: bool, cmd: str) -> None:
    """gc's or migrate's report (:func:`_out`); each part of the store it could not list (``unlisted``) an
    error line on stderr (the first 20); a run stopped by a store refusing writes (``stopped_full``) an error
    line naming the store, its mount and why, then exit :data:`EXIT_STORE_FULL` (3); one stopped by the store
    becoming unavailable part way (``stopped_unavailable``) an error line naming the store, the error and how far
    it got, then exit :data:`EXIT_STORE_UNAVAILABLE` (4); one stopped by a store still answering "slow down" after
    its backed-off retries (``stopped_throttled``) an error line naming the store, the error and how far it got (a dry
    run's: that nothing was written), then exit :data:`EXIT_STORE_THROTTLED` (5); else exit 1 when ``errors`` > 0 (the
    run went on with the rest)."""
    _out(res, as_json)
    for w in res.get("warnings", []):
        console.print(Text.assemble(("warning:", "yellow"), f" {cmd}: {w}"), soft_wrap=True, highlight=False)
    unlisted = res.get("unlisted", [])
    for line in unlisted[:20]:
        error_line(f"{cmd}: {line}: its objects were not examined")
    if len(unlisted) > 20:
        error_line(f"{cmd}: {len(unlisted) - 20} more parts of the store not listed (see unlisted)")
    full = res.get("stopped_full")
    if full:
        mount = f", mount {full['mount']}" if full.get("mount") else ""
        error_line(f"{cmd}: stopped: {full['url']} refuses writes: {full['reason']} ({full['errno']}{mount}): "
                   f"{full['error']}; {res.get('migrated', 0)} renamed before it, {full['not_renamed']} left under "
                   "their old names untouched; free space (kvbm-backend gc), raise the quota or remount read-write, "
                   "then run it again (it goes on with those left)")
        raise typer.Exit(EXIT_STORE_FULL)
    down = res.get("stopped_unavailable")
    if down:
        error_line(f"{cmd}: stopped: {down['url']} unavailable: {down['error']}; {down['renamed']} renamed before it, "
                   f"{down['not_renamed']} left under their old names untouched (but the one it stopped at, {down['at']}: "
                   "its copy or its delete may have landed); run it again once the store is back (it goes on with "
                   "those left and settles that one)")
        raise typer.Exit(EXIT_STORE_UNAVAILABLE)
    slow = res.get("stopped_throttled")
    if slow:
        if res.get("dry_run"):  # wrote nothing: its counts are what a run would have done
            where = ("while listing" if slow["phase"] == "list" else
                     f"at {slow['at']}: {slow['renamed']} would be renamed before it, {slow['not_renamed']} from it "
                     "on not checked") + " (a dry run: nothing written)"
        else:
            where = ("while listing: nothing renamed" if slow["phase"] == "list" else
                     f"at {slow['at']}: {slow['renamed']} renamed before it, {slow['not_renamed']} left under their "
                     "old names" + (" untouched" if slow["phase"] == "check" else
                                    " (the one it stopped at may have its copy under the new name already)"))
        error_line(f"{cmd}: stopped: {slow['url']} still throttled (asked to slow down) after {slow['attempts']} "
                   f"tries with backoff: {slow['error']}; {where}; run it again when the store's load is lower"
                   + ("" if res.get("dry_run") else " (it goes on with those left)"))
        raise typer.Exit(EXIT_STORE_THROTTLED)
    if res["errors"]:
        raise typer.Exit(1)


@contextmanager
def _keyring_errors():
    """A KeyringError (wrong KEK, insecure file mode, unknown tenant...) or an OSError (a keyring or KEK
    file that cannot be created or read) becomes a one-line error, exit 2."""
    from kvbm_backend.crypto.keyring import KeyringError
    try:
        yield
    except KeyringError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"keys: {e}")


def _table(rows: list[dict]) -> None:
    t = Table("tenant", "pseudonym", "state", "key_id", "version", "current", "uses", "created")
    for r in rows:
        if r.get("state") == "revoked":  # the keyring keeps no name and no key of a revoked tenant
            t.add_row(r["tenant"] or "-", r["pseudonym"], "revoked", "-", "-", "", "-",
                      f"revoked {r['revoked_at']}")
            continue
        for v in r["versions"]:
            t.add_row(r["tenant"] or "(none)", r["pseudonym"], r.get("state", "active"), str(r["key_id"]),
                      str(v["version"]), "*" if v["current"] else "", str(v["uses"]), v["created"])
    Console().print(t)


def _revoked_rows(kr, tenant: Optional[str] = None) -> list[dict]:
    """``keys list`` rows of revoked tenants: ``{"tenant", "pseudonym", "state": "revoked", "revoked_at"
    (ISO 8601 UTC), "versions": []}``. The keyring records only the pseudonym of a revoked tenant, so
    ``tenant`` is None unless asked for by name (``tenant``: only that tenant's row, if revoked)."""
    from datetime import datetime, timezone
    rows = []
    want = kr.pseudonym(tenant).hex() if tenant is not None else None
    for ps, t in sorted(kr.revoked().items()):
        if want is None or ps == want:
            rows.append({"tenant": tenant, "pseudonym": ps, "state": "revoked", "versions": [],
                         "revoked_at": datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")})
    return rows


def _open(keyring: str, kek_env: str, kek_file: Optional[str], create: bool):
    """The keyring ``--keyring`` names under the KEK of ``--kek-env`` / ``--kek-file`` (:func:`provider_for`),
    created with its KEK file when ``create`` and absent. A ``--kek-env`` other than the default
    ``KVBM_BACKEND_KEK`` that is unset (or empty) is refused before anything is read or created, as the workers
    refuse such a ``g4.keyring.kek_env`` (before 2026-12-03 it fell back to the KEK file, ``create`` making a
    new KEK file and keyring), as is a relative path while the working directory has been removed
    (:func:`.cli_checks.named_paths`; before 2026-12-03 ``keys create`` said ``error: keys: [Errno 2] No such file
    or directory``, ``keys list`` that the keyring was not found, ``gc --keyring`` that it had no KEK). Every refusal is :func:`_fail` (one ``error:`` line, exit 2)."""
    import os
    from pathlib import Path

    from kvbm_backend.config import dir_problem
    from kvbm_backend.crypto.kek import DEFAULT_KEK_ENV
    from kvbm_backend.crypto.keyring import Keyring, provider_for
    if kek_env != DEFAULT_KEK_ENV and not os.environ.get(kek_env):
        _fail(f"--kek-env: ${kek_env} is not set (the KEK variable named; the KEK file {kek_file or keyring + '.kek'} "
              f"is no fallback for it: set ${kek_env} to the base64 32-byte KEK, or omit --kek-env (default "
              f"{DEFAULT_KEK_ENV}) to use the KEK file)")
    _named_paths(("--keyring", keyring), ("--kek-file", kek_file))
    for name, f in (("--keyring", keyring), ("--kek-file", kek_file)):
        if f and create and not Path(f).exists():
            problem = dir_problem(str(Path(f).absolute().parent))
            if problem:
                _fail(f"{name}: {f}: directory {Path(f).absolute().parent}: {problem}")
        elif f and Path(f).is_dir():
            _fail(f"{name}: {f}: is a directory, not a file")
    prov = provider_for(keyring, kek_env, kek_file, create=create)
    return Keyring(keyring, prov, create=create)


def _home(path: Optional[str]) -> Optional[str]:
    """A keyring or KEK file option with a leading ``~`` expanded (the home directory), as the workers and ``doctor``
    read ``g4.keyring.path`` / ``kek_file``: a ``--keyring=~/k.json`` no shell expanded names the same file."""
    import os
    return os.path.expanduser(path) if path else path


_KR = typer.Option(..., "--keyring", help="keyring file (JSON, mode 0600)", callback=_home)
_ENV = typer.Option("KVBM_BACKEND_KEK", "--kek-env", help="env var holding the base64 KEK")
_KF = typer.Option(None, "--kek-file", help="KEK file (default KEYRING.kek) when the env var is unset", callback=_home)


@keys_app.command("create")
def keys_create(keyring: str = _KR, tenant: str = typer.Option(..., "--tenant", help="tenant id"), kek_env: str = _ENV,
                kek_file: Optional[str] = _KF, as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Create a tenant's data key (and the keyring and its KEK file if they do not exist). The report
    says where the KEK is; a KEK file created here belongs in a secret store."""
    import os
    from pathlib import Path
    kf = Path(kek_file) if kek_file else Path(f"{keyring}.kek")
    kek_existed = bool(os.environ.get(kek_env)) or kf.exists()
    with _keyring_errors():
        kr = _open(keyring, kek_env, kek_file, True)
        was_revoked = tenant not in {r["tenant"] for r in kr.info()} and kr.pseudonym(tenant).hex() in kr.revoked()
        res = dict(kr.create(tenant), state="active", keyring=str(Path(keyring).absolute()))
    if was_revoked:  # same pseudonym, so the shredded blocks hold the new blocks' names (docs/configuration.md)
        res["note"] = ("this tenant was revoked: run `kvbm-backend gc --keyring` on every G4 store it used, or its "
                       "revoked blocks keep the names its new blocks take (offloads skipped, loads missed); run it "
                       "again once every worker re-read the keyring: it reclaims blocks sealed under the revoked "
                       "key after the revocation")
    src = getattr(kr.provider, "source", "?")
    if src.startswith("$"):
        res["kek"] = f"from {src} (the environment)"
    else:
        res["kek"] = f"{src}" + ("" if kek_existed else " (created now, mode 0600)")
    res["kek_note"] = ("the KEK unwraps every tenant's data key: keep it in a secret store (a Kubernetes Secret, "
                       "Vault, a cloud KMS), not beside the keyring or the G4 store; give it to workers through "
                       f"${kek_env} or g4.keyring.kek_file")
    _out(res, as_json)


@keys_app.command("rotate")
def keys_rotate(keyring: str = _KR, tenant: Optional[str] = typer.Option(None, "--tenant", help="default: all"),
                kek_env: str = _ENV, kek_file: Optional[str] = _KF,
                as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """New data key version for new writes; old versions stay for reads. No block is rewritten."""
    with _keyring_errors():
        kr = _open(keyring, kek_env, kek_file, False)
        names = [tenant] if tenant is not None else [r["tenant"] for r in kr.info()]
        _out([kr.rotate(t) for t in names], as_json)


@keys_app.command("revoke")
def keys_revoke(keyring: str = _KR, tenant: str = typer.Option(..., "--tenant", help="tenant id"), kek_env: str = _ENV,
                kek_file: Optional[str] = _KF, as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Delete every key of the tenant (crypto-shred: its G4 blocks become unreadable; gc reclaims them).
    Workers' G3 tiers (local plaintext) have nothing to shred: what reaches them is in the report's note."""
    with _keyring_errors():
        _out(dict(_open(keyring, kek_env, kek_file, False).revoke(tenant), note=REVOKE_NOTE), as_json)


#: ``keys revoke``'s report: what the crypto-shred does not reach (docs/configuration.md)
REVOKE_NOTE = ("G4 is shredded; the tenant's blocks in a worker's G3 (local plaintext SSD, its own saves and blocks "
               "promoted from G4) are not shredded: workers of the vLLM connector with G3 and this keyring, and "
               "G3Tiers following it (their config's keyring or their G4Tier's), stop serving them and delete them "
               "at their next keyring check (blocks a restarted worker restored at the tenant's next request); "
               "workers and G3Tiers without this keyring, or down, keep them: delete their g3.paths where they must "
               "go (docs/configuration.md, \"Revocation and G3\")")


@keys_app.command("list")
def keys_list(keyring: str = _KR, tenant: Optional[str] = typer.Option(None, "--tenant", help="only this tenant (default: all)"), kek_env: str = _ENV,
              kek_file: Optional[str] = _KF, as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Tenants, versions, use counts and created dates (never key material); revoked tenants as
    revoked (pseudonym and revocation time: the keyring keeps nothing else of them)."""
    with _keyring_errors():
        from kvbm_backend.crypto.keyring import KeyringError
        kr = _open(keyring, kek_env, kek_file, False)
        try:
            info = kr.info(tenant)
        except KeyringError:
            if tenant is None or not _revoked_rows(kr, tenant):
                raise
            info = []
        rows = [dict(r, state="active") for r in (info if isinstance(info, list) else [info])]
        _out(rows + _revoked_rows(kr, tenant), as_json)


@keys_app.command("rewrap")
def keys_rewrap(keyring: str = _KR, new_kek_file: Optional[str] = typer.Option(
                    None, help="new KEK file (created 0600 if absent)", callback=_home),
                new_kek_env: Optional[str] = typer.Option(None, help="env var with the new base64 KEK"),
                kek_env: str = _ENV, kek_file: Optional[str] = _KF,
                as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Re-wrap every key under a new KEK (KEK rotation) without rewriting any block. Running workers with
    the old KEK fail closed at their next reload until restarted with the new one (the report's note)."""
    from pathlib import Path

    from kvbm_backend.crypto.keyring import LocalKek
    if bool(new_kek_file) == bool(new_kek_env):
        _fail("keys rewrap: give exactly one of --new-kek-file or --new-kek-env")
    _named_paths(("--keyring", keyring), ("--kek-file", kek_file), ("--new-kek-file", new_kek_file))
    with _keyring_errors():
        kr = _open(keyring, kek_env, kek_file, False)
        if new_kek_env:
            new = LocalKek.from_env(new_kek_env)
        else:
            assert new_kek_file  # exactly one of --new-kek-file / --new-kek-env: checked above
            if Path(new_kek_file).is_dir():
                _fail(f"--new-kek-file: {new_kek_file}: is a directory, not a file")
            if not Path(new_kek_file).exists():
                from kvbm_backend.config import dir_problem
                parent = Path(new_kek_file).absolute().parent
                problem = dir_problem(str(parent))
                if problem:
                    _fail(f"--new-kek-file: {new_kek_file}: directory {parent}: {problem}")
                from kvbm_backend.fsmodes import makedirs_private
                makedirs_private(parent)  # 0700, parents too: as `keys create` makes the keyring's and KEK's
            new = (LocalKek.from_file(new_kek_file) if Path(new_kek_file).exists()
                   else LocalKek.generate_file(new_kek_file))
        n = kr.rewrap(new)
        _out({"rewrapped_keys": n, "kek_id": new.key_id, "note": REWRAP_NOTE}, as_json)


#: ``keys rewrap``'s report: the keyring names one KEK, so a worker still holding the old one fails closed
REWRAP_NOTE = ("every worker still holding the old KEK stops serving G4 keys at its next keyring reload (G4 misses, "
               "offloads dropped, keyring_ok false) until it is restarted with the new KEK: a running worker reads "
               "its KEK once, at start (docs/configuration.md, \"KEK rotation\")")


@keys_app.command("destroy")
def keys_destroy(keyring: str = _KR, yes: bool = typer.Option(False, "--yes", help="confirm: every tenant's keys are "
                                                                                  "deleted for good"),
                 as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Crypto-shred every tenant: delete the keyring file (and temp files killed writers left) holding its
    lock, so no running worker's change writes it back, then fsync its directory. The KEK stays; keys create
    then makes a new keyring (new pseudonym key). Needs --yes. A plain rm can race a worker's write."""
    if not yes:
        _fail(f"keys destroy: deletes every tenant's data keys in {keyring} for good (all their G4 blocks "
              "become unreadable); add --yes to confirm")
    from pathlib import Path
    _named_paths(("--keyring", keyring))
    if Path(keyring).is_dir():
        _fail(f"--keyring: {keyring}: is a directory, not a file")
    with _keyring_errors():
        from kvbm_backend.crypto.keyring_publish import destroy_keyring
        _out(dict(destroy_keyring(keyring), note=DESTROY_NOTE), as_json)


#: ``keys destroy``'s report: what deleting the keyring does not reach (docs/configuration.md)
DESTROY_NOTE = ("every tenant's G4 blocks are unreadable from now on (gc --max-age-s reclaims them: no revocation is "
                "recorded); running workers fail closed at their next keyring reload (G4 misses, offloads dropped) "
                "until `kvbm-backend keys create` makes a new keyring; copies of the keyring (backups, read-only "
                "mounts, Secrets) still hold the keys: delete them too; workers' G3 copies (local plaintext) are not "
                "shredded: delete their g3.paths where they must go (docs/configuration.md, \"Replacing the keyring "
                "file\")")


def _open_store(url: str, endpoint_url: Optional[str], region: Optional[str]):
    """The store ``--url`` names; a ``file://`` store must exist (never created here)."""
    from kvbm_backend.pool.g4.factory import open_store

    from .cli_checks import existing_dir, file_url_path
    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        _fail(f"--endpoint-url: expected http://HOST:PORT or https://HOST (got {endpoint_url!r})")
    local = file_url_path(url)
    if local is not None:
        existing_dir("--url", local, "this command works on an existing G4 store and creates none")
    try:
        return open_store(url, endpoint_url=endpoint_url, region=region, timeout_s=10.0)
    except ValueError as e:  # scheme or form of the URL ("g4.url ...: ...")
        _fail(f"--url: {str(e).removeprefix('g4.url').lstrip(': ')}")


@g4_app.command("migrate")
def g4_migrate(url: str = typer.Option(..., help="s3://BUCKET/PREFIX or file:///path"),
               endpoint_url: Optional[str] = typer.Option(None, help="S3 endpoint URL"),
               region: Optional[str] = typer.Option(None, help="S3 region (default: from the AWS environment)"),
               keyring: Optional[str] = typer.Option(None, help="the workers' keyring (or --unkeyed)", callback=_home),
               unkeyed: bool = typer.Option(False, "--unkeyed", help="the workers have no keyring (or --keyring)"),
               kek_env: str = _ENV, kek_file: Optional[str] = _KF,
               dir_fanout: int = typer.Option(256, help="the workers' g4.dir_fanout"),
               dry_run: bool = typer.Option(False, "--dry-run", help="count what the run would do (reading and "
                                            "verifying as it does); write and delete nothing"),
               encrypted: Optional[bool] = typer.Option(
                   None, "--encrypted/--plaintext",
                   help="the workers' g4.encrypt; with --keyring required once a plaintext object is found "
                        "(--encrypted leaves plaintext objects for gc: an encrypted pool never serves them)"),
               throttle_attempts: int = typer.Option(
                   10, help="tries of a request the store answers \"slow down\" (S3 503 SlowDown, 429), a jittered "
                            "exponential backoff between them (50 ms doubling to 1 s); then the run stops (exit 5)"),
               as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Rename blocks stored under format 1 names (sequence hash in clear) to keyed names. Safe while
    workers run; repeatable. Until it ran, old-named blocks are misses (recomputed). Exit 1 when an
    object could not be renamed or a directory listed (errors > 0; the rest was), 2 for a refused run
    (nothing written: a store unavailable before the run's first write included), 3 when the store refused a
    write for room (full, over quota, read-only): the run stopped there, every object not renamed left in place;
    run it again once there is room. 4 when the store became unavailable after the run's first write (S3 5xx or
    no answer after the retries, a file mount gone): the run stopped there, the report's stopped_unavailable says
    how many were renamed and left under their old names; run it again once the store is back. 5 when a request
    was still answered "slow down" (S3 503 SlowDown, 429) after --throttle-attempts tries, each after a jittered
    backoff: the run stopped there, stopped_throttled says how far it got; run it again when the store's load is
    lower."""
    from kvbm_backend.crypto.keyring import KeyringError
    from kvbm_backend.pool.g4.migrate import run_migrate
    store = _open_store(url, endpoint_url, region)
    try:
        kr = _open(keyring, kek_env, kek_file, False) if keyring else None
        res = run_migrate(store, keyring=kr, unkeyed=unkeyed, dir_fanout=dir_fanout, dry_run=dry_run,
                          encrypted=encrypted, throttle_attempts=throttle_attempts)
    except (ValueError, KeyringError, OSError) as e:
        _fail(str(e))
    _report(res, as_json, "g4 migrate")


def gc(url: str = typer.Option(..., help="s3://BUCKET/PREFIX or file:///path (an existing directory)"),
       endpoint_url: Optional[str] = typer.Option(None, help="S3 endpoint URL"),
       region: Optional[str] = typer.Option(None, help="S3 region (default: from the AWS environment)"),
       max_age_s: Optional[float] = typer.Option(
           None, help="delete blocks at least this old on the store's clock (seconds, >= 0; 0: all)"),
       target_gb: Optional[float] = typer.Option(None, help="then delete oldest until at most this (GB = 1e9 B, 0 to 10,000,000)"),
       tenant: Optional[str] = typer.Option(None, help="only this tenant: its id (with --keyring) or its 32-hex pseudonym (as keys list shows)"),
       keyring: Optional[str] = typer.Option(None, help="keyring: revoked tenants are reclaimed, --tenant mapped",
                                             callback=_home),
       kek_env: str = _ENV, kek_file: Optional[str] = _KF,
       temp_grace_s: float = typer.Option(3600.0, help="writer temp files younger than this are never touched"),
       announce_ttl_s: float = typer.Option(
           3600.0, help="announcement batches (g4.announce) at least this old on the store's clock are deleted"),
       dry_run: bool = typer.Option(False, "--dry-run", help="report, delete nothing"),
       as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Remove G4 blocks by age and/or to a capacity target (oldest first), per tenant too, and every
    block of revoked tenants. Ages are measured on the store's clock: the earlier of the time the store
    states (S3: its Date header) and the mtime of an empty probe object written and removed under
    gc-clock-probe/ (a file store: its server stamps it; a dry run writes none), else this host's clock; the report's
    time_base says which. Objects stamped later are new (future_objects). Safe while workers run. Exit 1 when an object could not be
    deleted or a directory listed (errors > 0; the rest was), 2 for a refused run."""
    from kvbm_backend.crypto.keyring import KeyringError
    from kvbm_backend.pool.g4.gc import run_gc
    if max_age_s is None and target_gb is None and keyring is None:
        _fail("gc: give --max-age-s and/or --target-gb (and/or --keyring to reclaim revoked tenants)")
    # a negative age or an infinite/NaN threshold is a mistake, never a policy (-1 would delete every
    # block); 0 ("everything older than now") and --target-gb 0 ("empty it") are explicit
    _finite("--max-age-s", max_age_s, ge=0)
    from kvbm_backend.config import MAX_CAPACITY_GB
    _finite("--target-gb", target_gb, ge=0, le=MAX_CAPACITY_GB)
    _finite("--temp-grace-s", temp_grace_s, ge=0)
    _finite("--announce-ttl-s", announce_ttl_s, ge=0)
    store = _open_store(url, endpoint_url, region)
    try:
        kr = _open(keyring, kek_env, kek_file, False) if keyring else None
        res = run_gc(store, keyring=kr, max_age_s=max_age_s,
                     target_bytes=None if target_gb is None else int(target_gb * 1e9), tenant=tenant,
                     temp_grace_s=temp_grace_s, dry_run=dry_run, announce_ttl_s=announce_ttl_s)
    except (ValueError, KeyringError, OSError) as e:
        _fail(str(e))
    _report(res, as_json, "gc")


def register(app: typer.Typer) -> None:
    """Add ``gc`` and the ``keys`` and ``g4`` sub-apps to the ``kvbm-backend`` CLI."""
    app.command("gc")(gc)
    app.add_typer(keys_app, name="keys")
    app.add_typer(g4_app, name="g4")
