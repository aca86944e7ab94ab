"""The strict MoE ops (router, grouped experts, combine): a token's route and output bits do not depend on the
other tokens routed beside it, how many rows each expert got, or where the token sits; ties route to the lower
expert id; the combine's order is the ascending expert id whatever order the slots come in; gradients match
fp64 autograd of a plain MoE; the contracts are registered and recorded.

Native twins: torch's fp32 CPU GEMM changes a row's bits with the number of rows beside it (on every machine of
this project so far: M-dependent blocking), so the native expert MLP and router are not batch-invariant there.
Torch's bf16 CPU GEMM keeps a row's bits, and so does its fp16 GEMM on an AVX-512 EPYC (not on an earlier
machine): no twin in those dtypes on CPU, where it would test the machine's kernels; the GPU's grouped GEMMs are
where bf16 breaks, checked by the GPU suite. The native combine sums the slots in the order they come, so a
permutation of the slots moves bits in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.bits import same_bits
from rl_kernel.contracts import source_digests
from rl_kernel.ops.moe import expert_order, native_combine

SETTINGS = settings(max_examples=8, deadline=None, database=None)
E, D, I = 8, 128, 64
DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    router = (torch.randn(E, D, generator=g) * 0.2).to(dtype)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * 0.1).to(dtype)
    down = (torch.randn(E, D, I, generator=g) * 0.1).to(dtype)
    return router, gate_up, down


def _batch_around(probe_ids: torch.Tensor, counts: list[int], position: int, k: int, g: torch.Generator):
    """(ids [T, k], the probe's row): rows of k distinct experts that route about counts[e] other (token, slot)
    pairs to expert e (rows topped up at random), with `probe_ids` inserted at row `position` (or last)."""
    rows = []
    pool = [e for e, c in enumerate(counts) for _ in range(c)]
    pool = [pool[i] for i in torch.randperm(len(pool), generator=g).tolist()]
    while pool:  # k distinct experts per row, filled from the pool, the rest at random
        row = []
        for e in list(pool):
            if e not in row and len(row) < k:
                row.append(e)
                pool.remove(e)
        for e in torch.randperm(E, generator=g).tolist():
            if len(row) < k and e not in row:
                row.append(e)
        rows.append(sorted(row))
    at = min(position, len(rows))
    rows.insert(at, probe_ids.tolist())
    return torch.tensor(rows), at


@SETTINGS
@given(
    counts=st.lists(st.integers(0, 9), min_size=E, max_size=E),
    position=st.integers(0, 40),
    k=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(DTYPES),
)
def test_expert_rows_do_not_depend_on_the_group_sizes(counts, position, k, dtype):
    """A token's expert outputs (fp32 [k, D], raw bits) are the same alone and with any number of other rows in
    its experts' groups, at any position."""
    g = torch.Generator().manual_seed(sum(counts) * 7 + position)
    _, gate_up, down = _weights(dtype)
    probe = torch.randperm(E, generator=g)[:k].sort().values
    ids, at = _batch_around(probe, counts, position, k, g)
    x = torch.randn(ids.shape[0], D, generator=g).to(dtype)
    together = rk.moe_experts(x, ids, gate_up, down)
    alone = rk.moe_experts(x[at : at + 1], ids[at : at + 1], gate_up, down)
    assert torch.equal(ids[at], probe)
    assert same_bits(together[at : at + 1], alone)


@SETTINGS
@given(batch=st.integers(1, 48), position=st.integers(0, 47), dtype=st.sampled_from(DTYPES))
def test_a_token_routes_and_combines_alike_in_any_batch(batch, position, dtype):
    """The whole block (route, experts, combine): a token's ids and output bits alone == in a batch."""
    position = position % batch
    g = torch.Generator().manual_seed(batch * 100 + position)
    router, gate_up, down = _weights(dtype)
    x = torch.randn(batch, D, generator=g).to(dtype)
    out, ids = rk.moe(x, router, gate_up, down, 2)
    w, _ = rk.moe_route(x, router, 2)
    one_out, one_ids = rk.moe(x[position : position + 1], router, gate_up, down, 2)
    one_w, _ = rk.moe_route(x[position : position + 1], router, 2)
    assert torch.equal(one_ids, ids[position : position + 1])
    assert same_bits(one_w, w[position : position + 1])
    assert same_bits(one_out, out[position : position + 1])


@settings(max_examples=40, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 9), min_size=0, max_size=300))
def test_expert_order_is_the_stable_sort_and_its_inverse(ids):
    flat = torch.tensor(ids, dtype=torch.int64)
    order, place, counts = expert_order(flat, 10)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(place[order], torch.arange(len(ids)))
    assert torch.equal(counts, torch.bincount(flat, minlength=10))


def test_native_twin_expert_rows_change_with_the_batch():
    """The same check on the native expert MLP (fp32: module doc): some token's bits change between alone and in
    a batch."""
    g = torch.Generator().manual_seed(3)
    _, gate_up, down = _weights(torch.float32)
    x = torch.randn(64, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2].sort().values for _ in range(64)])
    strict = rk.moe_experts(x, ids, gate_up, down)
    with rk.mode("native", "moe"):
        native = rk.moe_experts(x, ids, gate_up, down)
        native_moved = [
            not same_bits(rk.moe_experts(x[t : t + 1], ids[t : t + 1], gate_up, down), native[t : t + 1])
            for t in range(64)
        ]
    strict_moved = [
        not same_bits(rk.moe_experts(x[t : t + 1], ids[t : t + 1], gate_up, down), strict[t : t + 1]) for t in range(64)
    ]
    assert any(native_moved), "native expert rows kept their bits: the twin shows nothing here"
    assert not any(strict_moved)


def test_native_twin_router_weights_change_with_the_batch():
    g = torch.Generator().manual_seed(4)
    router, _, _ = _weights(torch.float32)
    x = torch.randn(64, D, generator=g)
    with rk.mode("native", "moe"):
        w, _ = rk.moe_route(x, router, 2)
        moved = [not same_bits(rk.moe_route(x[t : t + 1], router, 2)[0], w[t : t + 1]) for t in range(64)]
    assert any(moved)
    w, _ = rk.moe_route(x, router, 2)
    assert all(same_bits(rk.moe_route(x[t : t + 1], router, 2)[0], w[t : t + 1]) for t in range(64))


def test_native_and_strict_routes_disagree_somewhere():
    """Near-ties in bf16: the native router (logits rounded to bf16) and the strict one (fp32 logits) pick
    different experts for some tokens - the disagreement strict mode removes between two engines."""
    g = torch.Generator().manual_seed(5)
    router, _, _ = _weights(torch.bfloat16)
    x = torch.randn(4096, D, generator=g).to(torch.bfloat16)
    _, strict = rk.moe_route(x, router, 2)
    with rk.mode("native", "moe"):
        _, native = rk.moe_route(x, router, 2)
    differ = (strict != native).any(-1).float().mean().item()
    assert 0 < differ < 0.05, differ


def test_ties_route_to_the_lower_expert_id_in_ascending_order():
    weight = torch.zeros(6, 4)
    weight[[1, 4], 0] = 1.0  # experts 1 and 4 tie at the top, 0, 2, 3, 5 tie below
    x = torch.tensor([[1.0, 0, 0, 0], [0.0, 0, 0, 0]])
    w, ids = rk.moe_route(x, weight, 3, renormalize=False)
    assert ids.tolist() == [[0, 1, 4], [0, 1, 2]]
    assert w[0, 1] == w[0, 2] and w[1].unique().numel() == 1
    w, _ = rk.moe_route(x, weight, 3)
    assert torch.allclose(w.sum(-1), torch.ones(2))


def test_top_k_beyond_the_experts_fails_in_one_line():
    with pytest.raises(ValueError, match=r"top-k \(num_experts_per_tok\) = 9 must lie in \[1, num_experts=8\]"):
        rk.moe_route(torch.ones(2, D), torch.ones(E, D), 9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_takes_slots_in_ascending_expert_id(dtype):
    g = torch.Generator().manual_seed(6)
    y, w = torch.randn(64, 4, 128, generator=g), torch.rand(64, 4, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(64)])
    perm = torch.tensor([3, 1, 0, 2])
    out = rk.moe_combine(y, w, ids, dtype)
    assert same_bits(out, rk.moe_combine(y[:, perm], w[:, perm], ids[:, perm], dtype))
    order = ids.argsort(-1)
    ys, ws = y.gather(1, order[..., None].expand(-1, -1, 128)), w.gather(1, order)
    acc = ys[:, 0] * ws[:, :1]
    for j in range(1, 4):
        acc = acc + ys[:, j] * ws[:, j : j + 1]
    assert same_bits(out, acc.to(dtype))
    assert same_bits(rk.moe_combine(ys, ws, ids.gather(1, order), dtype, ascending=True), out)  # no sort needed
    if dtype == torch.float32:  # the twin: the slots' order moves the native sum's bits
        assert not same_bits(native_combine(y, w, dtype), native_combine(y[:, perm], w[:, perm], dtype))


def _plain_moe(x, router, gate_up, down, k):
    """A plain fp64 MoE (HF's formulas) for the gradients' reference, routing on the given inputs."""
    probs = torch.softmax(x @ router.T, -1)
    picked, ids = torch.topk(probs, k, -1)
    w = picked / picked.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for j in range(k):
        gate, up = torch.einsum("td,tnd->tn", x, gate_up[ids[:, j]]).chunk(2, -1)
        out = out + w[:, j : j + 1] * torch.einsum("ti,tdi->td", F.silu(gate) * up, down[ids[:, j]])
    return out


def test_gradients_match_fp64_autograd():
    g = torch.Generator().manual_seed(7)
    tensors = [*_weights(torch.float32, 1)]
    x = torch.randn(24, D, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, *tensors)]
    out, _ = rk.moe(*leaves, 2)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.double().requires_grad_() for t in (x, *tensors)]
    ref = torch.autograd.grad(_plain_moe(*ref_leaves, 2), ref_leaves, grad.double())
    for name, a, b in zip(("x", "router", "gate_up", "down"), got, ref):
        assert float((a.double() - b).abs().max()) <= 2e-6 * float(b.abs().max()), name


def test_contracts_are_registered_and_recorded():
    contracts = rk.contracts.all_contracts()
    for op in ("moe_router", "moe_experts", "moe_combine"):
        for backend in ("torch", "triton"):
            c = contracts[f"rl_kernel.{op}.{backend}.v1"]
            assert c.sources == ("rl_kernel.ops.moe", f"rl_kernel.backends.{backend}.moe")
    # the router's logits and the experts' products are the GEMM contract's: its code is in the fingerprints
    gemm = set(source_digests(("rl_kernel.ops.gemm", "rl_kernel.backends.torch.gemm")))
    assert gemm <= set(source_digests(contracts["rl_kernel.moe_experts.torch.v1"].sources))
    router, gate_up, down = _weights(torch.bfloat16)
    x = torch.randn(5, D).to(torch.bfloat16)
    with rk.evidence.recording() as ran:
        rk.moe(x, router, gate_up, down, 2)
    assert {(r["op"], r["mode"]) for r in ran} == {
        ("gemm", "strict"),
        ("moe_router", "strict"),
        ("moe_experts", "strict"),
        ("moe_combine", "strict"),
    }
    assert all(contracts[r["contract_id"]].fingerprint == r["fingerprint"] for r in ran)
    with rk.mode("native", "moe"), rk.evidence.recording() as ran:
        rk.moe(x, router, gate_up, down, 2)
    assert {r["op"] for r in ran if r["mode"] == "native"} == {"moe_router", "moe_experts", "moe_combine"}


def test_the_expert_order_benchmark_checks_every_form_against_the_stable_sort(tmp_path):
    """benchmarks/moe_expert_order.py on CPU: every form it times (the flat scan, the inner- and outer-dimension
    scans it replaced, argsort) gives the stable sort's order, place and counts at 30B-A3B's 128 experts, top-8."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.moe_expert_order import main

    main(["--device", "cpu", "--tokens", "1,64,300", "--out", str(tmp_path / "order.json")])
    rows = json.loads((tmp_path / "order.json").read_text())["rows"]
    assert [r["rows"] for r in rows] == [8, 512, 2400]
