#!/usr/bin/env bash
# The main job: set up .venv (when needed), then `python -m vime.train` with any Hydra overrides.
# With none, it runs the embedded default: a tiny Qwen3 made on the fly, GRPO on CPU, a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export WANDB_MODE=${WANDB_MODE:-offline} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/python -m vime.train "$@"
