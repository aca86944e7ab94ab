"""What every actor of a run (a rollout engine, a trainer rank) sets up in its own process: its side's
rl_kernel modes, and where its output goes."""

from __future__ import annotations

import os
import sys


def apply_modes(modes: dict[str, str]) -> None:
    """Set this process's rl_kernel mode per boundary (engine workers get theirs from the engine's config)."""
    import rl_kernel as rk

    for boundary, m in modes.items():
        rk.set_mode(m, boundary)


def redirect_output() -> None:
    """When `VIME_ENGINE_LOG` names a file, append this process's stdout and stderr (file descriptors
    1 and 2: Python, C++ and the engine workers it spawns) to it: engine and framework logs stay in
    the run's `engines.log` instead of the console."""
    path = os.environ.get("VIME_ENGINE_LOG")
    if not path:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
