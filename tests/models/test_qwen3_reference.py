"""Qwen3Reference: correctness against HF transformers, weights in and out, evidence, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import rl_kernel as rk
from rl_kernel.bits import same_bits
from rl_kernel.models import Qwen3Reference

STRICT_OPS = {"rms_norm", "gemm", "rope", "attention", "silu_and_mul", "logprobs"}


def _sequences(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_logprobs(path, sequences: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Teacher-forcing logprobs of tokens 1.. from HF transformers, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out = []
    for s in sequences:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = hf(ids).logits[0, :-1].to(torch.float64)
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


# 70 tokens: attention crosses the contract's 64-key chunk boundary.
LENGTHS = [5, 70, 13]


def test_tiny_checkpoint_and_tokenizer(tiny_qwen3_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    ids = tok("Hello, world!")["input_ids"]
    assert tok.decode(ids) == "Hello, world!"
    assert len(tok) == 512 and max(ids) < 512
    cfg = json.loads((tiny_qwen3_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == tok.eos_token_id


def test_native_matches_hf_fp32(tiny_qwen3_fp32_path):
    """Native mode (torch kernels) on an fp32 checkpoint reproduces HF Qwen3ForCausalLM in fp32 to
    within fp32 rounding (|logprob| ~ 7, fp32 ulp there ~5e-7): tolerance 1e-5 absolute."""
    seqs = _sequences(LENGTHS)
    ref = _hf_logprobs(tiny_qwen3_fp32_path, seqs, torch.float32)
    model = Qwen3Reference.from_pretrained(tiny_qwen3_fp32_path, dtype=torch.float32)
    with rk.mode("native"):
        ours = model.sequence_logprobs(seqs, [1] * len(seqs))
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


def test_strict_matches_hf_fp64(tiny_qwen3_fp32_path):
    """Strict mode on an fp32 checkpoint agrees with HF run in fp64 to within 1e-5 absolute: the
    contracts change rounding order, not the function."""
    seqs = _sequences(LENGTHS)
    ref = _hf_logprobs(tiny_qwen3_fp32_path, seqs, torch.float64)
    model = Qwen3Reference.from_pretrained(tiny_qwen3_fp32_path, dtype=torch.float32)
    ours = model.sequence_logprobs(seqs, [1] * len(seqs))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


def test_bf16_strict_close_to_hf_fp64(tiny_qwen3_path):
    """bf16 weights and activations: strict logprobs stay near HF fp64 on the same (bf16) weights.
    bf16 activations carry ~3 significant digits, so the tolerance is 0.1 absolute on |logprob| ~ 7."""
    seqs = _sequences(LENGTHS)
    ref = _hf_logprobs(tiny_qwen3_path, seqs, torch.float64)
    ours = Qwen3Reference.from_pretrained(tiny_qwen3_path).sequence_logprobs(seqs, [1] * len(seqs))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=0.1)


def test_tied_embeddings_match_hf(tiny_qwen3_fp32_path, tmp_path):
    """Small Qwen3 releases tie the LM head to the embedding (no lm_head.weight in the checkpoint)."""
    from safetensors.torch import save_file

    tied = _copy_with_config(tiny_qwen3_fp32_path, tmp_path / "tied", tie_word_embeddings=True)
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    model = Qwen3Reference.from_pretrained(tied, dtype=torch.float32)
    assert model.lm_head is model.embed and "lm_head.weight" not in model.state_dict_hf()
    seqs = _sequences([7, 11])
    ref = _hf_logprobs(tied, seqs, torch.float32)
    with rk.mode("native"):
        ours = model.sequence_logprobs(seqs, [1, 1])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


def test_strict_forward_is_differentiable(tiny_qwen3_fp32_path):
    """Gradients of the summed teacher-forcing logprobs w.r.t. every weight, strict vs native (fp32):
    the backward carries no bit contract, so they agree to fp32 accumulation noise (observed <= 2e-5
    on gradients up to ~18): tolerance 1e-4 absolute."""
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 15, 40])
    grads = {}
    for mode in ("strict", "native"):
        model = Qwen3Reference.from_pretrained(tiny_qwen3_fp32_path, dtype=torch.float32)
        params = [model.embed, model.lm_head, model.norm] + [t for layer in model.layers for t in layer.values()]
        for p in params:
            p.requires_grad_(True)
        with rk.mode(mode):
            keep = torch.ones(40, dtype=torch.bool)
            keep[torch.tensor([14, 39])] = False  # the last token of each sequence predicts nothing
            model.logprobs(model.forward_packed(ids, cu)[keep], ids.roll(-1)[keep]).sum().backward()
        grads[mode] = [p.grad for p in params]
    for g, ref in zip(grads["strict"], grads["native"]):
        assert bool(g.abs().max() > 0)
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-4)


def test_strict_forward_runs_only_strict_ops(tiny_qwen3_path):
    model = Qwen3Reference.from_pretrained(tiny_qwen3_path)
    seqs = _sequences([9, 4])
    with rk.evidence.recording() as ran:
        model.sequence_logprobs(seqs, [2, 1])
    assert rk.evidence.native_ops(ran) == []
    assert {r["op"] for r in ran} == STRICT_OPS
    # Twin: in native mode the same forward shows only native records.
    with rk.mode("native"), rk.evidence.recording() as ran_native:
        model.sequence_logprobs(seqs, [2, 1])
    assert {r["op"] for r in rk.evidence.native_ops(ran_native)} == STRICT_OPS
    assert all(r["mode"] == "native" for r in ran_native)


def test_state_dict_roundtrip_and_weight_swap(tiny_qwen3_path):
    model = Qwen3Reference.from_pretrained(tiny_qwen3_path)
    ckpt = load_file(tiny_qwen3_path / "model.safetensors")
    sd = model.state_dict_hf()
    assert sd.keys() == ckpt.keys()
    for name, t in ckpt.items():
        assert same_bits(sd[name], t), name
    seqs = _sequences([12])
    before = model.sequence_logprobs(seqs, [1])[0]
    # A bucketed update of one tensor changes the result; loading the original back restores every bit.
    name = "model.layers.1.mlp.down_proj.weight"
    model.load_hf_weights({name: ckpt[name] * 2})
    changed = model.sequence_logprobs(seqs, [1])[0]
    assert not same_bits(changed, before)
    model.load_hf_weights({name: ckpt[name]})
    assert same_bits(model.sequence_logprobs(seqs, [1])[0], before)


def test_sequence_logprobs_prompt_and_temperature(tiny_qwen3_path):
    """Positions before prompt_len are left out; temperature is per sequence and matters."""
    model = Qwen3Reference.from_pretrained(tiny_qwen3_path)
    seqs = _sequences([10, 6])
    full = model.sequence_logprobs(seqs, [1, 1], temperature=[1.0, 0.5])
    part = model.sequence_logprobs(seqs, [4, 1], temperature=[1.0, 0.5])
    assert [len(x) for x in part] == [6, 5]
    assert same_bits(part[0], full[0][3:])
    assert same_bits(part[1], full[1])
    hot = model.sequence_logprobs(seqs, [1, 1], temperature=1.0)
    assert not torch.equal(hot[1], full[1])


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        Qwen3Reference.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        Qwen3Reference.from_pretrained(tmp_path)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_rejects_other_architectures(tiny_qwen3_path, tmp_path):
    moe = _copy_with_config(tiny_qwen3_path, tmp_path / "moe", num_experts=8)
    with pytest.raises(ValueError, match="MoE"):
        Qwen3Reference.from_pretrained(moe)
    llama = _copy_with_config(
        tiny_qwen3_path, tmp_path / "llama", architectures=["LlamaForCausalLM"], model_type="llama"
    )
    with pytest.raises(ValueError, match="not a dense Qwen3ForCausalLM"):
        Qwen3Reference.from_pretrained(llama)
    wider = _copy_with_config(tiny_qwen3_path, tmp_path / "wider", intermediate_size=512)
    with pytest.raises(ValueError, match="mlp\\..*_proj.weight: shape .* does not match the config"):
        Qwen3Reference.from_pretrained(wider)


def test_bad_tokens_and_weights(tiny_qwen3_path):
    model = Qwen3Reference.from_pretrained(tiny_qwen3_path)
    with pytest.raises(ValueError, match="token ids must lie in \\[0, 512\\)"):
        model.sequence_logprobs([[1, 2, 512]], [1])
    with pytest.raises(ValueError, match="prompt_len 0"):
        model.sequence_logprobs([[1, 2]], [0])
    with pytest.raises(KeyError, match="unknown Qwen3 weight names"):
        model.load_hf_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(256, 128)})
