#!/usr/bin/env bash
# Run ON the GPU machine, in the repository root, once per transfer that carries GPU-bundle parts
# (.bundle/manifest.json + .bundle/vime-site-*.tar.xz.<i>of<n>, from scripts/gpu_bundle.sh):
#
#   bash scripts/gpu_stage.sh && . .bundle/env.sh
#
# Moves the arriving parts, each checked against the manifest's sha256 first, into a store that outlives the
# transfer (VIME_BUNDLE_STORE, default /root/vime_bundle); once every part is there, checks the whole archive,
# unpacks it into VIME_SITE (default /root/vime_site) with an entry point for the vLLM plugin, and writes
# `export PYTHONPATH=<repository>:<site>` into .bundle/env.sh (also printed). A second run once unpacked does
# nothing but that. Checks first that the bundle's vLLM pins this machine's torch.
# Optional add-ons (`python scripts/gpu_bundle.py --addon moe`: .bundle/vime-addon-moe-<sha12>.tar.xz, native
# vLLM's MoE kernels vllm/_moe_C_stable_libtorch.abi3.so, ~39 MiB) travel in a transfer of their own, with the
# manifest, before or after the parts: checked against the manifest's sha256, kept in the store, and installed
# into VIME_SITE once it is unpacked (each file checked by sha256; a re-run with the files in place does nothing).
# A dense session carries only the parts (one line notes an add-on not carried).
# Exit status: 0 ready; 3 more parts needed (the missing ones are named); 1 an error (one line: what to do).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/vime_bundle.py "$@"
