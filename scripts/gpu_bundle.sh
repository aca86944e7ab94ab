#!/usr/bin/env bash
# The GPU bundle: vLLM (the release whose wheel pins the GPU image's torch), its missing dependencies, Ray,
# Hydra/omegaconf/antlr4 and megatron-core, installed into one site tree, stripped of what a dense Qwen3 on
# Hopper never loads, packed as `tar | xz -9e` and split into parts that each fit one transfer beside the
# repository, with .bundle/manifest.json (parts' sha256 and sizes, the archive's sha256, the versions inside).
# Needs internet (about 330 MB of wheels, cached in .bundle-cache/) and a few minutes of xz.
#
#   bash scripts/gpu_bundle.sh                  # torch 2.11.0, Python 3.12, x86-64 (the H200 image)
#   bash scripts/gpu_bundle.sh --torch 2.13.0   # another image's torch: the newest vLLM that pins it
#   bash scripts/gpu_bundle.sh --help           # every option (--vllm, --part-mib, --xz, ...)
#
# On the GPU machine, carry .bundle/manifest.json and one part per transfer, and run scripts/gpu_stage.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_bundle.py "$@"
