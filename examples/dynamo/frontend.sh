#!/usr/bin/env bash
# Dynamo frontend: OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /v1/models, /metrics),
# tokenizes with the model directory's tokenizer and routes to the dynamo.vllm workers it discovers.
# Parameters (environment): PYTHON, HTTP_HOST (default 0.0.0.0), HTTP_PORT (8000). Further arguments go to
# dynamo.frontend, e.g. `--router-mode kv`, or, for one host without etcd/NATS (what tests/e2e/test_dynamo_e2e.py
# runs): `--discovery-backend file --request-plane tcp --event-plane zmq` with DYN_FILE_KV=DIR shared with the
# workers.
set -euo pipefail
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m dynamo.frontend \
  --http-host "${HTTP_HOST:-0.0.0.0}" \
  --http-port "${HTTP_PORT:-8000}" \
  "$@"
