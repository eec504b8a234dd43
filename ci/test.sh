#!/usr/bin/env bash
# The README's test command: installs into .venv if needed, then runs the whole suite.
#
#   bash ci/test.sh            the whole suite, in two lanes at once (below)
#   bash ci/test.sh --fast     the unit lane only (no SeaweedFS, no vLLM engine, no GPU, nothing slow)
#   bash ci/test.sh ARGS...    pytest ARGS (one lane; `--fast` may be combined with them)
#
# Two lanes: the engine/server lane (tests marked slow, vllm, s3 or gpu: vLLM engines, Dynamo, SeaweedFS,
# crashes) runs in the foreground; the unit lane (everything else) runs beside it at `nice 19`, on the CPU
# the engine lane leaves idle (it waits on process start-ups and polls), so it barely slows the engine
# lane's timing-sensitive tests. The markers split the suite exactly (tests/conftest.py applies them), each
# lane has its own --basetemp, and the run fails if either lane fails or collects nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/kvbm-backend ] && [ -z "${KVBM_REINSTALL:-}" ] || bash ci/install.sh
export PYTHONUNBUFFERED=1
UNIT="not slow and not vllm and not s3 and not gpu"
PY=.venv/bin/python
if [ $# -gt 0 ]; then
  args=()
  for a in "$@"; do
    if [ "$a" = "--fast" ]; then args+=(-m "$UNIT"); else args+=("$a"); fi
  done
  set +e
  "$PY" -m pytest -ra --durations=15 "${args[@]}"
  rc=$?
  # pytest exit 5 = no tests collected: that is a failure for CI, never a pass.
  exit $rc
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvbm-tests.XXXXXX")"
start=$(date +%s)
set +e
nice -n 19 "$PY" -m pytest -ra --durations=10 -m "$UNIT" --basetemp "$tmp/unit" -p no:cacheprovider \
  > "$tmp/unit.log" 2>&1 &
unit_pid=$!
"$PY" -m pytest -ra --durations=25 -m "not ($UNIT)" --basetemp "$tmp/engine" -p no:cacheprovider \
  2>&1 | tee "$tmp/engine.log"
engine_rc=${PIPESTATUS[0]}
wait "$unit_pid"
unit_rc=$?
set -e
echo
echo "================ unit lane (ran beside the engine lane at nice 19): $tmp/unit.log ================"
cat "$tmp/unit.log"
echo
echo "================ engine lane, summary again (full output above) ================"
sed -n '/short test summary info/,$p' "$tmp/engine.log"
[ "$engine_rc" -eq 0 ] || tail -n 3 "$tmp/engine.log"
echo
echo "engine lane exit $engine_rc, unit lane exit $unit_rc, whole suite $(( $(date +%s) - start )) s"
# pytest exit 5 = no tests collected: that is a failure for CI, never a pass.
[ "$engine_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ] || exit 1
