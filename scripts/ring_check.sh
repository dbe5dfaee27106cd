#!/usr/bin/env bash
# Issue 13's checks of ring attention over NCCL, on one machine with two GPUs (target: < 5 minutes):
#
#   1. tests/gpu/test_gpu_ring.py: two spawned ranks, ring_attention against float64 and one GPU
#      (causal and not, GQA, float32 and float16, CuPy arrays, a process group, a kept TorchRing);
#   2. the target run: B1 H16 D128 float16 causal, N = 262144 on 2 GPUs (zigzag), which must take
#      at most 0.55x the time of the whole sequence on one GPU;
#   3. a smaller non-causal GQA float32 run (H16 / Hkv4, N = 8190: shards of 4095 rows).
#
# Run from the repository root: bash scripts/ring_check.sh
# Each step's stdout and stderr, and the demo runs' JSON, go to $OUT (default: ./ring-check); a
# summary goes to stdout. Exit status 0 only if every step passed.
set -u

# What it needs (two GPUs, CuPy, torch), said in one line before anything runs (numba_flash.needs).
python -c 'from numba_flash import needs; needs.exit_unless("ring_check.sh", needs.gpu(), needs.module("cupy"), needs.module("torch"))' || exit 2

out="${OUT:-ring-check}"
mkdir -p "$out"
launch=(python -m torch.distributed.run --standalone --nproc-per-node 2 -m numba_flash.distributed.demo)
status=0

step() {  # step NAME COMMAND...: run it, keep its output, report its exit status and duration
  local name=$1 started=$SECONDS rc
  shift
  echo "== $name: $*"
  "$@" >"$out/$name.txt" 2>"$out/$name.err"
  rc=$?
  cat "$out/$name.txt"
  if [ $rc -ne 0 ]; then
    status=1
    echo "-- $name failed (exit $rc); the end of $out/$name.err:"
    tail -n 40 "$out/$name.err"
  fi
  echo "== $name: exit $rc after $((SECONDS - started)) s"
  echo
}

step gpu_tests python -m pytest -q -rA -s tests/gpu/test_gpu_ring.py
step target "${launch[@]}" --batch 1 --heads 16 --head-dim 128 --dtype float16 --seq 262144 --causal \
  --repeats 3 --json "$out/target.json"
step gqa_float32 "${launch[@]}" --batch 2 --heads 16 --kv-heads 4 --head-dim 128 --dtype float32 --seq 8190 \
  --repeats 5 --json "$out/gqa_float32.json"

python - "$out/target.json" <<'EOF'
import json
import sys

try:
    result = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print(f"target: no result ({exc})")
    sys.exit(1)
ratio, single = result["time_ratio"], result["single"]
ok = ratio is not None and ratio <= 0.55 and result["passed"]
print(f"target: ring {result['ring']['ms']:.1f} ms on {result['world_size']} GPUs, one GPU "
      f"{single['ms'] if single else float('nan'):.1f} ms: ratio {ratio if ratio is not None else float('nan'):.3f} "
      f"(needs <= 0.55), checks {'passed' if result['passed'] else 'FAILED'}, work per rank max/min "
      f"{result['work_imbalance']:.4f}: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
[ $? -eq 0 ] || status=1
echo "ring_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) (outputs in $out)"
exit $status
