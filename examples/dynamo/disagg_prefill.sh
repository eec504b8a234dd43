#!/usr/bin/env bash
# Disaggregated serving, PREFILL worker: NixlConnector hands KV to the decode worker, kvbm-backend
# keeps prefixes in G3/G4 so a returning prompt is loaded instead of recomputed.
# Run one Dynamo frontend (python -m dynamo.frontend) and disagg_decode.sh beside it.
# Parameters (environment): MODEL, PYTHON, KVBM_BACKEND_CONFIG_FILE / KVBM_BACKEND_STATS_PATH (put into the JSON
# below by kvbm_backend.integrations.dynamo.ktc), DYN_SYSTEM_PORT; further arguments go to dynamo.vllm.
# Script defaults, used only where neither the YAML nor the environment gives the field: G3 in /mnt/nvme0/kvbm,
# 800 GB.
# Launcher: `python -m dynamo.vllm` with kvbm-backend's version-guarded compat shims (see agg_kvbm_backend.sh).
# One worker per G3 directory (the pool locks it): a prefill and a decode worker on one host each need their own
# (DYN_KVBM_DISK_CACHE_DIR), else the second stops with G3LockedError naming the holder.
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
export VLLM_NIXL_SIDE_CHANNEL_PORT="${VLLM_NIXL_SIDE_CHANNEL_PORT:-20097}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "MultiConnector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {
    "connectors": [
      {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
      {"kv_connector": "KvbmBackendConnector",
       "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
       "kv_role": "kv_both",
       "kv_connector_extra_config": {"config_file": "/etc/kvbm-backend/kvbm-backend.yaml"}}
    ]
  }
}'

# KVBM_BACKEND_CONFIG_FILE / KVBM_BACKEND_STATS_PATH, when set, go into the JSON above:
KV_TRANSFER_CONFIG="$("$PYTHON" -m kvbm_backend.integrations.dynamo.ktc "$KV_TRANSFER_CONFIG")"
# Effective settings: the script's defaults apply only where neither the YAML nor the environment sets the field;
# one line on stderr says each G3/G4 setting and where it came from (kvbm_backend/apps/effective.py).
EFFECTIVE="$("$PYTHON" -m kvbm_backend.apps.effective --for dynamo \
  --default 'g3.paths=["/mnt/nvme0/kvbm"]' --default g3.capacity_gb=800 "$KV_TRANSFER_CONFIG")"
eval "$EFFECTIVE"

# KVBM_BACKEND_DRY_RUN=1: print the command and run the launcher's preflight instead of starting the engine.
exec ${KVBM_BACKEND_DRY_RUN:+"$PYTHON" -m kvbm_backend.apps.effective --dry-run} \
  "$PYTHON" -m kvbm_backend.integrations.dynamo.vllm_worker \
  --model "$MODEL" \
  --disaggregation-mode prefill \
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" \
  "$@"
