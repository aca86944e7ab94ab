"""A trainer rank's forked helpers die with it (`stops.forked_children_die_with_this_process`).

Megatron's checkpoint writers are forked children of the rank; if they outlive a killed rank they
hold its Ray connections and the driver waits forever. Each case starts a parent that forks a child
which sleeps, SIGKILLs the parent, and looks whether the child is still there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]

PARENT = textwrap.dedent("""
    import os, sys, time
    from vime.faults import stops
    if sys.argv[1] == "guarded":
        stops.forked_children_die_with_this_process()
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
""")


def _child_outlives_killed_parent(mode: str) -> bool:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by its new parent
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    return True


def test_forked_children_die_with_a_killed_parent():
    assert not _child_outlives_killed_parent("guarded")


def test_native_twin_forked_children_outlive_a_killed_parent():
    assert _child_outlives_killed_parent("plain")
