#!/usr/bin/env bash
# Disaggregated serving on the engine's native offloading, PREFILL worker: NixlConnector hands the prompt's KV to the decode worker; vLLM's
# OffloadingConnector (CPU primary tier + kvbm-backend's G3/G4 as secondary tiers) keeps the prefixes, so a returning
# prompt is loaded instead of recomputed.
# This is the form of Dynamo's Native KV Offloading guide: MultiConnector = NixlConnector + OffloadingConnector.
# Run one Dynamo frontend and disagg_native_decode.sh beside it.
# Not run by a test on the CPU CI VM (KVBM_BACKEND_DRY_RUN only): NIXL's UCX transfer stalls there (README.md,
# "With NIXL"); the OffloadingConnector half is the one agg_native_tiers.sh runs, see that script for the settings.
#
# Parameters (environment): as agg_native_tiers.sh (MODEL, PYTHON, KVBM_BACKEND_CONFIG_FILE, KVBM_BACKEND_CPU_BYTES,
# KVBM_BACKEND_NUM_KV_HEADS, DYN_KVBM_DISK_CACHE_DIR / _GB, DYN_SYSTEM_PORT, KVBM_BACKEND_DRY_RUN), plus
# VLLM_NIXL_SIDE_CHANNEL_PORT (default 20097). Further arguments go to dynamo.vllm.
# One worker per G3 directory (the pool locks it): a prefill and a decode worker on one host each need their own
# (DYN_KVBM_DISK_CACHE_DIR), else the second stops with G3LockedError naming the holder.
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
export VLLM_NIXL_SIDE_CHANNEL_PORT="${VLLM_NIXL_SIDE_CHANNEL_PORT:-20097}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "MultiConnector",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {
    "connectors": [
      {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
      {"kv_connector": "OffloadingConnector",
       "kv_role": "kv_both",
       "kv_connector_extra_config": {
         "spec_name": "CpuTieringOffloadingSpec",
         "spec_module_path": "kvbm_backend.integrations.vllm.native_cpu",
         "cpu_bytes_to_use": 68719476736,
         "block_size": 256,
         "eviction_policy": "lru",
         "self_describing_kv_events": true,
         "secondary_tiers": [
           {"type": "G3Tier",
            "module_path": "kvbm_backend.integrations.vllm.tiering",
            "layout": "llama-3.1-8b",
            "config": "/etc/kvbm-backend/kvbm-backend.yaml",
            "locality": "LOCAL",
            "enable_kv_events": true},
           {"type": "G4Tier",
            "module_path": "kvbm_backend.integrations.vllm.tiering",
            "layout": "llama-3.1-8b",
            "config": "/etc/kvbm-backend/kvbm-backend.yaml",
            "locality": "REMOTE"}
         ]
       }}
    ]
  }
}'
# As agg_native_tiers.sh: the environment and the script's defaults go into the OffloadingConnector's tiers; one
# line on stderr with the effective settings (kvbm_backend/apps/effective.py).
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
