"""``python -m kvbm_backend.integrations.dynamo.ktc JSON``: print a ``--kv-transfer-config`` JSON with the
kvbm-backend connector's options set from the environment, so launch scripts keep one readable JSON
block and deployments (and the tests that run the scripts) point it elsewhere without editing them.

Applies to every ``KvbmBackendConnector`` entry (top level or a ``MultiConnector`` child):

* ``KVBM_BACKEND_CONFIG_FILE``: ``kv_connector_extra_config.config_file`` (drops an inline ``kvbm_backend``);
* ``KVBM_BACKEND_STATS_PATH``: ``kv_connector_extra_config.stats_path`` (the connector's JSON counters);
* ``KVBM_BACKEND_HANDOFF_WAIT_S``: ``kv_connector_extra_config.handoff_wait_s`` (seconds in [0, 600], the
  connector's own bounds: how long a decode worker waits for its prefill worker's blocks; the disaggregated G4
  scripts write 5.0).

Unset variables leave the JSON as written. A bad value raises ValueError naming the variable (:func:`main`: one
line ``kvbm-backend: error: ...`` on stderr, exit 2, as the launchers' preflight; before 2026-11-30 ``abc`` was a
traceback and 601 passed here, to be refused by the connector inside vLLM's workers).
"""
from __future__ import annotations

import json
import os
import sys

from ..vllm.extra_config import HANDOFF_WAIT_MAX_S

CONNECTOR = "KvbmBackendConnector"
_VARS = ("KVBM_BACKEND_CONFIG_FILE", "KVBM_BACKEND_STATS_PATH", "KVBM_BACKEND_HANDOFF_WAIT_S")


def _seconds(name: str, raw: str) -> float:
    """``raw`` as seconds in [0, 600] (``kv_connector_extra_config.handoff_wait_s``'s bounds).

    Raises:
        ValueError: naming ``name``, for anything else (not a number, NaN, out of bounds).
    """
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0 <= v <= HANDOFF_WAIT_MAX_S:
        raise ValueError(f"{name}: expected seconds in [0, {HANDOFF_WAIT_MAX_S:g}] (handoff_wait_s), got {raw!r}")
    return v


def apply_env(cfg: dict, environ: dict | None = None) -> dict:
    env = os.environ if environ is None else environ
    out = json.loads(json.dumps(cfg))

    def visit(c: dict) -> None:
        extra = c.get("kv_connector_extra_config") or {}
        if c.get("kv_connector") == CONNECTOR and any(env.get(v) for v in _VARS):
            extra = c.setdefault("kv_connector_extra_config", {})
            if env.get("KVBM_BACKEND_CONFIG_FILE"):
                extra.pop("kvbm_backend", None)
                extra["config_file"] = env["KVBM_BACKEND_CONFIG_FILE"]
            if env.get("KVBM_BACKEND_STATS_PATH"):
                extra["stats_path"] = env["KVBM_BACKEND_STATS_PATH"]
            if env.get("KVBM_BACKEND_HANDOFF_WAIT_S"):
                extra["handoff_wait_s"] = _seconds("KVBM_BACKEND_HANDOFF_WAIT_S", env["KVBM_BACKEND_HANDOFF_WAIT_S"])
        for child in extra.get("connectors", []) if c.get("kv_connector") == "MultiConnector" else []:
            visit(child)

    visit(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvbm_backend.integrations.dynamo.ktc KV_TRANSFER_CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        print(json.dumps(apply_env(json.loads(args[0]))))
    except ValueError as e:  # a bad variable (or JSON): one line, as the launchers' preflight says it
        print(f"kvbm-backend: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
