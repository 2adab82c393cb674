#!/usr/bin/env bash
# The one prepared GPU check, for a single H200 session of at most 8 minutes.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run                  # on CPU: every part tiny, results in a temp dir
#   PARTS=env,steps bash benchmarks/gpu_check.sh --dry-run  # only some parts
#
# The interpreter: $PYTHON if set, else the first of `python`, `python3` and /opt/torch/.venv/bin/python3 (the
# GPU image's, not on its PATH) that imports jax. XLA_FLAGS is passed on only when it holds flags (an empty or
# blank XLA_FLAGS makes XLA abort at start: "Could not open file " " to read flags").
#
# Parts, in order, each under its own timeout (capped by what is left of BUDGET_S, default 470 s: the whole check
# fits 8 minutes), results written as they go (a part that times out or fails does not stop the rest):
#   env      (10 s)  nvidia-smi, JAX / jaxlib versions, devices.
#   tests    (60 s)  tests/test_kernels.py, tests/test_mosaic_kernels.py, tests/test_mosaic_fp8.py and the
#                    one-device cases of tests/test_fused_kernels.py compiled on the GPU (JAX_PLATFORMS=cuda: interpret=None means
#                    compiled) with this JAX's default backend (Mosaic GPU from JAX 0.11), slow cases left out.
#   bench    (90 s)  benchmarks/kernels.py: pack / unpack bandwidth against a device copy of the same buffer
#                    (goal >= 0.85 of the copy) and against XLA, Mosaic GPU and Triton on the 1.7 GB GPT bucket,
#                    Mosaic GPU on 256 small tensors (goal: each op compiles in <= 2 s); writes kernels_gpu.md
#                    and the measured table for KernelPolicy(mode="auto") ($OUT/kernels_measured.json; to ship
#                    it, copy it to vescale_jax/kernels/_measured.json).
#   steps   (45-60 s each) benchmarks/gpu_step.py, one process per variant: plain jax.jit, vj.fsdp, FP8 gather
#                    (3 timed steps), 8-bit Adam; then jit and vj.fsdp again with XLA's latency-hiding scheduler
#                    (LHS_FLAGS appended to XLA_FLAGS). gpu.md is rewritten after every variant, with its goals.
#   triton  (rest)   tests/test_kernels.py with the Triton fallback (VESCALE_JAX_KERNEL_BACKEND=triton), if time
#                    is left and JAX still ships it.
# Real run: tables in benchmarks/results/ (gpu.md, kernels_gpu.md) and copies of everything in $OUT.
# --dry-run: CPU, tiny model and buckets, 4 simulated devices (JAX_NUM_CPU_DEVICES, so XLA_FLAGS is handled as
# in the real run), caps doubled and a 900 s budget (CPU compiles are slow); everything (logs, tables) goes to
# $OUT (a temp dir by default), never to benchmarks/results/; it prints what the real run would measure.
# GPU_CHECK_CAPS=0 runs every part to its end, with no timeout and no budget (what a test of the script wants:
# it checks what ran, and a loaded machine cannot make it fail).
set -u
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
PARTS=${PARTS:-env,tests,bench,steps,triton}
CAPS=${GPU_CHECK_CAPS:-1}
pick_python() {  # the first candidate that runs and imports jax
  local c
  for c in ${PYTHON:+"$PYTHON"} python python3 /opt/torch/.venv/bin/python3; do
    if command -v "$c" > /dev/null 2>&1 && "$c" -c "import jax" > /dev/null 2>&1; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}
if ! PY=$(pick_python); then
  echo "gpu_check: no Python that imports jax (tried \$PYTHON, python, python3, /opt/torch/.venv/bin/python3); set PYTHON" >&2
  exit 1
fi
# pytest without the project's addopts (they need pytest-xdist, which the GPU image may lack): serial, not slow
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -m "not slow" -rs)
LHS_FLAGS=${LHS_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CAP_SCALE=1
if (( DRY )); then  # CPU compiles are slower than the H200's: twice each cap, a 15-minute budget
  CAP_SCALE=2
  BUDGET_S=${BUDGET_S_DRY:-900}
  OUT=${OUT:-$(mktemp -d -t gpu_check_dry.XXXXXX)}
  RES=$OUT
  export JAX_PLATFORMS=cpu
  export JAX_NUM_CPU_DEVICES=4  # not XLA_FLAGS: the dry run passes XLA_FLAGS on exactly as the real run does
else
  OUT=${OUT:-benchmarks/results/gpu_check}
  RES=benchmarks/results
  export JAX_PLATFORMS=cuda
fi
BASE_FLAGS="${XLA_FLAGS:-}"
unset XLA_FLAGS  # each command gets it from xla_env, and only when it holds flags
# xla_env "EXTRA FLAGS": XENV, the `env` prefix of a command: XLA_FLAGS="$BASE_FLAGS EXTRA", or none when both are
# blank (parts run under `timeout`, which takes a command, not a shell function)
xla_env() {
  local words flags
  read -r -a words <<< "$BASE_FLAGS $1"  # split on blanks (no xargs: it runs an `echo` binary the PATH may lack)
  flags="${words[*]}"
  XENV=(env)
  if [[ -n "$flags" ]]; then XENV+=("XLA_FLAGS=$flags"); fi
}
xla_env ""
mkdir -p "$OUT" "$RES"
SUMMARY="$OUT/gpu_check_summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
want() { [[ ",$PARTS," == *",$1,"* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# part NAME CAP_SECONDS CMD...: runs CMD with min(CAP, time left) seconds, logs to $OUT/NAME.log.
part() {
  local name=$1 cap=$(( $2 * CAP_SCALE )); shift 2
  local s rc t
  if (( CAPS )); then
    t=$(left)
    if (( t < 15 )); then say "SKIP  $name (budget spent)"; return 0; fi
    (( t > cap )) && t=$cap
    say "== $name (timeout ${t}s): $*"
    s=$(date +%s)
    timeout --kill-after=5 "$t" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
  else
    say "== $name (no timeout: GPU_CHECK_CAPS=0): $*"
    s=$(date +%s)
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
  fi
  say "   rc=$rc after $(( $(date +%s) - s ))s$( (( rc == 124 || rc == 137 )) && echo ' (TIMED OUT)'); tail:"
  tail -n 4 "$OUT/$name.log" | cut -c1-220 | sed 's/^/   | /' | tee -a "$SUMMARY"
  return 0
}

say "gpu_check $( (( DRY )) && echo 'DRY RUN (CPU, tiny; figures meaningless)' || echo 'GPU run'): OUT=$OUT, budget ${BUDGET_S}s, parts $PARTS"
say "   python: $PY; XLA_FLAGS: ${BASE_FLAGS:-(unset)}"

if want env; then
  part env 10 "${XENV[@]}" bash -c 'nvidia-smi || echo "nvidia-smi: absent"; "$0" -c "
import importlib.metadata as m, jax
print(\"jax\", jax.__version__, \"jaxlib\", m.version(\"jaxlib\"))
print(jax.devices())"' "$PY"
fi

if want tests; then
  # The kernels compiled on the GPU against their references; the fused kernels' one-device cases (the
  # others need 3 or 8 devices). tests/test_cuda_lowering.py is a CPU-machine test (8 simulated devices).
  KTESTS=(tests/test_kernels.py tests/test_mosaic_kernels.py tests/test_mosaic_fp8.py tests/test_fused_kernels.py
    -k "not test_fused_kernels or m1 or lower")
  if (( DRY )); then  # the same command on CPU, narrowed to the policy tests (the kernels interpret on CPU)
    say "   would run on GPU: JAX_PLATFORMS=cuda ${PYTEST[*]} ${KTESTS[*]}"
    part tests 60 "${XENV[@]}" "${PYTEST[@]}" tests/test_kernel_choice.py tests/test_kernels.py -k "policy or choice or size_class or table"
  else
    part tests 60 "${XENV[@]}" "${PYTEST[@]}" --durations=5 "${KTESTS[@]}"
  fi
fi

if want bench; then
  if (( DRY )); then
    say "   would run on GPU: $PY benchmarks/kernels.py --chunks '' --backends mosaic_gpu,triton --small-backends mosaic_gpu --small-n 256 --out $RES/kernels_gpu.md --json \$OUT/kernels_measured.json"
    part bench 90 "${XENV[@]}" "$PY" benchmarks/kernels.py --dry-run --out "$RES/kernels_gpu.md" --json "$OUT/kernels_measured.json"
  else
    part bench 90 "${XENV[@]}" "$PY" benchmarks/kernels.py --chunks "" --backends mosaic_gpu,triton \
      --small-backends mosaic_gpu --small-n 256 --out "$RES/kernels_gpu.md" --json "$OUT/kernels_measured.json"
    cp "$RES/kernels_gpu.md" "$OUT/" 2>/dev/null || true
  fi
  sed -n '/records; Pallas measured faster/,$p' "$OUT/bench.log" 2>/dev/null | head -n 12 | sed 's/^/   | /' | tee -a "$SUMMARY"
fi

if want steps; then
  STEPS="$OUT/gpu_steps.jsonl"
  : > "$STEPS"
  DRYARG=()
  (( DRY )) && DRYARG=(--dry-run)
  (( DRY )) && say "   would run on GPU: benchmarks/gpu_step.py --variant V (0.94 B GPT, cuDNN attention, remat, bf16, batch 16 x 2048) for V in jit fsdp fsdp_fp8 fsdp_adam8bit, then jit and fsdp with $LHS_FLAGS"
  step_variant() {  # step_variant NAME CAP VARIANT LABEL EXTRA_XLA_FLAGS [MORE ARGS]
    xla_env "$5"
    part "$1" "$2" "${XENV[@]}" "$PY" benchmarks/gpu_step.py "${DRYARG[@]}" --variant "$3" \
      --label "$4" --jsonl "$STEPS" "${@:6}"
    "$PY" benchmarks/gpu_step.py --report "$STEPS" --md "$RES/gpu.md" >> "$OUT/report.log" 2>&1
  }
  step_variant step_jit 55 jit "" ""
  step_variant step_fsdp 55 fsdp "" ""
  step_variant step_fsdp_fp8 60 fsdp_fp8 "" "" --steps 3
  step_variant step_fsdp_adam8bit 50 fsdp_adam8bit "" ""
  (( DRY )) || step_variant step_jit_lhs 45 jit lhs "$LHS_FLAGS"
  step_variant step_fsdp_lhs 45 fsdp lhs "$LHS_FLAGS"
  [[ -f "$RES/gpu.md" ]] && { cp "$RES/gpu.md" "$OUT/" 2>/dev/null; sed 's/^/   | /' "$RES/gpu.md" | tail -n 8 | tee -a "$SUMMARY"; }
fi

if want triton && (( ! DRY )); then
  xla_env ""
  part tests_triton 60 "${XENV[@]}" VESCALE_JAX_KERNEL_BACKEND=triton "${PYTEST[@]}" tests/test_kernels.py
fi

say "total $(( $(date +%s) - START ))s; results in $OUT"
(( DRY )) || cp "$SUMMARY" "$RES/gpu_check_summary.txt" 2>/dev/null || true
exit 0
