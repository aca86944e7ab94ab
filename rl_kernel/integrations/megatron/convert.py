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
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_DIVISOR = 128


@dataclass(frozen=True)
class Qwen3Shape:
    """The parts of an HF Qwen3 config that fix the model's shapes and numerics."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    def padded_vocab(self, tp: int) -> int:
        multiple = VOCAB_DIVISOR * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        if self.num_kv_heads % tp or self.num_heads % tp or self.intermediate_size % tp:
            raise ValueError(f"tp={tp} must divide num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads} "
                             f"and intermediate_size={self.intermediate_size}")


def read_config(path: str | Path) -> Qwen3Shape:
    """Shape of the HF Qwen3 checkpoint in directory `path` (config.json); clear errors otherwise."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no HF checkpoint at {path}: {cfg_file} is missing "
                                "(expected a Qwen3 directory with config.json and model.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") != "qwen3":
        raise ValueError(f"{cfg_file}: model_type={cfg.get('model_type')!r}; only dense 'qwen3' is supported")
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ValueError(f"{cfg_file}: rope scaling is not supported (rope_parameters={rope})")
    heads = cfg["num_attention_heads"]
    return Qwen3Shape(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(theta), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


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


def check_tokenizer(path: str | Path, shape: Qwen3Shape) -> None:
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


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: Qwen3Shape, tp_rank: int = 0, tp: int = 1
                   ) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state dict of TP rank `tp_rank` (local-spec names) from HF Qwen3 tensors."""
    shape.check_tp(tp)
    hd, heads, groups = shape.head_dim, shape.num_heads, shape.num_kv_heads
    per_group = heads // groups
    padded = shape.padded_vocab(tp)
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


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
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
