"""Clean stops: Ctrl-C / SIGTERM, exit codes, and the report a stopped run leaves.

A stop while the steps run loses no finished step (`finishing_steps`, unless `checkpoint.on_stop=false`): the
step in progress finishes, a checkpoint of it is saved and the run stops, all within `checkpoint.on_stop_s`
(past that, the stop lands as an immediate one: the last checkpoint stays the resume point, and a save cut
short is never `latest`). A stop at any other time (start-up, the end), or with `checkpoint.on_stop=false`:
SIGINT and SIGTERM raise `Stopped` in the driver's main thread (wherever it waits, Ray included);
`train.py` then flushes what the run has (metrics are written per step; the plot is drawn; the
summary and the resume command are printed), shuts the engines down, hands W&B the exit code and
exits 128 + signal (130 for SIGINT, 143 for SIGTERM) without a traceback. A stop before the first
step says what was starting and that nothing was trained. A second signal during that clean-up
exits at once with the same code, after killing the processes the run started (Ray's, the
engines') and removing its temporary files, so nothing of the run is left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil

log = logging.getLogger("vime")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):  # noqa: N818 - a control-flow signal like KeyboardInterrupt, not an error
    """A stop signal arrived; `exit_code` is 128 + its number. A KeyboardInterrupt, because that is the
    only exception Ray's blocking calls (ray.wait / ray.get) let through from a signal handler: they
    re-raise it as a plain KeyboardInterrupt, so the signal is also kept in `stop_signal()`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name, self.exit_code = signum, signal.Signals(signum).name, 128 + signum


def _exit_now(signum: int, frame) -> None:
    del frame
    with contextlib.suppress(Exception):  # best effort: exiting now is what was asked
        n = kill_descendants()
        remove_own_temp_files()
        os.write(
            2,
            f"{signal.Signals(signum).name} again: exiting now; killed the run's {n} remaining process(es)\n".encode(),
        )
    os._exit(128 + signum)


_received: list[int] = []


def stop_signal() -> int:
    """The last stop signal that arrived (SIGINT when none did: a plain KeyboardInterrupt)."""
    return _received[-1] if _received else int(signal.SIGINT)


def _stop(signum: int, frame) -> None:
    del frame
    _received.append(signum)
    for s in SIGNALS:  # the clean-up that follows is not interrupted again; a second signal ends it at once
        signal.signal(s, _exit_now)
    seconds = _finish_s[0]
    if seconds is None:
        raise Stopped(signum)
    _deferred[0], _given_s[0] = True, seconds  # the loop finishes the step, saves it and stops (`stop_requested`)
    signal.signal(signal.SIGALRM, _too_late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    name = signal.Signals(signum).name
    log.warning(
        "%s: finishing the step in progress and saving a checkpoint of it (at most %.0f s; %s again exits now)",
        name,
        seconds,
        name,
    )


# A stop while the steps run (`finishing_steps`): the seconds it gives the step in progress and its checkpoint
# (None: stops are immediate), whether one is pending, and whether it ran out of time.
_finish_s: list[float | None] = [None]
_deferred = [False]
_given_s = [0.0]
_late = [False]


def _too_late(signum: int, frame) -> None:
    del signum, frame
    _late[0] = True
    raise Stopped(stop_signal())


@contextlib.contextmanager
def finishing_steps(seconds: float | None) -> Iterator[None]:
    """While the run's steps run (the driver's loop, main thread): a first SIGINT / SIGTERM lets the step in
    progress finish; the loop then sees `stop_requested()`, saves that step (`save_on_stop`) and raises
    `Stopped`. After `seconds` without that, `Stopped` is raised wherever the run waits (`stop_note` says the step
    was not saved). None: every stop is immediate (`checkpoint.on_stop=false`)."""
    _finish_s[0] = seconds
    try:
        yield
    finally:
        _finish_s[0] = None
        if threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)


def stop_requested() -> bool:
    """Whether a stop signal arrived while the steps ran and waits for the step in progress to finish."""
    return _deferred[0]


def save_on_stop(driver, step: int, rows: list) -> str:
    """Checkpoint step `step` (the last finished one) unless the schedule did; returns what the stop line says of
    it. A save that fails (a trainer rank died) keeps the last checkpoint as the resume point, said so."""
    import time

    from vime.errors import VimeError
    from vime.state import checkpoint

    path = checkpoint.step_dir(driver.output_dir, step)
    if checkpoint.latest(driver.output_dir) == path:
        return f"step {step} is checkpointed ({path.name})"
    run = getattr(driver.logger, "run", None)
    t0 = time.perf_counter()
    try:
        checkpoint.save(driver, step, rows, run.id if run is not None else None)
    except VimeError as e:
        return f"no checkpoint of step {step} could be saved ({e})"
    return f"saved a checkpoint of step {step} ({path.name}, {time.perf_counter() - t0:.1f} s)"


def stop_note(driver) -> str:
    """What the stop line adds about the checkpoint of the stop (nothing when the stop was immediate)."""
    saved = getattr(driver, "stop_saved", None) if driver is not None else None
    if saved:
        return f"; {saved}"
    if _late[0]:
        return f"; the step in progress did not finish within checkpoint.on_stop_s={_given_s[0]:g} s: not saved"
    return ""


def install_signal_handlers() -> None:
    """Route SIGINT / SIGTERM to `Stopped` (main thread only; call again after `ray.init`, whose
    core worker installs its own SIGTERM handler)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _stop)


def ignore_signals() -> None:
    """During the final clean-up: a further signal exits at once."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _exit_now)


def report_stop(driver, reason: str) -> None:
    """What a run that did not finish leaves behind: the plot of the steps it has, one summary line,
    and how to continue (from its last checkpoint)."""
    from vime.reporting.commands import resume_command
    from vime.state import checkpoint

    if driver.logger is None:  # it stopped while setting up: no step ran
        if reason != "failed":
            log.warning(
                "%s during start-up (%s): no step ran, nothing was trained; stopping what started. Run "
                "the same command again to start over (output_dir=%s is reused)",
                reason.split(":")[0],
                starting_what(driver),
                driver.output_dir,
            )
        return
    rows = list(driver.logger.rows)
    plot = None
    try:
        plot = driver.logger.plot()
    except Exception as e:  # noqa: BLE001 - the plot is a courtesy here; the stop reason matters more
        log.warning("plot: %s", e)
    last = checkpoint.latest(driver.output_dir) if driver.output_dir.is_dir() else None
    log.warning(
        "%s after %d step(s) (%d tokens compared, %d mismatches); metrics %s, plot %s",
        reason,
        len(rows),
        sum(r.consistency.tokens for r in rows),
        sum(r.consistency.mismatch_count for r in rows),
        Path(driver.output_dir) / "metrics.jsonl",
        plot,
    )
    if last is not None:
        log.warning("continue from %s with: %s", last.name, resume_command(driver.output_dir))
    else:
        log.warning("no checkpoint was saved yet: rerun with a new output_dir to start again")


def starting_what(driver) -> str:
    """What a driver stopped before its first step was doing, in words."""
    if driver.engines or driver.trainer:
        return "the engines were starting"
    import ray

    return "Ray was starting" if ray.is_initialized() else "the model and data were being prepared"


def kill_descendants() -> int:
    """SIGKILL every process this one started, and theirs (Ray's GCS, raylet and agents, the actors, the
    engines' workers), all listed before the first is killed (an orphan's parent changes). Returns how many."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return len(procs)


# ---- processes a worker forks --------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
_forking_pid = [0]


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != _forking_pid[0]:  # the parent died between fork and prctl
        os._exit(1)


def forked_children_die_with_this_process() -> None:
    """From now on every process this one forks gets SIGKILL when its parent dies (Linux
    PR_SET_PDEATHSIG). Called in trainer ranks: Megatron's checkpoint writers are forked processes
    that inherit the rank's Ray connections, so writers outliving a killed rank keep it alive to Ray
    and the driver would wait on it forever instead of reporting the dead rank."""
    if sys.platform.startswith("linux"):
        os.register_at_fork(before=lambda: _forking_pid.__setitem__(0, os.getpid()), after_in_child=_die_with_parent)


# ---- temporary files ------------------------------------------------------------------------------

# What runs leave in /tmp and /dev/shm when a process is killed before it cleans up, and how old such
# a file must be (besides held open or mapped by no process) to count as stale. vLLM's FileStore
# rendezvous files are opened per operation, not held, so only a long-idle one is taken as stale.
# vime's own rendezvous file names its driver's pid: it is stale once that process is gone.
STALE_PATTERNS = {
    "/tmp/vllm_dist_*": 6 * 3600.0,
    "/dev/shm/rl_kernel_weights_*": 600.0,
    "/dev/shm/vime_weights_*": 600.0,
    "/dev/shm/psm_*": 600.0,
    "/dev/shm/vllm_dist_*": 600.0,
}  # vLLM's CPU all-reduce segments (TP > 1), mapped while in use
RENDEZVOUS_PATTERN = "/tmp/vime_rdzv_*"
# A run's own temporary directory (`vime_tmp_<driver pid>`): TMPDIR of its actors, so what they and the
# libraries in them leave (multiprocessing's pymp-*, W&B's and vLLM's temporary files) goes with it.
RUN_TEMP_PATTERN = "/tmp/vime_tmp_*"


def run_temp_dir() -> str:
    """This run's temporary directory (made on first use), removed at exit (`remove_own_temp_files`), or by
    the next run's `sweep_stale` when this process was killed."""
    path = Path(f"/tmp/vime_tmp_{os.getpid()}")
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def actor_temp_env() -> dict[str, str]:
    """Environment of the run's actors: TMPDIR in the run's temporary directory, and torch's compile cache
    where it would be without that (so it is kept between runs)."""
    import getpass
    import tempfile

    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"
    )
    return {"TMPDIR": run_temp_dir(), "TORCHINDUCTOR_CACHE_DIR": inductor}


def remove_own_temp_files() -> list[str]:
    """Remove this process's rendezvous files and its run temporary directory; returns what was removed."""
    import glob
    import shutil

    removed = []
    for path in glob.glob(f"/tmp/vime_rdzv_{os.getpid()}_*") + glob.glob(f"/tmp/vime_tmp_{os.getpid()}"):
        with contextlib.suppress(OSError):
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            removed.append(path)
    return removed


def _in_use() -> set[str]:
    """Paths some process holds open or mapped (those of the processes we may inspect)."""
    used: set[str] = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            used.update(f.path for f in proc.open_files())
            used.update(m.path for m in proc.memory_maps())
    return used


def _orphaned_rendezvous(pattern: str) -> list[str]:
    """vime rendezvous files (`vime_rdzv_<driver pid>_<id>`) and run temporary directories
    (`vime_tmp_<driver pid>`) whose driver process is gone."""
    import glob

    found = []
    for path in glob.glob(pattern):
        pid = Path(path).name.split("_")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            found.append(path)
    return found


def sweep_stale(
    patterns: dict[str, float] | None = None, rendezvous: str = RENDEZVOUS_PATTERN, run_temp: str = RUN_TEMP_PATTERN
) -> list[str]:
    """Remove temporary files of earlier runs: files matching a pattern of `patterns` (pattern -> minimum
    age in seconds) that no process holds open or mapped and that are older than that, and vime
    rendezvous files and run temporary directories whose driver is gone. Returns what was removed."""
    import glob
    import shutil
    import time

    patterns = STALE_PATTERNS if patterns is None else patterns
    candidates = [(p, age) for pattern, age in patterns.items() for p in glob.glob(pattern)]
    removed = []
    if candidates:
        used, now = _in_use(), time.time()
        for path, age in candidates:
            try:
                if path not in used and now - os.stat(path).st_mtime >= age:
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
    for path in _orphaned_rendezvous(rendezvous) + _orphaned_rendezvous(run_temp):
        try:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    if removed:
        log.info("removed %d stale temporary file(s) of earlier runs: %s", len(removed), ", ".join(removed[:5]))
    return removed
