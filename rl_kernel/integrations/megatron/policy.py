"""`MegatronPolicy`: the trainer-facing API over a Megatron-core Qwen3 (TP x CP, strict or native).

Every rank of the tp * cp world builds one and calls its methods collectively with the same
arguments (the orchestrator's Ray actors do this); results are the same on every rank.
torch.distributed must be initialised first (gloo on CPU, NCCL on CUDA); Megatron's model-parallel
groups are created here when absent (order tp-cp, no pipeline or data parallelism).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import rl_kernel as rk
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from rl_kernel.integrations.megatron._cpu import cuda_as_cpu
from rl_kernel.integrations.megatron.convert import (
    check_tokenizer,
    check_tp,
    hf_to_megatron,
    load_hf_state_dict,
    megatron_to_hf,
    read_config,
)
from rl_kernel.integrations.megatron.cp import CHUNK, TokenLayout, _gather_varlen, cp_unit
from rl_kernel.integrations.megatron.loss import PolicyLossConfig, policy_loss
from rl_kernel.integrations.megatron.model import build_gpt_model, forward_hidden, token_logprobs

_TP_SHARDED = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "word_embeddings", "output_layer")
_TP_PARTIAL_GRADS = ("q_layernorm", "k_layernorm")  # shared by the heads of every TP rank: grads sum over TP


def resolve_modes(mode: str | dict[str, str]) -> dict[str, str]:
    """{boundary: 'strict' | 'native'} for every rl_kernel boundary, from one mode or a full dict."""
    if isinstance(mode, str):
        if mode not in rk.MODES:
            raise ValueError(f"mode must be 'strict' or 'native', got {mode!r}")
        return {b: mode for b in rk.BOUNDARIES}
    modes = dict(mode)
    if set(modes) != set(rk.BOUNDARIES) or not set(modes.values()) <= set(rk.MODES):
        raise ValueError(f"per-boundary modes must give 'strict' or 'native' for each of {rk.BOUNDARIES}; "
                         f"got {modes}")
    return modes


@contextlib.contextmanager
def _modes(modes: dict[str, str]) -> Iterator[None]:
    """Run a block with rl_kernel's per-boundary modes set to `modes` (restored after)."""
    with contextlib.ExitStack() as stack:
        for m in rk.MODES:
            boundaries = [b for b, v in modes.items() if v == m]
            if boundaries:
                stack.enter_context(rk.mode(m, *boundaries))
        yield


@dataclass
class TrainBatch:
    """One optimizer step's samples. Per sequence i: token ids, prompt length, advantage, and the
    fp32 logprobs of its response tokens j >= prompt_lens[i] under the behaviour policy (rollout),
    optionally under a reference policy (for the KL term)."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    advantages: list[float]
    old_logprobs: list[torch.Tensor]
    ref_logprobs: list[torch.Tensor] | None = None
    temperature: float = 1.0


@dataclass
class _Packed:
    ids: torch.Tensor  # [T]
    layout: TokenLayout
    targets: torch.Tensor  # [T] token predicted from row t (0 where none)
    rows: torch.Tensor  # [R] rows whose prediction is a response token, sequence by sequence
    counts: list[int]  # response tokens per sequence


def _pack(sequences: list[list[int]], prompt_lens: list[int], cp: int, unit: int = CHUNK) -> _Packed:
    if not sequences or len(sequences) != len(prompt_lens):
        raise ValueError(f"need one prompt_len per sequence and at least one sequence; got {len(sequences)} "
                         f"sequences, {len(prompt_lens)} prompt_lens")
    for s, p in zip(sequences, prompt_lens):
        if not 1 <= p <= len(s):
            raise ValueError(f"prompt_len {p} must be in [1, len(sequence)={len(s)}]")
    lens = [len(s) for s in sequences]
    counts = [n - p for n, p in zip(lens, prompt_lens)]
    filler: list[list[int]] = []
    while True:  # Megatron cannot run a rank without tokens: give empty CP ranks a 1-token filler sequence
        cu = torch.tensor([0] + lens + [1] * len(filler), dtype=torch.int64).cumsum(0)
        layout = TokenLayout(cu, cp, unit)
        if all(layout.local_index(r).numel() for r in range(cp)):
            break
        filler.append([0])
    ids = torch.tensor([t for s in sequences + filler for t in s], dtype=torch.int64)
    targets = torch.zeros_like(ids)
    targets[:-1] = ids[1:]
    rows = [torch.arange(a + p - 1, a + n - 1) for a, p, n in zip(cu.tolist(), prompt_lens, lens)]
    return _Packed(ids, layout, targets, torch.cat(rows), counts)


class MegatronPolicy:
    """A Qwen3 policy in Megatron-core, loaded from an HF checkpoint directory.

    mode "strict": rl_kernel's layer spec (bitwise equal to `Qwen3Reference` and to the rollout at the
    same or any tp dividing 8, at any cp); "native": Megatron's own modules. A dict {boundary: mode}
    (every boundary of `rl_kernel.BOUNDARIES`, as `resolve_modes` builds) sets modes per boundary:
    with any boundary strict the model uses rl_kernel's layer spec and a native boundary runs
    rl_kernel's native (framework-style torch) form of its ops, as a strict vLLM engine does;
    `set_modes` changes them between calls (operator ablation without rebuilding). Optimizer:
    Megatron's (Adam, fp32 main params for bf16 models, grad clipping at `clip_grad`).
    """

    def __init__(self, hf_path: str | Path, *, tp: int = 1, cp: int = 1, mode: str | dict[str, str] = "strict",
                 lr: float = 1e-6,
                 weight_decay: float = 0.0, adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 clip_grad: float = 1.0, loss: PolicyLossConfig | None = None,
                 micro_batch_size: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device | None = None):
        modes = resolve_modes(mode)
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed initialised (world size tp * cp) first")
        if dist.get_world_size() != tp * cp:
            raise ValueError(f"world size {dist.get_world_size()} != tp * cp = {tp * cp} (data parallelism is "
                             "not supported: run one policy group per world)")
        self.shape = read_config(hf_path)
        check_tokenizer(hf_path, self.shape)
        check_tp(self.shape, tp)
        # The layer spec: rl_kernel's modules when any boundary is strict, else Megatron's own.
        self.spec_mode = "strict" if "strict" in modes.values() else "native"
        self.modes = modes
        self.tp, self.cp, self.loss_config = tp, cp, loss or PolicyLossConfig()
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cp_unit = cp_unit(self.device)  # CP deals whole units of the strict attention's partials
        if parallel_state.model_parallel_is_initialized():
            have = (parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_context_parallel_world_size())
            if have != (tp, cp):
                raise ValueError(f"Megatron parallel state is already tp={have[0]}, cp={have[1]}; "
                                 f"asked tp={tp}, cp={cp}")
        else:
            parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.model = build_gpt_model(self.shape, self.spec_mode, tp, cp, dtype, self.device)
        self.load_hf_state_dict(load_hf_state_dict(hf_path), _reload_optimizer=False)
        self.model.ddp_config = DistributedDataParallelConfig()  # no DDP wrapper: dp = 1, grads reduced here
        opt_config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=adam_betas[0],
            adam_beta2=adam_betas[1], adam_eps=adam_eps, clip_grad=clip_grad,
            bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype, use_distributed_optimizer=False,
        )
        if dtype == torch.float16:
            raise ValueError("fp16 models need a loss scaler; use bfloat16 or float32")
        with cuda_as_cpu():
            self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.steps = 0

    @property
    def mode(self) -> str:
        """'strict' or 'native' when every boundary runs that mode, else 'mixed'."""
        values = set(self.modes.values())
        return values.pop() if len(values) == 1 else "mixed"

    def set_modes(self, mode: str | dict[str, str]) -> None:
        """Change the per-boundary modes of later forwards (same weights). A policy built with
        Megatron's own modules (every boundary native) has no rl_kernel op to switch to strict."""
        modes = resolve_modes(mode)
        if self.spec_mode == "native" and "strict" in modes.values():
            raise ValueError("this policy was built all-native (Megatron's own modules); build it with a strict "
                             "boundary to switch boundaries between strict and native")
        self.modes = modes

    # ---- weights -------------------------------------------------------------------------------

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor], _reload_optimizer: bool = True) -> None:
        """Replace all weights by full HF-named tensors (sharded here); the optimizer's fp32 main
        params follow."""
        local = hf_to_megatron(hf, self.shape, self.tp_rank, self.tp)
        own = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        missing = sorted(set(own) - set(local))
        if missing:
            raise KeyError(f"HF weights do not cover Megatron parameters {missing[:5]}")
        with torch.no_grad():
            for name, tensor in local.items():
                if own[name].shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shard {tuple(tensor.shape)} != model "
                                     f"{tuple(own[name].shape)}")
                own[name].copy_(tensor)
        if _reload_optimizer:
            with cuda_as_cpu():
                self.optimizer.reload_model_params()

    def export_hf_state_dict(self, which: str = "model") -> dict[str, torch.Tensor]:
        """Full HF-named tensors, TP shards gathered (a bit copy); the same on every rank.

        which: "model" (the weights, model dtype), "main" (the optimizer's fp32 main params) or
        "main_grad" (their fp32 gradients of the last `train_step`)."""
        if which not in ("model", "main", "main_grad"):
            raise ValueError(f"which must be 'model', 'main' or 'main_grad', got {which!r}")
        own = {}
        for name, p in self.model.named_parameters():
            t = p if which == "model" else getattr(p, "main_param", p)
            if which == "main_grad":
                t = t.grad if t.grad is not None else torch.zeros_like(t)
            own[name] = t.detach()
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        group = parallel_state.get_tensor_model_parallel_group()
        for name, t in own.items():
            if self.tp > 1 and any(key in name for key in _TP_SHARDED):
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t.contiguous(), group=group)
            else:
                parts = [t] * self.tp
            for shard, part in zip(shards, parts):
                shard[name] = part.to("cpu", copy=True)
        return megatron_to_hf(shards, self.shape)

    # ---- logprobs ------------------------------------------------------------------------------

    def _micro_batches(self, n: int) -> list[range]:
        size = self.micro_batch_size or n
        return [range(a, min(n, a + size)) for a in range(0, n, size)]

    def _local_logprobs(self, packed: _Packed, temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logprobs of this CP rank's rows, those rows' global indices)."""
        cp_rank = parallel_state.get_context_parallel_rank() if self.cp > 1 else 0
        local = packed.layout.local_index(cp_rank)
        with _modes(self.modes):
            hidden = forward_hidden(self.model, packed.layout, packed.ids)
            lp = token_logprobs(self.model, hidden, packed.targets[local].to(self.device),
                                temps[local].to(self.device), self.shape.vocab_size, self.spec_mode == "strict")
        return lp, local

    def _gather_rows(self, lp: torch.Tensor, packed: _Packed) -> torch.Tensor:
        """[T] logprobs of every row (each CP rank contributes its own rows)."""
        if self.cp == 1:
            return lp.detach().cpu()
        layout = packed.layout
        idx = [layout.local_index(r) for r in range(self.cp)]
        parts = _gather_varlen(lp.detach(), [int(i.numel()) for i in idx], parallel_state.get_context_parallel_group())
        full = torch.empty(int(layout.cu_seqlens[-1]), dtype=torch.float32)
        full[torch.cat(idx)] = torch.cat(parts).cpu()
        return full

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int],
                 temperature: float | list[float] = 1.0) -> list[torch.Tensor]:
        """Teacher-forcing fp32 logprobs: entry i holds log p(sequences[i][j] | sequences[i][:j]) at the
        sequence's temperature, for j in [prompt_lens[i], len(sequences[i])). Micro-batches of
        `micro_batch_size` sequences are packed (varlen); the bits do not depend on the packing."""
        temps = [temperature] * len(sequences) if isinstance(temperature, int | float) else list(temperature)
        if len(temps) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(temps)} temperatures")
        out: list[torch.Tensor] = []
        for mb in self._micro_batches(len(sequences)):
            packed = _pack([sequences[i] for i in mb], [prompt_lens[i] for i in mb], self.cp, self.cp_unit)
            row_temps = torch.ones(packed.ids.numel(), dtype=torch.float64)  # filler rows keep 1.0
            cu = packed.layout.cu_seqlens.tolist()
            for j, i in enumerate(mb):
                row_temps[cu[j]:cu[j + 1]] = float(temps[i])
            with torch.no_grad():
                lp, _ = self._local_logprobs(packed, row_temps)
            full = self._gather_rows(lp, packed)
            out.extend(full[packed.rows].split(packed.counts))
        return out

    # ---- training ------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the clipped policy-gradient loss over the whole batch (token mean over
        all response tokens, summed over micro-batches and CP ranks). Returns metrics, including the
        trainer-vs-rollout logprob agreement on every response token (before the update)."""
        n = len(batch.sequences)
        if not (len(batch.prompt_lens) == len(batch.advantages) == len(batch.old_logprobs) == n):
            raise ValueError("sequences, prompt_lens, advantages and old_logprobs must have one entry per sequence")
        total_tokens = sum(len(s) - p for s, p in zip(batch.sequences, batch.prompt_lens))
        self.model.train()
        self.optimizer.zero_grad()
        sums = {"loss": 0.0, "pg_sum": 0.0, "clipped": 0.0, "ratio_sum": 0.0, "tokens": 0.0, "kl_sum": 0.0,
                "mismatch_count": 0.0, "max_abs_diff": 0.0, "abs_diff_sum": 0.0}
        for mb in self._micro_batches(n):
            packed = _pack([batch.sequences[i] for i in mb], [batch.prompt_lens[i] for i in mb], self.cp, self.cp_unit)
            T = packed.ids.numel()
            old, adv, mask = torch.zeros(T), torch.zeros(T), torch.zeros(T)
            ref = torch.zeros(T) if batch.ref_logprobs is not None else None
            for rows, i in zip(packed.rows.split(packed.counts), mb):
                if batch.old_logprobs[i].numel() != rows.numel():
                    raise ValueError(f"sequence {i}: {batch.old_logprobs[i].numel()} old logprobs for "
                                     f"{rows.numel()} response tokens")
                old[rows], adv[rows], mask[rows] = batch.old_logprobs[i].float(), float(batch.advantages[i]), 1.0
                if ref is not None:
                    ref[rows] = batch.ref_logprobs[i].float()
            temps = torch.full((T,), float(batch.temperature), dtype=torch.float64)
            lp, local = self._local_logprobs(packed, temps)
            old, adv, mask = (t[local].to(self.device) for t in (old, adv, mask))
            ref = None if ref is None else ref[local].to(self.device)
            loss, m = policy_loss(lp, old, adv, mask, self.loss_config, ref, normalizer=total_tokens)
            loss.backward()
            active = mask.bool()
            diff = (lp.detach() - old)[active]
            bits = lp.detach()[active].view(torch.int32) != old[active].view(torch.int32)
            sums["loss"] += float(loss.detach())
            for key in ("pg_sum", "clipped", "ratio_sum", "tokens", "kl_sum"):
                sums[key] += float(m.get(key, 0.0))
            sums["mismatch_count"] += float(bits.sum())
            sums["abs_diff_sum"] += float(diff.abs().sum())
            sums["max_abs_diff"] = max(sums["max_abs_diff"], float(diff.abs().max()) if diff.numel() else 0.0)
        self._reduce_grads()
        sums = self._reduce_metrics(sums)
        with cuda_as_cpu():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("Megatron optimizer step failed (non-finite gradients)")
        self.steps += 1
        tokens = max(sums["tokens"], 1.0)
        return {"loss": sums["loss"], "pg_loss": sums["pg_sum"] / tokens, "clip_frac": sums["clipped"] / tokens,
                "ratio_mean": sums["ratio_sum"] / tokens, "kl": sums["kl_sum"] / tokens, "tokens": sums["tokens"],
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "mismatch_count": sums["mismatch_count"], "max_abs_diff": sums["max_abs_diff"],
                "mean_abs_diff": sums["abs_diff_sum"] / tokens, "step": float(self.steps)}

    def _reduce_grads(self) -> None:
        """Sum the gradients CP ranks computed from their tokens, and the TP-partial qk-norm grads."""
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            if self.tp > 1 and any(key in name for key in _TP_PARTIAL_GRADS):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
            if self.cp > 1:
                dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        if self.cp == 1:
            return sums
        keys = [k for k in sums if k != "max_abs_diff"]
        group = parallel_state.get_context_parallel_group()
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        mx = torch.tensor([sums["max_abs_diff"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(keys, t.tolist())) | {"max_abs_diff": float(mx)}
