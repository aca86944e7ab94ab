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
#   7 tp        two GPUs: tests/gpu/tp_nccl.py under torchrun (NCCL); the RL loop itself: scripts/gpu_train.sh
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_stages.sh

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
else
  printf '%-9s %-9s %5s  %s\n' tp SKIP 0 "fewer than 2 GPUs" >> "$SUMMARY"
fi
finish
