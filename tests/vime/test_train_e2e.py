"""End to end: `python -m vime.train` in a subprocess, with the real components (Ray, vLLM engine with
the rl_kernel plugin, Megatron-core trainer, Hydra, W&B offline).

Strict (the shared `default_run`, the default config's 40 steps): every step, every active response token,
rollout and trainer logprobs have equal fp32 bits (mismatch_count == 0, max_abs_diff == 0), across every
weight sync. Native twin (the shared `native_run`): the same job with vLLM's and Megatron's own kernels shows
mismatches on every step. `compare=native` (opt-in set): one invocation runs that twin first and plots both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vime.conftest import alive, run_files_left, wandb_exit_codes

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]
NO_SAVE = ("checkpoint.final=false", "checkpoint.export_hf=false")  # a run whose checkpoints no test reads


def _train(
    out: Path,
    *overrides: str,
    timeout: int = 420,
    proc: subprocess.CompletedProcess | None = None,
    figure: bool = True,
    steps: int = 2,
) -> list[dict]:
    """The rows of the `steps`-step run in `out` (made here with `overrides`, or `proc` made it already), after
    the checks every such run passes. `figure=False`: a `compare=native` twin, whose rows are plotted in
    the figure of the run that made it, not in one of its own."""
    env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    # The arithmetic task: its format term gives every step's groups reward variance, so the weights
    # move on both steps (the default copy task can start with all groups tied at reward 0).
    cmd = [sys.executable, "-m", "vime.train", "steps=2", "data.task=arithmetic", f"output_dir={out}", *overrides]
    if proc is None:  # else: the run was made already (a shared run fixture)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    command = " ".join(map(str, proc.args))
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps)) and [r["version"] for r in rows] == list(range(steps))
    assert all(r["tokens"] > 0 for r in rows)
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "no W&B offline run file"
    if figure:
        assert (out / "consistency.png").stat().st_size > 0
    return rows


def test_strict_run_has_zero_mismatches_every_step(default_run):
    rows = _train(default_run.out, proc=default_run.proc, steps=40)
    assert wandb_exit_codes(default_run.out) == [0]  # the finished run's exit code, in its W&B exit record
    for r in rows:
        assert r["rollout_engine"].startswith("vllm ") and "strict plugin" in r["rollout_engine"]
        assert r["trainer_engine"].startswith("megatron-core ")
        assert r["strict"] is True
        assert r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["train_mismatch_count"] == 0, r  # Megatron's train-mode forward vs the rollout, independently
        sampler = r["contracts"].pop("gumbel_sample")  # the engine's sampler: picks tokens, records no value
        assert sampler == "sampling" and set(r["contracts"].values()) <= {"same", "paired"}
        assert r["contracts"]["gemm"] == "same"
    assert any(r["grad_norm"] > 0 for r in rows)  # the weights did move


def test_a_finished_run_leaves_no_process_or_temporary_file(default_run):
    """What the run's actors and the libraries in them write to their TMPDIR (multiprocessing's pymp-*
    sockets when a checkpoint is written, W&B's tmp*wandb-* directories, vLLM's vllm_dist_* files) lands in
    the run's own /tmp/vime_tmp_<pid>, which is gone at exit with the rendezvous file; no process of the run's
    tree outlives it; and the summary says the run is complete and how to extend it (no resume= hint that would
    start engines to run no step)."""
    run = default_run
    assert run.proc.returncode == 0, run.proc.stderr[-4000:]
    assert any(name.startswith("pymp-") for name in run.temp_seen), run.temp_seen
    assert not run_files_left(run.pid)
    assert not alive(run.pids)
    console = run.console
    assert "run complete     all 40 steps done; to train further: " in console
    assert f"-m vime.train resume={run.out.resolve()} steps=80" in console and "continue with" not in console
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


@pytest.mark.extended  # in CI: tests/vllm/test_vllm_compile.py (the compiled strict engine against teacher forcing)
def test_strict_run_with_a_compiled_rollout_engine_has_zero_mismatches_every_step(tmp_path):
    """rollout.compile=true: vLLM's torch.compile of the strict model serves the rollout across the weight pushes
    (the compiled graph reads the pushed parameters in place), and the trainer recomputes every token's bits."""
    out = tmp_path / "compiled"
    rows = _train(out, "rollout.compile=true", "rollout.enforce_eager=false", *NO_SAVE, timeout=600)
    for r in rows:
        assert r["strict"] is True and r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["train_mismatch_count"] == 0, r
    log = (out / "engines.log").read_text()
    assert "'rl_kernel_compile': True" in log, "the engine was not asked to compile"
    # vLLM's own log of a compile: a fresh one (Dynamo's transform, AOT save) or one loaded from its cache
    assert re.search(r"Dynamo bytecode transform|compiled function|compiled graph", log), "the engine did not compile"


@pytest.mark.extended  # in CI: tests/vllm/test_vllm_topp.py (engine) and tests/vime/test_topp_trainer.py (trainer)
def test_strict_run_with_top_p_top_k_has_zero_mismatches_every_step(tmp_path):
    """algo.top_p=0.9 algo.top_k=20: the strict vLLM engine samples from the exact truncated support and records
    the renormalised logprob, Megatron rebuilds both from its own logits: equal bits on every token of every
    step, no token outside the trainer's support, the truncation contract 'same' on both sides, the entropy
    logged."""
    rows = _train(tmp_path / "topp", "algo.top_p=0.9", "algo.top_k=20", *NO_SAVE)
    for r in rows:
        assert r["strict"] is True and r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["train_mismatch_count"] == 0 and r["outside_support"] == 0, r
        assert r["contracts"]["truncation"] == "same", r["contracts"]
        assert r["entropy"] > 0, r


@pytest.mark.extended  # in CI the twins of the engines' parity tests show it (tests/vllm, tests/megatron)
def test_native_twin_shows_mismatches_every_step(native_run):
    """The all-native twin (`rollout.mode=native trainer.mode=native`) of the default run, 2 steps."""
    rows = _train(native_run.out, proc=native_run.proc)
    assert wandb_exit_codes(native_run.out) == [0]
    for r in rows:
        assert "native kernels" in r["rollout_engine"] and r["strict"] is False
        assert r["mismatch_count"] > 0 and r["max_abs_diff"] > 0, r
        print(
            f"native step {r['step']}: {r['mismatch_count']} / {r['tokens']} tokens differ, "
            f"max |diff| {r['max_abs_diff']:.3e}"
        )


@pytest.mark.extended
def test_compare_native_runs_the_twin_first_and_reports_both(strict_run):
    """`compare=native`: one invocation runs the native twin (under `<out>/native`) then the strict run; the
    summary has the twin's line and the strict run's figure plots both."""
    strict = _train(strict_run.out, proc=strict_run.proc)
    twin = _train(strict_run.out / "native", proc=strict_run.proc, figure=False)
    assert wandb_exit_codes(strict_run.out) == [0] and wandb_exit_codes(strict_run.out / "native") == [0]
    assert "native twin      " in strict_run.console  # the summary's twin line
    assert all(r["mismatch_count"] == 0 for r in strict) and all(r["mismatch_count"] > 0 for r in twin)
