"""A contract's fingerprint covers what decides the bits: its terms and parameters and the source of the
code that serves it (the op module, the backend's kernel module and the rl_kernel modules they import).
A kernel change that keeps the prose changes it; the same code under another module name does not."""

from __future__ import annotations

import dataclasses
import shutil
import sys

import pytest

import rl_kernel as rk
from rl_kernel.backends.torch import gemm as torch_gemm
from rl_kernel.contracts import source_digests
from rl_kernel.ops.gemm import GEMM


@pytest.fixture
def kernel_copies(tmp_path, monkeypatch):
    """Packages `same_kernels` (the torch GEMM kernel module, copied) and `changed_kernels` (the copy with
    its K group count 8 -> 4), importable from tmp_path."""
    source = open(torch_gemm.__file__).read()
    assert "\nK_GROUPS = 8\n" in source
    for name, text in (
        ("same_kernels", source),
        ("changed_kernels", source.replace("\nK_GROUPS = 8\n", "\nK_GROUPS = 4\n")),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "gemm.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("same_kernels", "changed_kernels"):
        sys.modules.pop(name, None)
        shutil.rmtree(tmp_path / name)


def test_kernel_source_change_changes_the_fingerprint(kernel_copies):
    assert GEMM.contracts["torch"].sources == ("rl_kernel.ops.gemm", "rl_kernel.backends.torch.gemm")
    contract = dataclasses.replace(GEMM.contracts["torch"], sources=("rl_kernel.backends.torch.gemm",))
    served_by = {
        name: dataclasses.replace(contract, sources=(f"{name}.gemm",)).fingerprint
        for name in ("same_kernels", "changed_kernels")
    }
    assert served_by["same_kernels"] == contract.fingerprint  # the text counts, not the module's name
    assert served_by["changed_kernels"] != contract.fingerprint  # same prose, one constant changed
    assert dataclasses.replace(contract, sources=()).fingerprint != contract.fingerprint  # prose alone differs


def test_sources_reach_imported_kernels_and_packages():
    """The torch logprob kernel calls the GEMM op (lazily): the GEMM's op and kernel modules are among the
    logprob contract's sources; the Triton package (cuBLASLt's workspace) is among every Triton contract's."""
    logprobs = rk.contracts.all_contracts()["rl_kernel.logprobs.torch.v1"]
    digests = set(source_digests(logprobs.sources))
    assert set(source_digests(("rl_kernel.ops.gemm", "rl_kernel.backends.torch.gemm"))) <= digests
    attention = rk.contracts.all_contracts()["rl_kernel.attention.triton.v1"]
    assert set(source_digests(("rl_kernel.backends.triton",))) <= set(source_digests(attention.sources))
