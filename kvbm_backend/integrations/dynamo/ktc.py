"""``python -m kvbm_backend.integrations.dynamo.ktc JSON``: print a ``--kv-transfer-config`` JSON with the
kvbm-backend connector's options set from the environment, so launch scripts keep one readable JSON
block and deployments (and the tests that run the scripts) point it elsewhere without editing them.

Applies to every ``KvbmBackendConnector`` entry (top level or a ``MultiConnector`` child):

* ``KVBM_BACKEND_CONFIG_FILE``: ``kv_connector_extra_config.config_file`` (drops an inline ``kvbm_backend``);
* ``KVBM_BACKEND_STATS_PATH``: ``kv_connector_extra_config.stats_path`` (the connector's JSON counters).

Unset variables leave the JSON as written.
"""
from __future__ import annotations

import json
import os
import sys

CONNECTOR = "KvbmBackendConnector"


def apply_env(cfg: dict, environ: dict | None = None) -> dict:
    env = os.environ if environ is None else environ
    out = json.loads(json.dumps(cfg))

    def visit(c: dict) -> None:
        extra = c.get("kv_connector_extra_config") or {}
        if c.get("kv_connector") == CONNECTOR and (env.get("KVBM_BACKEND_CONFIG_FILE") or env.get("KVBM_BACKEND_STATS_PATH")):
            extra = c.setdefault("kv_connector_extra_config", {})
            if env.get("KVBM_BACKEND_CONFIG_FILE"):
                extra.pop("kvbm_backend", None)
                extra["config_file"] = env["KVBM_BACKEND_CONFIG_FILE"]
            if env.get("KVBM_BACKEND_STATS_PATH"):
                extra["stats_path"] = env["KVBM_BACKEND_STATS_PATH"]
        for child in extra.get("connectors", []) if c.get("kv_connector") == "MultiConnector" else []:
            visit(child)

    visit(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvbm_backend.integrations.dynamo.ktc KV_TRANSFER_CONFIG_JSON", file=sys.stderr)
        return 2
    print(json.dumps(apply_env(json.loads(args[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
