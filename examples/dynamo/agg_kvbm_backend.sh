#!/usr/bin/env bash
# Aggregated Dynamo vLLM worker with the kvbm-backend connector alone: G3 (local NVMe) and G4 (S3).
# Dynamo 1.6 takes the connector as --kv-transfer-config JSON (its `--connector kvbm` flag is rejected).
set -euo pipefail
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

exec python -m dynamo.vllm \
  --model "$MODEL" \
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG"
