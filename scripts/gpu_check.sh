#!/usr/bin/env bash
# The one GPU run: build, check and time everything in a single device call (~8 minutes at most).
#
#   bash scripts/gpu_check.sh        # on a 2 x H200 machine; results under $OUT (default /tmp/gpu_out)
#
# Stages, in order of value; each runs under its own timeout (and the global deadline), a failure is
# recorded and the next stage still runs:
#   1 kernels   pytest tests/gpu/test_triton_kernels.py (each Triton kernel vs torch backend / fp64,
#               poisoned outputs, batch/position/schedule invariance, CUDA graphs, native twins)
#   2 selftest  python -m rl_kernel.selftest --device cuda with RL_KERNEL_BACKEND=triton
#   3 pytest    pytest -m gpu tests/ (the other GPU tests: tests/gpu, tests/megatron)
#   4 parity    tests/gpu/parity.py: Qwen3-8B-shaped reference, train-style vs rollout-style, bitwise
#   5 bench     benchmarks/kernels.py (table + JSON)
#   6 megatron  benchmarks/megatron_step.py (if present)
#   7 tp        two GPUs: tests/gpu/tp_nccl.py under torchrun (NCCL), then benchmarks/rl_layout.py (if present)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.txt"
STAGE_LOG=$(mktemp /tmp/gpu_check_stage.XXXXXX)
: > "$LOG"
: > "$SUMMARY"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-490}))
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# never use NVLink multicast on the shared multi-GPU hosts (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> "$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

{
  echo "== environment"; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  $PY -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
} >> "$LOG" 2>&1
head -c 2000 "$LOG"

# stage NAME MAX_SECONDS COMMAND...: runs COMMAND under min(MAX, time left), logs it, records PASS/FAIL/TIMEOUT.
stage() {
  local name=$1 max=$2; shift 2
  local now left t0 rc status
  now=$(date +%s); left=$((DEADLINE - now))
  if [ "$left" -lt 15 ]; then
    printf '%-9s %-7s %5s  %s\n' "$name" "SKIP" "0" "no time left" >> "$SUMMARY"; return
  fi
  [ "$max" -gt "$left" ] && max=$left
  echo "== stage $name (timeout ${max}s): $*" >> "$LOG"
  t0=$(date +%s)
  timeout -k 10 "$max" "$@" > "$STAGE_LOG" 2>&1
  rc=$?
  cat "$STAGE_LOG" >> "$LOG"
  case $rc in 0) status=PASS;; 124|137) status=TIMEOUT;; *) status="FAIL($rc)";; esac
  local key
  key=$(grep -E "^(PARITY|TP|BENCH done|RESULT)|^[0-9]+ (passed|failed|skipped)|passed|failed|Error" "$STAGE_LOG" \
        | tail -1 | cut -c1-150)
  [ -z "$key" ] && key=$(grep -v '^\s*$' "$STAGE_LOG" | tail -1 | cut -c1-150)
  printf '%-9s %-9s %5ss  %s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$key" >> "$SUMMARY"
  echo "---- $name: $status (last lines)"
  tail -n "${TAIL_LINES:-10}" "$STAGE_LOG" | cut -c1-220
}

stage kernels 75 $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_triton_kernels.py
RL_KERNEL_BACKEND=triton stage selftest 80 $PY -m rl_kernel.selftest --device cuda --json "$OUT/selftest.json"
stage pytest 80 $PY -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests/ --ignore=tests/gpu/test_triton_kernels.py \
  --ignore=tests/vime --ignore=tests/vllm  # hydra, ray, vllm are not on the GPU image
RL_KERNEL_BACKEND=triton stage parity 100 $PY tests/gpu/parity.py --shape 8b --layers 2 --json "$OUT/parity.json"
TAIL_LINES=40 stage bench 190 $PY benchmarks/kernels.py --json "$OUT/kernels.json" --md "$OUT/kernels.md"
if [ -f benchmarks/megatron_step.py ]; then
  stage megatron 90 $PY benchmarks/megatron_step.py --out "$OUT/megatron_step.json"
else
  printf '%-9s %-9s %5s  %s\n' megatron SKIP 0 "benchmarks/megatron_step.py absent" >> "$SUMMARY"
fi
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" -ge 2 ]; then
  stage tp 60 $PY -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/tp_nccl.py --json "$OUT/tp.json"
  if [ -f benchmarks/rl_layout.py ]; then
    stage layout 60 $PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/rl_layout.py --tp 2 --cp 1
  fi
else
  printf '%-9s %-9s %5s  %s\n' tp SKIP 0 "fewer than 2 GPUs" >> "$SUMMARY"
fi
rm -f "$STAGE_LOG"

echo
echo "== gpu_check summary ($(( $(date +%s) - START ))s; full log: \$OUT/gpu_check.log)"
cat "$SUMMARY"
