#!/usr/bin/env bash
# `python -m vime.train` on the H200 machine: ONE command, about 6 minutes, at most GPU_TRAIN_BUDGET_S (480 s).
#
#   bash scripts/gpu_train.sh [Hydra overrides for every run, e.g. steps=8 model.tiny.num_layers=2]
#   GPU_TRAIN_PRESET=h200_vllm bash scripts/gpu_train.sh    # vLLM rollout (needs the GPU bundle: gpu_vllm.sh)
#
# Needs .whl/ beside the repository (`bash scripts/gpu_wheels.sh` on a machine with internet); installs it into
# /tmp/site. Makes the Qwen3-8B-layer-shaped random checkpoint of `+experiment=h200_8b_layers` once
# (/tmp/gpu_train_model), then runs the preset (each run under `timeout`, each >= 5 steps):
#   strict_1gpu   strict on both sides, trainer and rollout engine sharing GPU 0 (fail_on_mismatch=true)
#   native_1gpu   rollout.mode=native trainer.mode=native fail_on_mismatch=false
#   strict_2gpu   trainer on GPU 0, rollout engine on GPU 1            (only when 2 GPUs are visible)
#   native_2gpu   the same, native
# GPU_TRAIN_RUNS picks and orders the runs (default: the four above, the two-GPU ones only with 2 GPUs); also
#   strict_nosleep_1gpu   strict_1gpu with rollout.sleep_level=0 (the engine keeps the GPU while the trainer works)
#   async_1gpu            strict, asynchronous: algo.max_staleness=1 algo.correction=tis rollout.sleep_level=0
# Results under ${OUT:-/tmp/out} (6-7 files): gpu_train_h200.json (every run: status, per-step rows, medians,
# versions), gpu_train_h200.txt (this script's log: per-run end-of-run summaries with their per-step tables),
# <run>.metrics.jsonl per run, runs.tar.gz (each run's output_dir: train.log, engines.log, config, figure).
# Exit status: 0 when at least one strict run PASSed and every strict run that ran showed 0 mismatches on every
# step (all strict runs skipped for time, or none named, is 1); 1 otherwise; 2 when the environment is not ready
# (a missing import, no GPU, no wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
PRESET=${GPU_TRAIN_PRESET:-h200_8b_layers}
MODEL_ROOT=${GPU_TRAIN_MODEL:-/tmp/gpu_train_model}
START=$(date +%s)
DEADLINE=$((START + ${GPU_TRAIN_BUDGET_S:-480}))
RUN_MAX=${GPU_TRAIN_RUN_S:-170}
mkdir -p "$OUT"
LOG="$OUT/gpu_train_h200.txt"
STATUS="$OUT/.status"
: > "$LOG"
: > "$STATUS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
# never use NVLink multicast on the shared multi-GPU hosts (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ray's object store carries a restarted engine's weights (~4 GB at 4 layers, one object): room for it
export VIME_OBJECT_STORE_BYTES=${VIME_OBJECT_STORE_BYTES:-8589934592}

say() { echo "$*" | tee -a "$LOG"; }
die() { say "gpu_train: $*"; exit 2; }

if [ "${GPU_TRAIN_SKIP_INSTALL:-0}" != 1 ]; then
  compgen -G ".whl/*.whl" > /dev/null || die "no wheels in .whl/: run 'bash scripts/gpu_wheels.sh' on a machine \
with internet, and carry .whl/ with the repository"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 || die "installing .whl/*.whl into /tmp/site failed (pip's output above, in $LOG)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # vime and rl_kernel from this checkout, in Ray's workers too

# Every import vime.train needs, named when missing; the GPUs.
NGPU=$($PY -W ignore - "$@" <<'EOF' 2>> "$LOG" | tail -1
import importlib, sys
mods = ("torch", "triton", "ray", "hydra", "omegaconf", "megatron.core", "transformers", "tokenizers", "safetensors",
        "matplotlib", "tqdm", "psutil", "numpy", "yaml", "rl_kernel", "vime.train")
missing = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - any failure to import is reported the same way
        missing.append(f"{m} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
if missing:
    print("gpu_train: cannot import " + "; ".join(missing) + ". Wheels: bash scripts/gpu_wheels.sh (here .whl/ is "
          "installed into /tmp/site); the rest must be on the image.", file=sys.stderr)
    print("ERR")
    sys.exit(0)
import megatron.core, ray, torch, transformers, triton  # noqa: E401
n = torch.cuda.device_count()
print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__} megatron-core "
      f"{megatron.core.__version__} ray {ray.__version__} transformers {transformers.__version__}; {n} GPU(s)"
      + (f": {torch.cuda.get_device_name(0)}" if n else ""), file=sys.stderr)
print(n)
EOF
)
tail -1 "$LOG"
case "$NGPU" in ERR|"") die "the environment is not ready (see above)";; esac
if [ "$NGPU" -lt 1 ] && [[ " $* " != *" device=cpu "* ]]; then
  die "no CUDA GPU visible (torch.cuda.device_count() == 0)"
fi

# The preset's checkpoint, made once for every run (a stamp of its shapes decides whether to remake it).
MODEL=$(timeout 300 $PY -W ignore - "$MODEL_ROOT" "$PRESET" "$@" <<'EOF' 2>> "$LOG" | tail -1
import json, sys, time
from pathlib import Path
from hydra import compose, initialize_config_dir
from vime.config.schema import register_configs, to_object, validate
from vime.loop.driver import make_model
import dataclasses
root, preset, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
register_configs()
with initialize_config_dir(config_dir=str(Path("configs").resolve()), version_base="1.3"):
    cfg = validate(to_object(compose("config", [f"+experiment={preset}", *overrides, f"output_dir={root}"])))
if cfg.model.path:
    print(cfg.model.path)
    sys.exit(0)
stamp = json.dumps(dataclasses.asdict(cfg.model.tiny) | {"dtype": cfg.model.dtype, "device": cfg.device},
                   sort_keys=True)
model = root / "model"
made = (root / "stamp.json").read_text() if (root / "stamp.json").is_file() else None
if made != stamp or not (model / "config.json").is_file():
    import shutil
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.time()
    make_model(cfg, root)
    (root / "stamp.json").write_text(stamp)
    print(f"gpu_train: made {model} in {time.time() - t0:.0f} s", file=sys.stderr)
print(model)
EOF
)
tail -1 "$LOG"
[ -n "$MODEL" ] && [ -f "$MODEL/config.json" ] || die "could not make the preset's checkpoint (see $LOG)"

# run NAME OVERRIDES...: one vime.train run under min(RUN_MAX, time left); its summary block goes to the log.
run() {
  local name=$1; shift
  local left=$((DEADLINE - $(date +%s))) t0 rc status
  if [ "$left" -lt 60 ]; then echo "$name SKIP 0 no time left" >> "$STATUS"; say "== $name: SKIP (no time left)"; return; fi
  local limit=$(( left < RUN_MAX ? left : RUN_MAX ))
  rm -rf "${OUT:?}/$name" "$OUT/$name.console.log" "$OUT/$name.metrics.jsonl"
  say "== $name (timeout ${limit}s): python -m vime.train +experiment=$PRESET $* model.path=$MODEL output_dir=$OUT/$name"
  t0=$(date +%s)
  timeout -k 20 "$limit" $PY -m vime.train +experiment="$PRESET" "$@" model.path="$MODEL" \
    output_dir="$OUT/$name" > "$OUT/$name.console.log" 2>&1
  rc=$?
  case $rc in 0) status=PASS;; 124|137) status=TIMEOUT;; *) status="FAIL($rc)";; esac
  echo "$name $status $(( $(date +%s) - t0 ))" >> "$STATUS"
  if [ "$rc" -ne 0 ]; then  # a killed or failed run may leave its local Ray behind, holding GPU memory
    $PY -m ray.scripts.scripts stop --force > /dev/null 2>&1 || true
    tail -n 25 "$OUT/$name.console.log" | cut -c1-300 | tee -a "$LOG"
  fi
  sed -n '/run summary/,$p' "$OUT/$name.console.log" | sed -E 's/^\[[^]]*\]\[vime\]\[INFO\] - //' \
    | grep -v "^\s*$" | cut -c1-240 | tee -a "$LOG"
  [ -f "$OUT/$name/metrics.jsonl" ] && cp "$OUT/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  [ -d "$OUT/$name" ] && mv "$OUT/$name.console.log" "$OUT/$name/console.log"
  say "== $name: $status in $(( $(date +%s) - t0 ))s"
}

NATIVE=(rollout.mode=native trainer.mode=native fail_on_mismatch=false)
TWO=(ray.num_gpus=2 ray.gpus_per_actor=1 weights.transport=nccl weights.colocate=false)
ASYNC=(algo.max_staleness=1 algo.correction=tis rollout.sleep_level=0)
if [ -n "${GPU_TRAIN_RUNS:-}" ]; then
  read -r -a RUNS <<< "$GPU_TRAIN_RUNS"
elif [ "$NGPU" -ge 2 ]; then
  RUNS=(strict_1gpu native_1gpu strict_2gpu native_2gpu)
else
  RUNS=(strict_1gpu native_1gpu)
  say "== strict_2gpu, native_2gpu: SKIP (1 GPU visible)"
fi
for name in "${RUNS[@]}"; do
  case $name in
    strict_1gpu) run "$name" "$@" ;;
    native_1gpu) run "$name" "${NATIVE[@]}" "$@" ;;
    strict_nosleep_1gpu) run "$name" rollout.sleep_level=0 "$@" ;;
    async_1gpu) run "$name" "${ASYNC[@]}" "$@" ;;
    strict_2gpu) run "$name" "${TWO[@]}" "$@" ;;
    native_2gpu) run "$name" "${TWO[@]}" "${NATIVE[@]}" "$@" ;;
    *) die "GPU_TRAIN_RUNS: unknown run $name (strict_1gpu native_1gpu strict_nosleep_1gpu async_1gpu strict_2gpu native_2gpu)" ;;
  esac
done

# The combined JSON and the verdict (scripts/gpu_train_verdict.py).
$PY -W ignore scripts/gpu_train_verdict.py "$OUT" "$STATUS" "$START" "$PRESET" "$*" "${RUNS[@]}" 2>&1 | tee -a "$LOG"
rc=$?
dirs=()
for name in "${RUNS[@]}"; do [ -d "$OUT/$name" ] && dirs+=("$name"); done
if [ "${#dirs[@]}" -gt 0 ] && [ "${GPU_TRAIN_KEEP_DIRS:-0}" != 1 ]; then
  tar czf "$OUT/runs.tar.gz" -C "$OUT" "${dirs[@]}" && (cd "$OUT" && rm -rf "${dirs[@]}")
fi
rm -f "$STATUS"
exit $rc
