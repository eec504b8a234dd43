#!/usr/bin/env bash
# Start/stop a loopback SeaweedFS S3 server for the G4 tests and benches.
#   eval "$(bash ci/seaweedfs.sh start DIR)"   # exports KVBM_TEST_S3_ENDPOINT and AWS_* test credentials
#   bash ci/seaweedfs.sh stop DIR
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?start|stop}; dir=${2:?data directory}
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-kvbmtest} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-kvbmtest-secret}
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
if [ "$cmd" = start ]; then
  line=$(.venv/bin/python tests/helpers/seaweed.py start "$dir" kvbm-test)
  echo "export ${line} AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY} AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION}"
else
  .venv/bin/python tests/helpers/seaweed.py stop "$dir"
fi
