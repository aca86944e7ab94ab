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
# Exit status: 0 ready; 3 more parts needed (the missing ones are named); 1 an error (one line: what to do).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/vime_bundle.py "$@"
