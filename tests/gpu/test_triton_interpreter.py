"""CI (CPU) check of the Triton kernels' logic through Triton's interpreter: see interpreter_checks.py.

This is a logic test (indexing, masking, schedules, group tree, split merge, fixed-point sums), not a
bit-contract test of a device: the interpreter's dot is replaced by an exact one, so there is no native
twin here; the device's bits and their native twins are in test_triton_kernels.py (marked gpu).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # a subprocess (the interpreter is chosen before triton is imported)

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("interpreter_checks.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0 and "INTERPRETER PASS" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
