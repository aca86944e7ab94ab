"""Commands printed for the user (resume, extend, audit): runnable as printed, with this interpreter."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def python_command() -> str:
    """How to run this interpreter in a command printed for the user: `python` when that is what the
    shell finds on PATH, else this interpreter's path (relative to the working directory when under it:
    `.venv/bin/python` for the project's environment), so the printed command works as printed."""
    exe = os.path.abspath(sys.executable)
    found = shutil.which("python")
    if found and os.path.abspath(found) == exe:
        return "python"
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe


def resume_command(output_dir: Path) -> str:
    """The command that continues the run in `output_dir`, runnable as printed."""
    return f"{python_command()} -m vime.train resume={Path(output_dir).resolve()}"
