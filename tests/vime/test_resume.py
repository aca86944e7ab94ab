"""Nothing is lost, end to end with the real components (Ray, vLLM, Megatron, Hydra, W&B).

One run is stopped with SIGTERM after its first checkpoint, then resumed with `resume=<dir>`. The
stop is clean (exit 143, no traceback, the resume command printed); starting a new run in that dir
is refused without touching it; the resumed run ends with the same metrics and the same final
weights, in raw bits, as the uninterrupted twin (`strict_run`, shared with test_train_e2e.py). W&B
records each run's true exit code (143 stopped, 1 failed, 0 finished; read from the offline run file).
Where the signal lands within step 1 does not matter: whatever came after the checkpoint is redone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_kernel.bits import same_bits
from tests.vime.conftest import REPO, TRAIN_ENV, train_cmd, wandb_exit_codes
from vime.state.checkpoint import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.vllm, pytest.mark.megatron]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "hf_model" / "model.safetensors"))


def _start(out: Path, *overrides: str) -> subprocess.Popen:
    """`python -m vime.train` into `out`, console (stdout and stderr together) captured."""
    return subprocess.Popen(
        train_cmd(*overrides, f"output_dir={out}"),
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _printed_python() -> str:
    """The interpreter a command printed by a run started from REPO names: this one, runnable as printed."""
    rel = os.path.relpath(sys.executable, REPO)
    return (
        "python" if shutil.which("python") == sys.executable else (rel if not rel.startswith("..") else sys.executable)
    )


def _stop_after_first_checkpoint(out: Path) -> tuple[int, str]:
    """Start a 2-step run saving every step; SIGTERM it once step 0's checkpoint is complete. With
    checkpoint.on_stop=false: the stop is immediate, so what came after that checkpoint is redone on resume
    (the default finishes and saves the step in progress: test_a_stop_saves_the_step_in_progress...)."""
    proc = _start(out, "steps=2", "checkpoint.every=1", "checkpoint.on_stop=false")
    deadline = time.monotonic() + 420
    while not (out / "checkpoints" / "latest").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=180)
    return proc.returncode, text


def test_stopped_then_resumed_run_is_identical_in_bits(strict_run, tmp_path):
    base, base_proc = strict_run.out, strict_run.proc
    assert base_proc.returncode == 0, base_proc.stderr[-4000:]
    out = tmp_path / "stopped"

    code, text = _stop_after_first_checkpoint(out)
    assert code == 143, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert "continue from step_00000" in text and f"python -m vime.train resume={out}" in text
    assert (out / "consistency.png").is_file()  # the plot of the steps so far
    assert wandb_exit_codes(out) == [143]  # W&B records the stop's exit code, not 0

    log_size = (out / "train.log").stat().st_size
    again = subprocess.run(
        train_cmd("steps=2", f"output_dir={out}"),
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        again.returncode == 1
        and f"continue that run with `{_printed_python()} -m vime.train resume={out}`" in again.stderr
    ), again.stderr
    assert (out / "train.log").stat().st_size == log_size  # refused before Hydra wrote anything

    resumed = subprocess.run(
        train_cmd(f"resume={out}"), cwd=REPO, env=os.environ | TRAIN_ENV, capture_output=True, text=True, timeout=420
    )
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert wandb_exit_codes(out)[0] == 143 and wandb_exit_codes(out)[-1] == 0  # the resumed run finished

    rows, base_rows = _rows(out), _rows(base)
    assert [r["step"] for r in rows] == [0, 1]  # nothing lost, nothing repeated
    assert _untimed(rows) == _untimed(base_rows)
    weights, base_weights = _weights(out), _weights(base)
    assert weights.keys() == base_weights.keys()
    for name, t in weights.items():
        assert t.dtype == base_weights[name].dtype
        assert same_bits(t, base_weights[name]), name


def _actor_pids(pid: int, actor: str) -> list[int]:
    """Processes of the run's `actor` class (RolloutWorker, TrainerWorker): descendants of the driver
    (its Ray) whose title names the class, less the helpers they fork (a trainer rank's checkpoint
    writers carry its title too)."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if actor in " ".join(p.cmdline()) and actor not in " ".join(p.parent().cmdline()):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_rows(proc: subprocess.Popen, metrics: Path, n: int) -> None:
    deadline = time.monotonic() + 600
    while (
        proc.poll() is None
        and time.monotonic() < deadline
        and not (metrics.is_file() and metrics.read_text().count("\n") >= n)
    ):
        time.sleep(0.2)


def _engine_after_first_step(proc: subprocess.Popen, out: Path) -> int:
    """The pid of the run's one rollout engine actor, once step 0's metrics are written."""
    _wait_rows(proc, out / "metrics.jsonl", 1)
    engines = _actor_pids(proc.pid, "RolloutWorker")
    assert len(engines) == 1, engines
    return engines[0]


def test_a_killed_rollout_engine_is_restarted_and_a_killed_trainer_ends_the_run_cleanly(strict_run, tmp_path):
    """kill -9 of the vLLM engine's process after step 0: the engine is restarted on weight version 1 and
    step 1 comes out as if nothing happened (its metrics equal the uninterrupted run's, in bits), the
    restart logged and counted. Then kill -9 of the trainer rank during step 2: the run ends (exit 1)
    with one line naming the rank and the command that resumes from the last checkpoint."""
    base = strict_run.out
    out = tmp_path / "killed"
    proc = _start(out, "steps=3", "checkpoint.every=1")
    engine = _engine_after_first_step(proc, out)
    os.kill(engine, signal.SIGKILL)  # during step 0's checkpoint save, before step 1's rollout
    _wait_rows(proc, out / "metrics.jsonl", 2)
    trainers = _actor_pids(proc.pid, "TrainerWorker")
    assert len(trainers) == 1, trainers
    os.kill(trainers[0], signal.SIGKILL)
    text, _ = proc.communicate(timeout=420)
    assert proc.returncode == 1, text[-6000:]
    assert "rollout engine 0 died; restarting it on weight version 1 (restart 1 of at most 3)" in text
    assert "EngineDiedError: trainer rank 0 died during" in text and "Traceback" not in text, text[-6000:]
    assert f"with: {_printed_python()} -m vime.train resume={out}" in text
    assert wandb_exit_codes(out) == [1]  # the failed run's exit code
    rows, base_rows = _rows(out), _rows(base)
    assert [r["engine_restarts"] for r in rows] == [0, 1]
    assert _untimed(rows) == [r | {"engine_restarts": n} for r, n in zip(_untimed(base_rows), (0, 1))]


def _tp_worker(engine_pid: int, rank: int) -> int:
    """The pid of vLLM's TP worker `rank` of the engine in process `engine_pid` (title `VLLM::Worker_TP<rank>`)."""
    import psutil

    found = [
        p.pid
        for p in psutil.Process(engine_pid).children(recursive=True)
        if f"Worker_TP{rank}" in " ".join(p.cmdline())
    ]
    assert len(found) == 1, found
    return found[0]


def _engine_temp_files(pids: list[int]) -> set[str]:
    from vime.rollout.vllm_engine import _mapped_temp_files

    return _mapped_temp_files(pids)


def test_a_killed_vllm_tp_worker_restarts_its_engine(tmp_path):
    """rollout.tp=2: kill -9 of the engine's TP rank 1 process after step 0. The death is reported as
    "rollout engine 0, TP rank 1 died" and handled like the engine's death: a fresh engine on weight
    version 1 redoes step 1, counted in `engine_restarts`; every step still has 0 mismatches and the run
    finishes (exit 0, W&B exit code 0). The dead engine's temporary files (its workers' shared memory in
    /dev/shm, its /tmp/vllm_dist_* rendezvous file) are gone at the end. Part of `bash scripts/test.sh full`
    like the rest of this module (extended): on 2 cores the TP workers' shared-memory all-reduce spins, so a
    step takes minutes."""
    import glob

    dist = ("/tmp/vllm_dist_*", "/dev/shm/vllm_dist_*")  # vLLM's FileStore file, its CPU all-reduce segments
    dist_before = {f for pattern in dist for f in glob.glob(pattern)}
    out = tmp_path / "tp_killed"
    proc = _start(out, "steps=3", "rollout.tp=2")
    engine = _engine_after_first_step(proc, out)
    workers = [_tp_worker(engine, r) for r in (0, 1)]
    files = _engine_temp_files(workers)
    assert files, "the TP workers map no shared memory?"
    os.kill(workers[1], signal.SIGKILL)
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text[-6000:]
    assert "rollout engine 0, TP rank 1 died; restarting it on weight version 1 (restart 1 of at most 3)" in text
    assert "rollout engine 0, TP rank 1 died (pid " in text, text[-6000:]
    assert "Traceback" not in text and "GLHF" not in text, text[-6000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["engine_restarts"] for r in rows] == [0, 1, 1]
    assert all(r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0 and r["tokens"] > 0 for r in rows), rows
    assert wandb_exit_codes(out) == [0]

    def left() -> set[str]:
        return {f for f in files if os.path.exists(f)} | ({f for p in dist for f in glob.glob(p)} - dist_before)

    deadline = time.monotonic() + 30  # an engine actor can finish its clean-up just after the driver exits
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left(), left()


class _Watched:
    """A `python -m vime.train` run whose console lines are read as they come and whose process tree is
    sampled every 0.2 s (so what it started is known after it is gone)."""

    def __init__(self, out: Path, *overrides: str):
        import threading

        self.proc = _start(out, *overrides)
        self.lines: list[str] = []
        self.pids: set[int] = set()
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _sample(self) -> None:
        import psutil

        while not self._done.is_set() and self.proc.poll() is None:
            try:
                self.pids.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
            except psutil.Error:
                pass
            self._done.wait(0.2)

    def wait_for(self, text: str, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines) and self.proc.poll() is None:
            assert time.monotonic() < deadline, f"no {text!r} in:\n{''.join(self.lines)[-4000:]}"
            time.sleep(0.2)

    def wait_for_engines(self, timeout: float = 420) -> None:
        """Until the rollout engine's actor process exists (the engines are starting)."""
        deadline = time.monotonic() + timeout
        while not _actor_pids(self.proc.pid, "RolloutWorker") and self.proc.poll() is None:
            assert time.monotonic() < deadline, "no rollout engine started"
            time.sleep(0.2)

    def finish(self, timeout: float = 180) -> str:
        self.proc.wait(timeout=timeout)
        self._done.set()
        time.sleep(0.5)  # the reader drains the pipe
        return "".join(self.lines)


def _gone_within(pids: set[int], seconds: float) -> list[str]:
    from tests.vime.conftest import alive

    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)


def test_a_stop_saves_the_step_in_progress_and_the_resume_continues_after_it(tmp_path):
    """SIGINT once step 0 is logged, in a 4-step run with no checkpoint scheduled before the end: the step in
    progress (step 0's last bookkeeping, or step 1) finishes, a checkpoint of it is saved within
    checkpoint.on_stop_s, the stop line says which, exit 130; `resume=` starts at the step after it (no finished
    step is done again) and completes the run."""
    out = tmp_path / "stopped"
    run = _Watched(out, "steps=4")
    deadline = time.monotonic() + 420
    while not ((out / "metrics.jsonl").is_file() and _rows(out)) and run.proc.poll() is None:
        assert time.monotonic() < deadline, "".join(run.lines)[-4000:]
        time.sleep(0.2)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    text = run.finish(timeout=240)
    assert run.proc.returncode == 130, text[-4000:]
    assert "SIGINT: finishing the step in progress and saving a checkpoint of it (at most 60 s" in text
    assert time.monotonic() - t0 < 60 + 30  # the bound, and the shutdown after it
    done = [r["step"] for r in _rows(out)]
    last = done[-1]
    assert done == list(range(last + 1)) and last < 3, done  # it stopped before the end, every step logged once
    assert f"SIGINT: stopped; saved a checkpoint of step {last} (step_{last:06d}, " in text, text[-4000:]
    assert f"continue from step_{last:06d} with: " in text and "Traceback" not in text
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"

    resumed = subprocess.run(
        train_cmd(f"resume={out}"), cwd=REPO, env=os.environ | TRAIN_ENV, capture_output=True, text=True, timeout=420
    )
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3]  # nothing done twice, nothing lost


def test_ctrl_c_during_start_up_says_nothing_was_trained_and_leaves_nothing(tmp_path):
    """SIGINT while the engines start: one line says what was starting and that nothing was trained; exit 130;
    no process of the run and none of its temporary files are left. Then a double Ctrl-C: the second signal
    ends the clean-up at once, and still leaves no process (Ray's agents included) and no file behind."""
    from tests.vime.conftest import run_files_left

    out = tmp_path / "stopped"
    run = _Watched(out)
    run.wait_for_engines()
    run.proc.send_signal(signal.SIGINT)
    text = run.finish()
    assert run.proc.returncode == 130, text[-4000:]
    assert "warning: SIGINT during start-up (the engines were starting): no step ran, nothing was trained" in text
    assert "Traceback" not in text and "\x1b[" not in text, text[-4000:]
    assert not _gone_within(run.pids, 10) and not run_files_left(run.proc.pid)

    again = _Watched(out)  # the same output_dir: the stopped start is no run, it is reused
    again.wait_for_engines()
    assert "held a start that never completed a step" in "".join(again.lines)
    again.proc.send_signal(signal.SIGINT)
    again.wait_for("nothing was trained", timeout=60)
    again.proc.send_signal(signal.SIGINT)
    text = again.finish(timeout=30)
    assert again.proc.returncode == 130, text[-4000:]
    assert "SIGINT again: exiting now; killed the run's" in text
    assert not _gone_within(again.pids, 5) and not run_files_left(again.proc.pid)


def test_an_engine_that_dies_at_start_is_named_with_its_own_error_and_its_log(tmp_path):
    """vLLM refuses `max_num_batched_tokens` < `max_num_seqs` inside the engine's constructor: the run ends
    (exit 1) with one line naming the engine, vLLM's own error first and `<output_dir>/engines.log` last; no
    raw `(raylet)` line, no colour codes, no pointer to a shared Ray session directory."""
    out = tmp_path / "dead"
    proc = subprocess.run(
        train_cmd("rollout.max_num_batched_tokens=64", f"output_dir={out}"),
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        capture_output=True,
        text=True,
        timeout=420,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    died = [line for line in text.splitlines() if "rollout engine 0 died during 'start'" in line]
    assert len(died) == 1, text[-4000:]
    assert "max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (128)" in died[0]
    assert died[0].endswith(f"(its log: {out.resolve() / 'engines.log'})") and len(died[0]) < 500, died[0]
    assert "(raylet)" not in text and "\x1b[" not in text and "session_latest" not in text, text[-4000:]
