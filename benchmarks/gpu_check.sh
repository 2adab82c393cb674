#!/usr/bin/env bash
# One-shot GPU check of the ragged pack / unpack kernels (vescale_jax/kernels), for a single H200 session.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#
# 1. Installs jax[cuda12] (pip install -e ".[cuda12]") only if JAX sees no GPU.
# 2. Runs tests/test_kernels.py compiled on the GPU (JAX_PLATFORMS=cuda: interpret=None means compiled),
#    once with the Triton backend and, time permitting, once with Mosaic GPU (unsupported cases skip).
# 3. Runs benchmarks/kernels.py --out benchmarks/results/kernels_gpu.md (the table is rewritten after every
#    row, so a timeout still leaves what was measured).
# 4. Trains examples/train_gpt.py for 30 steps on the GPU (fp32, then --bf16): the vj.fsdp runtime under the
#    device's JAX version.
# Every step has its own timeout and failures do not stop the rest; the whole script stays under ~7 minutes
# (BUDGET_S). Logs and the results table go to $OUT and benchmarks/results/.
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET_S=${BUDGET_S:-420}
OUT=${OUT:-benchmarks/results/gpu_check}
RES=benchmarks/results
mkdir -p "$OUT" "$RES"
SUMMARY="$OUT/gpu_check_summary.txt"
: > "$SUMMARY"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME CAP_SECONDS CMD...: runs CMD with min(CAP, time left) seconds, logs to $OUT/NAME.log.
step() {
  local name=$1 cap=$2; shift 2
  local t; t=$(left)
  if (( t < 20 )); then echo "SKIP  $name (budget spent)" | tee -a "$SUMMARY"; return 0; fi
  (( t > cap )) && t=$cap
  echo "== $name (timeout ${t}s): $*" | tee -a "$SUMMARY"
  local s; s=$(date +%s)
  timeout --kill-after=10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc after $(( $(date +%s) - s ))s; tail:" | tee -a "$SUMMARY"
  tail -n 4 "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
  cp "$OUT/$name.log" "$RES/gpu_check_$name.log" 2>/dev/null || true
  return 0
}

has_gpu() {
  timeout 90 python -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)" \
    > /dev/null 2>&1
}

step env 60 bash -c 'nvidia-smi; python -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"'
if has_gpu; then
  echo "JAX sees a GPU: no install" | tee -a "$SUMMARY"
else
  step install 240 pip install -q -e ".[cuda12]"
  step env_after_install 60 python -c "import jax; print(jax.__version__, jax.devices())"
fi

export JAX_PLATFORMS=cuda
PYTEST=(python -m pytest tests/test_kernels.py -q -p no:cacheprovider -rs --durations=5)
step tests_triton 120 env VESCALE_JAX_KERNEL_BACKEND=triton "${PYTEST[@]}"
step bench 240 python benchmarks/kernels.py --out "$RES/kernels_gpu.md"
cp "$RES/kernels_gpu.md" "$OUT/" 2>/dev/null || true
# The FSDP runtime on one GPU under the device's JAX: 30 steps of the example, fp32 then bf16.
step train_gpt 60 python examples/train_gpt.py --steps 30 --plot ""
step train_gpt_bf16 60 python examples/train_gpt.py --steps 30 --bf16 --plot ""
step tests_mosaic_gpu 100 env VESCALE_JAX_KERNEL_BACKEND=mosaic_gpu "${PYTEST[@]}"

echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
cp "$SUMMARY" "$RES/gpu_check_summary.txt" 2>/dev/null || true
exit 0
