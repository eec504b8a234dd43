#!/usr/bin/env bash
# Disaggregated serving through the shared tiers, PREFILL worker: kvbm-backend alone, no KV transport between
# the engines. The prefill worker offloads the prompt's blocks to G3/G4 and tells the decode worker how many
# (vLLM kv_transfer_params, passed on by Dynamo); the decode worker onboards them from G4 (its own G3 after a
# first load), waiting at most handoff_wait_s for the prefill worker's write-behind.
# Both workers must share one G4 (S3 bucket or shared mount) and one keyring (g4.keyring in the YAML), and one G4
# namespace: the same model, revision, dtype and TP size, or g4.layout: canonical. G3 is private to each worker;
# without G4 (or with save_to_g4 false) the preflight refuses to start (dry run: exit 2, one line).
# Pair: disagg_prefill_g4.sh + disagg_decode_g4.sh + frontend.sh (tests/e2e/test_dynamo_e2e.py runs all three).
# Parameters (environment): MODEL, PYTHON, KVBM_BACKEND_CONFIG_FILE / KVBM_BACKEND_STATS_PATH /
# KVBM_BACKEND_HANDOFF_WAIT_S (put into the JSON
# below by kvbm_backend.integrations.dynamo.ktc), DYN_KVBM_DISK_CACHE_DIR / _GB (override the YAML when set; G3
# defaults to /mnt/nvme0/kvbm, 800 GB only where neither gives it), DYN_SYSTEM_PORT, KVBM_BACKEND_DRY_RUN; further
# arguments go to dynamo.vllm. Launcher: `python -m dynamo.vllm` with kvbm-backend's version-guarded shims,
# which also register the connector's PD protocol with Dynamo (kvbm_backend/integrations/dynamo/pd_protocol.py).
# One worker per G3 directory (the pool locks it): a prefill and a decode worker on one host each need their own
# (DYN_KVBM_DISK_CACHE_DIR), else the second stops with G3LockedError naming the holder.
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"

KV_TRANSFER_CONFIG='{
  "kv_connector": "KvbmBackendConnector",
  "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"config_file": "/etc/kvbm-backend/kvbm-backend.yaml", "handoff_wait_s": 5.0}
}'
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
