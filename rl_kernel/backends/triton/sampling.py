"""Strict Gumbel-max sampling on Triton: the torch contract's hash, noise and argmax, in two launches.

`_tile_kernel` (rows x vocab tiles) scores one tile of a row, lp + -log(-log(u(h(key, id)))), keeps the tile's
best (score, id, log-probability bits) and writes -inf over the tile; `_pick_kernel` (one program a row) takes
the best tile (the lowest on ties, so the lowest id overall), writes the token's log-probability bits back
and the token out. Every row's result depends on its own log-probs and key only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH

BLOCK = 4096


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["tiles"])
def _tile_kernel(lp_ptr, rows_ptr, keys_ptr, score_ptr, id_ptr, bits_ptr, vocab, stride, tiles, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    tile = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    key = tl.load(keys_ptr + i).to(tl.uint64, bitcast=True)
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = (key >> 32).to(tl.uint32)
    local = tl.arange(0, BLOCK)
    cols = tile * BLOCK + local
    mask = cols < vocab
    ptrs = lp_ptr + row * stride + cols
    lp = tl.load(ptrs, mask=mask, other=float("-inf"))
    h = _fmix32(_fmix32(cols.to(tl.uint32) ^ lo) ^ hi)
    u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    score = lp + -tl.log(-tl.log(u))
    score = tl.where(score != score, float("inf"), score)
    score = tl.where(mask, score, float("-inf"))
    best = tl.argmax(score, 0, tie_break_left=True)
    bits = tl.sum(tl.where(local == best, lp.to(tl.int32, bitcast=True), 0), 0)  # one nonzero term: exact
    slot = i * tiles + tile
    tl.store(score_ptr + slot, tl.max(score, 0))
    tl.store(id_ptr + slot, tile * BLOCK + best)
    tl.store(bits_ptr + slot, bits)
    tl.store(ptrs, tl.full((BLOCK,), float("-inf"), tl.float32), mask=mask)


@triton.jit(do_not_specialize=["tiles"])
def _pick_kernel(lp_bits_ptr, rows_ptr, score_ptr, id_ptr, bits_ptr, tokens_ptr, stride, tiles, TILES: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    t = tl.arange(0, TILES)
    mask = t < tiles
    score = tl.load(score_ptr + i * tiles + t, mask=mask, other=float("-inf"))
    best = tl.argmax(score, 0, tie_break_left=True)
    token = tl.sum(tl.where(t == best, tl.load(id_ptr + i * tiles + t, mask=mask, other=0), 0), 0)
    bits = tl.sum(tl.where(t == best, tl.load(bits_ptr + i * tiles + t, mask=mask, other=0), 0), 0)
    tl.store(lp_bits_ptr + row * stride + token, bits)
    tl.store(tokens_ptr + i, token.to(tl.int64))


def sample_(lp: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Sample rows `rows` (int64 [R]) of fp32 lp [T, V] with keys [R], making each such row one-hot (-inf but
    the token's own log-probability bits) in place; returns the tokens (int64 [R])."""
    count, vocab = rows.shape[0], lp.shape[-1]
    tokens = torch.empty(count, dtype=torch.int64, device=lp.device)
    if count == 0 or vocab == 0:
        return tokens
    tiles = triton.cdiv(vocab, BLOCK)
    score = torch.empty(count * tiles, dtype=torch.float32, device=lp.device)
    ids = torch.empty(count * tiles, dtype=torch.int32, device=lp.device)
    bits = torch.empty(count * tiles, dtype=torch.int32, device=lp.device)
    _tile_kernel[(count, tiles)](
        lp, rows, keys, score, ids, bits, vocab, lp.stride(0), tiles, BLOCK=BLOCK, num_warps=8, **LAUNCH
    )
    _pick_kernel[(count,)](
        lp.view(torch.int32),
        rows,
        score,
        ids,
        bits,
        tokens,
        lp.stride(0),
        tiles,
        TILES=triton.next_power_of_2(tiles),
        **LAUNCH,
    )
    return tokens
