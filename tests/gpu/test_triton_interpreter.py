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


# Two groups of about equal interpreter time, run side by side: the interpreter is one Python thread per process.
GROUPS = (
    ["cp_attention", "gemms", "split_decode", "paged_tma", "moes", "norm_widths", "gumbel_sampling"],
    [
        "elementwise",
        "qk_norm_rope",
        "angle_table",
        "attentions",
        "logprobs",
        "logprob_slice_stats",
        "logprob_bf16_logits",
        "logprob_full_log_softmax",
        "far_offsets",
    ],
)


def test_the_groups_cover_every_part_once():
    import ast

    tree = ast.parse(Path(__file__).with_name("interpreter_checks.py").read_text())
    parts = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PARTS")
    assert sorted(name for group in GROUPS for name in group) == sorted(e.id for e in parts.value.elts)


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    script = str(Path(__file__).with_name("interpreter_checks.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script, *group], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for group in GROUPS
    ]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    for proc, stdout, stderr in results:
        print(stdout[-3000:], stderr[-3000:])
        assert proc.returncode == 0 and "INTERPRETER PASS" in stdout, stdout[-2000:] + stderr[-2000:]
