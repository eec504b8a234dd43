"""``kv_connector_extra_config`` of :class:`~kvbm_backend.integrations.vllm.connector.KvbmBackendConnector`:
the backend config and the connector's own options, checked.

No vLLM import here: the launchers' preflight and the tests on machines without vLLM (the lent GPU)
read the same settings the connector does.
"""
from __future__ import annotations

import os

from ...config import ConfigError, KvbmBackendConfig, _merge, dir_problem, load_config

EXTRA_KEYS = {"kvbm_backend", "config_file", "stats_path", "save", "load", "save_decode", "save_to_g4",
              "promote_to_g3", "max_pending_save_bytes", "sliding_capacity_weight", "handoff_wait_s",
              "reset_tiers"}
HANDOFF_WAIT_MAX_S = 600.0  # handoff_wait_s's upper bound (seconds; the scripts' KVBM_BACKEND_HANDOFF_WAIT_S too)


def config_from_extra(extra: dict | None) -> tuple[KvbmBackendConfig, dict]:
    """Split ``kv_connector_extra_config`` into the backend config and the connector options.

    With G3 on, the default ``g3.paths`` (``./kvbm-g3``) is judged as a given path (:func:`check_default_g3_paths`).

    Raises:
        ConfigError: an unknown key, both or neither-typed config sources, or an invalid field
            (the message names it, e.g. ``kv_connector_extra_config.kvbm_backend: g3.capacity_gb: ...``).
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - EXTRA_KEYS)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(EXTRA_KEYS)}")
    if "kvbm_backend" in extra and "config_file" in extra:
        raise ConfigError("kv_connector_extra_config: give either 'kvbm_backend' or 'config_file', not both")
    try:
        if "config_file" in extra:
            cfg = load_config(str(extra["config_file"]))
        else:
            src = extra.get("kvbm_backend")
            if src is not None and not isinstance(src, (dict, str)):
                raise ConfigError(f"kv_connector_extra_config.kvbm_backend: expected a mapping or JSON string, "
                                  f"got {type(src).__name__}")
            cfg = load_config(src)
        check_default_g3_paths(cfg)  # the connector opens G3 unless g3.enabled is false
    except ConfigError as e:
        which = "config_file" if "config_file" in extra else "kvbm_backend"
        raise ConfigError(f"kv_connector_extra_config.{which}: {e}") from None
    opts = {"stats_path": extra.get("stats_path"), "save": extra.get("save", True), "load": extra.get("load", True),
            "save_decode": extra.get("save_decode", True),
            "save_to_g4": extra.get("save_to_g4", True), "promote_to_g3": extra.get("promote_to_g3", True),
            "max_pending_save_bytes": extra.get("max_pending_save_bytes", 1 << 30),
            "sliding_capacity_weight": extra.get("sliding_capacity_weight", 0.25),
            "handoff_wait_s": extra.get("handoff_wait_s", 5.0), "reset_tiers": extra.get("reset_tiers", False)}
    for k in ("save", "load", "save_decode", "save_to_g4", "promote_to_g3", "reset_tiers"):
        if not isinstance(opts[k], bool):
            raise ConfigError(f"kv_connector_extra_config.{k}: expected true/false, got {opts[k]!r}")
    hw = opts["handoff_wait_s"]
    if isinstance(hw, bool) or not isinstance(hw, (int, float)) or not 0 <= hw <= HANDOFF_WAIT_MAX_S:
        raise ConfigError(f"kv_connector_extra_config.handoff_wait_s: expected seconds in [0, {HANDOFF_WAIT_MAX_S:g}], "
                          f"got {hw!r}")
    opts["handoff_wait_s"] = float(hw)
    mp = opts["max_pending_save_bytes"]
    if isinstance(mp, bool) or not isinstance(mp, int) or mp <= 0:  # bool is an int: true would be 1 byte
        raise ConfigError(f"kv_connector_extra_config.max_pending_save_bytes: expected a positive integer "
                          f"(bytes), got {mp!r}")
    w = opts["sliding_capacity_weight"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1:
        raise ConfigError(f"kv_connector_extra_config.sliding_capacity_weight: expected a number in (0, 1] (a "
                          f"sliding-window group's share of G3 capacity relative to a full-attention group), got {w!r}")
    return cfg, opts


def tier_config(config: str | dict | None, *, g3: dict | None = None, g4: dict | None = None,
                tier: str | None = None) -> KvbmBackendConfig:
    """The backend config of a vLLM secondary tier (``G3Tier``/``G4Tier`` keys ``config``, ``g3``, ``g4``;
    :mod:`.tiering`): ``config`` (a file path or a dict, :func:`load_config`) with ``g3``/``g4`` merged over
    its sections field by field, nested sections too (``g4: {"keyring": {"read_only": true}}`` keeps the
    keyring's ``path``, ``kek_env``, ``auto_create_tenants`` from the file or the environment; before
    2026-11-30 it replaced the whole ``keyring`` section, which then fell back to its defaults).

    Admission: vLLM's primary tier already decides what is offloaded (tiering has no store_threshold) and hands a
    chunk down once per residency, so G3 admits every cascaded chunk (``all``) unless ``g3.admission.policy`` itself
    is set (file, environment, the tier's ``g3`` key). Before 2026-12-01 any ``g3.admission`` field chose (a
    ``min_sightings`` alone switched the tier to ``frequency``).

    ``tier`` (``"G3"`` for a G3Tier, ``"G4"`` for a G4Tier; None: no tier check) also checks that the tier's own
    section is on (:func:`check_tier_section`); for ``"G4"`` the result has ``g4.enabled`` true. A tier checks the
    directories of its own pool only (a G4Tier's ``g4.url`` ``file://`` store, a G3Tier's ``g3.paths``): the other
    section's are neither checked nor created (its fields are still validated). Before 2026-12-03 a G4Tier-only setup
    was refused where the default ``g3.paths`` (``./kvbm-g3``) could not be created, e.g. a read-only working
    directory. Raises ConfigError naming the field."""
    skip = {"G3": ("g4",), "G4": ("g3",)}.get(tier or "", ())
    cfg = load_config(config, skip_dirs=skip)
    data = cfg.model_dump()
    default_paths = "paths" not in cfg.g3.model_fields_set and "paths" not in (g3 if isinstance(g3, dict) else {})
    if default_paths:  # left to its default here too: judged below, the error saying it is the default
        del data["g3"]["paths"]
    for name, override in (("g3", g3), ("g4", g4)):
        if override is not None:
            if not isinstance(override, dict):
                raise ConfigError(f"{name}: expected a mapping of {name} settings, got {override!r}")
            data[name] = _merge(data[name], override)
    adm = (g3 or {}).get("admission")
    if not ((isinstance(adm, dict) and "policy" in adm) or "policy" in cfg.g3.admission.model_fields_set):
        data["g3"]["admission"] = {**data["g3"]["admission"], "policy": "all"}
    if tier is not None:
        g4_set = "enabled" in cfg.g4.model_fields_set or "enabled" in (g4 or {})
        check_tier_section(tier, g3_enabled=bool(data["g3"]["enabled"]), g4_enabled=bool(data["g4"]["enabled"]),
                           g4_enabled_set=g4_set, g4_url=data["g4"]["url"])
        if tier == "G4":
            data["g4"]["enabled"] = True
    out = load_config(data, use_env=False, skip_dirs=skip)
    check_default_g3_paths(out, skip_dirs=skip)
    return out


def check_default_g3_paths(cfg: KvbmBackendConfig, *, skip_dirs: tuple[str, ...] = ()) -> None:
    """Judge ``g3.paths`` left to its default (``./kvbm-g3``, relative to the working directory) as a given path
    is judged at load (:func:`~kvbm_backend.config.dir_problem`), for what opens G3: the connector
    (:func:`config_from_extra`), a G3Tier (:func:`tier_config`) and the launchers' preflight of both. Nothing when
    G3 is off, ``"g3"`` is in ``skip_dirs`` or ``g3.paths`` was given (file, environment, tier key). Other callers of
    :func:`~kvbm_backend.config.load_config` (CLI tools that never open G3) are not refused. Before 2026-12-03 the
    default was never judged: from a working directory where ``./kvbm-g3`` cannot be created the preflight passed
    and the engine failed opening the pool (``FileExistsError: ... kvbm-g3``, no field named).

    Raises ConfigError ``g3.paths[i]: <problem> (got '<path>': the default, ...)`` naming how to set it."""
    if not cfg.g3.enabled or "g3" in skip_dirs or "paths" in cfg.g3.model_fields_set:
        return
    for i, p in enumerate(cfg.g3.paths):
        problem = dir_problem(p)
        if problem:
            try:
                cwd = os.getcwd()
            except OSError as e:  # removed under this process
                cwd = f"(unknown: {e.strerror})"
            raise ConfigError(f"g3.paths[{i}]: {problem} (got {p!r}: the default, relative to the working directory "
                              f"{cwd}; set g3.paths, or DYN_KVBM_DISK_CACHE_DIR, to a directory this process can "
                              f"write)")


def check_tier_section(tier: str, *, g3_enabled: bool, g4_enabled: bool, g4_enabled_set: bool,
                       g4_url: str | None) -> None:
    """Refuse a native tier whose own section is off (before 2026-12-01 a G3Tier opened G3 whatever
    ``g3.enabled`` said, at ``g3.paths`` unchecked, and a G4Tier forced ``g4.enabled`` on). ``tier``: ``"G3"`` or
    ``"G4"``. A G4Tier's ``g4.enabled`` left unset counts as on (the G4Tier is the opt-in, as before; the example
    scripts leave a G4Tier out unless the config sets it true); set false anywhere (the config file, the
    environment, the tier's ``g4`` key) it is refused, as is a G4Tier without ``g4.url``. Raises ConfigError."""
    for name, on, known in (("G3", g3_enabled, True), ("G4", g4_enabled, g4_enabled_set)):
        if tier == name and known and not on:
            sec = name.lower()
            raise ConfigError(f"{sec}.enabled: false, but secondary_tiers has a {name}Tier, which is a {name} pool: "
                              f"set {sec}.enabled: true (in the config file, KVBM_BACKEND__{name}__ENABLED or the "
                              f"tier's {sec} key), or remove the {name}Tier from secondary_tiers (the example scripts "
                              f"leave it out: kvbm-backend config effective)")
    if tier == "G4" and not g4_url:
        raise ConfigError("g4.url: required for G4Tier (s3://BUCKET/PREFIX or file:///shared/path)")
