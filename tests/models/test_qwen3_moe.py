"""Qwen3-MoE in the reference model: the tiny checkpoint (HF Qwen3MoeForCausalLM, hub weight names), agreement
with HF transformers, weights in and out, the paged rollout equal to teacher forcing bit for bit with the same
routes for every (token, layer), and the bad configs that fail in one line.

Native twin: the MoE boundary native (every other boundary strict) in fp32, where torch's CPU GEMMs change a
row's bits with the rows beside it: the rollout's logprobs then differ from teacher forcing.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches, same_bits
from rl_kernel.models import Qwen3Reference
from rl_kernel.models.qwen3 import read_config
from rl_kernel.models.qwen3_moe import Qwen3MoeConfig, capture_routes, rollout_routes
from rl_kernel.models.rollout import Request, RolloutEngine
from rl_kernel.models.tiny import make_tiny_qwen3

TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def moe_path(tiny_moe_path):
    return tiny_moe_path


@pytest.fixture(scope="module")
def moe_fp32_path(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_moe_fp32"), dtype="float32", **TINY_MOE)


def _sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _hf_logprobs(path, sequences: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    # the eager expert loop: transformers' grouped_mm default takes no fp64
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    out = []
    for s in sequences:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = hf(ids).logits[0, :-1].to(torch.float64)
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def test_tiny_moe_checkpoint(moe_path):
    cfg = json.loads((moe_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    config = read_config(moe_path)
    assert isinstance(config, Qwen3MoeConfig)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 64)
    assert config.norm_topk_prob is True
    model = Qwen3Reference.from_pretrained(moe_path)
    exported = model.state_dict_hf()
    from safetensors.torch import load_file

    stored = load_file(str(moe_path / "model.safetensors"))
    assert set(exported) == set(stored)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored and "model.layers.0.mlp.gate.weight" in stored
    assert all(same_bits(exported[n], stored[n]) for n in stored)


def test_native_matches_hf_fp32(moe_fp32_path):
    seqs = _sequences([5, 70, 13])
    ref = _hf_logprobs(moe_fp32_path, seqs, torch.float32)
    model = Qwen3Reference.from_pretrained(moe_fp32_path, dtype=torch.float32)
    with rk.mode("native"):
        ours = model.sequence_logprobs(seqs, [1] * len(seqs))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


def test_strict_matches_hf_fp64(moe_fp32_path):
    seqs = _sequences([5, 70, 13])
    ref = _hf_logprobs(moe_fp32_path, seqs, torch.float64)
    model = Qwen3Reference.from_pretrained(moe_fp32_path, dtype=torch.float32)
    ours = model.sequence_logprobs(seqs, [1] * len(seqs))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


def test_strict_forward_runs_strict_moe_ops_and_trains(moe_fp32_path):
    model = Qwen3Reference.from_pretrained(moe_fp32_path, dtype=torch.float32)
    layer = model.model.layers[0].mlp
    for p in (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
        p.requires_grad_(True)
    ids = torch.tensor(_sequences([20])[0])
    with rk.evidence.recording() as ran:
        hidden = model.forward_packed(ids, torch.tensor([0, 20]))
        model.logprobs(hidden[:-1], ids[1:]).sum().backward()
    assert {"moe_router", "moe_experts", "moe_combine"} <= {r["op"] for r in ran}
    assert rk.evidence.native_ops(ran) == []
    for p in (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)


def _requests(seed: int = 1) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    spec = [(5, 10, 1.0, 0), (70, 6, 0.7, 0), (13, 12, 1.3, 2), (33, 8, 1.0, 5), (1, 8, 0.9, 7)]
    return [Request(torch.randint(4, 512, (n,), generator=g).tolist(), m, t, a) for n, m, t, a in spec]


def _rollout_vs_teacher(model: Qwen3Reference):
    """(logprob bit mismatches, tokens, route mismatches, (token, layer) routes) of a mixed rollout."""
    reqs = _requests()
    engine = RolloutEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=13)
    with capture_routes(model.model) as captured:
        outs = engine.generate(reqs, seed=3)
    seqs = [r.prompt_ids + o.token_ids for r, o in zip(reqs, outs)]
    rollout = rollout_routes(engine.trace, captured, [len(q) - 1 for q in seqs])
    with capture_routes(model.model) as tf_captured:
        tf = model.sequence_logprobs(seqs, [len(r.prompt_ids) for r in reqs], [r.temperature for r in reqs])
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).tolist()
    bad_routes = compared = 0
    for index, routes in enumerate(rollout):
        trainer = torch.stack([layer[0] for layer in tf_captured], dim=1)[offsets[index] : offsets[index] + len(routes)]
        assert bool((routes >= 0).all())  # the reference engine feeds every position itself (no prefix cache)
        compared += routes.shape[0] * routes.shape[1]
        bad_routes += int((routes != trainer.to(torch.int16)).any(-1).sum())
    return bit_mismatches([o.logprobs for o in outs], tf), sum(o.logprobs.numel() for o in outs), bad_routes, compared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rollout_equals_teacher_forcing_with_the_same_routes(dtype, moe_path, moe_fp32_path):
    model = Qwen3Reference.from_pretrained(moe_path if dtype == torch.bfloat16 else moe_fp32_path, dtype=dtype)
    bad, n, bad_routes, routes = _rollout_vs_teacher(model)
    print(f"strict {dtype}: {bad} / {n} logprobs differ, {bad_routes} / {routes} routes differ")
    assert n == 44 and bad == 0
    assert routes > 2 * 150 and bad_routes == 0


def test_native_twin_moe_rollout_differs_from_teacher_forcing(moe_fp32_path):
    model = Qwen3Reference.from_pretrained(moe_fp32_path, dtype=torch.float32)
    with rk.mode("native", "moe"):
        bad, n, bad_routes, routes = _rollout_vs_teacher(model)
    print(f"native moe fp32: {bad} / {n} logprobs differ, {bad_routes} / {routes} routes differ")
    assert bad > 0


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_experts_per_tok": 9}, r"top-k \(num_experts_per_tok\) = 9 must lie in \[1, num_experts=8\]"),
        ({"shared_expert_intermediate_size": 64}, r"MoE options \['shared_expert_intermediate_size'\] are not"),
        ({"moe_intermediate_size": 0}, "needs num_experts and moe_intermediate_size > 0"),
        ({"hidden_act": "gelu"}, "unsupported Qwen3 options"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "not a dense Qwen3ForCausalLM"),
    ],
)
def test_bad_moe_configs_fail_in_one_line(moe_path, tmp_path, changes, match):
    bad = _copy_with_config(moe_path, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=match) as err:
        Qwen3Reference.from_pretrained(bad)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)


def test_moe_needs_tp_1(moe_path, monkeypatch):
    """A group of two ranks (stood in for: the check fires before any collective) is refused."""
    import torch.distributed as dist

    from rl_kernel.models.layers import Qwen3Model

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="MoE layers run at tp=1 only"):
        Qwen3Model(read_config(moe_path), group=object())
