"""GPU tests: with VIME_INSTAFAIL=1 (scripts/gpu_vllm.sh) a failure's traceback is printed as it happens, so a
stage cut by its time limit still shows why an earlier test failed."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report):
    if report.failed and os.environ.get("VIME_INSTAFAIL") == "1":
        print(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n", flush=True)
