"""Hugging Face Qwen3 <-> Megatron-core GPTModel: config and weights (TP-sharded), exact both ways.

Megatron layouts (per TP rank r of tp):
- linear_qkv: query groups g = r*G/tp .. (r+1)*G/tp - 1, each as [q heads of g; k_g; v_g] (rows).
- linear_fc1: [gate rows of r; up rows of r] (SwiGLU, `gated_linear_unit`).
- linear_proj, linear_fc2: row-parallel, columns (the K axis) split contiguously.
- word embeddings and output layer: vocab rows split contiguously; the vocab is padded to a
  multiple of 128 * tp (Megatron's rule) with zero rows that are cut again on export.
Conversions only move and concatenate tensors, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rl_kernel.models.qwen3 import Qwen3Config

VOCAB_DIVISOR = 128


def padded_vocab(config: Qwen3Config, tp: int) -> int:
    """Megatron's padded vocab: a multiple of VOCAB_DIVISOR * tp (the padding rows score -inf)."""
    multiple = VOCAB_DIVISOR * tp
    return -(-config.vocab_size // multiple) * multiple


def check_tp(config: Qwen3Config, tp: int) -> None:
    if config.num_kv_heads % tp or config.num_heads % tp or config.intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide num_kv_heads={config.num_kv_heads}, num_heads={config.num_heads} "
                         f"and intermediate_size={config.intermediate_size}")


def read_config(path: str | Path) -> Qwen3Config:
    """Shape of the HF Qwen3 checkpoint in directory `path` (config.json); clear errors otherwise."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no HF checkpoint at {path}: {cfg_file} is missing "
                                "(expected a Qwen3 directory with config.json and model.safetensors)")
    return Qwen3Config.from_hf(json.loads(cfg_file.read_text()), str(cfg_file))


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors file(s) in `path`, by HF name (lm_head added when tied)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def check_tokenizer(path: str | Path, shape: Qwen3Config) -> None:
    """Raise when the tokenizer saved with the checkpoint has ids the model's vocab cannot score."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(str(path)))
    if n > shape.vocab_size:
        raise ValueError(f"tokenizer in {path} has {n} tokens but the model vocab_size is {shape.vocab_size}: "
                         "token ids >= vocab_size cannot be scored; use the tokenizer the checkpoint was made with")


def _rows(t: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    return t.chunk(parts, dim=0)[rank]


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: Qwen3Config, tp_rank: int = 0, tp: int = 1
                   ) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state dict of TP rank `tp_rank` (local-spec names) from HF Qwen3 tensors."""
    check_tp(shape, tp)
    hd, heads, groups = shape.head_dim, shape.num_heads, shape.num_kv_heads
    per_group = heads // groups
    padded = padded_vocab(shape, tp)
    out = {
        "embedding.word_embeddings.weight": _rows(_pad_vocab(hf["model.embed_tokens.weight"], padded), tp_rank, tp),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], padded), tp_rank, tp)
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[h + "self_attn.q_proj.weight"].reshape(groups, per_group * hd, -1)
        k = hf[h + "self_attn.k_proj.weight"].reshape(groups, hd, -1)
        v = hf[h + "self_attn.v_proj.weight"].reshape(groups, hd, -1)
        qkv = torch.cat([q, k, v], dim=1)  # [G, (per_group + 2) * hd, D]
        out[m + "self_attention.linear_qkv.weight"] = _rows(qkv, tp_rank, tp).reshape(-1, qkv.shape[-1])
        out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank]
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        gate = _rows(hf[h + "mlp.gate_proj.weight"], tp_rank, tp)
        up = _rows(hf[h + "mlp.up_proj.weight"], tp_rank, tp)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank]
    return {name: t.contiguous() for name, t in out.items()}


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], shape: Qwen3Config) -> dict[str, torch.Tensor]:
    """HF Qwen3 tensors from the Megatron state dicts of all TP ranks (rank order)."""
    hd, heads, groups = shape.head_dim, shape.num_heads, shape.num_kv_heads
    per_group = heads // groups

    def rows(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards])

    def cols(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    first = shards[0]
    hf = {
        "model.embed_tokens.weight": rows("embedding.word_embeddings.weight")[: shape.vocab_size],
        "model.norm.weight": first["decoder.final_layernorm.weight"],
    }
    if not shape.tie_word_embeddings:
        hf["lm_head.weight"] = rows("output_layer.weight")[: shape.vocab_size]
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = rows(m + "self_attention.linear_qkv.weight").reshape(groups, (per_group + 2) * hd, -1)
        q, k, v = qkv.split([per_group * hd, hd, hd], dim=1)
        hf[h + "self_attn.q_proj.weight"] = q.reshape(heads * hd, -1)
        hf[h + "self_attn.k_proj.weight"] = k.reshape(groups * hd, -1)
        hf[h + "self_attn.v_proj.weight"] = v.reshape(groups * hd, -1)
        hf[h + "self_attn.q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
        hf[h + "self_attn.k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        hf[h + "self_attn.o_proj.weight"] = cols(m + "self_attention.linear_proj.weight")
        hf[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        hf[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        hf[h + "mlp.down_proj.weight"] = cols(m + "mlp.linear_fc2.weight")
    return {name: t.contiguous() for name, t in hf.items()}
