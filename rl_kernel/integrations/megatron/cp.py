"""Context parallelism for packed sequences under the strict attention contract.

Tokens are dealt to CP ranks in *units* of `layout.unit` positions (a multiple of the 64-key chunk):
unit u (positions [u*unit, (u+1)*unit)) of packed sequence b lives on CP rank (b + u) % cp, for every
layer's queries, keys and values alike. `cp_unit(device)` picks the unit the strict attention backend
needs: 64 for the torch backend, 512 (one KV split) for the Triton backend.

Torch backend. The strict attention of a query is a fold of per-chunk partials (m, l, o) in global
chunk order (`rl_kernel.backends.torch.attention.attend`). Each rank computes, with `chunk_partial`,
the partials of every query (all ranks' queries are all-gathered) against the key chunks it holds,
sends each partial to the query's rank (all-to-all), and each rank folds the partials of its own
queries with `attend`.

Triton backend. Its contract runs an online softmax chunk by chunk inside a KV split of 8 chunks (512
keys) from the empty state, and merges the *split* partials left to right; a split's state cannot be
rebuilt from per-chunk partials (the online update rounds differently), so the unit of work is the
split, and the layout deals whole splits (unit 512) so that every split's keys sit on one rank. Each
rank computes, for every split it holds, the split partial of every query of that sequence at or
after the split's first key (queries all-gathered, in the model dtype: a bit copy), with the same
`_split_partial` the CP1 kernel runs (`triton.attention.split_partials`); partials go to the queries'
ranks (all-to-all); each rank sorts its partials by (query, split) and folds them left to right from
the empty state with `_merge`, then o / l (`triton.attention.fold_partials`): the operations of the
CP1 split schedule, which equals its fused schedule bit for bit. A layout whose unit is not a multiple
of the split raises StrictModeError (the policy builds layouts with `cp_unit`, so `auto` never does).
Scratch: one (m, l, o) fp32 row per query and split at or before it (about L^2 / 1024 rows for a
sequence of L tokens), as for the CP1 split schedule.

In both, every partial and every merge is the one the CP1 computation performs, so CP gives the CP1
bits, and each key is processed by one rank only.

The backward carries no bit contract: keys and values are all-gathered and the local queries'
gradients come from fp32 SDPA; key/value gradients are summed over the CP group. Native mode uses
the same gather-KV SDPA path in the model dtype (ring-attention style).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_kernel.backends.torch.attention import CHUNK, Partial, attend, chunk_partial
from rl_kernel.errors import StrictModeError

TRITON_SPLIT = 64 * 8  # keys per KV split of the Triton attention contract (chunk 64 x 8 chunks)


def cp_unit(device: torch.device | str) -> int:
    """Positions per CP dealing unit for the strict attention backend that runs on `device`."""
    from rl_kernel.backends import strict_backend

    try:
        backend = strict_backend("attention", torch.device(device))
    except StrictModeError:
        return CHUNK
    return TRITON_SPLIT if backend == "triton" else CHUNK


@dataclass
class TokenLayout:
    """A packed batch (global, the same on every rank) and which CP rank holds each token.

    cu_seqlens [B+1] int64; positions [T] (position inside its sequence); seq_ids [T]; owner [T];
    unit: positions per dealing unit (a multiple of 64; see `cp_unit`).
    """

    cu_seqlens: torch.Tensor
    cp: int = 1
    unit: int = CHUNK
    positions: torch.Tensor = field(init=False)
    seq_ids: torch.Tensor = field(init=False)
    owner: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        cu = self.cu_seqlens = self.cu_seqlens.to(torch.int64).cpu()
        lens = cu.diff()
        if cu.dim() != 1 or int(cu[0]) != 0 or bool((lens < 0).any()):
            raise ValueError(f"cu_seqlens must be [0, ..., T] non-decreasing; got {cu.tolist()}")
        if self.unit < CHUNK or self.unit % CHUNK:
            raise ValueError(f"CP dealing unit {self.unit} must be a positive multiple of {CHUNK} positions")
        self.seq_ids = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        self.positions = torch.arange(int(cu[-1])) - cu[:-1][self.seq_ids]
        self.owner = self.chunk_owner(self.seq_ids, torch.div(self.positions, CHUNK, rounding_mode="floor"))
        self._local = [torch.nonzero(self.owner == r).squeeze(1) for r in range(self.cp)]

    def chunk_owner(self, seq: torch.Tensor, chunk: torch.Tensor | int) -> torch.Tensor:
        """CP rank holding key chunk `chunk` (64 positions) of sequence `seq`."""
        return (seq + chunk // (self.unit // CHUNK)) % self.cp

    def local_index(self, rank: int) -> torch.Tensor:
        """Global indices (ascending) of the tokens CP rank `rank` holds."""
        return self._local[rank]


def _gather_varlen(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-gather tensors whose first dim differs per rank (`counts`): a bit copy."""
    width = max(counts)
    padded = torch.zeros(width, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return [p[:n] for p, n in zip(parts, counts)]


def _exchange(send: torch.Tensor, counts_out: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all of rows: the first counts_out[d] rows of `send` go to rank d (rank order)."""
    counts_in = torch.empty(len(counts_out), dtype=torch.int64, device=send.device)
    dist.all_to_all_single(counts_in, torch.tensor(counts_out, dtype=torch.int64, device=send.device), group=group)
    recv = send.new_empty(int(counts_in.sum()), *send.shape[1:])
    dist.all_to_all_single(recv, send.contiguous(), counts_in.tolist(), counts_out, group=group)
    return recv


def strict_cp_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    scale: float,
    group: dist.ProcessGroup,
    backend: str = "torch",
) -> torch.Tensor:
    """Strict attention of this CP rank's queries; q [n, H, d], k, v [n, Hkv, d] are the rows of
    `layout.local_index(rank)`. Returns [n, H, d] in q's dtype, equal to the rows of the CP1 result of
    `backend`'s contract ("torch" or "triton")."""
    if backend == "triton":
        return _triton_cp_forward(q, k, v, layout, scale, group)
    if backend != "torch":
        raise StrictModeError("attention", backend, "no context-parallel attention for this backend")
    rank, cp = dist.get_rank(group), layout.cp
    heads, hd, device = q.shape[1], q.shape[2], q.device
    idx = [layout.local_index(r) for r in range(cp)]
    counts = [int(i.numel()) for i in idx]
    q_all = torch.cat(_gather_varlen(q.to(torch.float32), counts, group))
    glob = torch.cat(idx)
    q_pos, q_seq = layout.positions[glob].to(device), layout.seq_ids[glob].to(device)
    q_dest = torch.repeat_interleave(torch.arange(cp), torch.tensor(counts)).to(device)
    q_row = torch.cat([torch.arange(n) for n in counts]).to(device)
    to_local = torch.full((int(layout.cu_seqlens[-1]) + 1,), -1, dtype=torch.int64, device=device)
    to_local[idx[rank].to(device)] = torch.arange(counts[rank], device=device)
    seq_start = layout.cu_seqlens.to(device)[:-1]
    seq_end = layout.cu_seqlens.to(device)[1:]
    last_chunk = torch.div(q_pos, CHUNK, rounding_mode="floor")
    offsets = torch.arange(CHUNK, device=device)

    pieces, meta = [], []
    for c in range(int(last_chunk.max()) + 1 if q_pos.numel() else 0):
        rows = torch.nonzero((last_chunk >= c) & (layout.chunk_owner(q_seq, c) == rank)).squeeze(1)
        if not rows.numel():
            continue
        key_pos = c * CHUNK + offsets
        valid = key_pos.unsqueeze(0) <= q_pos[rows].unsqueeze(1)
        key_glob = (seq_start[q_seq[rows]].unsqueeze(1) + key_pos).clamp(max=seq_end[q_seq[rows]].unsqueeze(1) - 1)
        local = to_local[key_glob].clamp(min=0)  # keys of a valid position are held here by construction
        part = chunk_partial(q_all[rows], k[local], v[local], valid, scale)
        pieces.append(torch.cat([part.m.unsqueeze(-1), part.l.unsqueeze(-1), part.o], dim=-1))
        meta.append(torch.stack([q_dest[rows], q_row[rows], torch.full_like(rows, c)], dim=1))
    payload = torch.cat(pieces) if pieces else q.new_zeros(0, heads, hd + 2, dtype=torch.float32)
    meta_t = torch.cat(meta) if meta else torch.zeros(0, 3, dtype=torch.int64, device=device)
    order = torch.argsort(meta_t[:, 0], stable=True)
    counts_out = torch.bincount(meta_t[:, 0], minlength=cp).tolist()
    payload = _exchange(payload[order], counts_out, group)
    meta_t = _exchange(meta_t[order], counts_out, group)

    n = counts[rank]
    my_pos = layout.positions[idx[rank]].to(device)
    chunks = int(torch.div(my_pos, CHUNK, rounding_mode="floor").max()) + 1 if n else 0
    table = torch.zeros(n, chunks, heads, hd + 2, dtype=torch.float32, device=device)
    table[meta_t[:, 1], meta_t[:, 2]] = payload

    def partial_of_chunk(c: int, rows: torch.Tensor) -> Partial:
        t = table[rows, c]
        return Partial(t[..., 0], t[..., 1], t[..., 2:])

    total = attend(my_pos, partial_of_chunk, heads, hd)
    return (total.o / total.l.unsqueeze(-1)).to(q.dtype)


def _split_keys(split_chunks: int | None) -> int:
    from rl_kernel.backends.triton import attention as triton_attention

    return triton_attention.CHUNK * (split_chunks or triton_attention.SPLIT_CHUNKS)


def triton_rank_partials(
    q_sorted: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    rank: int,
    scale: float,
    *,
    split_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton split partials CP rank `rank` owes: for every KV split it holds (keys k, v [n, Hkv, d], the
    rows of `layout.local_index(rank)`), the partial of every query of that sequence at or after the
    split's first key. q_sorted [T, H, d]: all queries of the packed batch in global order.

    Returns (payload [N, H, d + 2] fp32: m, l, o per row; meta [N, 3] int64 on the CPU: the query's
    rank, its row there, the split index). `split_chunks` other than the contract's (8) is for the
    native twin in tests only: its partials are not the contract's."""
    from rl_kernel.backends.triton.attention import split_partials

    keys = _split_keys(split_chunks)
    if layout.unit % keys:
        raise StrictModeError(
            "attention",
            "triton",
            f"the CP layout deals tokens in units of {layout.unit} "
            f"positions, but each KV split of {keys} keys must sit on one rank; build the "
            "TokenLayout with unit=cp_unit(device)",
        )
    heads, d = q_sorted.shape[1], q_sorted.shape[2]
    cu = layout.cu_seqlens
    lens = cu.diff()
    n_split = torch.div(lens + keys - 1, keys, rounding_mode="floor")
    task_b = torch.repeat_interleave(torch.arange(lens.numel()), n_split)
    task_s = torch.arange(task_b.numel()) - torch.repeat_interleave(n_split.cumsum(0) - n_split, n_split)
    mine = (task_b + task_s * keys // layout.unit) % layout.cp == rank
    task_b, task_s = task_b[mine], task_s[mine]
    pos0 = task_s * keys
    q_len = lens[task_b] - pos0
    q_row = cu[:-1][task_b] + pos0
    out_row = q_len.cumsum(0) - q_len
    n_out = int(q_len.sum())
    to_local = torch.full((int(cu[-1]),), -1, dtype=torch.int64)
    local = layout.local_index(rank)
    to_local[local] = torch.arange(local.numel())
    kv_base = to_local[q_row] - pos0 if q_row.numel() else q_row
    m, l, o = split_partials(
        q_sorted,
        k,
        v,
        q_row,
        pos0,
        q_len,
        out_row,
        kv_base,
        lens[task_b],
        task_s,
        n_out,
        scale,
        split_chunks=split_chunks,
    )
    glob = torch.repeat_interleave(q_row, q_len) + torch.arange(n_out) - torch.repeat_interleave(out_row, q_len)
    rank_row = torch.empty(int(cu[-1]), dtype=torch.int64)
    for r in range(layout.cp):
        rank_row[layout.local_index(r)] = torch.arange(layout.local_index(r).numel())
    meta = torch.stack([layout.owner[glob], rank_row[glob], torch.repeat_interleave(task_s, q_len)], dim=1)
    payload = torch.cat([m.unsqueeze(-1), l.unsqueeze(-1), o], dim=-1) if n_out else m.new_zeros(0, heads, d + 2)
    return payload, meta


def triton_fold(
    payload: torch.Tensor,
    meta: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    *,
    split_chunks: int | None = None,
) -> torch.Tensor:
    """This rank's attention output [n, H, d] in `dtype` from the split partials it received (payload and
    meta as `triton_rank_partials` returns them, any row order); positions [n]: its queries' positions."""
    from rl_kernel.backends.triton.attention import fold_partials

    keys = _split_keys(split_chunks)
    n = positions.numel()
    meta = meta.to(payload.device)
    need = torch.div(positions.to(payload.device), keys, rounding_mode="floor") + 1
    have = torch.bincount(meta[:, 1], minlength=n) if meta.numel() else torch.zeros_like(need)
    if not torch.equal(have, need):
        raise RuntimeError(
            "CP attention: a query did not receive exactly one partial per KV split at or "
            "before it (layout differs between ranks?)"
        )
    order = torch.argsort(meta[:, 1] * (int(need.max()) if n else 1) + meta[:, 2])
    start = torch.zeros(n + 1, dtype=torch.int64, device=payload.device)
    start[1:] = need.cumsum(0)
    p = payload[order]
    return fold_partials(p[..., 0], p[..., 1], p[..., 2:], start, dtype)


def _triton_cp_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    scale: float,
    group: dist.ProcessGroup,
    split_chunks: int | None = None,
) -> torch.Tensor:
    """`strict_cp_attention_forward` under the Triton contract (`split_chunks` != 8: native twin, tests only)."""
    rank, cp = dist.get_rank(group), layout.cp
    idx = [layout.local_index(r) for r in range(cp)]
    counts = [int(i.numel()) for i in idx]
    q_sorted = q.new_empty(int(layout.cu_seqlens[-1]), *q.shape[1:])
    q_sorted[torch.cat(idx).to(q.device)] = torch.cat(_gather_varlen(q, counts, group))  # a bit copy
    payload, meta = triton_rank_partials(q_sorted, k, v, layout, rank, scale, split_chunks=split_chunks)
    order = torch.argsort(meta[:, 0], stable=True)
    counts_out = torch.bincount(meta[:, 0], minlength=cp).tolist()
    payload = _exchange(payload[order.to(q.device)], counts_out, group)
    meta = _exchange(meta[order].to(q.device), counts_out, group)
    return triton_fold(payload, meta, layout.positions[idx[rank]], q.dtype, split_chunks=split_chunks)


def _gathered_sdpa(q, k_full, v_full, layout: TokenLayout, rank: int, scale: float) -> torch.Tensor:
    """Attention of this rank's queries over all keys of their sequences (k_full in global order)."""
    idx = layout.local_index(rank).to(q.device)
    q_seq, q_pos = layout.seq_ids.to(q.device)[idx], layout.positions.to(q.device)[idx]
    rep = q.shape[1] // k_full.shape[1]
    out = torch.empty_like(q)
    cu = layout.cu_seqlens.tolist()
    for b in torch.unique(q_seq).tolist():
        rows = torch.nonzero(q_seq == b).squeeze(1)
        kb = k_full[cu[b] : cu[b + 1]].repeat_interleave(rep, dim=1).transpose(0, 1)
        vb = v_full[cu[b] : cu[b + 1]].repeat_interleave(rep, dim=1).transpose(0, 1)
        mask = torch.arange(kb.shape[1], device=q.device) <= q_pos[rows].unsqueeze(1)
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), kb, vb, attn_mask=mask, scale=scale)
        out = out.index_put((rows,), o.transpose(0, 1))
    return out


def _gather_global(x: torch.Tensor, layout: TokenLayout, group: dist.ProcessGroup) -> torch.Tensor:
    idx = [layout.local_index(r) for r in range(layout.cp)]
    parts = _gather_varlen(x, [int(i.numel()) for i in idx], group)
    full = x.new_empty(int(layout.cu_seqlens[-1]), *x.shape[1:])
    full[torch.cat(idx).to(x.device)] = torch.cat(parts)
    return full


class CPAttention(torch.autograd.Function):
    """Causal GQA attention of packed sequences sharded over a CP group (see module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: TokenLayout, scale: float, group, strict: bool, backend: str = "torch"):
        ctx.save_for_backward(q, k, v)
        ctx.layout, ctx.scale, ctx.group = layout, scale, group
        if strict:
            return strict_cp_attention_forward(q, k, v, layout, scale, group, backend)
        k_full, v_full = _gather_global(k, layout, group), _gather_global(v, layout, group)
        return _gathered_sdpa(q, k_full, v_full, layout, dist.get_rank(group), scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        layout, group = ctx.layout, ctx.group
        rank = dist.get_rank(group)
        with torch.enable_grad():
            q32 = q.detach().to(torch.float32).requires_grad_()
            k_full = _gather_global(k.detach().to(torch.float32), layout, group).requires_grad_()
            v_full = _gather_global(v.detach().to(torch.float32), layout, group).requires_grad_()
            out = _gathered_sdpa(q32, k_full, v_full, layout, rank, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q32, k_full, v_full), grad_out.to(torch.float32))
        dkv = torch.stack([dk, dv])
        dist.all_reduce(dkv, group=group)
        idx = layout.local_index(rank).to(q.device)
        return dq.to(q.dtype), dkv[0][idx].to(k.dtype), dkv[1][idx].to(v.dtype), None, None, None, None, None


def cp_attention(
    q, k, v, layout: TokenLayout, scale: float, group: dist.ProcessGroup, strict: bool, backend: str = "torch"
):
    """q [n, H, d], k, v [n, Hkv, d] of this CP rank's tokens -> [n, H, d] in q's dtype; `backend` names
    the strict contract ("torch" or "triton") whose CP1 bits the strict forward reproduces."""
    if not math.isfinite(scale):
        raise ValueError(f"attention scale must be finite, got {scale}")
    return CPAttention.apply(q, k, v, layout, scale, group, strict, backend)
