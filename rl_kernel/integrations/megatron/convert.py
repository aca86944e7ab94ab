"""Hugging Face Qwen3 <-> Megatron-core GPTModel: config and weights (TP-sharded), exact both ways.

Megatron layouts (per TP rank r of tp):
- linear_qkv: query groups g = r*G/tp .. (r+1)*G/tp - 1, each as [q heads of g; k_g; v_g] (rows).
- linear_fc1: [gate rows of r; up rows of r] (SwiGLU, `gated_linear_unit`).
- linear_proj, linear_fc2: row-parallel, columns (the K axis) split contiguously.
- word embeddings and output layer: vocab rows split contiguously; the vocab is padded to a
  multiple of 128 * tp (Megatron's rule) with zero rows that are cut again on export.
- MoE layers (Qwen3-MoE, tp 1): `mlp.gate.weight` is HF's router; `mlp.experts.gate_up_proj` [E, 2I, D] stacks
  every expert's [gate; up] rows, `mlp.experts.down_proj` [E, D, I] every expert's down projection.
Conversions only move and concatenate tensors, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_kernel.models import qwen3_layout
from rl_kernel.models.qwen3 import Qwen3Config


def padded_vocab(config: Qwen3Config, tp: int) -> int:
    """Megatron's padded vocab: a multiple of VOCAB_DIVISOR * tp (the padding rows score -inf)."""
    return qwen3_layout.padded_vocab(config.vocab_size, tp)


def check_tp(config: Qwen3Config, tp: int) -> None:
    """Megatron-core splits whole query groups over TP ranks: no kv-head replication; MoE models at tp 1."""
    if getattr(config, "num_experts", 0) and tp > 1:
        raise ValueError(f"a Qwen3-MoE trainer runs at tp=1 (expert parallelism 1); got tp={tp}")
    qwen3_layout.check_tp(config, tp, kv_replication=False)


def check_tokenizer(path: str | Path, shape: Qwen3Config) -> None:
    """Raise when the tokenizer saved with the checkpoint has ids the model's vocab cannot score."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(str(path)))
    if n > shape.vocab_size:
        raise ValueError(
            f"tokenizer in {path} has {n} tokens but the model vocab_size is {shape.vocab_size}: "
            "token ids >= vocab_size cannot be scored; use the tokenizer the checkpoint was made with"
        )


def hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: Qwen3Config, tp_rank: int = 0, tp: int = 1
) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state dict of TP rank `tp_rank` (local-spec names) from HF Qwen3 tensors."""
    check_tp(shape, tp)
    layout = qwen3_layout.weight_layout(shape)

    def local(name: str) -> torch.Tensor:
        return layout[name].shard(hf[name], tp_rank, tp)

    hd, per_group = shape.head_dim, shape.num_heads // shape.num_kv_heads
    out = {
        "embedding.word_embeddings.weight": local("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": local("model.norm.weight"),
    }
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = local("lm_head.weight")
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = local(h + "self_attn.q_proj.weight").reshape(-1, per_group * hd, shape.hidden_size)
        k = local(h + "self_attn.k_proj.weight").reshape(-1, hd, shape.hidden_size)
        v = local(h + "self_attn.v_proj.weight").reshape(-1, hd, shape.hidden_size)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, shape.hidden_size)
        for hf_name, mg_name in _RENAMED:
            if qwen3_layout.is_moe_layer(shape, i) and hf_name.startswith("mlp."):
                continue
            out[m + mg_name] = local(h + hf_name)
        if qwen3_layout.is_moe_layer(shape, i):
            out |= _moe_to_megatron(hf, shape, h, m)
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [local(h + "mlp.gate_proj.weight"), local(h + "mlp.up_proj.weight")]
        )
    return {name: t.contiguous() for name, t in out.items()}


# HF name -> Megatron name of the per-layer tensors that only change name (q/k/v and gate/up are fused).
_RENAMED = (
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
)


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], shape: Qwen3Config) -> dict[str, torch.Tensor]:
    """HF Qwen3 tensors from the Megatron state dicts of all TP ranks (rank order)."""
    layout = qwen3_layout.weight_layout(shape)
    hd, per_group = shape.head_dim, shape.num_heads // shape.num_kv_heads

    def full(hf_name: str, parts: list[torch.Tensor] | str) -> torch.Tensor:
        return layout[hf_name].unshard([s[parts] for s in shards] if isinstance(parts, str) else parts)

    hf = {
        "model.embed_tokens.weight": full("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        "model.norm.weight": full("model.norm.weight", "decoder.final_layernorm.weight"),
    }
    if not shape.tie_word_embeddings:
        hf["lm_head.weight"] = full("lm_head.weight", "output_layer.weight")
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = [
            s[m + "self_attention.linear_qkv.weight"]
            .reshape(-1, (per_group + 2) * hd, shape.hidden_size)
            .split([per_group * hd, hd, hd], dim=1)
            for s in shards
        ]
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            name = h + f"self_attn.{proj}.weight"
            hf[name] = full(name, [t[j].reshape(-1, shape.hidden_size) for t in qkv])
        for hf_name, mg_name in _RENAMED:
            if qwen3_layout.is_moe_layer(shape, i) and hf_name.startswith("mlp."):
                continue
            hf[h + hf_name] = full(h + hf_name, m + mg_name)
        if qwen3_layout.is_moe_layer(shape, i):
            hf |= _moe_to_hf(shards[0], shape, h, m)
            continue
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        hf[h + "mlp.gate_proj.weight"] = full(h + "mlp.gate_proj.weight", [g for g, _ in fc1])
        hf[h + "mlp.up_proj.weight"] = full(h + "mlp.up_proj.weight", [u for _, u in fc1])
    return {name: t.contiguous() for name, t in hf.items()}


def _moe_to_megatron(hf: dict[str, torch.Tensor], shape, h: str, m: str) -> dict[str, torch.Tensor]:
    """One MoE layer's Megatron tensors (HF prefix `h`, Megatron prefix `m`): the router and the stacked experts."""
    e = [f"{h}mlp.experts.{j}." for j in range(shape.num_experts)]
    return {
        m + "mlp.gate.weight": hf[h + "mlp.gate.weight"],
        m + "mlp.experts.gate_up_proj": torch.stack(
            [torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]]) for x in e]
        ),
        m + "mlp.experts.down_proj": torch.stack([hf[x + "down_proj.weight"] for x in e]),
    }


def _moe_to_hf(shard: dict[str, torch.Tensor], shape, h: str, m: str) -> dict[str, torch.Tensor]:
    """One MoE layer's HF tensors from its Megatron tensors (tp 1)."""
    out = {h + "mlp.gate.weight": shard[m + "mlp.gate.weight"]}
    gate_up, down = shard[m + "mlp.experts.gate_up_proj"], shard[m + "mlp.experts.down_proj"]
    for j in range(shape.num_experts):
        x = f"{h}mlp.experts.{j}."
        out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate_up[j].chunk(2)
        out[x + "down_proj.weight"] = down[j]
    return out
