#!/usr/bin/env bash
# vLLM on a GPU machine that has torch but no vLLM and no internet: one command per transfer of the GPU bundle.
#
#   bash scripts/gpu_vllm.sh STAGE...      (in the repository root there; results under $OUT)
#
# First it stages whatever bundle parts this transfer carried (scripts/gpu_stage.sh: checksums, then unpack once
# all are there); while parts are missing it stops there (exit 0, the missing parts named). Then each STAGE runs
# under its own time limit with its log in $OUT/<stage>.log, so one failing stage does not hide the others:
#   tests    GPU tests of the strict vLLM path and the Triton kernels (tests/gpu, less the CPU interpreter checks
#            and the `faults` runs; TESTS_K replaces that selection), pytest's junit XML; it includes
#            test_vllm_truncation_gpu.py (exact top-k/top-p/min-p, two engines: about a minute more)
#   train    python -m vime.train +experiment=h200_vllm, strict then native (scripts/gpu_train.sh), 5 steps each
#   faults   vime.train on vLLM (small shapes): an engine killed mid-run is restarted and reloaded over IPC; a
#            stopped run resumed from its checkpoint over IPC (tests/gpu/test_vllm_train_gpu.py)
#   generate the headline rollout figure: whole `generate` of fresh mixed-length prompts, strict vs native vLLM at
#            Qwen3-8B shapes, engines alive together, passes interleaved (benchmarks/rollout_generate.py)
#   rlstep   the RL step end to end: vime.train +experiment=h200_vllm at RL sizes (RLSTEP_ARGS; default 16 layers,
#            64 sequences x 1024 new tokens), strict then native, per-phase medians (benchmarks/rl_step.py)
#   bench    strict vs native vLLM marginal decode and prefill at Qwen3-8B shapes (benchmarks/vllm_throughput.py)
#   profile  where strict decode time goes against native (benchmarks/vllm_decode_profile.py: one engine per
#            subprocess, CUDA graphs on both; per decode step device time by category, kernels, host launches),
#            once per batch size of PROFILE_BATCHES (default 128); PROFILE_ARCH=qwen3_30b_a3b: the MoE layers;
#            PROFILE_PHASE=prefill: fresh prompts prefilled, per 1k prompt tokens
#   async    vime.train +experiment=h200_vllm synchronous and asynchronous (algo.max_staleness=1, TIS), both without
#            sleep mode, no checkpoint: the overlap of rollout and training on one GPU (scripts/gpu_train.sh)
#   moe      the Qwen3-MoE parts (issue 39), each its own stage, picked and ordered by MOE_PARTS (default
#            tests,generate,train): moe_tests (pytest tests/gpu/test_moe_gpu.py), moe_generate (whole `generate`,
#            strict vs native vLLM at Qwen3-30B-A3B shapes: benchmarks/rollout_generate.py --arch qwen3_30b_a3b;
#            MOE_GENERATE_LAYERS passes --layers, MOE_GENERATE_ARGS more options), moe_train (vime.train
#            +experiment=h200_moe strict then native, scripts/gpu_train.sh; MOE_TRAIN_ARGS: its overrides;
#            MOE_TRAIN_RUNS=strict_1gpu: strict alone, with the stage's whole limit; MOE_TRAIN_RUN_S: each run's
#            limit instead of an equal share, a later run getting what is left). Native
#            vLLM's MoE needs the bundle's `moe` add-on (scripts/gpu_bundle.py --addon moe, its own transfer);
#            without it a warning is printed (and `moe_addon missing` in stages.txt) and the parts still run. Limits MOE_TESTS_S (300), MOE_GENERATE_S (540),
#            MOE_TRAIN_S (560)
# Variables: GPU_LAYERS (train, async, default 4), BENCH_LAYERS (36), PROFILE_LAYERS (8); BENCH_ARGS (more options of
# vllm_throughput.py, e.g. --grid 512x1,512x64 --pushes 1); BENCH_MODES, PROFILE_MODES
# (strict,native; strict_compiled: vLLM's torch.compile of the strict model, FULL_AND_PIECEWISE; bench also takes
# rl_kernel: rl_kernel's own paged engine); each stage's time limit in
# seconds: TESTS_S (420), TRAIN_S (330), FAULTS_S (420), BENCH_S (480), PROFILE_S (300, per batch size), ASYNC_S (330).
# Every file of $OUT ends up in $OUT/results.tar.gz (one file back from a device call), stages.txt beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 VLLM_NO_USAGE_STATS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export VLLM_USE_FLASHINFER_SAMPLER=0  # FlashInfer is not in the bundle
PROFILE_BATCHES=${PROFILE_BATCHES:-128}
MOE_PARTS=${MOE_PARTS:-tests,generate,train}
RLSTEP_DEFAULT="model.tiny.num_layers=16 algo.prompts_per_step=8 algo.group_size=8 algo.max_new_tokens=1024
  rollout.max_model_len=1280 trainer.micro_batch_size=4 steps=5"

bash scripts/gpu_stage.sh
case $? in
  0) . .bundle/env.sh ;;
  3) echo "gpu_vllm: bundle parts staged; carry the next part"; exit 0 ;;
  *) echo "gpu_vllm: staging the bundle failed (above)"; exit 2 ;;
esac
$PY -c 'import torch, vllm, ray, megatron.core, hydra; print(f"vllm {vllm.__version__} torch {torch.__version__}'\
' ray {ray.__version__} megatron-core {megatron.core.__version__}; {torch.cuda.get_device_name(0)}")' \
  || { echo "gpu_vllm: the bundle does not import (above)"; exit 2; }

stage() {  # stage NAME LIMIT_S COMMAND...: run under LIMIT_S seconds, log to $OUT/NAME.log, report the verdict
  local name=$1 limit=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  $PY -m ray.scripts.scripts stop --force > /dev/null 2>&1 || true
  echo "== $name: exit $rc in $(( $(date +%s) - t0 ))s"
  tail -n "${TAIL:-25}" "$OUT/$name.log" | cut -c1-300
  echo "$name $rc $(( $(date +%s) - t0 ))" >> "$OUT/stages.txt"
}

moe_stage() {  # the `moe` stage: MOE_PARTS in order, each its own `stage`
  if ! $PY -c 'import importlib.util as u, pathlib as p, sys; s = u.find_spec("vllm");'\
' sys.exit(not (p.Path(s.origin).parent / "_moe_C_stable_libtorch.abi3.so").is_file())'; then
    echo "gpu_vllm: moe: WARNING native vLLM's MoE kernels (vllm/_moe_C_stable_libtorch.abi3.so) are not installed:"\
      "its native runs will fail; carry .bundle/manifest.json and .bundle/vime-addon-moe-*.tar.xz in a transfer"\
      "(python scripts/gpu_bundle.py --addon moe)"
    echo "moe_addon missing 0" >> "$OUT/stages.txt"
  fi
  local part
  for part in ${MOE_PARTS//,/ }; do
    case $part in
      tests) stage moe_tests "${MOE_TESTS_S:-300}" env VIME_INSTAFAIL=1 $PY -m pytest tests/gpu/test_moe_gpu.py -v \
               -p no:cacheprovider -rA --durations=15 --junitxml="$OUT/gpu_moe_tests.xml" ;;
      generate) stage moe_generate "${MOE_GENERATE_S:-540}" $PY benchmarks/rollout_generate.py --device cuda \
               --arch qwen3_30b_a3b ${MOE_GENERATE_LAYERS:+--layers "$MOE_GENERATE_LAYERS"} \
               --modes "${MOE_GENERATE_MODES:-strict,native}" --out "$OUT/rollout_generate_moe_h200.json" \
               ${MOE_GENERATE_ARGS:-} ;;
      train) local runs=(${MOE_TRAIN_RUNS:-strict_1gpu native_1gpu})
             stage moe_train "${MOE_TRAIN_S:-560}" env GPU_TRAIN_SKIP_INSTALL=1 GPU_TRAIN_PRESET=h200_moe \
               OUT="$OUT/moe_train" GPU_TRAIN_RUNS="${runs[*]}" GPU_TRAIN_BUDGET_S=$(( ${MOE_TRAIN_S:-560} - 30 )) \
               GPU_TRAIN_RUN_S=${MOE_TRAIN_RUN_S:-$(( (${MOE_TRAIN_S:-560} - 60) / ${#runs[@]} ))} \
               bash scripts/gpu_train.sh ${MOE_TRAIN_ARGS:-} ;;
      *) echo "gpu_vllm: moe: unknown part $part in MOE_PARTS (tests, generate, train)"; exit 2 ;;
    esac
  done
}

for s in "$@"; do
  case $s in
    tests) stage tests "${TESTS_S:-420}" env VIME_INSTAFAIL=1 $PY -m pytest tests/gpu -v -p no:cacheprovider -rA --durations=15 \
             -k "${TESTS_K:-not interpreter and not vllm_train_gpu}" --junitxml="$OUT/gpu_tests.xml" ;;
    train) stage train "${TRAIN_S:-330}" env GPU_TRAIN_SKIP_INSTALL=1 GPU_TRAIN_PRESET=h200_vllm OUT="$OUT/train" \
             GPU_TRAIN_BUDGET_S=$(( ${TRAIN_S:-330} - 20 )) bash scripts/gpu_train.sh "model.tiny.num_layers=${GPU_LAYERS:-4}" ;;
    faults) stage faults "${FAULTS_S:-420}" env VIME_INSTAFAIL=1 $PY -m pytest tests/gpu/test_vllm_train_gpu.py -v -p no:cacheprovider -rA ;;
    generate) stage generate "${GENERATE_S:-540}" $PY benchmarks/rollout_generate.py --device cuda \
             --layers "${BENCH_LAYERS:-36}" --modes "${GENERATE_MODES:-strict,native}" \
             --out "$OUT/rollout_generate_h200.json" ${GENERATE_ARGS:-} ;;
    rlstep) stage rlstep "${RLSTEP_S:-560}" env GPU_TRAIN_SKIP_INSTALL=1 GPU_TRAIN_PRESET=h200_vllm OUT="$OUT/rlstep" \
             GPU_TRAIN_RUNS="strict_1gpu native_1gpu" GPU_TRAIN_BUDGET_S=$(( ${RLSTEP_S:-560} - 30 )) \
             GPU_TRAIN_RUN_S=$(( (${RLSTEP_S:-560} - 40) / 2 )) bash scripts/gpu_train.sh ${RLSTEP_ARGS:-$RLSTEP_DEFAULT} \
             checkpoint.every=0
           $PY benchmarks/rl_step.py --runs "$OUT/rlstep/gpu_train_h200.json" --out "$OUT/rl_step_h200.json" \
             | tee -a "$OUT/rlstep.log" ;;
    bench) stage bench "${BENCH_S:-480}" $PY benchmarks/vllm_throughput.py --device cuda --layers "${BENCH_LAYERS:-36}" \
             --modes "${BENCH_MODES:-strict,native}" --out "$OUT/vllm_rollout_h200.json" ${BENCH_ARGS:-} ;;
    profile) for b in ${PROFILE_BATCHES//,/ }; do
               stage "profile_b$b" "${PROFILE_S:-300}" $PY benchmarks/vllm_decode_profile.py --device cuda \
                 --layers "${PROFILE_LAYERS:-8}" --batch "$b" --modes "${PROFILE_MODES:-strict,native}" \
                 --arch "${PROFILE_ARCH:-qwen3_8b}" --phase "${PROFILE_PHASE:-decode}" \
                 --out "$OUT/vllm_decode_profile_h200_${PROFILE_ARCH:+${PROFILE_ARCH}_}${PROFILE_PHASE:+${PROFILE_PHASE}_}b$b.json"
             done ;;
    async) stage async "${ASYNC_S:-330}" env GPU_TRAIN_SKIP_INSTALL=1 GPU_TRAIN_PRESET=h200_vllm OUT="$OUT/async" \
             GPU_TRAIN_RUNS="strict_nosleep_1gpu async_1gpu" GPU_TRAIN_BUDGET_S=$(( ${ASYNC_S:-330} - 20 )) \
             bash scripts/gpu_train.sh "model.tiny.num_layers=${GPU_LAYERS:-4}" steps="${ASYNC_STEPS:-10}" \
             checkpoint.every=0 ;;
    moe) moe_stage ;;
    *) echo "gpu_vllm: unknown stage $s (tests, train, faults, generate, rlstep, bench, profile, async, moe)"; exit 2 ;;
  esac
done
grep -h "during inference" "$OUT"/*.log 2>/dev/null | sort | uniq -c | head -20 > "$OUT/jit_during_inference.txt"
echo "vLLM JIT monitor warnings during inference: $(wc -l < "$OUT/jit_during_inference.txt") distinct"
cat "$OUT/stages.txt"
(cd "$OUT" && tar czf /tmp/results.tar.gz --exclude=results.tar.gz . && find . -mindepth 1 -not -name stages.txt -delete \
  && mv /tmp/results.tar.gz .)
