"""Check the kvbm-backend connector's settings before an engine starts, and exit with one line naming
the field when they cannot work.

Why: vLLM creates KV connectors inside its worker processes. When our connector raises there (for
example ``g4.keyring.path`` missing with ``g4.encrypt`` on, or a KEK that cannot be read), vLLM 0.32's
engine core reports "Worker failed with error ..." but the API server process does not exit: seen with
``vllm serve`` on the CPU engine (the shipped example's G4 settings without a keyring: the server
stayed up, serving nothing, until killed). The launchers (``kvbm_backend.integrations.vllm.cli`` and
``kvbm_backend.integrations.dynamo.vllm_worker``) run :func:`check_argv` first, so such a
configuration stops before any engine process exists.

What is checked, for every ``KvbmBackendConnector`` in ``--kv-transfer-config`` (top level or a
``MultiConnector`` child): ``kv_connector_extra_config`` parses into the config tree (every field rule
of :mod:`kvbm_backend.config`, G3 paths included), and with G4 encryption on the keyring and its KEK
open (:meth:`kvbm_backend.crypto.keyring.Keyring.from_config`, exactly as the pool opens them).
Storage reachability is not checked here: an unreachable G4 is a degraded tier, not a start-up error.
"""
from __future__ import annotations

import json
import sys

CONNECTOR = "KvbmBackendConnector"


def _arg(argv: list[str], name: str) -> str | None:
    """The value of option ``name`` (``--a-b``) as vLLM's parser takes it: the last occurrence wins, ``--a_b``
    is the same option, ``--a-b=V`` and ``--a-b V`` both count. (Before 2026-11-29 the first occurrence was
    checked: a launch script passes its own ``--kv-transfer-config`` and then the operator's arguments, so the
    operator's, the one vLLM uses, went unchecked.)"""
    found = None
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        if not flag.startswith("--") or flag.replace("_", "-") != name:
            continue
        if eq:
            found = val
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return found


def _ours(ktc: dict) -> list[dict]:
    out = []
    if ktc.get("kv_connector") == CONNECTOR:
        out.append(ktc.get("kv_connector_extra_config") or {})
    if ktc.get("kv_connector") == "MultiConnector":
        for child in (ktc.get("kv_connector_extra_config") or {}).get("connectors", []) or []:
            if isinstance(child, dict):
                out += _ours(child)
    return out


def check_extra(extra: dict) -> None:
    """Raise :class:`~kvbm_backend.config.ConfigError` (field named) if the connector's
    ``kv_connector_extra_config`` cannot start."""
    from ..config import ConfigError
    from .vllm.extra_config import config_from_extra
    cfg, _ = config_from_extra(extra)
    if cfg.g4.enabled and cfg.g4.encrypt:
        from ..crypto.keyring import Keyring, KeyringError
        try:
            Keyring.from_config(cfg.g4.keyring).close()
        except (KeyringError, OSError) as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("g4.") else f"g4.keyring: {msg}") from None


def check_argv(argv: list[str]) -> str | None:
    """The first problem of the kvbm-backend connectors in ``--kv-transfer-config`` as one line, or
    None (also None when there is no such argument or no connector of ours)."""
    raw = _arg(argv, "--kv-transfer-config")
    if raw is None:
        return None
    try:
        ktc = json.loads(raw)
    except ValueError as e:
        return f"--kv-transfer-config: not JSON ({e})"
    if not isinstance(ktc, dict):
        return "--kv-transfer-config: expected a JSON object"
    for extra in _ours(ktc):
        try:
            check_extra(extra)
        except Exception as e:  # noqa: BLE001 - ConfigError / ValueError: one line for the operator
            return f"kv_connector_extra_config: {e}" if not str(e).startswith("kv_connector_extra_config") else str(e)
    return None


def exit_if_bad(argv: list[str] | None = None) -> None:
    """:func:`check_argv` on ``sys.argv``; print ``kvbm-backend: error: ...`` and exit 2 on a problem."""
    why = check_argv(sys.argv[1:] if argv is None else argv)
    if why:
        print(f"kvbm-backend: error: {why}", file=sys.stderr)
        raise SystemExit(2)
