"""scripts/gpu_train.sh's verdict (scripts/gpu_train_verdict.py): it passes only when a strict run PASSed; every
strict run skipped for time, or none named, is a failure, not "strict 0 mismatches on every step"."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_train_verdict", REPO / "scripts" / "gpu_train_verdict.py")
gv = importlib.util.module_from_spec(_spec)
sys.modules["gpu_train_verdict"] = gv
_spec.loader.exec_module(gv)


def _rows(n: int, mismatch: int = 0) -> list[dict]:
    return [{"step": i, "tokens": 64, "mismatch_count": mismatch, "step_s": 1.0} for i in range(n)]


def _runs(tmp_path: Path, status: str, runs: dict[str, list[dict]]) -> dict[str, dict]:
    (tmp_path / "status").write_text(status)
    read = gv.read_status(tmp_path / "status")
    return {name: gv.run_result(name, read, rows) for name, rows in runs.items()}


def test_a_passing_strict_run_passes(tmp_path):
    runs = _runs(
        tmp_path, "strict_1gpu PASS 90\nnative_1gpu PASS 80\n", {"strict_1gpu": _rows(5), "native_1gpu": _rows(5, 3)}
    )
    ok, says = gv.strict_verdict(runs)
    assert ok and says == "0 mismatches on every step (strict_1gpu)"


def test_every_strict_run_skipped_or_none_named_fails(tmp_path):
    skipped = _runs(
        tmp_path,
        "strict_1gpu SKIP 0 no time left\nnative_1gpu PASS 80\n",
        {"strict_1gpu": [], "native_1gpu": _rows(5, 3)},
    )
    ok, says = gv.strict_verdict(skipped)
    assert not ok and says == "FAILED: no strict run passed (strict_1gpu SKIP)"
    ok, says = gv.strict_verdict(_runs(tmp_path, "native_1gpu PASS 80\n", {"native_1gpu": _rows(5, 3)}))
    assert not ok and says == "FAILED: no strict run passed (none named in GPU_TRAIN_RUNS)"


def test_a_failed_mismatched_or_short_strict_run_fails_beside_a_passing_one(tmp_path):
    status = "strict_1gpu PASS 90\nstrict_2gpu PASS 90\nasync_1gpu TIMEOUT 170\n"
    runs = _runs(tmp_path, status, {"strict_1gpu": _rows(5), "strict_2gpu": _rows(5, 1), "async_1gpu": _rows(2)})
    ok, says = gv.strict_verdict(runs)
    assert not ok and says == "FAILED (strict_2gpu PASS with 5 mismatches, async_1gpu TIMEOUT)"
    short = _runs(tmp_path, "strict_1gpu PASS 30\n", {"strict_1gpu": _rows(gv.MIN_STEPS - 1)})
    ok, says = gv.strict_verdict(short)
    assert not ok and says == f"FAILED (strict_1gpu PASS with {gv.MIN_STEPS - 1} steps, fewer than {gv.MIN_STEPS})"
