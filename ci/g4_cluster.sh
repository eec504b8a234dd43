#!/usr/bin/env bash
# Multi-node G4 test bed (SeaweedFS cluster + G4 workers, each on its own network namespace; loopback
# processes with distinct ports where namespaces cannot be made). See docs/g4_cluster.md.
#   bash ci/g4_cluster.sh test                 # the cluster tests (also part of ci/test.sh: markers s3, slow)
#   bash ci/g4_cluster.sh bench [--workers 1,2,4,8 --blocks 16 ...]
#                                              # scaling curve vs plain S3 PUT/GET -> benchmarks/results/g4_cluster-<mode>-<date>.json/.png
#   bash ci/g4_cluster.sh up DIR [--workers 4] # start one and keep it until Ctrl-C (prints hosts and endpoint)
#   bash ci/g4_cluster.sh clean                # remove namespaces/bridges/processes left by runs whose owner died
# KVBM_G4_CLUSTER_MODE=loopback forces the fallback; =netns fails instead of falling back.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
cmd=${1:-test}; shift || true
case "$cmd" in
  test) exec "$PY" -m pytest -ra --durations=5 tests/e2e/test_g4_cluster.py "$@" ;;
  up) dir=${1:?usage: g4_cluster.sh up DIR [--workers N] [--volumes N]}; shift
      exec "$PY" -m kvbm_backend.apps.bench.g4_cluster up --dir "$dir" "$@" ;;
  clean) exec "$PY" -m kvbm_backend.apps.bench.g4_cluster clean ;;
  bench) exec "$PY" -m kvbm_backend.apps.bench.g4_cluster bench --out-dir benchmarks/results "$@" ;;
  *) echo "usage: $0 test|bench|up DIR|clean" >&2; exit 2 ;;
esac
