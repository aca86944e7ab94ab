# Sourced by scripts/gpu_check.sh and scripts/gpu_speed.sh (from the repository root): the environment of a
# device call (carried wheels, no NVLink multicast), its header, `stage NAME MAX_SECONDS COMMAND...` and
# `finish` (the summary table).
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

finish() {
  rm -f "$STAGE_LOG"
  echo
  echo "== summary ($(( $(date +%s) - START ))s; full log: \$OUT/gpu_check.log)"
  cat "$SUMMARY"
}
