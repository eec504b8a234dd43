"""``kvbm-backend config effective`` (also ``python -m kvbm_backend.apps.effective``): what the example
launch scripts run before they start an engine, so a script's defaults never override the operator.

Given the script's ``--kv-transfer-config`` JSON (after :mod:`kvbm_backend.integrations.dynamo.ktc`), it finds
every kvbm-backend config in it (``KvbmBackendConnector``'s ``config_file`` / inline ``kvbm_backend``, a
``G3Tier``/``G4Tier``'s ``config``; inline as a mapping or its JSON text, as the engine takes them), and:

* applies each script default (``--default g3.paths='["/mnt/nvme0/kvbm"]'``) only where neither the config file
  nor the environment (``DYN_KVBM_*``, ``KVBM_BACKEND__SECTION__FIELD``) gives the field, as an exported
  ``KVBM_BACKEND__SECTION__FIELD`` (never a ``DYN_KVBM_*`` name: Dynamo's KVBM reads those too); a section
  variable (``KVBM_BACKEND__G3='{"capacity_gb": 5}'``) gives only the fields it holds;
* tiering form (an ``OffloadingConnector``, alone or in a ``MultiConnector``): points every tier's ``config``
  at ``$KVBM_BACKEND_CONFIG_FILE`` when set, takes ``cpu_bytes_to_use`` from ``$KVBM_BACKEND_CPU_BYTES`` and
  the tiers' ``num_kv_heads`` (KV heads per TP rank, replacing their ``layout`` preset) from
  ``$KVBM_BACKEND_NUM_KV_HEADS`` when set, and leaves ``G3Tier`` out when G3 is off and ``G4Tier`` when G4 is off
  (unset included), each said in the line (a tier whose section is off refuses to start:
  :func:`kvbm_backend.integrations.vllm.extra_config.check_tier_section`; before 2026-12-01 the G3Tier stayed and
  opened G3 at the script's default paths);
* prints ONE line on stderr with the effective G3/G4 settings and where each came from: ``file`` (the config
  file), ``env NAME``, ``script`` (the script's default or its inline settings), ``default`` (kvbm-backend's);
  only the sections the config's users open (a G4Tier's config: no ``g3.*``; :func:`summary`);
* prints on stdout the shell lines the script evaluates (``export ...``, ``KV_TRANSFER_CONFIG=...``).

A missing config file, an invalid field or, with G4 encryption on, no KEK (neither ``$kek_env`` nor the KEK
file, and no new keyring to create one for) is one ``kvbm-backend: error: ...`` line and exit 2 (an invalid
script default is named ``(from --default FIELD)``, not by the variable it is exported as); so is a
``g4.keyring.kek_env`` other than the default ``KVBM_BACKEND_KEK`` that is unset (``g4.keyring.kek_env: NAME is not
set``), with G4 encryption on or a ``g4.keyring.path`` set, as the worker refuses it (before 2026-12-03 the line said
``g4.kek=[new file ...]``); so are the default ``g3.paths`` (``./kvbm-g3``) where it cannot be created, when a user of
the config opens G3 (``g3.paths[0]: ... the default ...``, as the engine and the dry run say), and a relative
``g4.keyring.path`` / ``kek_file`` while the working directory has been removed (both since 2026-12-03).

``--dry-run ARGV...`` (what the scripts exec instead of the engine when ``KVBM_BACKEND_DRY_RUN`` is set):
print ``kvbm-backend dry run: exec ARGV`` (shell-quoted) and ``kvbm-backend dry run: env K=V ...`` (the
``KVBM_BACKEND__*`` / ``DYN_KVBM_*`` variables the engine would see; URLs with credentials or a query in either
line, or in the error, pass through :func:`~kvbm_backend.pool.g4.store.redact_urls`) on stdout, run the launchers' preflight
(:func:`kvbm_backend.integrations.preflight.check_argv`) and exit 0, or 2 with its one-line error.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

import typer

CONNECTOR = "KvbmBackendConnector"
TIER_MODULE = "kvbm_backend.integrations.vllm.tiering"
SHOWN = ("g3.enabled", "g3.paths", "g3.capacity_gb", "g4.enabled", "g4.url", "g4.endpoint_url", "g4.encrypt",
         "g4.keyring.path")
DEFAULT_CONFIG_VAR = "KVBM_BACKEND_CONFIG_FILE"
CPU_BYTES_VAR = "KVBM_BACKEND_CPU_BYTES"
KV_HEADS_VAR = "KVBM_BACKEND_NUM_KV_HEADS"


class EffectiveError(ValueError):
    """A setting the engine could not start with; the message names the field or file."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _given(field: str, keys) -> bool:
    """``field`` (dotted) is set by one of ``keys``: the same field, a section above it or a field in it."""
    return any(k == field or field.startswith(k + ".") or k.startswith(field + ".") for k in keys)


def _env_name(field: str) -> str:
    return "KVBM_BACKEND__" + "__".join(p.upper() for p in field.split("."))


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    if isinstance(v, bool):
        return str(v).lower()
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


class Source:
    """One kvbm-backend config as a script hands it to the engine: a file path, an inline dict, or None.

    ``spec`` as the engine takes it (:func:`kvbm_backend.config.load_config`): a string starting with ``{`` is
    inline JSON, parsed here into its dict (before 2026-11-30 it was taken for a file name and refused as not
    found, although the connector and the tiers load it); anything but a path, a mapping or None raises
    EffectiveError naming ``where`` (the connector's own check; it was a traceback)."""

    def __init__(self, spec: Any, inline: dict | None = None, where: str = "config"):
        from ..config import ConfigError, _json_loads
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = _json_loads(spec, f"{where}: inline JSON config")
            except ConfigError as e:
                raise EffectiveError(str(e)) from None
        if spec is not None and not isinstance(spec, (str, Path, dict)):
            raise EffectiveError(f"{where}: expected a mapping, a JSON string or a file path, got "
                                 f"{type(spec).__name__}")
        self.spec, self.inline = spec, inline or {}

    def describe(self) -> str:
        if isinstance(self.spec, (str, Path)):
            return f"config file {self.spec}"
        return "inline settings" if self.spec else "no config file"

    def file_fields(self, skip_dirs: tuple[str, ...] = ()) -> tuple[dict, str]:
        """The fields the file (or the script's inline dict) sets, flattened, and their label. ``skip_dirs``:
        :func:`~kvbm_backend.config.load_config`'s."""
        from ..config import ConfigError, load_config
        if isinstance(self.spec, (str, Path)):
            from ..fsmodes import WorkdirRemoved, abspath
            try:  # a relative file while the working directory has been removed: say so, not "not found"
                abspath(self.spec)
            except WorkdirRemoved as e:
                raise EffectiveError(f"config file: {e}") from None
            if not Path(self.spec).is_file():
                raise EffectiveError(f"config file {self.spec}: not found (set {DEFAULT_CONFIG_VAR} to your "
                                     f"kvbm-backend YAML)")
            try:
                cfg = load_config(str(self.spec), use_env=False, skip_dirs=skip_dirs)
            except ConfigError as e:
                raise EffectiveError(str(e) if str(self.spec) in str(e) else f"config file {self.spec}: {e}") from None
            return _flatten(cfg.model_dump(exclude_unset=True)), "file"
        return _flatten(self.spec or {}), "script"


def effective(source: Source, defaults: dict[str, Any], environ: dict[str, str] | None = None,
              skip_dirs: tuple[str, ...] = ()) -> tuple[Any, dict[str, str], dict[str, str]]:
    """Resolve one config. Returns ``(config, exports, where)``: the effective
    :class:`~kvbm_backend.config.KvbmBackendConfig`, the ``KVBM_BACKEND__...`` variables that carry the
    script defaults the operator left open, and field -> source label for :data:`SHOWN`. ``skip_dirs``: sections
    whose directories are not checked (:func:`~kvbm_backend.config.load_config`; a section no user of this config
    opens, :func:`_skip_dirs`). ``g3.paths`` left to its default (``./kvbm-g3``) is judged as the engine judges it
    when a user of the config opens G3 (:func:`~kvbm_backend.integrations.vllm.extra_config.check_default_g3_paths`):
    before 2026-12-03 only the dry run's preflight did, and ``config effective`` passed (exit 0) a connector config
    from a read-only or removed working directory that the preflight and the engine refuse.

    Raises EffectiveError (one line naming the field, variable or file)."""
    from ..config import ConfigError, _merge, env_overrides, load_config
    env = dict(os.environ if environ is None else environ)
    file_fields, file_label = source.file_fields(skip_dirs)
    env_src: dict[tuple, str] = {}
    try:
        env_overrides(env, env_src)
    except ConfigError as e:
        raise EffectiveError(str(e)) from None
    env_keys = {".".join(k): v for k, v in env_src.items()}
    exports: dict[str, str] = {}
    for field, value in defaults.items():
        if not _given(field, file_fields) and not _given(field, env_keys):
            exports[_env_name(field)] = json.dumps(value)
    spec = str(source.spec) if isinstance(source.spec, (str, Path)) else source.spec
    from ..integrations.vllm.extra_config import check_default_g3_paths
    try:
        cfg = load_config(spec, environ={**env, **exports}, skip_dirs=skip_dirs)
        if source.inline:
            data = cfg.model_dump()
            if "paths" not in cfg.g3.model_fields_set and "paths" not in source.inline.get("g3", {}):
                del data["g3"]["paths"]  # left to its default: stays so, judged below (as tier_config does)
            for sec, over in source.inline.items():  # field by field, as the tiers merge them (tier_config)
                data[sec] = _merge(data[sec], over)
            cfg = load_config(data, use_env=False, skip_dirs=skip_dirs)
        check_default_g3_paths(cfg, skip_dirs=skip_dirs)  # ./kvbm-g3, as the connector, a G3Tier and the preflight
    except ConfigError as e:  # a script default is the script's, not a variable the operator set
        msg = str(e)
        for field in (f for f in defaults if _env_name(f) in exports):
            msg = msg.replace(f"(from {_env_name(field)})", f"(from --default {field})")
        raise EffectiveError(msg) from None
    where: dict[str, str] = {}
    inline_keys = _flatten(source.inline)
    for field in SHOWN:
        if _given(field, inline_keys):
            where[field] = "inline"
        elif _env_name(field) in exports:
            where[field] = "script"
        else:
            hits = [k for k in env_keys if k == field or field.startswith(k + ".")]  # one per field a variable sets
            hit = env_keys[max(hits, key=len)] if hits else None
            where[field] = (f"env {hit}" if hit else file_label if _given(field, file_fields) else "default")
    return cfg, exports, where


def check_kek_env(kr, environ: Mapping[str, str] | None = None) -> None:
    """:func:`kvbm_backend.crypto.kek.check_kek_env` of keyring config ``kr``: a ``g4.keyring.kek_env`` other than
    the default ``KVBM_BACKEND_KEK`` must be set in ``environ`` (None: this process's), as the worker requires
    (:meth:`~kvbm_backend.crypto.keyring.Keyring.from_config`). Raises EffectiveError naming the field and the
    variable (before 2026-12-03 ``config effective`` reported ``g4.kek=[new file ...]``, the node-local KEK file
    the worker no longer falls back to)."""
    from ..crypto.kek import KeyringError, check_kek_env as _check
    try:
        _check(kr, os.environ if environ is None else environ)
    except KeyringError as e:
        raise EffectiveError(str(e)) from None


def check_keyring_paths(kr) -> None:
    """``g4.keyring.path`` and ``g4.keyring.kek_file`` of keyring config ``kr`` must name files: a relative one while
    this process's working directory has been removed names none (:func:`kvbm_backend.fsmodes.abspath`). Raises
    EffectiveError naming the field (before 2026-12-03 ``config effective`` said ``g4.kek=[new file ...]``, exit 0, and
    the worker failed ``g4.keyring: [Errno 2] No such file or directory``)."""
    from ..fsmodes import unresolvable
    bad = unresolvable((("g4.keyring.path", _home(kr.path)), ("g4.keyring.kek_file", _home(kr.kek_file))))
    if bad:
        raise EffectiveError(bad)


def _home(path: str | None) -> str | None:
    """``path`` with a leading ``~`` expanded, as the workers read keyring paths (Keyring.from_config)."""
    return path and os.path.expanduser(path)


def kek_source(cfg, environ: dict[str, str] | None = None) -> str:
    """Where the G4 keyring's KEK comes from (``env NAME``, ``file PATH``, ``new file PATH``); raises
    EffectiveError when there is none, when a ``g4.keyring.kek_env`` other than the default is unset
    (:func:`check_kek_env`), or the KEK file is a symbolic link to nothing (the same rule as
    :func:`kvbm_backend.crypto.kek.provider_for`, which takes any name there, a link too, as the KEK file)."""
    env = os.environ if environ is None else environ
    kr = cfg.g4.keyring
    if not kr.path:
        raise EffectiveError("g4.keyring.path: required when g4.encrypt is true (a keyring file, created 0600)")
    check_kek_env(kr, env)
    if env.get(kr.kek_env):
        return f"env {kr.kek_env}"
    path = os.path.expanduser(kr.path)  # `~`: the home directory, as the workers read it (before 2026-12-03: "new file ~/...")
    kf = _home(kr.kek_file) or f"{path}.kek"
    if os.path.lexists(kf):  # as provider_for: a symbolic link there is the KEK file, never "create one"
        if not Path(kf).exists():
            raise EffectiveError(f"g4.keyring: KEK file {kf} is a symbolic link to nothing "
                                 f"({os.readlink(kf)!r}): the keyring opener reads it and fails; replace it by "
                                 f"the file or set ${kr.kek_env}")
        return f"file {kf}"
    if not Path(path).exists():
        return f"new file {kf}"
    raise EffectiveError(f"g4.keyring: keyring {path} has no KEK: set ${kr.kek_env} (base64 32-byte key) or "
                         f"provide {kf}")


def summary(kind: str, source: Source, cfg, where: dict[str, str], kek: str | None, notes: list[str],
            unused: tuple[str, ...] = ()) -> str:
    """The one printed line: ``kvbm-backend effective (KIND, SOURCE): field=value [source] ...``.

    ``unused``: the sections no user of this config opens (:func:`_skip_dirs`, the same ones whose directories are
    not checked), whose fields are left out: a G4Tier-only config prints no ``g3.*`` field, a G3Tier-only one no
    ``g4.*`` field but ``g4.keyring.path`` when set (the G3Tier follows that keyring's revocations). Before
    2026-12-03 a G4Tier-only config's line said ``g3.enabled=true [default] g3.paths=./kvbm-g3 ...``, a G3 the
    engine never opens (and whose paths were not checked)."""
    parts = []
    for field in SHOWN:
        sec, _, rest = field.partition(".")
        if sec in unused:
            if field != "g4.keyring.path" or not cfg.g4.keyring.path:
                continue
        elif (sec == "g3" and not cfg.g3.enabled and rest != "enabled") or \
                (sec == "g4" and not cfg.g4.enabled and rest != "enabled") or \
                (field == "g4.keyring.path" and not cfg.g4.encrypt):
            continue
        value = cfg
        for p in field.split("."):
            value = getattr(value, p)
        if field in ("g4.url", "g4.endpoint_url") and value:  # credentials in a URL never reach a log line
            from kvbm_backend.store_url import redact_url
            value = redact_url(value)
        parts.append(f"{field}={_fmt(value)} [{where[field]}]")
    if kek:
        parts.append(f"g4.kek=[{kek}]")
    return f"kvbm-backend effective ({kind}, {source.describe()}): " + " ".join(parts + notes)


def _sources(ktc: dict, environ: dict) -> list[tuple[dict, Source]]:
    """(owner dict, Source) for each kvbm-backend config in the JSON; tiering tiers' ``config`` follows
    ``$KVBM_BACKEND_CONFIG_FILE`` (rewritten in place)."""
    out: list[tuple[dict, Source]] = []
    kind = ktc.get("kv_connector")
    extra = ktc.get("kv_connector_extra_config") or {}
    if kind == CONNECTOR:
        if "config_file" in extra:
            out.append((ktc, Source(extra["config_file"], where="kv_connector_extra_config.config_file")))
        else:
            out.append((ktc, Source(extra.get("kvbm_backend"), where="kv_connector_extra_config.kvbm_backend")))
    elif kind == "MultiConnector":
        for child in extra.get("connectors") or []:
            if isinstance(child, dict):
                out += _sources(child, environ)
    elif kind == "OffloadingConnector":
        for tier in extra.get("secondary_tiers") or []:
            if tier.get("module_path") == TIER_MODULE:
                if environ.get(DEFAULT_CONFIG_VAR):
                    tier["config"] = environ[DEFAULT_CONFIG_VAR]
                inline = {s: tier[s] for s in ("g3", "g4") if isinstance(tier.get(s), dict)}
                out.append((tier, Source(tier.get("config"), inline, where=f"{tier.get('type', 'tier')}.config")))
    return out


def _skip_dirs(found: list[tuple[dict, Source]]) -> dict[str, tuple[str, ...]]:
    """Per config (:func:`resolve`'s key), the sections whose directories none of its users opens: a G4Tier's config
    skips ``g3`` (``g3.paths``, the default ``./kvbm-g3`` included), a G3Tier's ``g4``, as the tiers themselves do
    (:func:`kvbm_backend.integrations.vllm.extra_config.tier_config`); the connector uses both. Before 2026-12-03 a
    G4Tier-only transfer config was refused (``g3.paths[0]: ...``) where ``./kvbm-g3`` could not be created."""
    out: dict[str, set[str]] = {}
    for owner, src in found:
        own = {"G3Tier": {"g4"}, "G4Tier": {"g3"}}.get(owner.get("type", ""), set()) if "module_path" in owner else set()
        key = _key(src)
        out[key] = out[key] & own if key in out else own
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _key(src: Source) -> str:
    return json.dumps([src.spec, src.inline], sort_keys=True, default=str)


def _offloading(ktc: dict) -> dict | None:
    """The ``OffloadingConnector`` entry: ``ktc`` itself or a ``MultiConnector`` child (the first); None."""
    if ktc.get("kv_connector") == "OffloadingConnector":
        return ktc
    if ktc.get("kv_connector") == "MultiConnector":
        for child in (ktc.get("kv_connector_extra_config") or {}).get("connectors") or []:
            if isinstance(child, dict) and (found := _offloading(child)) is not None:
                return found
    return None


def resolve(ktc: dict, kind: str, defaults: dict[str, Any], environ: dict[str, str] | None = None
            ) -> tuple[dict, dict[str, str], list[str]]:
    """Everything the script needs: ``(new ktc, exports, summary lines)`` (one line per distinct config).
    Raises EffectiveError."""
    env = dict(os.environ if environ is None else environ)
    ktc = json.loads(json.dumps(ktc))
    found = _sources(ktc, env)
    if not found:
        raise EffectiveError("--kv-transfer-config: no KvbmBackendConnector and no kvbm-backend tier in it")
    notes: list[str] = []
    offload = _offloading(ktc)
    extra = (offload or {}).get("kv_connector_extra_config") or {}
    if offload is not None and env.get(CPU_BYTES_VAR):
        raw = env[CPU_BYTES_VAR]
        if not raw.isdigit() or int(raw) <= 0:
            raise EffectiveError(f"{CPU_BYTES_VAR}: need a positive number of bytes, got {raw!r}")
        extra["cpu_bytes_to_use"] = int(raw)
        notes.append(f"cpu_bytes_to_use={raw} [env {CPU_BYTES_VAR}]")
    elif "cpu_bytes_to_use" in extra:
        notes.append(f"cpu_bytes_to_use={extra['cpu_bytes_to_use']} [script]")
    if offload is not None and env.get(KV_HEADS_VAR):
        raw = env[KV_HEADS_VAR]
        if not raw.isdigit() or int(raw) <= 0:
            raise EffectiveError(f"{KV_HEADS_VAR}: need a positive number of KV heads per rank, got {raw!r}")
        for tier in extra.get("secondary_tiers") or []:
            if tier.get("module_path") == TIER_MODULE:
                tier.pop("layout", None)
                tier["num_kv_heads"] = int(raw)
        notes.append(f"num_kv_heads={raw} [env {KV_HEADS_VAR}]")
    exports: dict[str, str] = {}
    lines, seen, skips = [], {}, _skip_dirs(found)
    for owner, src in found:
        key = _key(src)
        if key not in seen:
            cfg, ex, where = effective(src, defaults, env, skips[key])
            if cfg.g4.keyring.path and (cfg.g4.enabled or "g4" in skips[key]):  # the G4 pool or a G3Tier opens it
                check_keyring_paths(cfg.g4.keyring)
            kek = kek_source(cfg, env) if cfg.g4.enabled and cfg.g4.encrypt else None
            if cfg.g4.enabled and not cfg.g4.encrypt and cfg.g4.keyring.path:  # the pool opens it (names, reads)
                check_kek_env(cfg.g4.keyring, env)
            seen[key] = cfg
            exports.update(ex)
            lines.append((src, cfg, where, kek, skips[key]))
        sec = {"G3Tier": "g3", "G4Tier": "g4"}.get(owner.get("type", ""))
        if sec and not getattr(seen[key], sec).enabled:  # the tier would refuse to start (check_tier_section)
            extra["secondary_tiers"] = [t for t in extra["secondary_tiers"] if t is not owner]
            notes.append(f"{owner['type']} left out ({sec}.enabled=false)")
    return ktc, exports, [summary(kind, s, c, w, k, notes if i == len(lines) - 1 else [], u)
                          for i, (s, c, w, k, u) in enumerate(lines)]


def _default_arg(raw: str) -> tuple[str, Any]:
    field, sep, value = raw.partition("=")
    if not sep or not field:
        raise EffectiveError(f"--default: expected FIELD=VALUE, got {raw!r}")
    try:
        return field, json.loads(value)
    except ValueError:
        return field, value


def dry_run(argv: list[str]) -> int:
    """Print the command a script would exec and run the launchers' preflight on it; 0 or 2."""
    from ..integrations.preflight import check_argv
    from ..store_url import redact_urls  # credentials in a URL (an S3 endpoint's) never reach the log
    print("kvbm-backend dry run: exec " + redact_urls(shlex.join(argv)))
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("KVBM_BACKEND__", "DYN_KVBM_")))
    print("kvbm-backend dry run: env " + redact_urls(shlex.join(env)), flush=True)
    why = check_argv(argv, create=False)  # a dry run writes nothing (no keyring, no KEK file)
    if why:
        print(f"kvbm-backend: error: {redact_urls(why)}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0, or 2 with one ``kvbm-backend: error:`` line)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--dry-run"]:
        return dry_run(args[1:])
    ap = argparse.ArgumentParser(prog="kvbm-backend config effective",
                                 description="Effective G3/G4 settings of a launch script and where each comes "
                                             "from; prints the shell lines the script evaluates.")
    ap.add_argument("kv_transfer_config", help="the script's --kv-transfer-config JSON")
    ap.add_argument("--for", dest="kind", choices=["dynamo", "vllm"], required=True,
                    help="which launcher the script runs (printed in the summary line)")
    ap.add_argument("--default", action="append", default=[], metavar="FIELD=VALUE",
                    help="a script default (VALUE as JSON, else a string), applied only where the config file and "
                         "the environment leave FIELD unset; repeatable")
    ns = ap.parse_args(args)
    try:
        ktc = json.loads(ns.kv_transfer_config)
        if not isinstance(ktc, dict):
            raise EffectiveError("--kv-transfer-config: expected a JSON object")
        new, exports, lines = resolve(ktc, ns.kind, dict(_default_arg(d) for d in ns.default))
    except ValueError as e:  # EffectiveError, or JSON
        from ..store_url import redact_urls
        print(f"kvbm-backend: error: {redact_urls(str(e))}", file=sys.stderr)
        return 2
    for line in lines:
        print(line, file=sys.stderr)
    for k, v in exports.items():
        print(f"export {k}={shlex.quote(v)}")
    print(f"KV_TRANSFER_CONFIG={shlex.quote(json.dumps(new))}")
    return 0


typer_app = typer.Typer(add_completion=False, help="Inspect the configuration a launch script hands the engine.")


@typer_app.command("effective", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                                   "help_option_names": []}, add_help_option=False)
def _effective_cmd(ctx: typer.Context) -> None:
    """Effective G3/G4 settings of a launch script, with their source (see --help)."""
    raise typer.Exit(main(ctx.args))


@typer_app.callback()
def _config() -> None:
    """Configuration commands."""


if __name__ == "__main__":
    raise SystemExit(main())
