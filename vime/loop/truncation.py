"""The run's exact sampling truncation (algo.top_k / top_p / min_p, rl_kernel.ops.truncation): what the rollout
engines sample under and the trainer scores under, so both sides compute the same renormalised logprob."""

from __future__ import annotations

from rl_kernel.ops.truncation import Truncation
from vime.config.schema import VimeConfig


def truncation(cfg: VimeConfig) -> Truncation:
    """The truncation `cfg.algo` asks for (all off: the full softmax)."""
    a = cfg.algo
    return Truncation(top_k=int(a.top_k), top_p=float(a.top_p), min_p=float(a.min_p))


def key(top_k: int, top_p: float, min_p: float) -> tuple[int, float, float]:
    """A truncation's comparable form (top_k 0 and -1 both mean off)."""
    return (-1 if top_k in (0, -1) else int(top_k), float(top_p), float(min_p))
