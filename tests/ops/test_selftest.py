"""`python -m rl_kernel.selftest`: the table, the summary line, the JSON and the exit code."""

from __future__ import annotations

import json

import pytest
import torch

import rl_kernel as rk
import rl_kernel.selftest as selftest
from rl_kernel.selftest import matrix


def test_selftest_cpu_subset(tmp_path, capsys):
    path = tmp_path / "selftest.json"
    assert selftest.main(["--ops", "linear,rope", "--no-distributed", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert {c["op"] for c in report["cells"]} == {"linear", "rope"}
    assert all(c["strict"]["passed"] and c["strict"]["max_abs_diff"] == 0 for c in report["cells"])
    # native cells are measured and shown (whether they pass depends on the CPU), never an error
    assert all(isinstance(c["native"]["passed"], bool) and c["native"]["max_abs_diff"] >= 0 for c in report["cells"])
    assert report["strict_failures"] == 0 and set(report["contracts"]) == set(rk.contracts.all_contracts())
    for contract in rk.contracts.all_contracts().values():
        assert f"{contract.id}" in out and contract.fingerprint in out
    assert "OK: strict bit-identical in" in out.splitlines()[-1]
    assert f"cpu={selftest.cpu_name()} (native cells' results depend on it)" in out.splitlines()[0]


def test_selftest_exit_code_on_a_strict_failure(monkeypatch, capsys):
    """A strict cell whose layouts differ by one ulp makes the run fail (exit 1) and is shown as FAIL."""

    def differs(device, gen):
        x = torch.ones(3)
        return [(x, torch.nextafter(x, torch.full_like(x, 2.0)))]

    monkeypatch.setattr(matrix, "rowwise_cells", lambda: [matrix.Cell("linear", "broken", "fp32", differs)])
    monkeypatch.setattr(matrix, "attention_cells", list)
    assert selftest.main(["--no-distributed"]) == 1
    out = capsys.readouterr().out
    assert "FAIL 1.19e-07" in out and out.splitlines()[-1].startswith("FAILED: strict bit-identical in 0/1")


def test_selftest_rejects_cuda_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(SystemExit):
        selftest.main(["--device", "cuda"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selftest_cuda(tmp_path):
    """On CUDA the strict backend is whatever rk.get_backend() selects (Triton where it implements an op)."""
    path = tmp_path / "selftest.json"
    assert selftest.main(["--device", "cuda", "--no-distributed", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["device"] == "cuda" and report["strict_failures"] == 0
