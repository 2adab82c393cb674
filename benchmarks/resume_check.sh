#!/usr/bin/env bash
# Kill-and-resume check of examples/train_gpt.py (docs/checkpoint.md): for AdamW and Muon, an uninterrupted
# 250-step run against one stopped after step 100 and resumed, on 8 simulated devices and resumed on 4.
# Usage: bash benchmarks/resume_check.sh [OUTDIR]   (about 20 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/vj_resume_check}
mkdir -p "$out"
for opt in adamw muon; do
  rm -rf "$out/ck_$opt" "$out/ck_${opt}_4"
  python examples/train_gpt.py --plot '' --optimizer $opt --log-json "$out/full_$opt.json" > "$out/full_$opt.log" 2>&1
  python examples/train_gpt.py --plot '' --optimizer $opt --checkpoint-dir "$out/ck_$opt" --stop-after 100 \
    --log-json "$out/part1_$opt.json" > "$out/part1_$opt.log" 2>&1
  cp -r "$out/ck_$opt" "$out/ck_${opt}_4"
  python examples/train_gpt.py --plot '' --optimizer $opt --checkpoint-dir "$out/ck_$opt" --resume \
    --log-json "$out/part2_$opt.json" > "$out/part2_$opt.log" 2>&1
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/train_gpt.py --plot '' --optimizer $opt \
    --checkpoint-dir "$out/ck_${opt}_4" --resume --log-json "$out/part2_${opt}_4.json" > "$out/part2_${opt}_4.log" 2>&1
done
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda name: json.load(open(f"{out}/{name}.json"))
ok = True
for opt in ("adamw", "muon"):
    full, first, rest, four = load(f"full_{opt}"), load(f"part1_{opt}"), load(f"part2_{opt}"), load(f"part2_{opt}_4")
    merged = {**first["train"], **rest["train"]}
    same = merged == full["train"]
    rel = max(abs(four["train"][k] - full["train"][k]) / abs(full["train"][k]) for k in four["train"])
    print(f"{opt}: resumed on 8 devices bitwise={same}; resumed on 4 devices max relative difference {rel:.2e}; "
          f"validation {full['val_loss']:.5f} / {rest['val_loss']:.5f} / {four['val_loss']:.5f}")
    ok &= same and rel <= 1e-6
sys.exit(0 if ok else 1)
PY
