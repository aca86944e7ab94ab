"""End to end: `python -m vime.train` in a subprocess, with the real components (Ray, vLLM engine with
the rl_kernel plugin, Megatron-core trainer, Hydra, W&B offline).

Strict: every step, every active response token, rollout and trainer logprobs have equal fp32 bits
(mismatch_count == 0, max_abs_diff == 0), across a weight sync (step 1 runs on version 1 weights).
Native twin: the same run with vLLM's and Megatron's own kernels shows mismatches on every step (the
shared `strict_run` is made with `compare=native`, which runs that twin first, under `<out>/native`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vime.conftest import alive, run_files_left, wandb_exit_codes

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]
NO_SAVE = ("checkpoint.final=false", "checkpoint.export_hf=false")  # a run whose checkpoints no test reads


def _train(
    out: Path, *overrides: str, timeout: int = 420, proc: subprocess.CompletedProcess | None = None, figure: bool = True
) -> list[dict]:
    """The rows of the 2-step run in `out` (made here with `overrides`, or `proc` made it already), after
    the checks every such run passes. `figure=False`: a `compare=native` twin, whose rows are plotted in
    the figure of the run that made it (asserted for `strict_run`), not in one of its own."""
    env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    # The arithmetic task: its format term gives every step's groups reward variance, so the weights
    # move on both steps (the default copy task can start with all groups tied at reward 0).
    cmd = [sys.executable, "-m", "vime.train", "steps=2", "data.task=arithmetic", f"output_dir={out}", *overrides]
    if proc is None:  # else: the run was made already (the shared `strict_run` fixture)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and [r["version"] for r in rows] == [0, 1]
    assert all(r["tokens"] > 0 for r in rows)
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "no W&B offline run file"
    if figure:
        assert (out / "consistency.png").stat().st_size > 0
    return rows


def test_strict_run_has_zero_mismatches_every_step(strict_run):
    rows = _train(strict_run.out, proc=strict_run.proc)
    assert wandb_exit_codes(strict_run.out) == [0]  # the finished run's exit code, in its W&B exit record
    for r in rows:
        assert r["rollout_engine"].startswith("vllm ") and "strict plugin" in r["rollout_engine"]
        assert r["trainer_engine"].startswith("megatron-core ")
        assert r["strict"] is True
        assert r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["train_mismatch_count"] == 0, r  # Megatron's train-mode forward vs the rollout, independently
        assert set(r["contracts"].values()) <= {"same", "paired"} and r["contracts"]["gemm"] == "same"
        assert r["grad_norm"] > 0  # the weights did move between step 0 and step 1


def test_a_finished_run_leaves_no_process_or_temporary_file(strict_run):
    """What the run's actors and the libraries in them write to their TMPDIR (multiprocessing's pymp-*
    sockets when a checkpoint is written, W&B's tmp*wandb-* directories, vLLM's vllm_dist_* files) lands in
    the run's own /tmp/vime_tmp_<pid>, which is gone at exit with the rendezvous file; no process of the run's
    tree outlives it; and the summary says the run is complete and how to extend it (no resume= hint that would
    start engines to run no step)."""
    assert strict_run.proc.returncode == 0, strict_run.proc.stderr[-4000:]
    assert any(name.startswith("pymp-") for name in strict_run.temp_seen), strict_run.temp_seen
    assert not run_files_left(strict_run.pid)
    assert not alive(strict_run.pids)
    console = strict_run.proc.stdout + strict_run.proc.stderr
    assert "run complete     all 2 steps done; to train further: " in console
    assert f"-m vime.train resume={strict_run.out.resolve()} steps=4" in console and "continue with" not in console
    assert "\x1b[" not in console and "(raylet)" not in console


@pytest.mark.extended
def test_strict_run_with_bf16_logits_has_zero_mismatches_every_step(tmp_path):
    """model.logits_dtype=bfloat16: the logprob contracts round the LM head's logits to bf16 on both engines.
    The driver's contract gate fails the run if either engine ran its logprobs under another logit dtype (the
    dtype is in the fingerprint), so a run that ends with equal bits ran the bf16 contracts on both sides."""
    rows = _train(tmp_path / "bf16", "model.logits_dtype=bfloat16", *NO_SAVE)
    for r in rows:
        assert r["strict"] is True and r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["train_mismatch_count"] == 0, r


def test_native_twin_shows_mismatches_every_step(strict_run):
    """The all-native twin (`rollout.mode=native trainer.mode=native`) of the strict run, made by its
    `compare=native` in the same invocation; its figure is the strict run's (both runs plotted)."""
    rows = _train(strict_run.out / "native", proc=strict_run.proc, figure=False)
    assert wandb_exit_codes(strict_run.out / "native") == [0]
    assert "native twin      " in strict_run.proc.stdout + strict_run.proc.stderr  # the summary's twin line
    for r in rows:
        assert "native kernels" in r["rollout_engine"] and r["strict"] is False
        assert r["mismatch_count"] > 0 and r["max_abs_diff"] > 0, r
        print(
            f"native step {r['step']}: {r['mismatch_count']} / {r['tokens']} tokens differ, "
            f"max |diff| {r['max_abs_diff']:.3e}"
        )
