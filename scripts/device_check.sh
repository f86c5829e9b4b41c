#!/usr/bin/env bash
# The whole GPU check in one command (stage limits add up to under 6 minutes on an H200):
#   1. installs the wheels carried in .whl/ (scripts/fetch_device_wheels.sh) into /tmp/site, if any (the CUDA 12
#      runtime wheel is only unpacked, for the host emulator's headers);
#   2. pytest -m gpu (each CUDA kernel against its torch reference, backend vs backend, greedy end to end, CUDA
#      graph replay vs eager and TPOT with and without graphs);
#   3. bench/attention_kernels.py (decode kernel: % of copy bandwidth, time vs gather + SDPA);
#   4. scripts/serve_smoke.py (pagedserve serve on the GPU with the cuda attention backend).
# Logs and a summary go to $OUT when it is set (else a temp dir); the summary is also printed.
# Exit status: 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

wheels=()
for w in .whl/*.whl; do
  [ -f "$w" ] || continue
  case $w in
    # CUDA 12 headers for the host emulator only: unpacked, not installed, so the image's CUDA stack never sees them.
    *nvidia_cuda_runtime_cu12*)
      "$PY" -m zipfile -e "$w" /tmp/simt-cuda \
        && export PAGEDSERVE_SIMT_CUDA_INCLUDE=/tmp/simt-cuda/nvidia/cuda_runtime/include ;;
    *) wheels+=("$w") ;;
  esac
done
if [ ${#wheels[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || note "WARN: carried wheels failed to install"
fi
export PYTHONPATH="$ROOT/service:$ROOT/client${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# GPU tests that measure (tests/kernel_tests/gpu/test_cuda_graphs_gpu.py) write figures here.
export PAGEDSERVE_DEVICE_LOGS="$LOGS"

note "== device_check $(date -u +%FT%TZ)"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch, cupy
print(f"torch {torch.__version__} cuda {torch.version.cuda}; cupy {cupy.__version__}; "
      f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
EOF

status=0
run_stage() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  note "== $name: rc=$rc ($((SECONDS - start)) s), log $name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}

# NVRTC compiles dominate the gpu tests' time: spread them over 4 workers when pytest-xdist is there.
XDIST=(); "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
run_stage gpu_tests 170 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" ${XDIST[@]+"${XDIST[@]}"} \
  tests/kernel_tests/gpu
grep -E "passed|failed|error|skipped" "$LOGS/gpu_tests.log" | tail -n 3 | tee -a "$SUMMARY"
grep -E "^(FAILED|ERROR)" "$LOGS/gpu_tests.log" | head -n 20 | tee -a "$SUMMARY"
[ -f "$LOGS/cuda_graphs_tpot.txt" ] && tee -a "$SUMMARY" < "$LOGS/cuda_graphs_tpot.txt"

run_stage bench 80 "$PY" bench/attention_kernels.py --json "$LOGS/bench.json"
grep -vE "^(Traceback|  )" "$LOGS/bench.log" | tail -n 20 | tee -a "$SUMMARY"

# HOOK(lead): the serve smoke test starts `python -m pagedserve.cli serve`; see scripts/serve_smoke.py.
run_stage serve_smoke 100 "$PY" scripts/serve_smoke.py --timeout 75
grep -E "^(PASS|FAIL)" "$LOGS/serve_smoke.log" | tee -a "$SUMMARY"

note "== overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
