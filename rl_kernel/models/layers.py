"""Qwen3 (dense) as plain `nn.Module`s over rl_kernel ops: the one copy of the model's math.

The reference (`rl_kernel.models.qwen3`), the vLLM model (`rl_kernel.integrations.vllm.model`) and
the Megatron layer spec (`rl_kernel.integrations.megatron.spec`) all run these blocks; only the
attention function (packed varlen, a paged KV cache, vLLM's cache, context parallel) and the way
weights arrive differ. Tensor parallelism follows `rl_kernel.models.qwen3_layout`: each module holds
this rank's shard (local sizes), column-parallel linears need no communication, row-parallel ones
reduce over `group` in rank order (`rk.row_parallel_linear`), embedding and LM head are
vocab-parallel and gathered as bit copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import rl_kernel as rk
from rl_kernel.models.qwen3_layout import VOCAB_DIVISOR, TPShape, is_moe_layer, local_views, weight_layout
from rl_kernel.ops.collective import gather_ranks

# attn_fn(layer, q [T, H, d], k [T, Hkv, d], v [T, Hkv, d]) -> [T, H, d], after QK-norm and RoPE.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    """A zero-initialised weight (zeros also fill the vocab padding rows); loaded, not trained, by default."""
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's x, in rank order (a bit copy; over the group's device gather where one is registered:
    rl_kernel.ops.collective.use_gather)."""
    return list(gather_ranks(x, group).unbind(0))


class StrictLinear(nn.Module):
    """`x @ W.T` under the GEMM contract on this rank's shard W [out_features, in_features] (local sizes).
    "column": `rk.linear` (output rows sharded, no communication); "row": `rk.row_parallel_linear`
    (K sharded; fp32 partials reduced over `group` in rank order; None: tp 1)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: str = "column",
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.parallel, self.group = parallel, group
        self.weight = _weight(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "column":
            return rk.linear(x, self.weight)
        return rk.row_parallel_linear(x, self.weight, self.group)


class RMSNorm(nn.Module):
    """`rk.rms_norm` over the last dim; with `residual`, the fused add: returns (normed, x + residual)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _weight(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rk.rms_norm(x, self.weight, self.eps)
        return rk.rms_norm(x, self.weight, self.eps, residual=residual)


class Rotary(nn.Module):
    """RoPE (`rk.rope`) of x [T, heads, d] at each token's position."""

    def __init__(self, theta: float):
        super().__init__()
        self.theta = theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rk.rope(x, positions, self.theta)


class Attention(nn.Module):
    """Qwen3 self-attention: fused column-parallel QKV, per-head QK-norm, RoPE, `attn_fn`, row-parallel O."""

    def __init__(
        self,
        config,
        shape: TPShape,
        layer: int,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        d, D = config.head_dim, config.hidden_size
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, shape.heads, shape.kv_heads, d
        self.qkv_proj = StrictLinear(D, (self.heads + 2 * self.kv_heads) * d, "column", dtype=dtype, device=device)
        self.o_proj = StrictLinear(self.heads * d, D, "row", group, dtype=dtype, device=device)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        self.rotary = Rotary(config.rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn_fn: AttentionFn) -> torch.Tensor:
        d, heads, kv_heads = self.head_dim, self.heads, self.kv_heads
        qk, v = self.qkv_proj(x).split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        # q and k heads normed (each by its own weight) and rotated together: per head the same operations as
        # one q_norm, k_norm and rope each, in one launch on Triton instead of four
        qk = qk.reshape(-1, heads + kv_heads, d)
        qk = rk.qk_norm_rope(
            qk, self.q_norm.weight, self.k_norm.weight, heads, self.q_norm.eps, positions, self.rotary.theta
        )
        out = attn_fn(self.layer, qk[:, :heads], qk[:, heads:], v.reshape(-1, kv_heads, d))
        return self.o_proj(out.reshape(-1, heads * d))


class MLP(nn.Module):
    """SwiGLU: column-parallel [gate; up] (this rank's columns), `rk.silu_and_mul`, row-parallel down."""

    def __init__(
        self, config, shape: TPShape, group: dist.ProcessGroup | None, dtype: torch.dtype = torch.bfloat16, device=None
    ):
        super().__init__()
        D = config.hidden_size
        self.gate_up_proj = StrictLinear(D, 2 * shape.inter, "column", dtype=dtype, device=device)
        self.down_proj = StrictLinear(shape.inter, D, "row", group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(rk.silu_and_mul(self.gate_up_proj(x)))


class Router(nn.Module):
    """The MoE router's weight [E, D] (HF `mlp.gate.weight`); `rk.moe_route` runs it."""

    def __init__(self, experts: int, dim: int, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.weight = _weight(experts, dim, dtype=dtype, device=device)


class Experts(nn.Module):
    """Every expert's SwiGLU weights, fused as transformers holds them: gate_up_proj [E, 2I, D] (gate rows
    then up rows), down_proj [E, D, I]."""

    def __init__(self, experts: int, dim: int, inter: int, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.gate_up_proj = _weight(experts, 2 * inter, dim, dtype=dtype, device=device)
        self.down_proj = _weight(experts, dim, inter, dtype=dtype, device=device)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse block from the strict MoE ops (`rk.moe`): route, grouped experts, combine. When
    `routes` is a list, every forward appends its int64 expert ids [T, k] (ascending per token) to it. When
    `route_buffer` is a tensor [rows, k] (a fixed address, allocated before any CUDA-graph capture), every forward
    copies its ids into rows [0, T) on the device (no host sync: captured and replayed with the graph)."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        D, experts = config.hidden_size, config.num_experts
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(experts, D, dtype, device)
        self.experts = Experts(experts, D, config.moe_intermediate_size, dtype, device)
        self.routes: list[torch.Tensor] | None = None
        self.route_buffer: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts
        out, ids = rk.moe(x, self.gate.weight, e.gate_up_proj, e.down_proj, self.top_k, self.renormalize)
        if self.routes is not None:
            self.routes.append(ids)
        if self.route_buffer is not None:
            if ids.shape[0] > self.route_buffer.shape[0]:
                raise ValueError(
                    f"SparseMoeBlock.route_buffer holds {self.route_buffer.shape[0]} rows, the forward has "
                    f"{ids.shape[0]} tokens: allocate it for the engine's largest (padded) batch"
                )
            self.route_buffer[: ids.shape[0]].copy_(ids)
        return out


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer with the residual carried alongside (fused add in the norms)."""

    def __init__(
        self,
        config,
        shape: TPShape,
        layer: int,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype, device)
        self.self_attn = Attention(config, shape, layer, group, dtype, device)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, device)
        if is_moe_layer(config, layer):
            if shape.tp > 1:
                raise ValueError(f"MoE layers run at tp=1 only (expert parallelism 1); got tp={shape.tp}")
            self.mlp = SparseMoeBlock(config, dtype, device)
        else:
            self.mlp = MLP(config, shape, group, dtype, device)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, attn_fn: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, attn_fn), residual)
        return self.mlp(h), residual


class VocabParallelEmbedding(nn.Module):
    """Embedding over this rank's contiguous vocab rows; under TP every rank looks up its rows, the
    ranks' rows are gathered and the owner's row is picked (a bit copy)."""

    def __init__(
        self,
        rows: int,
        dim: int,
        rank: int = 0,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        self.rank, self.group = rank, group
        self.weight = _weight(rows, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.weight[ids]
        n, ids = self.weight.shape[0], ids.to(torch.int64)
        rows = self.weight[(ids - self.rank * n).clamp(0, n - 1)]
        owner = torch.div(ids, n, rounding_mode="floor")
        return torch.stack(_gather(rows, self.group))[owner, torch.arange(rows.shape[0], device=rows.device)]


class LMHead(nn.Module):
    """Vocab-parallel LM head over this rank's (padded) vocab rows of the ranks of `group` (None: tp 1)."""

    def __init__(
        self,
        rows: int,
        dim: int,
        vocab_size: int,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.weight = _weight(rows, dim, dtype=dtype, device=device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, padded vocab] under the GEMM contract, unrounded; the ranks' columns gathered
        (a bit copy), so every rank holds the whole vocab. Columns >= vocab_size are padding."""
        logits = rk.linear_fp32(hidden, self.weight)
        if self.group is None or dist.get_world_size(self.group) == 1:
            return logits
        return torch.cat(_gather(logits, self.group), dim=-1)

    def logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0, **options
    ) -> torch.Tensor:
        """fp32 log p(targets | hidden) at `temperature` over the real vocab (`rk.logprobs`, vocab-parallel;
        `options`: its `truncation` / `with_entropy`)."""
        return rk.logprobs(
            hidden, self.weight, targets, temperature, vocab_size=self.vocab_size, group=self.group, **options
        )


class Qwen3Model(nn.Module):
    """Qwen3ForCausalLM's forward from rl_kernel ops, tensor-parallel over `group` (None: tp 1).
    Parameters are named as in `qwen3_layout.weight_layout`'s `module` column; a tied LM head shares
    the embedding's parameter."""

    def __init__(
        self,
        config,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        vocab_multiple: int = VOCAB_DIVISOR,
    ):
        super().__init__()
        self.config, self.vocab_multiple = config, vocab_multiple
        self.tp = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.group = group
        self.shape = TPShape.of(config, self.tp, vocab_multiple)
        D, tp_group = config.hidden_size, group if self.tp > 1 else None
        self.embed_tokens = VocabParallelEmbedding(self.shape.vocab, D, self.rank, tp_group, dtype, device)
        self.layers = nn.ModuleList(
            DecoderBlock(config, self.shape, i, tp_group, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(D, config.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(self.shape.vocab, D, config.vocab_size, group, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn_fn: AttentionFn,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, D] of tokens `input_ids` [T] (or their `inputs_embeds`) at
        `positions` [T]; `attn_fn` supplies each layer's attention."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, attn_fn)
        h, _ = self.norm(h, residual)
        return h

    def hf_views(self) -> dict[str, torch.Tensor]:
        """This rank's storage of every HF tensor (views into the parameters), by HF name."""
        return local_views(weight_layout(self.config), self.get_parameter, self.tp, self.vocab_multiple)
