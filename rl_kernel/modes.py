"""Numeric modes, per boundary and per process.

`strict` runs an op under its numeric execution contract (rl_kernel's kernels); `native` runs the
framework's own kernels (the production baseline). The process default comes from the environment
(`RL_KERNEL_MODE`, and `RL_KERNEL_MODE_<BOUNDARY>` per boundary, e.g. `RL_KERNEL_MODE_ATTENTION=native`),
and `set_mode` changes it for the process and `mode(...)` for a `with` block. Engines whose workers are
spawned by a framework (vLLM) get their modes explicitly (`full_modes`, passed in the engine's config).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

BOUNDARIES = ("norm", "gemm", "activation", "rope", "attention", "logprob", "collective", "moe")
MODES = ("strict", "native")
# Each op (as named in its contracts and evidence records) -> the boundary whose mode governs it.
OP_BOUNDARY = {
    "gemm": "gemm",
    "rms_norm": "norm",
    "rope": "rope",
    "silu_and_mul": "activation",
    "attention": "attention",
    "logprobs": "logprob",
    "log_softmax": "logprob",
    "truncation": "logprob",
    "gumbel_sample": "logprob",
    "all_reduce": "collective",
    "moe_router": "moe",
    "moe_experts": "moe",
    "moe_combine": "moe",
}


def _check(name: str, boundaries: tuple[str, ...]) -> tuple[str, ...]:
    if name not in MODES:
        raise ValueError(f"unknown rl_kernel mode {name!r}; choose one of {MODES}")
    for b in boundaries:
        if b not in BOUNDARIES:
            raise ValueError(f"unknown rl_kernel boundary {b!r}; choose from {BOUNDARIES}")
    return boundaries or BOUNDARIES


def _from_env() -> dict[str, str]:
    default = os.environ.get("RL_KERNEL_MODE", "strict")
    state = {}
    for b in BOUNDARIES:
        value = os.environ.get(f"RL_KERNEL_MODE_{b.upper()}", default)
        _check(value, (b,))
        state[b] = value
    return state


_state: dict[str, str] = _from_env()


def get_mode(boundary: str) -> str:
    """The mode ('strict' or 'native') in force for `boundary` in this process."""
    return _state[boundary]


def current_modes() -> dict[str, str]:
    return dict(_state)


def full_modes(modes: dict[str, str] | None = None) -> dict[str, str]:
    """Every boundary's mode: those `modes` names, strict elsewhere; ValueError on an unknown mode or boundary.
    What an engine started in another process is given explicitly (not through the environment)."""
    full = dict.fromkeys(BOUNDARIES, "strict")
    for boundary, name in (modes or {}).items():
        _check(name, (boundary,))
        full[boundary] = name
    return full


def set_mode(name: str, *boundaries: str) -> None:
    """Set the mode for the given boundaries (all when none are named) for this process."""
    for b in _check(name, boundaries):
        _state[b] = name


@contextlib.contextmanager
def mode(name: str, *boundaries: str) -> Iterator[None]:
    """`with rl_kernel.mode("native", "attention"):` runs the block with that mode, then restores."""
    saved = dict(_state)
    set_mode(name, *boundaries)
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


# ---- the deployment's canonical TP -----------------------------------------------------------------
# Row-parallel GEMMs cut K into C = canonical_tp groups (one per rank of the widest TP engine of the run),
# so every TP dividing C computes the same tree of group partials. It is part of the GEMM contract's
# fingerprint on backends that honour it: both engines of a run must use the same C.


def _canonical_tp_from_env() -> int:
    value = int(os.environ.get("RL_KERNEL_CANONICAL_TP", "1"))
    _check_canonical_tp(value)
    return value


def _check_canonical_tp(c: int) -> None:
    if not isinstance(c, int) or c < 1 or c & (c - 1):
        raise ValueError(
            f"canonical TP must be a power of two >= 1 (the largest TP of any engine of the run), got {c!r}"
        )


_canonical_tp = _canonical_tp_from_env()


def canonical_tp() -> int:
    """C: the largest tensor-parallel size of any engine of this run (RL_KERNEL_CANONICAL_TP, default 1)."""
    return _canonical_tp


def set_canonical_tp(c: int) -> None:
    """Set C for this process. Trainer and rollout engines of one run must set the same C."""
    global _canonical_tp
    _check_canonical_tp(c)
    _canonical_tp = c


# ---- the deployment's logit dtype ------------------------------------------------------------------
# The logprob contracts' logits: the LM head's fp32 chain as it is (float32, the default), or rounded once to
# bf16 (bfloat16), as a native F.linear returns them. Part of the logprob contracts' fingerprints: both engines
# of a run must use the same one.
LOGITS_DTYPES = ("float32", "bfloat16")


def _check_logits_dtype(name: str) -> str:
    if name not in LOGITS_DTYPES:
        raise ValueError(
            f"logits dtype must be one of {LOGITS_DTYPES} (the LM head's fp32 result as it is, or "
            f"rounded once to bf16), got {name!r}"
        )
    return name


_logits_dtype = _check_logits_dtype(os.environ.get("RL_KERNEL_LOGITS_DTYPE", "float32"))


def logits_dtype() -> str:
    """The logprob contracts' logit dtype in this process (RL_KERNEL_LOGITS_DTYPE, default 'float32')."""
    return _logits_dtype


def set_logits_dtype(name: str) -> None:
    """Set the logit dtype ('float32' or 'bfloat16') for this process. Trainer and rollout engines of one run
    must set the same one."""
    global _logits_dtype
    _logits_dtype = _check_logits_dtype(name)
