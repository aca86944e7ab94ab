"""Logprob boundary: the fp32 log-probability of chosen tokens under softmax(hidden @ W.T / T).

Strict contract (torch backend): logits in fp32 by the GEMM contract (rounded once to bf16 when the
deployment's logit dtype, `rl_kernel.set_logits_dtype`, is bfloat16), never held for all rows at
once (row tiles; columns of this rank only); z = logits / temperature in fp64; padded vocab
columns (index >= vocab_size) excluded; M = max z (exact; across ranks by a max all-reduce, exact
in any order); S = sum of round(exp(z - M) * 2^44) in int64 (exact, so the same for any vocab
tiling and sharding); lse = M + log(S * 2^-44) in fp64 with rl_kernel's exp/log; logprob =
z[target] - lse rounded once to fp32. Vocab-parallel: `weight` is rank r's contiguous
slice [r * V_local, (r + 1) * V_local) and every rank returns the full [T] result, bit-identical to
the unsharded one.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_kernel import evidence
from rl_kernel.backends.torch import logprob as torch_logprob
from rl_kernel.backends.torch import truncation as truncation_kernels
from rl_kernel.backends.torch.numerics import exp64
from rl_kernel.contracts import Contract
from rl_kernel.errors import StrictModeError
from rl_kernel.modes import logits_dtype
from rl_kernel.ops import truncation as truncation_op
from rl_kernel.ops.spec import OpSpec
from rl_kernel.ops.truncation import Truncation

KERNELS = {"torch": "rl_kernel.backends.torch.logprob", "triton": "rl_kernel.backends.triton.logprob"}
# With a gradient to compute, the Triton forward's fp32 logits (T x V/tp x 4 bytes, as native training holds) are
# kept for the backward instead of being recomputed (RL_KERNEL_LOGPROB_KEEP_LOGITS=0: recomputed); scoring
# without gradients keeps nothing.
KEEP_LOGITS = os.environ.get("RL_KERNEL_LOGPROB_KEEP_LOGITS", "1") != "0"


def native_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temps: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Framework-style: F.linear in the model dtype, fp32 log-softmax (vocab-parallel as Megatron)."""
    logits = F.linear(hidden, weight.to(hidden.dtype)).to(torch.float32) / temps.to(torch.float32).unsqueeze(-1)
    column = vocab_start + torch.arange(logits.shape[-1], device=logits.device)
    logits = logits.masked_fill(column >= vocab_size, float("-inf"))
    if group is None or dist.get_world_size(group) == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.to(torch.int64).unsqueeze(-1)).squeeze(-1)
    m = logits.amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - m.unsqueeze(-1)).sum(-1)
    dist.all_reduce(sum_exp, group=group)
    local = targets.to(torch.int64) - vocab_start
    owned = (local >= 0) & (local < logits.shape[-1])
    z_t = torch.where(owned, logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    dist.all_reduce(z_t, group=group)
    return z_t - m - torch.log(sum_exp)


def native_log_softmax(
    logits: torch.Tensor, temps: torch.Tensor, vocab_start: int, vocab_size: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Framework-style fp32 log-softmax of every column (vocab-parallel as Megatron); -inf on padded columns."""
    z = logits.to(torch.float32) / temps.to(torch.float32).unsqueeze(-1)
    column = vocab_start + torch.arange(z.shape[-1], device=z.device)
    z = z.masked_fill(column >= vocab_size, float("-inf"))
    if group is None or dist.get_world_size(group) == 1:
        return torch.log_softmax(z, dim=-1)
    m = z.amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(z - m).sum(-1, keepdim=True)
    dist.all_reduce(sum_exp, group=group)
    return z - m - torch.log(sum_exp)


LOGPROBS = OpSpec("logprobs", "logprob", __name__, KERNELS, native=native_logprobs)
_DEPENDENCY = "out[t] depends on hidden[t], the real vocab rows of weight (all ranks), targets[t], temperature[t]"
_FULL_DEPENDENCY = "out[t, v] depends on logits[t, :] (all ranks' slices), temperature[t]"
_TRITON_MERGE = (
    "order-free: exact max per tile and per row; int64 fixed-point sums inside a tile and across tiles and ranks"
)
# The deployment's logit dtype (rl_kernel.set_logits_dtype): how the GEMM contract's fp32 result enters the softmax.
_LOGITS = {
    "float32": "logits: the GEMM contract's fp32 result, unrounded",
    "bfloat16": "logits: the GEMM contract's fp32 result rounded once to bf16 (to nearest, ties to even), "
    "as a native bf16 F.linear returns them",
}


@functools.cache
def torch_contract(logits: str) -> Contract:
    """The torch backend's logprobs contract for the deployment's logit dtype."""
    return LOGPROBS.contract(
        "torch",
        1,
        keep=False,
        input_dependency=_DEPENDENCY,
        partition="rows in tiles; vocab by rank slices; tiles and slices do not affect any bit",
        merge_order="order-free by construction: exact max; exact int64 fixed-point sum of exp terms",
        precision=f"{_LOGITS[logits]}; fp64 z, exp, lse; 2^-44 fixed-point exp terms",
        rounding="logprob rounded once from fp64 to fp32",
        primitives="rl_kernel exp64/log64; IEEE fp64 div, sub, round; int64 add",
        params=(("fixed_point_bits", torch_logprob.FIXED_POINT_BITS), ("logits_dtype", logits)),
    )


@functools.cache
def triton_contract(logits: str) -> Contract:
    """The Triton backend's logprobs contract for the deployment's logit dtype."""
    return LOGPROBS.contract(
        "triton",
        2,
        keep=False,
        input_dependency=_DEPENDENCY,
        partition="logits: one fp32 chain over D per element (the GEMM contract's one-chain form, served by "
        "cuBLASLt without split-K or by the Triton GEMM); vocab in tiles of 64 columns from column 0 of "
        "the full vocab (rank slices must start on a tile); rows and vocab slices: no effect on any bit",
        merge_order=_TRITON_MERGE,
        precision=f"{_LOGITS[logits]}; z = logits / fp32(T) in fp32; 2^-40 fixed-point exp terms; fp64 tile "
        "rescale and lse",
        rounding="logprob = z[target] - lse rounded once from fp64 to fp32",
        primitives="tensor-core mma with fp32 accumulation (k16 steps, ascending); hardware ex2.approx.f32; IEEE "
        "fp32 div_rn; fp64 mul; rl_kernel log64; int64 add",
        params=(("vocab_tile", 64), ("fixed_point_bits", 40), ("k_step", 16), ("logits_dtype", logits)),
    )


LOGPROBS.contracts["torch"] = lambda: torch_contract(logits_dtype())
LOGPROBS.contracts["triton"] = lambda: triton_contract(logits_dtype())

LOG_SOFTMAX = OpSpec("log_softmax", "logprob", __name__, KERNELS, native=native_log_softmax)


@functools.cache
def torch_log_softmax_contract(logits: str) -> Contract:
    """The torch backend's log_softmax contract for the deployment's logit dtype (its fp32 input is rounded as
    the logprobs contract rounds the logits)."""
    return LOG_SOFTMAX.contract(
        "torch",
        1,
        keep=False,
        input_dependency=_FULL_DEPENDENCY,
        partition="rows in tiles; vocab by rank slices; neither affects any bit",
        merge_order="order-free by construction: exact max; exact int64 fixed-point sum of exp terms",
        precision=f"fp32 logits in; {_LOGITS[logits]}; fp64 z, exp, lse; 2^-44 fixed-point exp terms",
        rounding="each log-probability rounded once from fp64 to fp32 (entry t equals the torch logprobs "
        "contract's value for target t)",
        primitives="rl_kernel exp64/log64; IEEE fp64 div, sub, round; int64 add",
        params=(("fixed_point_bits", torch_logprob.FIXED_POINT_BITS), ("logits_dtype", logits)),
    )


@functools.cache
def triton_log_softmax_contract(logits: str) -> Contract:
    """The Triton backend's log_softmax contract for the deployment's logit dtype: the Triton logprobs contract's
    steps for every column (an engine samples from it; the trainer scores the chosen token with `logprobs`)."""
    return LOG_SOFTMAX.contract(
        "triton",
        1,
        keep=False,
        input_dependency=_FULL_DEPENDENCY,
        partition="vocab in tiles of 64 columns from column 0 of the full vocab (rank slices must start on a tile); "
        "rows and ranks: no effect on any bit",
        merge_order=_TRITON_MERGE,
        precision=f"fp32 logits in; {_LOGITS[logits]}; z = logits / fp32(T) in fp32; 2^-40 fixed-point exp terms; "
        "fp64 tile rescale and lse",
        rounding="each log-probability z - lse rounded once from fp64 to fp32 (entry t equals the Triton logprobs "
        "contract's value for target t)",
        primitives="hardware ex2.approx.f32; IEEE fp32 div; fp64 mul; rl_kernel log64; int64 add",
        params=(("vocab_tile", 64), ("fixed_point_bits", 40), ("logits_dtype", logits)),
    )


LOG_SOFTMAX.contracts["torch"] = lambda: torch_log_softmax_contract(logits_dtype())
LOG_SOFTMAX.contracts["triton"] = lambda: triton_log_softmax_contract(logits_dtype())


def _temperatures(temperature: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """fp64 temperatures [rows] on `device`, checked > 0 where they are given: a number or a host tensor on the
    host (no wait for the device; a pinned one is copied asynchronously), a device tensor on the device."""
    t = torch.as_tensor(temperature, dtype=torch.float64)
    t = t.expand(rows) if t.dim() == 0 else t
    if t.shape != (rows,):
        raise ValueError(f"temperature must be a scalar or have shape [{rows}], got {tuple(t.shape)}")
    if not bool((t > 0).all()):
        raise ValueError("temperature must be > 0 (greedy sampling has no logprob under T=0)")
    return t.to(device, non_blocking=t.is_pinned())


def _vocab_layout(vocab_local: int, vocab_size: int | None, group) -> tuple[int, int, int]:
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    vocab_size = vocab_local * world if vocab_size is None else vocab_size
    if vocab_size > vocab_local * world:
        raise ValueError(f"vocab_size={vocab_size} exceeds the LM head's {vocab_local * world} rows")
    return rank * vocab_local, vocab_local, vocab_size


def _check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(
            f"targets must lie in [0, {vocab_size}) (the real vocab); got "
            f"[{int(targets.min())}, {int(targets.max())}]: tokenizer and model vocab disagree?"
        )


class StrictLogprobs(torch.autograd.Function):
    """One autograd form for every backend: the forward under the contract by the backend's kernel module
    (`kernels.forward` -> fp32 logprobs, fp64 lse; with `with_entropy` also the fp32 full-vocab entropy, a
    second output); the backward (no bit contract) by its `kernels.backward`, given the lse and the logits
    slices the forward kept (`keep`, see KEEP_LOGITS; a backend may keep none), and the entropy's gradient."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, temps, vocab_start, vocab_size, group, kernels, logits, with_entropy=False
    ):
        keep = [] if KEEP_LOGITS and any(ctx.needs_input_grad[:2]) else None
        extra = {}
        if with_entropy:
            extra["entropy"] = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        out, lse = kernels.forward(
            hidden, weight, targets, temps, vocab_start, vocab_size, group, keep=keep, logits_dtype=logits, **extra
        )
        ent = extra.get("entropy")
        ctx.save_for_backward(hidden, weight, targets, temps, lse, ent)
        ctx.kernels, ctx.kept = kernels, keep
        ctx.vocab_start, ctx.vocab_size, ctx.group = vocab_start, vocab_size, group
        return (out, ent) if with_entropy else out

    @staticmethod
    def backward(ctx, grad_out, grad_ent=None):
        hidden, weight, targets, temps, lse, ent = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        extra = {} if grad_ent is None else {"grad_entropy": grad_ent, "entropy": ent}
        if grad_out is None:
            grad_out = torch.zeros_like(lse, dtype=torch.float32)
        grad_h, grad_w = ctx.kernels.backward(
            grad_out,
            hidden,
            weight,
            targets,
            temps,
            lse,
            ctx.vocab_start,
            ctx.vocab_size,
            ctx.group,
            kept=kept,
            **extra,
        )
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    truncation: Truncation | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 log p(targets[t] | hidden[t]) under softmax((hidden @ weight.T) / temperature), over the
    first `vocab_size` vocab entries (padded LM-head rows excluded).

    hidden [T, D]; weight [V_local, D], this rank's contiguous vocab slice when `group` is given
    (rank order); targets [T] int token ids in [0, vocab_size); temperature a float > 0 or a [T]
    tensor. Every rank returns the full [T] result. Differentiable in strict mode.

    `truncation` (top-k / top-p / min-p, `rl_kernel.ops.truncation`): the log-probability under the
    renormalised distribution over each row's support, equal in bits to the engine's
    `truncate_log_softmax` entry; -inf for a target outside its support. `with_entropy`: returns
    (logprobs, entropy), the fp32 entropy [T] of the full-vocab softmax at the temperature, from the same
    pass (no bit contract; differentiable).
    """
    vocab_start, vocab_local, vocab_size = _vocab_layout(weight.shape[0], vocab_size, group)
    temps = _temperatures(temperature, hidden.shape[0], hidden.device)
    _check_targets(targets, vocab_size)
    if truncation is not None and truncation.active:
        out, ent = truncated_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation)
        return (out, ent) if with_entropy else out
    if not with_entropy:
        return LOGPROBS(_strict_logprobs, hidden, weight, targets, temps, vocab_start, vocab_size, group)
    return LOGPROBS(
        _strict_logprobs_entropy,
        hidden,
        weight,
        targets,
        temps,
        vocab_start,
        vocab_size,
        group,
        native_form=native_logprobs_entropy,
    )


def native_logprobs_entropy(hidden, weight, targets, temps, vocab_start, vocab_size, group):
    """Framework-style (logprobs, entropy): `native_log_softmax` of the model-dtype logits."""
    logits = F.linear(hidden, weight.to(hidden.dtype)).to(torch.float32)
    lp = native_log_softmax(logits, temps, vocab_start, vocab_size, group)
    local = targets.to(torch.int64) - vocab_start
    owned = (local >= 0) & (local < lp.shape[-1])
    z_t = torch.where(owned, lp.gather(-1, local.clamp(0, lp.shape[-1] - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = -torch.where(torch.isneginf(lp), 0.0, lp.exp() * lp).sum(-1)
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_reduce  # differentiable

        z_t, ent = all_reduce(z_t, group=group), all_reduce(ent, group=group)
    return z_t, ent


def _strict_logprobs_entropy(hidden, weight, targets, temps, vocab_start, vocab_size, group):
    return _strict_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, with_entropy=True)


def _strict_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, with_entropy=False):
    contract, kernels = LOGPROBS.strict(hidden.device, hidden, weight)
    if vocab_size > torch_logprob.MAX_VOCAB:
        raise StrictModeError(
            "logprobs",
            contract.backend,
            f"vocab {vocab_size} > {torch_logprob.MAX_VOCAB}: the int64 fixed-point sum could overflow",
        )
    return StrictLogprobs.apply(
        hidden,
        weight,
        targets.to(torch.int64),
        temps,
        vocab_start,
        vocab_size,
        group,
        kernels,
        _logits_torch_dtype(contract),
        with_entropy,
    )


def log_softmax(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """fp32 log-probabilities of every vocab entry from fp32 logits [T, V_local] (this rank's slice
    when `group` is given), under the logprob contract: for a token t, entry t equals
    `logprobs(hidden, weight, t, ...)` bit for bit when `logits == linear_fp32(hidden, weight)`.
    Padded columns (index >= vocab_size) are -inf. Engines that sample from full logits use this.
    """
    vocab_start, _, vocab_size = _vocab_layout(logits.shape[-1], vocab_size, group)
    temps = _temperatures(temperature, logits.shape[0], logits.device)
    return LOG_SOFTMAX(_strict_log_softmax, logits, temps, vocab_start, vocab_size, group)


def _strict_log_softmax(logits, temps, vocab_start, vocab_size, group):
    contract, kernels = LOG_SOFTMAX.strict(logits.device)
    if logits.dtype != torch.float32:
        raise StrictModeError(
            "log_softmax",
            contract.backend,
            f"logits must be the fp32 GEMM-contract output, "
            f"got {logits.dtype} (use rl_kernel.linear_fp32 for the LM head)",
        )
    return kernels.full_log_softmax(
        logits, temps, vocab_start, vocab_size, group, logits_dtype=_logits_torch_dtype(contract)
    )


def _logits_torch_dtype(contract: Contract) -> torch.dtype:
    """The logit dtype `contract` was made for (its parameter, so the kernels run what the record says)."""
    return getattr(torch, dict(contract.params)["logits_dtype"])


# ---- exact top-k / top-p / min-p on the trainer's side (rl_kernel.ops.truncation: the contract) ----------


def _gather_vocab(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[rows, V_local] slices of every rank -> [rows, V_local * world] (rank order; a bit copy)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def full_entropy(lp: torch.Tensor) -> torch.Tensor:
    """fp32 entropy [T] of fp32 log-probability rows [T, V] (-inf entries contribute 0): -sum p lp with
    p = exp64(lp), each term rounded to 2^-44 fixed point and summed in int64 (order-free, so any sharding
    gives the same value)."""
    lp64 = lp.to(torch.float64)
    term = torch.where(torch.isneginf(lp64), 0.0, exp64(lp64) * -lp64)
    return (
        torch.round(term * float(1 << truncation_kernels.FIXED_POINT_BITS)).to(torch.int64).sum(-1).to(torch.float64)
        * (1.0 / (1 << truncation_kernels.FIXED_POINT_BITS))
    ).to(torch.float32)


def _strict_rows(hidden, weight, temps, vocab_size, group):
    """Strict fp32 log-probabilities of this rank's vocab slice of rows `hidden` (the engine's steps)."""
    from rl_kernel.ops.gemm import linear_fp32

    return log_softmax(linear_fp32(hidden, weight), temps, vocab_size=vocab_size, group=group)


class TruncatedLogprobs(torch.autograd.Function):
    """Forward under the contract: per row tile, the strict rows (GEMM contract + log_softmax), gathered over
    the vocab ranks, truncated; the target's entry and the full-vocab entropy. Backward (no bit contract): the
    rows recomputed by the same steps, so the support is the forward's; d/dz = (onehot - p_support) g +
    g_H * (-p (log p + H)), over T."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation):
        rows = hidden.shape[0]
        out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        cut_lp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        cut_id = torch.empty(rows, dtype=torch.int64, device=hidden.device)
        norm = torch.empty(rows, dtype=torch.float64, device=hidden.device)
        params = truncation_op.row_params(truncation, rows, hidden.device)
        width = truncation_op.sort_width(truncation, rows)
        world = dist.get_world_size(group) if group is not None else 1
        tile = max(1, torch_logprob.TILE_ELEMENTS // max(1, weight.shape[0] * world))
        for a in range(0, rows, tile):
            b = min(rows, a + tile)
            lp = _gather_vocab(_strict_rows(hidden[a:b], weight, temps[a:b], vocab_size, group), group)
            trunc, cut_lp[a:b], cut_id[a:b], norm[a:b] = truncation_kernels.truncate(
                lp, *(p[a:b] for p in params), width
            )
            out[a:b] = trunc.gather(-1, targets[a:b].unsqueeze(-1)).squeeze(-1)
            ent[a:b] = full_entropy(lp)
        ctx.save_for_backward(hidden, weight, targets, temps, cut_lp, cut_id, norm, ent)
        ctx.vocab_start, ctx.vocab_size, ctx.group, ctx.tile = vocab_start, vocab_size, group, tile
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, targets, temps, cut_lp, cut_id, norm, ent = ctx.saved_tensors
        grad_out = torch.zeros_like(ent) if grad_out is None else grad_out
        grad_ent = torch.zeros_like(ent) if grad_ent is None else grad_ent
        w32 = weight.to(torch.float32)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros_like(w32)
        v_local = weight.shape[0]
        for a in range(0, hidden.shape[0], ctx.tile):
            b = min(hidden.shape[0], a + ctx.tile)
            with torch.no_grad():
                lp = _strict_rows(hidden[a:b], weight, temps[a:b], ctx.vocab_size, ctx.group).to(torch.float64)
            keep = truncation_kernels.in_support(lp, cut_lp[a:b].to(torch.float64), cut_id[a:b], ctx.vocab_start)
            p_support = torch.where(keep, torch.exp(lp - norm[a:b].unsqueeze(-1)), 0.0)
            p = torch.where(torch.isneginf(lp), 0.0, torch.exp(lp))
            local = targets[a:b] - ctx.vocab_start
            owned = ((local >= 0) & (local < v_local)).nonzero().squeeze(-1)
            dz = -p_support * grad_out[a:b].to(torch.float64).unsqueeze(-1)
            dz[owned, local[owned]] += grad_out[a:b][owned].to(torch.float64)
            plogp = torch.where(p > 0, lp, 0.0)
            dz -= grad_ent[a:b].to(torch.float64).unsqueeze(-1) * p * (plogp + ent[a:b].to(torch.float64).unsqueeze(-1))
            dlogits = (dz / temps[a:b].to(torch.float64).unsqueeze(-1)).to(torch.float32)
            h32 = hidden[a:b].to(torch.float32)
            grad_h[a:b] = dlogits @ w32
            grad_w += dlogits.T @ h32
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None, None


def native_truncated_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation):
    """Framework-style: fp32 log-softmax of the model-dtype logits, gathered over the vocab ranks, vLLM-style
    truncation (`native_truncate`); (logprobs, entropy), differentiable by autograd."""
    logits = F.linear(hidden, weight.to(hidden.dtype)).to(torch.float32)
    lp = native_log_softmax(logits, temps, vocab_start, vocab_size, group)
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_gather  # differentiable

        lp = torch.cat(all_gather(lp, group=group), dim=-1)
    params = truncation_op.row_params(truncation, hidden.shape[0], hidden.device)
    trunc = truncation_op.native_truncate(lp, *params)
    ent = -torch.where(torch.isneginf(lp), 0.0, lp.exp() * lp).sum(-1)
    return trunc.gather(-1, targets.unsqueeze(-1)).squeeze(-1), ent


def truncated_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temps: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    truncation: Truncation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log p_support(targets) [T], fp32 full-vocab entropy [T]): the trainer's side of the contract,
    equal in bits to the entry `truncate_log_softmax(log_softmax(linear_fp32(hidden, W)))` of each target (an
    engine's recorded value); a target outside its support gets -inf (the caller counts and refuses it).
    Differentiable in both outputs."""
    if not truncation_op.TRUNCATION.is_strict():
        truncation_op.TRUNCATION.record_native(hidden.device)
        return native_truncated_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation)
    evidence.record(truncation_op.CONTRACT, "strict", hidden.device.type)
    out, ent = TruncatedLogprobs.apply(
        hidden, weight, targets.to(torch.int64), temps, vocab_start, vocab_size, group, truncation
    )
    return out, ent
