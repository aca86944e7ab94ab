"""Context parallelism under the Triton attention contract, on one GPU (CUDA, marked gpu): every CP rank's
split partials computed on this device, routed as the all-to-all routes them (a bit copy) and folded on the
query's rank, equal CP1 (`rk.attention_varlen`, Triton) bit for bit at Qwen3-8B attention shapes. The NCCL
run over two GPUs is tests/gpu/gpu_path.py and tests/megatron/test_megatron_gpu.py::test_cuda_strict_cp_triton."""

from __future__ import annotations

import pytest
import torch

import rl_kernel as rk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from rl_kernel.bits import bits  # noqa: E402
from rl_kernel.errors import StrictModeError  # noqa: E402
from rl_kernel.integrations.megatron import cp as cpm  # noqa: E402


def simulated_cp(q, k, v, layout, scale, split_chunks=None):
    sent = [
        cpm.triton_rank_partials(
            q,
            k[layout.local_index(r).to(q.device)],
            v[layout.local_index(r).to(q.device)],
            layout,
            r,
            scale,
            split_chunks=split_chunks,
        )
        for r in range(layout.cp)
    ]
    out = torch.empty_like(q)
    for r in range(layout.cp):
        pay = torch.cat([p[(m[:, 0] == r).to(p.device)] for p, m in sent])
        meta = torch.cat([m[m[:, 0] == r] for _, m in sent])
        idx = layout.local_index(r)
        out[idx.to(q.device)] = cpm.triton_fold(pay, meta, layout.positions[idx], q.dtype, split_chunks=split_chunks)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_split_partials_equal_cp1_bitwise(cp):
    gen = torch.Generator(device="cuda").manual_seed(cp)
    lens = [2048, 1500, 777, 513, 512, 100, 1]
    cu = torch.tensor([0, *lens]).cumsum(0)
    t, d = int(cu[-1]), 128
    q = torch.randn(t, 32, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(t, 8, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    with rk.mode("strict"):
        ref = rk.attention_varlen(q, k, v, cu.cuda(), d**-0.5)
    layout = cpm.TokenLayout(cu, cp, unit=cpm.cp_unit("cuda"))
    assert layout.unit == 512
    out = simulated_cp(q, k, v, layout, d**-0.5)
    assert torch.equal(bits(out), bits(ref))
    # native twin: folding 64-key chunk partials (the torch contract's partition) is not the Triton contract
    twin = simulated_cp(q, k, v, layout, d**-0.5, split_chunks=1)
    assert int((bits(twin) != bits(ref)).sum()) > 0


def test_cp_layout_of_64_key_units_is_refused_under_triton():
    q = torch.zeros(600, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(600, 2, 64, device="cuda", dtype=torch.bfloat16)
    layout = cpm.TokenLayout(torch.tensor([0, 600]), 2, unit=64)
    with pytest.raises(StrictModeError, match="must sit on one rank"):
        cpm.triton_rank_partials(q, k, k, layout, 0, 0.125)
