#!/usr/bin/env bash
# One device call for a change to the strict Triton kernels, on any one-GPU machine (torch + Triton, no vLLM):
# stages the GPU-bundle part this transfer carries (so the call that follows can run vLLM), then checks the
# kernels' bits and times the kernels the change touched.
#
#   BENCH_ONLY=decode bash scripts/gpu_kernels.sh      # results under $OUT
#
#   kernels   pytest tests/gpu/test_triton_kernels.py and the MoE kernel tests of tests/gpu/test_moe_gpu.py (not
#             its vLLM engines, nor the report of vLLM's fused MoE, which needs vLLM), junit XML beside the log
#   bench     benchmarks/kernels.py --only $BENCH_ONLY (default decode): table and JSON
set -u
cd "$(dirname "$0")/.."
bash scripts/gpu_stage.sh > /tmp/gpu_stage.log 2>&1
echo "gpu_kernels: bundle staging exit $? ($(tail -1 /tmp/gpu_stage.log | cut -c1-160))"
export GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
source scripts/gpu_stages.sh
TAIL_LINES=12 stage kernels "${KERNELS_S:-240}" $PY -m pytest -q -rfE -p no:cacheprovider \
  tests/gpu/test_triton_kernels.py tests/gpu/test_moe_gpu.py -m "not vllm" -k "not over_group_sizes" \
  --junitxml "$OUT/kernel_tests.xml"
TAIL_LINES=30 stage bench "${BENCH_S:-170}" $PY benchmarks/kernels.py --only "${BENCH_ONLY:-decode}" \
  --json "$OUT/kernels_${BENCH_ONLY:-decode}.json" --md "$OUT/kernels_${BENCH_ONLY:-decode}.md"
finish
