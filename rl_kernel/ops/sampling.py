"""Batch-invariant sampling: each row's token from its own strict log-probabilities, seed and position.

Strict contract (torch and Triton backends; `rl_kernel.backends.torch.sampling` states the steps): token t is
argmax_v (lp[t, v] + g(key[t], v)), a Gumbel-max sample of softmax(lp[t]), where the noise g is a hash of
(key, v) alone and key[t] = row_keys(seed[t], step[t]). So a token depends on its row's log-probabilities, its
request's seed and its position in the response, never on the batch it shares a step with, on the batch's
order, or on what the engine sampled before (preemption, restarts and resumed runs draw the same tokens). The
sampled row becomes one-hot in place: -inf everywhere but the token, whose entry keeps its log-probability bits.

The two backends share the integer hash and the argmax (lowest id on ties); the fp32 `log` is each backend's
own, so the torch and Triton picks agree except where two scores lie within a few ulps of each other. The
native form is vLLM's sampler: an exponential race drawn from the device's global generator, whose draws
depend on the batch (a row's noise is read at its position in one batch-wide `exponential_`).
"""

from __future__ import annotations

import torch

from rl_kernel.backends.torch.sampling import one_hot_
from rl_kernel.ops.spec import OpSpec

GOLDEN64 = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (uint64 in int64: products and sums wrap mod 2^64)."""
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """int64 [R] keys of rows from their request seeds and steps (int64 [R]; a seed's bits are read as uint64):
    mix64(mix64(seed + G) + (step + 1) G), G = 2^64 / golden ratio, every operation mod 2^64."""
    g = _signed(GOLDEN64)
    return _mix64(_mix64(seeds + g) + (steps + 1) * g)


def seed_bits(seed: int) -> int:
    """A Python int seed as the int64 whose bits are its value mod 2^64 (what `row_keys` reads)."""
    return _signed(int(seed) & _M64)


def native_sample_(lp: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """vLLM's random sampler on the rows (keys unused): softmax, an exponential race from the global generator
    over the whole selection at once, argmax; the rows made one-hot as the strict form does."""
    del keys
    picked = lp.index_select(0, rows)
    race = picked.softmax(-1) / torch.empty_like(picked).exponential_()
    return one_hot_(lp, rows, picked, race.argmax(-1))


SAMPLING = OpSpec(
    "gumbel_sample",
    "logprob",
    __name__,
    native=native_sample_,
    kernels={"torch": "rl_kernel.backends.torch.sampling", "triton": "rl_kernel.backends.triton.sampling"},
)
_TERMS = dict(
    input_dependency="token[t] depends on lp[t, :], seed[t], step[t]",
    partition="rows independent; a row's noise is a function of (key, token id) alone",
    merge_order="argmax over the row: the largest score, the lowest token id on ties (NaN scores as +inf)",
    precision="key: splitmix64 mix of (seed, step) in uint64; noise: u = (2 (h >> 9) + 1) 2^-24 exact in fp32 "
    "from a uint32 hash h of (key, id); score = lp + -log(-log(u)) in fp32",
    rounding="the sampled row: -inf but the token, whose log-probability bits are kept",
)
SAMPLING.contract("torch", 1, **_TERMS, primitives="wrapping int64 mul, xor, shift; torch fp32 log, add; argmax")
SAMPLING.contract(
    "triton",
    1,
    **_TERMS,
    primitives="wrapping uint32 mul, xor, shift; Triton fp32 log, add (no FMA); per-tile then per-row argmax",
)


def gumbel_sample_(logprobs: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token for each of `rows` (int64 [R], default every row) of fp32 log-probabilities [T, V]
    (natural log; each row's probabilities over its support sum to 1) from the rows' keys (int64 [R],
    `row_keys(seeds, steps)`), and make those rows one-hot in place: -inf but the token's own log-probability.
    Returns the tokens (int64 [R]). `keys` and `rows` must be on the log-probs' device."""
    if rows is None:
        rows = torch.arange(logprobs.shape[0], device=logprobs.device)
    if logprobs.dtype != torch.float32 or logprobs.dim() != 2 or logprobs.stride(-1) != 1:
        raise ValueError(
            f"gumbel_sample_ needs fp32 [T, V] log-probs with unit column stride, got {logprobs.dtype} "
            f"{tuple(logprobs.shape)} strides {logprobs.stride()}"
        )
    if rows.shape != keys.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and keys {tuple(keys.shape)} must be equal 1-d shapes")
    if not SAMPLING.is_strict():
        SAMPLING.record_native(logprobs.device)
        return native_sample_(logprobs, keys, rows)
    _, kernels = SAMPLING.strict(logprobs.device, logprobs)
    return kernels.sample_(logprobs, keys.to(torch.int64), rows.to(torch.int64))
