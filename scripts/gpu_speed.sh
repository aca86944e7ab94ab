#!/usr/bin/env bash
# One device call for the GPU-speed work (issue 10) on a 2 x H200 machine: correctness first, then speed.
#   bash scripts/gpu_speed.sh            # results under $OUT (default /tmp/gpu_out)
# Stages (each under its own timeout; a failure is recorded and the next still runs):
#   kernels   pytest tests/gpu/test_triton_kernels.py (bits of both GEMM servers, backward accuracy, ...) and
#             tests/gpu/test_vllm_attention_capture.py (the vLLM model's attention captured in a CUDA graph)
#   models    pytest tests/models/test_qwen3_gpu.py (the reference model's rollout == teacher forcing on CUDA)
#   train1    benchmarks/train_step.py, 1 GPU (strict vs native step at Qwen3-8B shapes)
#   train2    benchmarks/train_step.py under torchrun, TP2
#   tp        tests/gpu/tp_nccl.py under torchrun (TP2 == TP1 bitwise with canonical TP 2)
#   parity    tests/gpu/parity.py: Qwen3-8B-shaped rollout == teacher forcing, bitwise
#   bench     benchmarks/kernels.py (GEMM, prefill, decode, logprob rows)
#   cp        pytest tests/gpu/test_cp_triton.py and the Megatron CUDA tests (strict CP under Triton == CP1;
#             needs megatron-core, carried as a wheel in .whl/)
#   path      tests/gpu/gpu_path.py: CP2 == CP1 over NCCL, and a Qwen3-8B-sized weight push over CUDA IPC / NCCL
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu_out} GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-560}
source scripts/gpu_stages.sh
TAIL_LINES=30 stage kernels 150 $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_triton_kernels.py \
  tests/gpu/test_vllm_attention_capture.py
stage models 90 $PY -m pytest -q -rfE -p no:cacheprovider tests/models/test_qwen3_gpu.py
TAIL_LINES=16 stage train1 110 $PY benchmarks/train_step.py --json "$OUT/train_step_tp1.json"
[ -n "${WITH_ND:-}" ] && TAIL_LINES=12 RL_KERNEL_DETERMINISTIC_GRADS=0 stage train1nd 80 $PY benchmarks/train_step.py --reps 8 \
  --json "$OUT/train_step_tp1_nondeterministic.json"
TAIL_LINES=40 stage train2 130 $PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/train_step.py \
  ${TRAIN_PROFILE:+--profile} --json "$OUT/train_step_tp2.json"
[ -n "${SKIP_TP:-}" ] || stage tp 50 $PY -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/tp_nccl.py --json "$OUT/tp.json"
stage parity 70 $PY tests/gpu/parity.py --shape 8b --layers 2 --json "$OUT/parity.json"
TAIL_LINES=40 stage bench 150 $PY benchmarks/kernels.py --only ${BENCH_ONLY:-gemm,logprob,prefill,decode} --json "$OUT/kernels.json" \
  --md "$OUT/kernels.md"
TAIL_LINES=20 stage cp 150 $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cp_triton.py \
  tests/megatron/test_megatron_gpu.py
TAIL_LINES=30 stage path 150 $PY tests/gpu/gpu_path.py --json "$OUT/gpu_path.json"
finish
