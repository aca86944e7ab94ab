"""Megatron-core layer specs whose modules call rl_kernel (strict), and the native (Megatron) spec.

Strict spec (`get_rl_kernel_layer_spec("strict")`): Megatron's own layers host rl_kernel's modules
(its parallel linears keep their parameters, TP attributes and gradient reductions; the norms and
RoPE are the shared blocks of `rl_kernel.models.layers`, the ones the reference and the vLLM model
run): RMSNorm -> `rk.rms_norm`; column-parallel
linear -> `rk.linear` on the local shard; row-parallel linear -> `rk.row_parallel_linear` over the
TP group (fp32 partials, tree-reduced in rank order, rounded once: TP-invariant when tp divides 8);
SwiGLU -> `rk.silu_and_mul`; core attention -> `rk.rope` at each token's packed position, then
`rk.attention_varlen` (CP1) or the chunk-partial CP attention of `cp.py` (CP > 1).
Native spec (`get_rl_kernel_layer_spec("native")`): Megatron's local spec (torch RMSNorm,
ColumnParallelLinear / RowParallelLinear with Megatron's all-reduce in the model dtype, Megatron's
MLP and SwiGLU); RoPE and core attention run rl_kernel's native ops (torch RoPE, SDPA) because
Megatron's local DotProductAttention does not take packed (THD) sequences and TE is not installed
here. Both specs use the same parameter names, so one converter serves both.
MoE layers (Qwen3-MoE, tp 1, `get_rl_kernel_moe_layer_spec`): the layer's MLP is
`RKMoELayer`, the shared `SparseMoeBlock` (router, grouped experts and combine by `rk.moe`; strict or native by
the moe boundary's mode) with trained parameters `mlp.gate.weight` [E, D], `mlp.experts.gate_up_proj`
[E, 2I, D] and `mlp.experts.down_proj` [E, D, I], in both specs. Under Megatron's expert parallelism
(expert_model_parallel_size > 1) the layer holds its rank's E / EP experts and runs `moe_expert_parallel`;
`MegatronPolicy` still refuses EP > 1 (its conversion, weight push and gradient reduction are EP = 1).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

import rl_kernel as rk
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from rl_kernel.integrations.megatron.cp import TokenLayout, cp_attention
from rl_kernel.models.layers import Experts, RMSNorm, Rotary, SparseMoeBlock
from rl_kernel.ops.attention import ATTENTION
from rl_kernel.ops.moe_parallel import check_expert_slices, moe_expert_parallel


@dataclass
class RLPackedSeqParams(PackedSeqParams):
    """Megatron's THD packed-sequence params plus where this rank's tokens sit (`layout`, `cp_rank`)."""

    layout: TokenLayout | None = None
    cp_rank: int = 0

    def local_positions(self, device: torch.device) -> torch.Tensor:
        return self.layout.positions[self.layout.local_index(self.cp_rank)].to(device)


def packed_params(layout: TokenLayout, cp_rank: int, device: torch.device) -> RLPackedSeqParams:
    cu = layout.cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int(layout.cu_seqlens.diff().max()) if layout.cu_seqlens.numel() > 1 else 0
    return RLPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        layout=layout,
        cp_rank=cp_rank,
    )


class RKRMSNorm(RMSNorm):
    """The shared RMSNorm block (`rk.rms_norm`) as Megatron builds a norm: (config, hidden_size, eps),
    weight initialised to ones and trained."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: object):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps, config.params_dtype, device)
        with torch.no_grad():
            self.weight.fill_(1.0)
        self.weight.requires_grad_(True)
        self.weight.sequence_parallel = config.sequence_parallel


class RKColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose local GEMM is `rk.linear` (no gather, no bias, no sequence parallel)."""

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if self.gather_output or self.bias is not None or self.sequence_parallel:
            raise NotImplementedError("rl_kernel column-parallel linear: no gather_output, bias or sequence_parallel")
        x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)  # all-reduce of dgrad only
        return rk.linear(x, self.weight if weight is None else weight), None


class RKRowParallelLinear(RowParallelLinear):
    """RowParallelLinear through `rk.row_parallel_linear`: deterministic, TP-invariant for tp dividing the
    contract's group count (8 on the torch backend, the canonical TP on triton)."""

    def forward(self, input_: torch.Tensor):
        if not self.input_is_parallel or self.bias is not None or self.sequence_parallel:
            raise NotImplementedError("rl_kernel row-parallel linear: input_is_parallel, no bias, no sequence_parallel")
        group = self.tp_group if self.tp_group.size() > 1 else None
        return rk.row_parallel_linear(input_, self.weight, group), None


class RKMLP(MLP):
    """Megatron's MLP with SwiGLU as one `rk.silu_and_mul` (fc1 holds [gate; up] per TP rank)."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise NotImplementedError("RKMLP: per_token_scale (MoE) is not supported")
        intermediate, _ = self.linear_fc1(hidden_states)
        return self.linear_fc2(rk.silu_and_mul(intermediate))


class RKCoreAttention(MegatronModule):
    """Core attention for THD packed sequences: RoPE at each token's position, then causal GQA
    attention (`rk.attention_varlen`, or the CP chunk-partial attention when cp > 1).
    Query [t, np, hn], key/value [t, ng, hn] -> [t, np * hn]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type=None,
        attention_type=None,
        softmax_scale: float | None = None,
        **_: object,
    ):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.rotary = Rotary(config.rope_theta)  # Qwen3TransformerConfig

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: RLPackedSeqParams | None = None,
        **_: object,
    ) -> torch.Tensor:
        if not isinstance(packed_seq_params, RLPackedSeqParams):
            raise ValueError(
                "RKCoreAttention needs RLPackedSeqParams (packed THD sequences with their layout); "
                "build them with rl_kernel.integrations.megatron.spec.packed_params"
            )
        params = packed_seq_params
        positions = params.local_positions(query.device)
        q, k = self.rotary(query, positions), self.rotary(key, positions)
        layout = params.layout
        if layout.cp == 1:
            out = rk.attention_varlen(q, k, value, layout.cu_seqlens.to(query.device), self.scale)
        else:
            strict, backend = ATTENTION.is_strict(), "torch"
            if strict:  # CP runs the contract CP1 would run here (torch chunk partials or Triton split partials)
                backend = ATTENTION.strict(query.device)[0].backend
            else:
                ATTENTION.record_native(query.device)
            group = parallel_state.get_context_parallel_group()
            out = cp_attention(q, k, value, layout, self.scale, group, strict, backend)
        return out.reshape(out.shape[0], -1)


def get_rl_kernel_layer_spec(mode: str = "strict") -> ModuleSpec:
    """TransformerLayer spec for Qwen3 (qk-norm, RMSNorm, SwiGLU, no biases): rl_kernel modules in
    "strict" mode, Megatron's local modules (rl_kernel native RoPE / attention) in "native" mode."""
    if mode not in ("strict", "native"):
        raise ValueError(f"mode must be 'strict' or 'native', got {mode!r}")
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = RKCoreAttention
    if mode == "native":
        return spec
    spec.submodules.input_layernorm = RKRMSNorm
    spec.submodules.pre_mlp_layernorm = RKRMSNorm
    attn.q_layernorm = RKRMSNorm
    attn.k_layernorm = RKRMSNorm
    attn.linear_qkv = RKColumnParallelLinear
    attn.linear_proj = RKRowParallelLinear
    mlp = spec.submodules.mlp
    if isinstance(mlp, ModuleSpec):  # megatron-core 0.16
        mlp.module = RKMLP
        mlp.submodules.linear_fc1 = RKColumnParallelLinear
        mlp.submodules.linear_fc2 = RKRowParallelLinear
    else:  # megatron-core 0.19: functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))
        subs = dataclasses.replace(
            mlp.keywords["submodules"], linear_fc1=RKColumnParallelLinear, linear_fc2=RKRowParallelLinear
        )
        spec.submodules.mlp = functools.partial(RKMLP.as_mlp_submodule, submodules=subs)
    return spec


class RKMoELayer(SparseMoeBlock):
    """A Qwen3-MoE sparse block as Megatron builds and calls an MLP: (config, shape) in, hidden states [s, b, h]
    -> (output, None). Parameters in the model dtype, trained.

    Expert parallelism (Megatron's `expert_model_parallel_size` > 1 in its parallel state): this rank holds the
    contiguous expert slice [r * E / EP, (r + 1) * E / EP) of its expert-parallel rank r (`mlp.experts.*`
    [E / EP, ...], marked `allreduce = False` as Megatron marks expert parameters) and the whole router; the
    forward is `rk.moe_expert_parallel` over Megatron's expert-parallel group: every token's output and route
    bits are the EP = 1 block's (see rl_kernel/ops/moe_parallel.py)."""

    def __init__(self, config: TransformerConfig, shape=None, **_: object):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(shape, config.params_dtype, device)
        self.ep, self.ep_group = 1, None
        if parallel_state.model_parallel_is_initialized():
            self.ep = parallel_state.get_expert_model_parallel_world_size()
        if self.ep > 1:
            check_expert_slices(shape.num_experts, shape.num_experts // self.ep, self.ep)
            self.ep_group = parallel_state.get_expert_model_parallel_group()
            local = shape.num_experts // self.ep
            self.experts = Experts(local, shape.hidden_size, shape.moe_intermediate_size, config.params_dtype, device)
            for p in self.experts.parameters():
                p.allreduce = False  # Megatron's mark: reduced over the expert data-parallel group, not dp
        for p in self.parameters():
            p.requires_grad_(True)

    def forward(self, hidden_states: torch.Tensor, padding_mask=None, **_: object):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.ep == 1:
            out = super().forward(x)
        else:
            e = self.experts
            out, ids = moe_expert_parallel(
                x, self.gate.weight, e.gate_up_proj, e.down_proj, self.top_k, self.renormalize, self.ep_group
            )
            if self.routes is not None:
                self.routes.append(ids)
        return out.reshape(hidden_states.shape), None


def get_rl_kernel_moe_layer_spec(mode: str, shape) -> ModuleSpec:
    """The layer spec of a Qwen3-MoE sparse layer of `shape` (a `Qwen3MoeConfig`): `get_rl_kernel_layer_spec`
    with `RKMoELayer` as its MLP."""
    spec = get_rl_kernel_layer_spec(mode)
    spec.submodules.mlp = ModuleSpec(module=RKMoELayer, params={"shape": shape})
    return spec
