#!/usr/bin/env bash
# One device call on a lent GPU (benchmarks/README.md, "Running it on a lent GPU"): installs the wheels carried
# in .whl/gpu into a scratch directory, then runs, each bounded so a slow part cannot eat the others' time:
#   doctor (JSON), benchmarks/gpu_bench.py (gpu_bench-<device>.json; first, so a call cut short keeps it), the
#   G4 host-side load bench (g4_load.json) and the GPU tests (tests/gpu, the worker's device path, layer-wise loads).
# Everything lands in $OUT. Usage (repository root): bash benchmarks/gpu_run.sh [extra gpu_bench.py options]
# Environment: TEST_S / G4_S / BENCH_S bound the parts (seconds; defaults 120 / 60 / 300; G4_S bounds each G4 run).
set -u
OUT=${OUT:?set OUT to the result directory}
D=/tmp/kvbm-pydeps
W=.whl/gpu
python3 -m pip install -q --no-index --no-deps --target $D $W/kvikio_cu12-*.whl $W/libkvikio_cu12-*.whl \
  $W/nvidia_cufile_cu12-*.whl $W/rapids_logger-*.whl $W/cuda_pathfinder-*.whl
python3 -m pip install -q --no-index --find-links $W --target $D xxhash pydantic prometheus-client pytest \
  pytest-timeout cryptography
export PYTHONPATH=$D:.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -m kvbm_backend.apps.cli doctor --path /var/tmp --json > "$OUT/doctor.json" 2>&1 || true
# the bench first: a call that runs out of device time still brings its JSON back
timeout "${BENCH_S:-300}" python3 benchmarks/gpu_bench.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
echo "gpu_bench rc=$?"; grep -E '^\[' "$OUT/bench.log" | tail -8
python3 - "$OUT" <<'EOF'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/gpu_bench-*.json"):
    d = json.load(open(f))
    for k, v in sorted(d.get("goals", {}).items()):
        print(f"{k}: {v}")
    print("errors:", d.get("errors"))
EOF
timeout "${G4_S:-60}" python3 -m kvbm_backend.apps.bench.g4_load --threads 4,8,16 --blocks 512 --rounds 2 --json \
  > "$OUT/g4_load.json" 2> "$OUT/g4_load.err"
echo "g4_load rc=$?"
# the same staged loads beside an engine step loop running Python, at CPython's 5 ms and load_gil_switch_ms's 0.5 ms
timeout "${G4_S:-60}" python3 -m kvbm_backend.apps.bench.g4_load --threads 8,16 --blocks 256 --rounds 1 --paths staged \
  --engine-busy 1.0 --switch-ms 5,0.5 --json > "$OUT/g4_load_engine_busy.json" 2> "$OUT/g4_load_engine_busy.err"
echo "g4_load engine busy rc=$?"
# GIL hand-offs per block of connector loads into HBM (a perf uprobe; skipped where perf is absent)
if command -v perf > /dev/null; then
  timeout 90 python3 benchmarks/gil_handoffs.py --device cuda --blocks 256 --loads 4 --json "$OUT/gil_handoffs.json" \
    > "$OUT/gil_handoffs.log" 2>&1; echo "gil_handoffs rc=$?"
  timeout 90 python3 benchmarks/gil_handoffs.py --device cuda --layerwise --blocks 256 --loads 4 \
    --json "$OUT/gil_handoffs_layerwise.json" > "$OUT/gil_handoffs_layerwise.log" 2>&1
  echo "gil_handoffs --layerwise rc=$?"
else
  echo "gil_handoffs: perf not installed here"
fi
timeout "${TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/gpu tests/integrations/vllm/test_worker_device_path.py \
  tests/pool/g3/test_g3_layerwise.py -rs --timeout 60 --durations 15 > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -12 "$OUT/gpu_tests.log"
