"""Build a Megatron-core GPTModel for an HF Qwen3 checkpoint, run it on packed sequences, and take
per-token logprobs from the vocab-parallel LM head without gathering logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rl_kernel as rk
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from rl_kernel.integrations.megatron.convert import padded_vocab
from rl_kernel.integrations.megatron.cp import TokenLayout
from rl_kernel.integrations.megatron.spec import (
    RKRMSNorm,
    get_rl_kernel_layer_spec,
    get_rl_kernel_moe_layer_spec,
    packed_params,
)
from rl_kernel.models.qwen3 import Qwen3Config
from rl_kernel.models.qwen3_layout import is_moe_layer

# Attribute set on the parameters that every TP rank holds whole but whose gradient each rank computes
# only from its own attention heads (the qk-norms): their gradients are summed over the TP group. The
# TP-sharded parameters carry Megatron's own `tensor_model_parallel` / `partition_dim` attributes.
TP_PARTIAL_GRAD = "rl_kernel_tp_partial_grad"


@dataclass
class Qwen3TransformerConfig(TransformerConfig):
    """TransformerConfig plus the RoPE base, which RKCoreAttention applies (Megatron's rope is off)."""

    rope_theta: float = 10000.0


def transformer_config(
    shape: Qwen3Config, tp: int, cp: int, dtype: torch.dtype, device: torch.device
) -> TransformerConfig:
    """Megatron TransformerConfig of a dense Qwen3: qk-norm, RMSNorm, SwiGLU, no biases, no dropout."""
    return Qwen3TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        qk_layernorm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rope_theta=shape.rope_theta,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=True,  # also sets TP attributes
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt_model(
    shape: Qwen3Config, mode: str, tp: int, cp: int, dtype: torch.dtype, device: torch.device
) -> GPTModel:
    """GPTModel with rl_kernel's (strict) or Megatron's (native) layer spec; weights uninitialised."""
    config = transformer_config(shape, tp, cp, dtype, device)
    if device.type == "cuda":  # Megatron's GPU weight init draws from its model-parallel CUDA RNG
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    block = TransformerBlockSubmodules(
        layer_specs=[
            get_rl_kernel_moe_layer_spec(mode, shape) if is_moe_layer(shape, i) else get_rl_kernel_layer_spec(mode)
            for i in range(shape.num_layers)
        ],
        layer_norm=RKRMSNorm if mode == "strict" else WrappedTorchNorm,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=padded_vocab(shape, tp),
        max_sequence_length=1 << 20,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="none",
    )
    model = model.to(device=device, dtype=dtype)  # as Megatron's Float16Module: every param in the model dtype
    for layer in model.decoder.layers:  # qk-norm: whole on every TP rank, each rank's grad covers its heads only
        for norm in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
            for p in norm.parameters():
                setattr(p, TP_PARTIAL_GRAD, True)
    return model


def lm_head_weight(model: GPTModel) -> torch.Tensor:
    return (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )


def forward_hidden(model: GPTModel, layout: TokenLayout, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [n, D] of this CP rank's tokens; input_ids [T] is the global packed
    batch (the same on every rank)."""
    cp_rank = parallel_state.get_context_parallel_rank() if layout.cp > 1 else 0
    device = lm_head_weight(model).device
    local = layout.local_index(cp_rank).to(device)
    ids = input_ids.to(device)[local].unsqueeze(0)
    params = packed_params(layout, cp_rank, device)
    emb = model.embedding(input_ids=ids, position_ids=None)  # [n, 1, D]
    hidden = model.decoder(hidden_states=emb, attention_mask=None, packed_seq_params=params)
    return hidden[:, 0]


def token_logprobs(
    model: GPTModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_size: int,
    strict: bool,
    truncation=None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 log p(targets | hidden) [n] over the real vocab, vocab-parallel over the TP group; with
    `with_entropy` (logprobs, full-vocab entropy) from the same pass.

    Strict: `rk.logprobs` (exact order-free LSE; logits never gathered nor held for all rows), under
    `truncation` (exact top-k / top-p / min-p, `rl_kernel.ops.truncation`) when given.
    Native: Megatron's output_layer (bf16 GEMM) and `vocab_parallel_cross_entropy` in fp32 (the entropy from the
    same logits, fp32, summed over the TP group); with a truncation, rl_kernel's framework-style native form
    (`rk.logprobs` under native modes)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    weight = lm_head_weight(model)
    if strict or (truncation is not None and truncation.active):
        group = tp_group if dist.get_world_size(tp_group) > 1 else None
        options = {"truncation": truncation, "with_entropy": with_entropy}
        return rk.logprobs(hidden, weight, targets, temperature, vocab_size=vocab_size, group=group, **options)
    rk.evidence.record(rk.contracts.native("logprobs", "megatron"), "native", hidden.device.type)
    logits, _ = model.output_layer(hidden.unsqueeze(1), weight=weight)  # [n, 1, V/tp], model dtype
    logits = logits.float() / temperature.to(torch.float32).view(-1, 1, 1)
    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    padded = start + torch.arange(logits.shape[-1], device=logits.device) >= vocab_size
    logits = logits.masked_fill(padded, float("-inf"))
    entropy = _native_entropy(logits[:, 0], tp_group) if with_entropy else None
    lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), targets.unsqueeze(1))[:, 0]
    return (lp, entropy) if with_entropy else lp


def _native_entropy(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Framework-style fp32 entropy [n] of the softmax of vocab-parallel logits [n, V/tp] (-inf on padding):
    log S - sum e (z - M) / S with e = exp(z - M), the sums all-reduced over the TP group (differentiable)."""
    from torch.distributed.nn.functional import all_reduce

    m = logits.detach().amax(-1, keepdim=True)
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - m
    e = torch.exp(shifted)
    total, spread = e.sum(-1), (e * torch.where(torch.isfinite(shifted), shifted, 0.0)).sum(-1)
    if dist.get_world_size(tp_group) > 1:
        total, spread = all_reduce(total, group=tp_group), all_reduce(spread, group=tp_group)
    return torch.log(total) - spread / total
