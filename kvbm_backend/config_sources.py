"""Where a configuration comes from, before it is validated: the parsers of its sources (YAML without
anchors or aliases, JSON, bounded nesting) and the environment's overrides (KVBM's ``DYN_KVBM_*`` names and
``KVBM_BACKEND__SECTION__FIELD``), with :class:`ConfigError`, the one error type of configuration.

Used by :mod:`kvbm_backend.config` (which re-exports every public name here).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping


MAX_NESTING = 16
"""Deepest nesting of mappings/lists a config source may have (the tree itself is 4 deep); deeper input
(e.g. JSON nested 5,000 deep) is refused before it is parsed further or validated."""
MAX_ERROR_CHARS = 1000
"""A :class:`ConfigError` message is cut to this many characters (a quoted input can be any size)."""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field (or file, or environment variable).

    The message is cut to :data:`MAX_ERROR_CHARS` characters (``... (N more characters)``)."""

    def __init__(self, msg: object = "") -> None:
        text = str(msg)
        if len(text) > MAX_ERROR_CHARS:
            text = f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS} more characters)"
        super().__init__(text)


def _too_deep(data: Any, limit: int = MAX_NESTING) -> bool:
    """Whether mappings/lists in ``data`` nest deeper than ``limit`` levels (iterative: no recursion)."""
    stack = [(data, 0)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, (dict, list, tuple)):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    return False


def _nesting_error(where: str) -> ConfigError:
    return ConfigError(f"{where}: nested deeper than {MAX_NESTING} levels (a config is at most 4 deep)")


def _one_value_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (``json.loads``' ``object_pairs_hook``); ValueError naming a key
    repeated: the last copy would silently replace the first (a whole ``g3`` section, say)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object (the second would silently replace the first)")
        out[k] = v
    return out


def _json_loads(text: str, where: str) -> Any:
    """``json.loads`` with every failure (syntax, deep nesting, a key repeated in one object) as a one-line
    ConfigError naming ``where``."""
    try:
        data = json.loads(text, object_pairs_hook=_one_value_per_key)
    except RecursionError:
        raise _nesting_error(where) from None
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if _too_deep(data):
        raise _nesting_error(where)
    return data


def config_file(source: str | os.PathLike) -> Path:
    """``source`` as :func:`kvbm_backend.config.load_config` reads it: the path of an existing regular file. Raises
    ConfigError naming the file: a directory, something that is not a regular file, a path that is not there, or a
    relative path while this process's working directory has been removed (``config file: 'rel.yaml' is relative to
    the working directory, and this process's working directory has been removed ...``,
    :func:`kvbm_backend.fsmodes.abspath`; before 2026-12-03 ``config file rel.yaml: not found``, which sent the
    operator looking for a file that is there). Callers prefix the field or option that named it
    (``kv_connector_extra_config.config_file``, ``secondary_tiers G3Tier``)."""
    from .fsmodes import WorkdirRemoved, abspath
    p = Path(source)
    try:
        abspath(p)
    except WorkdirRemoved as e:
        raise ConfigError(f"config file: {e}") from None
    if p.is_dir():
        raise ConfigError(f"config file {p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"config file {p}: " + ("not a regular file" if p.exists() else "not found"))
    return p


def _yaml_load(text: str) -> Any:
    """YAML with the safe loader, minus anchors and aliases (``&a`` / ``*a``, ``<<: *a``): their expansion
    turns a few hundred bytes into gigabytes ("billion laughs"), and a config never needs them. Nesting is
    bounded by :data:`MAX_NESTING` while composing; a key repeated in one mapping is refused (the safe loader
    keeps the last copy: a second ``g3:`` section silently dropped the first's paths and capacity). Raises
    ConfigError (without the file name)."""
    import yaml
    from yaml.events import AliasEvent, CollectionStartEvent

    class _Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            line = event.start_mark.line + 1 if event.start_mark else "?"
            if isinstance(event, AliasEvent) or getattr(event, "anchor", None):
                raise ConfigError(f"line {line}: YAML anchors and aliases (&name, *name) are not accepted")
            if isinstance(event, CollectionStartEvent):
                if self.depth >= MAX_NESTING:
                    raise ConfigError(f"line {line}: nested deeper than {MAX_NESTING} levels (a config is at most"
                                      f" 4 deep)")
                self.depth += 1
                try:
                    return super().compose_node(parent, index)
                finally:
                    self.depth -= 1
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen: dict[tuple[str, str], int] = {}  # (tag, text) of each scalar key -> its line
            for key_node, _ in getattr(node, "value", ()):
                if not isinstance(key_node, yaml.ScalarNode):
                    continue  # the safe loader refuses a non-scalar key itself
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"line {line}: key {key[1]!r} appears twice in one mapping (first at line "
                                      f"{seen[key]}; the second would silently replace the first)")
                seen[key] = line
            return super().construct_mapping(node, deep)

    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _set_path(d: dict, path: list[str], value: Any, name: str = "") -> None:
    """Set ``path`` in ``d`` to ``value``; a mapping value is merged field by field into a mapping already
    there (another variable's fields stay). Raises ConfigError naming ``name`` when the path runs through
    a value that is not a mapping."""
    for i, p in enumerate(path[:-1]):
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"{name}: {'.'.join(path[:i + 1])} is not a section (another variable set it to "
                              f"{d!r})")
    old = d.get(path[-1])
    d[path[-1]] = _merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value


#: Dynamo KVBM settings with no kvbm-backend meaning, and what to use instead (a warning, once per process,
#: when set: KVBM itself may be running beside us and read them, so they are never an error)
KVBM_ONLY_ENV = {
    "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "G3 is sized in bytes: g3.capacity_gb or DYN_KVBM_DISK_CACHE_GB",
    "DYN_KVBM_CPU_CACHE_GB": "no G2 of ours: the connector moves G1<->G3/G4; native tiers: vLLM's cpu_bytes_to_use",
    "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "no G2 of ours (see DYN_KVBM_CPU_CACHE_GB)",
    "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "no leader/worker start-up barrier here",
    "DYN_KVBM_DISK_ZEROFILL_FALLBACK": "slab files grow with posix_fallocate, chunked, whatever the filesystem",
}
_kvbm_only_warned: set[str] = set()


#: the one rule of every ``DYN_KVBM_*`` boolean (any case, surrounding spaces ignored; docs/configuration.md)
KVBM_TRUE = ("1", "true", "yes", "on")
KVBM_FALSE = ("0", "false", "no", "off")


def _kvbm_flag(env: Mapping[str, str], name: str) -> bool | None:
    """A KVBM boolean environment switch: true/false, 1/0, yes/no, on/off, any case, surrounding spaces
    ignored; unset or blank: None. Raises ConfigError naming ``name`` for another value."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in KVBM_TRUE + KVBM_FALSE:
        raise ConfigError(f"{name}: expected true/false, 1/0, yes/no or on/off, got {env[name]!r}")
    return raw in KVBM_TRUE


def env_overrides(environ: dict[str, str] | None = None, sources: dict[tuple, str] | None = None,
                  model: Any = None) -> dict:
    """The overrides the environment gives, as a nested dict. ``sources`` (if given) is filled with
    field path tuple -> environment variable name, one entry per field a variable sets (a section variable
    such as ``KVBM_BACKEND__G3='{"capacity_gb": 5}'`` gives ``("g3", "capacity_gb")`` only, not ``("g3",)``;
    an empty mapping is recorded at its own path), for error messages and ``config effective``. ``model``: the
    config's pydantic model (``KvbmBackendConfig``, passed in: this module is below it): a variable naming one of
    its text fields takes its text as it stands, not parsed as JSON (:func:`_text_field`).

    Raises ConfigError naming ``DYN_KVBM_DISK_CACHE_DIR`` when it has an empty entry (``/a::/b``, a
    leading or trailing ``:``) or an entry with spaces around it (``/a: /b``: `` /b`` is relative), either of
    which would otherwise put G3 in the current directory."""
    env = os.environ if environ is None else environ
    out: dict = {}
    sources = {} if sources is None else sources
    if env.get("DYN_KVBM_DISK_CACHE_DIR"):
        raw = env["DYN_KVBM_DISK_CACHE_DIR"]
        parts = raw.split(":")
        bad = [i for i, x in enumerate(parts) if not x.strip()]
        if bad:
            raise ConfigError(f"DYN_KVBM_DISK_CACHE_DIR: empty path entry {bad[0]} ('::' or a leading/trailing"
                              f" ':'); G3 would open in the current directory (got {raw!r})")
        spaced = [x for x in parts if x != x.strip()]
        if spaced:  # ' /b' is a relative path in the current directory; KVBM takes its one path verbatim
            raise ConfigError(f"DYN_KVBM_DISK_CACHE_DIR: path entry {spaced[0]!r} has spaces around it (a path"
                              f" starting with a space is relative: G3 would open in the current directory;"
                              f" separate entries with ':' alone; got {raw!r})")
        _set_path(out, ["g3", "paths"], parts)
        sources[("g3", "paths")] = "DYN_KVBM_DISK_CACHE_DIR"
    if env.get("DYN_KVBM_DISK_CACHE_GB"):
        _set_path(out, ["g3", "capacity_gb"], env["DYN_KVBM_DISK_CACHE_GB"])
        sources[("g3", "capacity_gb")] = "DYN_KVBM_DISK_CACHE_GB"
    flag = _kvbm_flag(env, "DYN_KVBM_METRICS")  # KVBM's names; the boolean by the DYN_KVBM_* rule
    if flag is not None:
        _set_path(out, ["metrics", "enabled"], flag)
        sources[("metrics", "enabled")] = "DYN_KVBM_METRICS"
    if env.get("DYN_KVBM_METRICS_PORT"):
        _set_path(out, ["metrics", "port"], env["DYN_KVBM_METRICS_PORT"])
        sources[("metrics", "port")] = "DYN_KVBM_METRICS_PORT"
    if _kvbm_flag(env, "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER"):  # KVBM's switch for its disk-offload filter
        _set_path(out, ["g3", "admission", "policy"], "all")
        sources[("g3", "admission", "policy")] = "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER"
    if _kvbm_flag(env, "DYN_KVBM_DISK_DISABLE_O_DIRECT"):  # KVBM's switch for O_DIRECT on its disk tier
        _set_path(out, ["g3", "o_direct"], "off")
        sources[("g3", "o_direct")] = "DYN_KVBM_DISK_DISABLE_O_DIRECT"
    for name in KVBM_ONLY_ENV:
        if env.get(name) and name not in _kvbm_only_warned:
            _kvbm_only_warned.add(name)
            logging.getLogger("kvbm_backend.config").warning(
                "%s is Dynamo KVBM's setting; kvbm-backend does not read it (%s; docs/migrating.md)",
                name, KVBM_ONLY_ENV[name])
    # whole sections first, then deeper fields: KVBM_BACKEND__G3__ADMISSION__POLICY wins over the policy in
    # KVBM_BACKEND__G3__ADMISSION, and a section merges with the fields other variables set (before 2026-11-29
    # it replaced them: KVBM_BACKEND__G3 dropped DYN_KVBM_DISK_CACHE_DIR's paths)
    for k, v in sorted(env.items(), key=lambda kv: (kv[0].count("__"), kv[0])):
        if k.startswith("KVBM_BACKEND__"):
            path = [p.lower() for p in k[len("KVBM_BACKEND__"):].split("__")]
            try:
                val = json.loads(v)
            except RecursionError:
                raise _nesting_error(k) from None
            except ValueError:
                val = v
            if _too_deep(val):
                raise _nesting_error(k)
            if isinstance(val, (int, float)) and model is not None and _text_field(path, model):  # bool is an int: TENANT=true is "true"
                val = v  # a text field takes the text: KVBM_BACKEND__TENANT=42 is the tenant "42", not 42 (refused)
            _set_path(out, path, val, k)
            _record(sources, tuple(path), val, k)
    return out


def _text_field(path: list[str], model: Any) -> bool:
    """Whether ``path`` names a text field of ``model`` (the config's pydantic model; ``str`` or ``str | None``:
    ``tenant``, ``revision``, ``g4.region``...). Before 2026-12-03 such a variable's text was parsed as JSON whatever
    the field, so ``KVBM_BACKEND__TENANT=42`` or ``KVBM_BACKEND__REVISION=2`` was the number 42 / 2, refused at load."""
    from pydantic import BaseModel

    for i, part in enumerate(path):
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return False
        model = field.annotation
        if i == len(path) - 1:
            return model in (str, str | None)
    return False


def _record(sources: dict[tuple, str], path: tuple, value: Any, name: str) -> None:
    """Note that variable ``name`` set ``path`` to ``value``: one entry per field it holds (a mapping is
    merged field by field, so a section variable sets only its own fields; an empty mapping is recorded at
    ``path``). A value that is not a mapping replaces whatever was below ``path``: those entries go."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _record(sources, path + (str(k),), v, name)
        return
    if not isinstance(value, dict):
        for old in [s for s in sources if len(s) > len(path) and s[:len(path)] == path]:
            del sources[old]
    sources[path] = name


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
