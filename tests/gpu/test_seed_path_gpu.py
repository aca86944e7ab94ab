"""The seed layout's device path on one GPU (issue 35, tests/gpu/seed_path_gpu.py), and that script on CPU.

On a GPU (marked gpu, skipped without CUDA): the script's three jobs (two NCCL ranks on one GPU, refused and
recorded; the strict TP reduction over every transport two ranks of one GPU allow; two trainer ranks pushing
over CUDA IPC into one strict vLLM engine, then logprob parity) must all pass. On CPU: the script's gloo
fallback runs the same strict reduction kernel sequence on two CPU ranks, bit for bit with its single-process
rank-order sum, with native twins that differ; and its argument errors are one line naming the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "seed_path_gpu.py"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.slow
def test_cpu_fallback_runs_the_strict_reduction_over_gloo_bit_for_bit(tmp_path):
    out = tmp_path / "seed.json"
    proc = _run("--json", str(out), "--device", "cpu", "--parts", "tp,push")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["pass"] and report["failures"] == []
    assert set(report["skipped"]) == {"tp_nccl", "push"}  # they need a GPU: recorded, not run
    routes = report["jobs"]["tp_gloo"]["verdict"]
    assert set(routes) == {"torch.distributed", "device_gather", "cpu_staged"}
    for route, got in routes.items():
        assert len(got["checks"]) == 6 and all(v == 0 for v in got["checks"].values()), (route, got)
        assert len(got["twins"]) == 2 and all(v > 0 for v in got["twins"].values()), (route, got)
    assert routes["device_gather"]["gathers_run"]["device"] > 0  # the registered gather is what ran
    assert routes["torch.distributed"]["gathers_run"]["device"] == 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--json", "x.json", "--parts", "tp,nope"], "--parts: ['nope'] is not among ['tp', 'push']"),
        (["--parts", "tp"], "--json PATH is required"),
        (["--json", "x.json", "--budget-s", "0"], "--budget-s must be positive"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(args, says, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    import seed_path_gpu

    with pytest.raises(SystemExit) as e:
        seed_path_gpu.parse(args)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
def test_seed_path_on_one_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "seed_path.json"
    proc = _run("--json", str(out), "--device", "cuda", timeout=200)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["pass"], report["failures"]
    assert set(report["jobs"]) == {"tp_nccl", "tp_gloo", "push"}
