"""Strict causal attention on the torch backend, for packed prefill and for a paged KV cache.

A query at position p attends to keys 0..p of its sequence. Keys are taken in chunks of CHUNK
positions counted from position 0; a chunk's keys beyond p are masked (score -inf, value 0), so a
chunk holds the same logical content whether the keys come from a packed batch, a paged cache, a
prefill, a decode step or another context-parallel rank. Each chunk gives a partial (m, l, o):
its fp32 max score, sum of exp(s - m) and sum of exp(s - m) * v. Partials merge in key order:
left to right inside a split of SPLIT_CHUNKS chunks, then the splits left to right, each merge
rescaling by exp(m_old - m_new). The output is o / l rounded once to q's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from rl_kernel.backends.torch.numerics import blocked_sum, exp32

CHUNK = 64
SPLIT_CHUNKS = 16


@dataclasses.dataclass
class Partial:
    m: torch.Tensor  # [R, H] fp32 max score (-inf where a row has no key)
    l: torch.Tensor  # [R, H] fp32 sum of exp(s - m)
    o: torch.Tensor  # [R, H, d] fp32 sum of exp(s - m) * v

    def rows(self, index: torch.Tensor) -> Partial:
        return Partial(self.m[index], self.l[index], self.o[index])

    def put(self, index: torch.Tensor, other: Partial) -> None:
        self.m[index], self.l[index], self.o[index] = other.m, other.l, other.o


def chunk_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> Partial:
    """Partial of one key chunk. q [R, H, d] fp32; k, v [R, S, Hkv, d] (any float dtype, invalid
    entries may hold garbage); valid [R, S] bool."""
    heads, kv_heads = q.shape[1], k.shape[2]
    k32 = k.to(torch.float32).repeat_interleave(heads // kv_heads, dim=2)  # [R, S, H, d]
    scores = blocked_sum(q.unsqueeze(1) * k32).transpose(1, 2) * scale  # [R, H, S]
    mask = valid.unsqueeze(1)
    scores = torch.where(mask, scores, -math.inf)
    m = scores.amax(-1)  # max is exact: no order to fix
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.where(mask, exp32(scores - m_safe.unsqueeze(-1)), 0.0)
    v32 = torch.where(valid[:, :, None, None], v.to(torch.float32), 0.0).repeat_interleave(heads // kv_heads, dim=2)
    o = blocked_sum(p.unsqueeze(2) * v32.permute(0, 2, 3, 1))  # [R, H, d]
    return Partial(m, blocked_sum(p), o)


def merge(a: Partial, b: Partial) -> Partial:
    """a then b, in key order: rescale both to the larger max and add (fp32, one rounding per op)."""
    m = torch.maximum(a.m, b.m)
    ea, eb = exp32(a.m - m), exp32(b.m - m)
    return Partial(m, a.l * ea + b.l * eb, a.o * ea.unsqueeze(-1) + b.o * eb.unsqueeze(-1))


def attend(
    q_pos: torch.Tensor,
    partial_of_chunk: Callable[[int, torch.Tensor], Partial],
    heads: int,
    head_dim: int,
) -> Partial:
    """Fold the chunk partials of every query in the contract's order. `partial_of_chunk(c, rows)`
    returns the partial of key chunk c for the query rows `rows` (all of which have c*CHUNK <= pos)."""
    rows_total = q_pos.shape[0]
    device = q_pos.device
    last_chunk = torch.div(q_pos, CHUNK, rounding_mode="floor")
    total = Partial(
        torch.full((rows_total, heads), -math.inf, device=device),
        torch.zeros(rows_total, heads, device=device),
        torch.zeros(rows_total, heads, head_dim, device=device),
    )
    split = Partial(total.m.clone(), total.l.clone(), total.o.clone())
    num_chunks = int(last_chunk.max().item()) + 1 if rows_total else 0
    for c in range(num_chunks):
        rows = torch.nonzero(last_chunk >= c).squeeze(1)
        part = partial_of_chunk(c, rows)
        split_part = part if c % SPLIT_CHUNKS == 0 else merge(split.rows(rows), part)
        split.put(rows, split_part)
        ends = (c % SPLIT_CHUNKS == SPLIT_CHUNKS - 1) | (last_chunk[rows] == c)
        done = rows[ends]
        if done.numel():
            finished = split.rows(done)
            total.put(done, finished if c < SPLIT_CHUNKS else merge(total.rows(done), finished))
    return total


def _attend_gathered(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    key_index: Callable[[int, torch.Tensor], torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Attention where key position j of query row r lives at row key_index(c, rows)[r, j] of the
    flat stores k_rows, v_rows [N, Hkv, d]."""
    q32 = q.to(torch.float32)
    offsets = torch.arange(CHUNK, device=q.device)

    def partial_of_chunk(c: int, rows: torch.Tensor) -> Partial:
        key_pos = c * CHUNK + offsets
        valid = key_pos.unsqueeze(0) <= q_pos[rows].unsqueeze(1)
        index = key_index(c, rows).clamp(0, k_rows.shape[0] - 1)
        return chunk_partial(q32[rows], k_rows[index], v_rows[index], valid, scale)

    total = attend(q_pos, partial_of_chunk, q.shape[1], q.shape[2])
    return (total.o / total.l.unsqueeze(-1)).to(q.dtype)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, H, d], k, v [T, Hkv, d], cu_seqlens [B+1]."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    q_pos = torch.arange(q.shape[0], device=q.device) - cu[:-1][seq_of_row]
    offsets = torch.arange(CHUNK, device=q.device)

    def key_index(c: int, rows: torch.Tensor) -> torch.Tensor:
        return cu[:-1][seq_of_row[rows]].unsqueeze(1) + c * CHUNK + offsets

    return _attend_gathered(q, q_pos, k, v, key_index, scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new queries over a paged KV cache [num_blocks, block_size, Hkv, d]."""
    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q.device), q_lens)
    first_pos = seq_lens.to(torch.int64) - q_lens
    q_pos = torch.arange(q.shape[0], device=q.device) - qsl[:-1][seq_of_row] + first_pos[seq_of_row]
    block_size = k_cache.shape[1]
    table = block_table.to(torch.int64)
    offsets = torch.arange(CHUNK, device=q.device)

    def key_index(c: int, rows: torch.Tensor) -> torch.Tensor:
        pos = c * CHUNK + offsets
        block_col = torch.div(pos, block_size, rounding_mode="floor").clamp(max=table.shape[1] - 1)
        blocks = table[seq_of_row[rows]][:, block_col]
        return blocks * block_size + pos % block_size

    k_rows = k_cache.reshape(-1, *k_cache.shape[2:])
    v_rows = v_cache.reshape(-1, *v_cache.shape[2:])
    return _attend_gathered(q, q_pos, k_rows, v_rows, key_index, scale)
