"""Clean stops: Ctrl-C / SIGTERM, exit codes, and the report a stopped run leaves.

SIGINT and SIGTERM raise `Stopped` in the driver's main thread (wherever it waits, Ray included);
`train.py` then flushes what the run has (metrics are written per step; the plot is drawn; the
summary and the resume command are printed), shuts the engines down, hands W&B the exit code and
exits 128 + signal (130 for SIGINT, 143 for SIGTERM) without a traceback. A second signal during
that clean-up exits at once with the same code.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

log = logging.getLogger("vime")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):  # noqa: N818 - a control-flow signal like KeyboardInterrupt, not an error
    """A stop signal arrived; `exit_code` is 128 + its number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name, self.exit_code = signum, signal.Signals(signum).name, 128 + signum


def _exit_now(signum: int, frame) -> None:
    del frame
    os._exit(128 + signum)


def _stop(signum: int, frame) -> None:
    del frame
    for s in SIGNALS:  # the clean-up that follows is not interrupted again; a second signal ends it at once
        signal.signal(s, _exit_now)
    raise Stopped(signum)


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
    from vime import checkpoint

    rows = list(driver.logger.rows) if driver.logger is not None else []
    plot = None
    if driver.logger is not None:
        try:
            plot = driver.logger.plot()
        except Exception as e:  # noqa: BLE001 - the plot is a courtesy here; the stop reason matters more
            log.warning("plot: %s", e)
    last = checkpoint.latest(driver.output_dir) if driver.output_dir.is_dir() else None
    log.warning("%s after %d step(s) (%d tokens compared, %d mismatches); metrics %s, plot %s", reason, len(rows),
                sum(r.get("tokens", 0) for r in rows), sum(r.get("mismatch_count", 0) for r in rows),
                Path(driver.output_dir) / "metrics.jsonl", plot)
    if last is not None:
        log.warning("continue from %s with: %s", last.name, checkpoint.resume_command(driver.output_dir))
    else:
        log.warning("no checkpoint was saved yet: rerun with a new output_dir to start again")


# ---- temporary files ------------------------------------------------------------------------------

# What runs leave in /tmp and /dev/shm when a process is killed before it cleans up: vLLM's FileStore
# rendezvous (vllm_dist_*), vime's trainer rendezvous, weight-transfer files, shared-memory segments.
STALE_PATTERNS = ("/tmp/vllm_dist_*", "/tmp/vime_rdzv_*", "/dev/shm/rl_kernel_weights_*", "/dev/shm/vime_weights_*",
                  "/dev/shm/psm_*")


def _in_use() -> set[str]:
    """Paths some process holds open or mapped (/proc/*/fd and /proc/*/maps; what we may read)."""
    used: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            used.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
            used.update(line.split(maxsplit=5)[5].strip() for line in (proc / "maps").read_text().splitlines()
                        if len(line.split(maxsplit=5)) == 6)
        except OSError:
            continue
    return used


def sweep_stale(patterns: tuple[str, ...] = STALE_PATTERNS, min_age_s: float = 120.0) -> list[str]:
    """Remove files matching `patterns` that no process holds open or mapped and that are older than
    `min_age_s` (a live run's files are in use, or younger). Returns what was removed."""
    import glob
    import time

    candidates = [p for pattern in patterns for p in glob.glob(pattern)]
    if not candidates:
        return []
    used, now, removed = _in_use(), time.time(), []
    for path in candidates:
        try:
            if path not in used and now - os.stat(path).st_mtime >= min_age_s:
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    if removed:
        log.info("removed %d stale temporary file(s) of earlier runs: %s", len(removed), ", ".join(removed[:5]))
    return removed
