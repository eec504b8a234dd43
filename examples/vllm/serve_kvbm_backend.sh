#!/usr/bin/env bash
# Plain `vllm serve` with the kvbm-backend connector (no Dynamo). The kvbm-backend settings are given
# inline here (kv_connector_extra_config.kvbm_backend); a YAML file works too ("config_file").
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "KvbmBackendConnector",
  "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {
    "kvbm_backend": {
      "model": "meta-llama/Llama-3.1-8B-Instruct",
      "g3": {"paths": ["/mnt/nvme0/kvbm"], "capacity_gb": 500},
      "g4": {"enabled": true, "url": "s3://kvbm-g4/llama-3.1-8b",
             "endpoint_url": "http://minio.storage.svc:9000", "encrypt": true}
    }
  }
}'

exec vllm serve "$MODEL" \
  --enable-prefix-caching \
  --kv-transfer-config "$KV_TRANSFER_CONFIG"
