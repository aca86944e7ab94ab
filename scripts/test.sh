#!/usr/bin/env bash
# The test command: set up .venv (when needed), lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
export WANDB_MODE=offline VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/python -m pytest tests --durations=25 "$@"
