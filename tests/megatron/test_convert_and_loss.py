"""Single-process tests: HF <-> Megatron weight layout (exact) and input errors (the policy loss is vime's:
tests/vime/test_logic.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rl_kernel.bits import same_bits
from rl_kernel.integrations.megatron.convert import (
    check_tokenizer,
    hf_to_megatron,
    megatron_to_hf,
)
from rl_kernel.models.qwen3 import load_hf_state_dict, read_config

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_round_trip_is_exact(tiny_qwen3_path, tp):
    shape = read_config(tiny_qwen3_path)
    hf = load_hf_state_dict(tiny_qwen3_path)
    shards = [hf_to_megatron(hf, shape, r, tp) for r in range(tp)]
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert same_bits(back[name], t), name


def test_megatron_qkv_layout_is_interleaved_per_query_group(tiny_qwen3_path):
    """Rank 1 of TP2 holds kv group 1 as [q heads 2, 3; k head 1; v head 1] (Megatron's layout)."""
    shape = read_config(tiny_qwen3_path)
    hf = load_hf_state_dict(tiny_qwen3_path)
    qkv = hf_to_megatron(hf, shape, 1, 2)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = shape.head_dim
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(qkv, torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    fc1 = hf_to_megatron(hf, shape, 1, 2)["decoder.layers.0.mlp.linear_fc1.weight"]
    inter = shape.intermediate_size
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[inter // 2 :], up[inter // 2 :]]))


def test_vocab_padding_is_cut_on_export(tiny_qwen3_path):
    shape = read_config(tiny_qwen3_path)
    hf = load_hf_state_dict(tiny_qwen3_path)
    hf = {k: (v[:500] if k in ("model.embed_tokens.weight", "lm_head.weight") else v) for k, v in hf.items()}
    shape = type(shape)(**{**shape.__dict__, "vocab_size": 500})
    shards = [hf_to_megatron(hf, shape, r, 2) for r in range(2)]
    assert shards[0]["output_layer.weight"].shape[0] == 256  # 500 padded to 512 = 2 * 256
    assert not shards[1]["output_layer.weight"][-12:].any()
    back = megatron_to_hf(shards, shape)
    assert torch.equal(back["lm_head.weight"], hf["lm_head.weight"])


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        read_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_state_dict(tmp_path)


def test_tokenizer_vocab_mismatch_is_a_clear_error(tiny_qwen3_path, tmp_path):
    shutil.copytree(tiny_qwen3_path, tmp_path / "ckpt")
    cfg_file = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["vocab_size"] = 256  # the tokenizer has 512 tokens
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tokenizer .* has 512 tokens but the model vocab_size is 256"):
        check_tokenizer(tmp_path / "ckpt", read_config(tmp_path / "ckpt"))
    check_tokenizer(tiny_qwen3_path, read_config(tiny_qwen3_path))  # the matching pair passes


def test_tp_must_divide_heads(tiny_qwen3_path):
    shape = read_config(tiny_qwen3_path)
    with pytest.raises(ValueError, match="tp=4 must divide num_kv_heads=2"):
        hf_to_megatron(load_hf_state_dict(tiny_qwen3_path), shape, 0, 4)
