#!/usr/bin/env bash
# Aggregated Dynamo vLLM worker WITHOUT kvbm-backend: the engine's own prefix cache only (G1). The baseline
# that `kvbm-backend demo` compares agg_kvbm_backend.sh against; run examples/dynamo/frontend.sh beside it.
# Parameters (environment): MODEL (HF id or directory), PYTHON, DYN_SYSTEM_PORT. Further arguments go to
# dynamo.vllm (vLLM engine arguments too). Launcher: `python -m dynamo.vllm` with kvbm-backend's
# version-guarded compat shims (see agg_kvbm_backend.sh; no-ops where not needed).
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
exec "$PYTHON" -m kvbm_backend.integrations.dynamo.vllm_worker \
  --model "$MODEL" \
  --enable-prefix-caching \
  "$@"
