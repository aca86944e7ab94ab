"""`MegatronPolicy`: the engine adapter over a Megatron-core Qwen3 (TP x CP, strict or native).

It builds the model and Megatron's optimizer from an HF checkpoint, loads and exports HF-named weights
(TP shards split and gathered), and runs the teacher-forcing forward of packed sequences to fp32
logprobs (CP-sharded), the gradient reductions and the optimizer step. The RL algorithm that drives it
(packing, micro-batches, the GRPO loss and step) is vime's (`vime.trainer.grpo`, whose `PolicyModel`
protocol this class implements).

Every rank of the tp * cp world builds one and calls its methods collectively with the same
arguments (the orchestrator's Ray actors do this); results are the same on every rank.
torch.distributed must be initialised first (gloo on CPU, NCCL on CUDA); Megatron's model-parallel
groups are created here when absent (order tp-cp, no pipeline or data parallelism).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
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
    megatron_to_hf,
)
from rl_kernel.integrations.megatron.cp import TokenLayout, _gather_varlen, cp_unit
from rl_kernel.integrations.megatron.model import TP_PARTIAL_GRAD, build_gpt_model, forward_hidden, token_logprobs
from rl_kernel.models.qwen3 import load_hf_state_dict, read_config


def resolve_modes(mode: str | dict[str, str]) -> dict[str, str]:
    """{boundary: 'strict' | 'native'} for every rl_kernel boundary, from one mode or a full dict."""
    if isinstance(mode, str):
        if mode not in rk.MODES:
            raise ValueError(f"mode must be 'strict' or 'native', got {mode!r}")
        return {b: mode for b in rk.BOUNDARIES}
    modes = dict(mode)
    if set(modes) != set(rk.BOUNDARIES) or not set(modes.values()) <= set(rk.MODES):
        raise ValueError(f"per-boundary modes must give 'strict' or 'native' for each of {rk.BOUNDARIES}; got {modes}")
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


class MegatronPolicy:
    """A Qwen3 policy in Megatron-core, loaded from an HF checkpoint directory.

    mode "strict": rl_kernel's layer spec (bitwise equal to `Qwen3Reference` and to the rollout at the
    same or any tp dividing 8, at any cp); "native": Megatron's own modules. A dict {boundary: mode}
    (every boundary of `rl_kernel.BOUNDARIES`, as `resolve_modes` builds) sets modes per boundary:
    with any boundary strict the model uses rl_kernel's layer spec and a native boundary runs
    rl_kernel's native (framework-style torch) form of its ops, as a strict vLLM engine does;
    `set_modes` changes them between calls (operator ablation without rebuilding). Optimizer:
    Megatron's (Adam, fp32 main params for bf16 models, grad clipping at `clip_grad`).

    Train-step interface (`vime.trainer.grpo.PolicyModel`): `zero_grad`, `forward_logprobs` (then the
    caller's loss and backward), `reduce_metrics`, `optimizer_step`; scoring: `forward_logprobs` under
    no_grad, then `gather_logprobs`.
    """

    def __init__(
        self,
        hf_path: str | Path,
        *,
        tp: int = 1,
        cp: int = 1,
        mode: str | dict[str, str] = "strict",
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        clip_grad: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device | None = None,
    ):
        modes = resolve_modes(mode)
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed initialised (world size tp * cp) first")
        if dist.get_world_size() != tp * cp:
            raise ValueError(
                f"world size {dist.get_world_size()} != tp * cp = {tp * cp} (data parallelism is "
                "not supported: run one policy group per world)"
            )
        self.shape = read_config(hf_path)
        check_tokenizer(hf_path, self.shape)
        check_tp(self.shape, tp)
        # The layer spec: rl_kernel's modules when any boundary is strict, else Megatron's own.
        self.spec_mode = "strict" if "strict" in modes.values() else "native"
        self.modes = modes
        self.tp, self.cp = tp, cp
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cp_unit = cp_unit(self.device)  # CP deals whole units of the strict attention's partials
        if parallel_state.model_parallel_is_initialized():
            have = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
            )
            if have != (tp, cp):
                raise ValueError(
                    f"Megatron parallel state is already tp={have[0]}, cp={have[1]}; asked tp={tp}, cp={cp}"
                )
        else:
            parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        if parallel_state.get_expert_model_parallel_world_size() != 1:
            raise ValueError(
                f"Megatron parallel state has expert_model_parallel_size="
                f"{parallel_state.get_expert_model_parallel_world_size()}: MegatronPolicy runs expert parallelism 1 "
                "(its HF conversion, weight push and gradient reduction hold every expert); initialise it with 1"
            )
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.model = build_gpt_model(self.shape, self.spec_mode, tp, cp, dtype, self.device)
        self.load_hf_state_dict(load_hf_state_dict(hf_path), _reload_optimizer=False)
        self.model.ddp_config = DistributedDataParallelConfig()  # no DDP wrapper: dp = 1, grads reduced here
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=weight_decay,
            adam_beta1=adam_betas[0],
            adam_beta2=adam_betas[1],
            adam_eps=adam_eps,
            clip_grad=clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=False,
            params_dtype=dtype,
            use_distributed_optimizer=False,
        )
        if dtype == torch.float16:
            raise ValueError("fp16 models need a loss scaler; use bfloat16 or float32")
        with cuda_as_cpu():
            self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.steps = 0
        self.truncation = None  # rl_kernel.ops.truncation.Truncation every forward renormalises under (None: off)

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
            raise ValueError(
                "this policy was built all-native (Megatron's own modules); build it with a strict "
                "boundary to switch boundaries between strict and native"
            )
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
                    raise ValueError(
                        f"{name}: checkpoint shard {tuple(tensor.shape)} != model {tuple(own[name].shape)}"
                    )
                own[name].copy_(tensor)
        if _reload_optimizer:
            with cuda_as_cpu():
                self.optimizer.reload_model_params()

    def export_hf_state_dict(self, which: str = "model", device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Full HF-named tensors, TP shards gathered (a bit copy, on `device`); the same on every rank.

        which: "model" (the weights, model dtype), "main" (the optimizer's fp32 main params) or
        "main_grad" (their fp32 gradients of the last `train_step`)."""
        if which not in ("model", "main", "main_grad"):
            raise ValueError(f"which must be 'model', 'main' or 'main_grad', got {which!r}")
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        group = parallel_state.get_tensor_model_parallel_group()
        for name, p in self.model.named_parameters():
            t = p if which == "model" else getattr(p, "main_param", p)
            if which == "main_grad":
                t = t.grad if t.grad is not None else torch.zeros_like(t)
            t = t.detach()
            if self.tp > 1 and getattr(p, "tensor_model_parallel", False):  # Megatron's TP-sharded parameters
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t.contiguous(), group=group)
            else:
                parts = [t] * self.tp
            for shard, part in zip(shards, parts):
                shard[name] = part.to(device, copy=True)
        return megatron_to_hf(shards, self.shape)

    # ---- forward ---------------------------------------------------------------------------------

    def _layout(self, cu_seqlens: torch.Tensor) -> TokenLayout:
        """The CP layout of packed sequences; Megatron cannot run a rank without tokens, so empty CP ranks
        get 1-token filler sequences appended (their rows come after the real ones)."""
        lens = cu_seqlens.diff().tolist()
        filler = 0
        while True:
            cu = torch.tensor([0] + lens + [1] * filler, dtype=torch.int64).cumsum(0)
            layout = TokenLayout(cu, self.cp, self.cp_unit)
            if all(layout.local_index(r).numel() for r in range(self.cp)):
                return layout
            filler += 1

    def forward_logprobs(
        self,
        ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        targets: torch.Tensor,
        temps: torch.Tensor,
        rows: torch.Tensor | None = None,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forcing fp32 logprobs of this CP rank's rows of the packed batch (ids, targets and temps
        [T], cu_seqlens [B+1]; differentiable under grad mode): (values, their row indices in [0, T)); with
        `entropy` also the rows' full-vocab entropy (fp32, differentiable), from the same LM-head pass.
        `rows` (the rows the caller needs) is ignored: each rank computes all rows it holds. Under
        `self.truncation` (exact top-k / top-p / min-p) the logprobs are renormalised over each row's support."""
        n = ids.numel()
        layout = self._layout(cu_seqlens)
        pad = int(layout.cu_seqlens[-1]) - n  # filler tokens (id 0, temperature 1, target 0)
        ids = torch.cat([ids, ids.new_zeros(pad)])
        targets = torch.cat([targets, targets.new_zeros(pad)])
        temps = torch.cat([temps, temps.new_ones(pad)])
        cp_rank = parallel_state.get_context_parallel_rank() if self.cp > 1 else 0
        local = layout.local_index(cp_rank)
        with _modes(self.modes):
            hidden = forward_hidden(self.model, layout, ids)
            lp = token_logprobs(
                self.model,
                hidden,
                targets[local].to(self.device),
                temps[local].to(self.device),
                self.shape.vocab_size,
                self.spec_mode == "strict",
                truncation=self.truncation,
                with_entropy=entropy,
            )
        lp, ent = lp if entropy else (lp, None)
        real = local < n
        if not bool(real.all()):
            keep = real.to(lp.device)
            lp, local, ent = lp[keep], local[real], None if ent is None else ent[keep]
        return (lp, local, ent) if entropy else (lp, local)

    def gather_logprobs(self, values: torch.Tensor, index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """[T] fp32 logprobs of every row (CPU), each CP rank contributing the rows `forward_logprobs`
        gave it; the same on every rank."""
        n = int(cu_seqlens[-1])
        if self.cp == 1:
            full = torch.empty(n, dtype=torch.float32)
            full[index] = values.detach().cpu()
            return full
        layout = self._layout(cu_seqlens)
        idx = [i[i < n] for i in (layout.local_index(r) for r in range(self.cp))]
        parts = _gather_varlen(
            values.detach(), [int(i.numel()) for i in idx], parallel_state.get_context_parallel_group()
        )
        full = torch.empty(n, dtype=torch.float32)
        full[torch.cat(idx)] = torch.cat(parts).cpu()
        return full

    # ---- training ------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Start a training step: training mode, gradients cleared."""
        self.model.train()
        self.optimizer.zero_grad()

    def reduce_metrics(self, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
        """`sums` summed and `maxes` maxed over the CP ranks (which split the tokens); TP ranks hold the
        same values already."""
        if self.cp == 1:
            return sums | maxes
        group = parallel_state.get_context_parallel_group()
        t = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        mx = torch.tensor(list(maxes.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(sums, t.tolist())) | dict(zip(maxes, mx.tolist()))

    def optimizer_step(self) -> float | None:
        """Reduce the gradients (`_reduce_grads`), clip and step Megatron's optimizer; returns the gradient
        norm (nan when not computed), or None when the gradients were not finite and nothing changed."""
        self._reduce_grads()
        with cuda_as_cpu():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            return None
        self.steps += 1
        return float(grad_norm) if grad_norm is not None else math.nan

    def _reduce_grads(self) -> None:
        """Sum the gradients CP ranks computed from their tokens, and over TP the gradients of the
        parameters every TP rank holds whole but feeds only its own heads (`TP_PARTIAL_GRAD`: qk-norm)."""
        for p in self.model.parameters():
            if p.grad is None:
                continue
            if self.tp > 1 and getattr(p, TP_PARTIAL_GRAD, False):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
            if self.cp > 1:
                dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
