"""The Triton kernels' logic on CPU, through Triton's interpreter (TRITON_INTERPRET=1), for CI.

    TRITON_INTERPRET=1 python tests/gpu/interpreter_checks.py

Run by `test_triton_interpreter.py` in a subprocess (the variable must be set before the kernels are
defined). Two interpreter limits are worked around here, not in the kernels: its bf16 conversions
truncate (so inputs are fp16 / fp32), and its `tl.dot` is numpy's matmul, whose per-element result
depends on the row's position in the block (BLAS blocking). The dot is therefore replaced by a chain of
k16 steps, each an exact fp64 product sum added onto the fp32 accumulator with one rounding: position-
and tile-invariant like the tensor cores' chained k16 MMAs. What this checks: the kernels' indexing,
masking, schedules, group tree, split merge and fixed-point sums; the bits on a GPU are checked by
test_triton_kernels.py there.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from triton.runtime import interpreter as _interp  # noqa: E402


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """k16 steps in ascending K, each an exact product sum added onto the fp32 accumulator with one rounding."""
    a64, b64 = a.data.astype(np.float64), b.data.astype(np.float64)
    acc = d.data.astype(np.float32)
    for k0 in range(0, a64.shape[-1], 16):
        step = np.einsum("...mk,...kn->...mn", a64[..., k0 : k0 + 16], b64[..., k0 : k0 + 16, :], optimize=False)
        acc = (acc.astype(np.float64) + step).astype(np.float32)
    return _interp.TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)


_interp.InterpreterBuilder.create_dot = _dot
np.seterr(invalid="ignore", divide="ignore")  # rows past a sequence's end compute 0/0 and are never stored

from rl_kernel.backends.torch import activation as torch_act  # noqa: E402
from rl_kernel.backends.torch import moe as torch_moe  # noqa: E402
from rl_kernel.backends.torch import norm as torch_norm  # noqa: E402
from rl_kernel.backends.torch import rope as torch_rope  # noqa: E402
from rl_kernel.backends.torch import sampling as torch_sampling  # noqa: E402
from rl_kernel.backends.torch.cuda_emulation import CudaScalarDivision  # noqa: E402
from rl_kernel.backends.torch.numerics import blocked_sum, sqrt32, tree_sum  # noqa: E402
from rl_kernel.backends.triton import activation, attention, gemm, logprob, moe, norm, rope, sampling  # noqa: E402
from rl_kernel.bits import bit_mismatches, bits  # noqa: E402
from rl_kernel.ops.norm import native_rms_norm  # noqa: E402
from rl_kernel.ops.rope import native_rope  # noqa: E402
from rl_kernel.ops.sampling import row_keys  # noqa: E402

# The interpreter runs one program per position: a 64-row angle table (the GPU's has 32,768) keeps it quick, and
# positions on both sides of its end take the table's path and the computed one.
rope.TABLE_POSITIONS = 64

F16 = torch.float16
FAILED: list[str] = []


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        FAILED.append(name)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def _rms_norm_contract(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch contract's RMSNorm (eps 1e-6) with a correctly rounded sqrt (CPU torch.sqrt on fp32 is not, on
    some machines)."""
    x32 = x.float()
    r = 1.0 / (blocked_sum(x32 * x32) / x.shape[-1] + 1e-6).double().sqrt().float()
    return ((x32 * r[:, None]).to(x.dtype).float() * w.float()).to(x.dtype)


def elementwise(gen: torch.Generator) -> None:
    for dtype in (F16, torch.float32):
        widths = ((19, 200, ""), (5, 1100, " with a partial last block"), (3, 5120, " in two chunks of blocks"))
        for rows, d, what in widths:  # 1100: 17 blocks and 12
            x, w = (torch.randn(rows, d, generator=gen) * 3).to(dtype), torch.randn(d, generator=gen).to(dtype)
            check(
                f"rms_norm {dtype}{what} == torch contract", same(norm.rms_norm(x, w, 1e-6), _rms_norm_contract(x, w))
            )
        x, w = (torch.randn(19, 200, generator=gen) * 3).to(dtype), torch.randn(200, generator=gen).to(dtype)
        # a program takes 16 rows of 200: each row's bits as in a batch of its own
        many = torch.cat([x, (torch.randn(40, 200, generator=gen) * 3).to(dtype)])
        check(
            f"rms_norm {dtype} rows per program move no bit",
            same(norm.rms_norm(many, w, 1e-6)[: x.shape[0]], norm.rms_norm(x, w, 1e-6)),
        )
        res = (torch.randn(19, 200, generator=gen) * 3).to(dtype)
        y, summed = norm.rms_norm_residual(x, res, w, 1e-6)
        check(f"rms_norm {dtype} with residual: the sum", same(summed, x + res))
        check(f"rms_norm {dtype} with residual == torch contract", same(y, _rms_norm_contract(x + res, w)))
        qkv = (torch.randn(5, 6 * 64, generator=gen) * 3).to(dtype)  # q of 4 heads out of a fused QKV, in place
        q = qkv[:, : 4 * 64].view(5, 4, 64)
        check(
            f"rms_norm {dtype} of a strided [T, H, D] view == of its copy",
            same(norm.rms_norm(q, w[:64], 1e-6), norm.rms_norm(q.contiguous(), w[:64], 1e-6)),
        )
        qk, wk = qkv[:, : 5 * 64].view(5, 5, 64), torch.randn(64, generator=gen).to(dtype)  # 4 q heads, 1 k head
        ref = torch.cat(
            [
                _rms_norm_contract(qk[:, :4].reshape(-1, 64), w[:64]).view(5, 4, 64),
                _rms_norm_contract(qk[:, 4:].reshape(-1, 64), wk).view(5, 1, 64),
            ],
            dim=1,
        )
        check(
            f"rms_norm {dtype} of q and k heads in one launch == torch contract",
            same(norm.rms_norm_heads(qk, w[:64], wk, 4, 1e-6), ref),
        )
        x = (torch.randn(7, 600, generator=gen) * 4).to(dtype)
        check(f"silu_and_mul {dtype} == torch backend", same(activation.silu_and_mul(x), torch_act.silu_and_mul(x)))
        x = torch.randn(9, 3, 32, generator=gen).to(dtype)
        for rd in (32, 16):
            cos, sin = torch_rope.cos_sin(torch.arange(9) * 37, rd, 1e6)
            check(
                f"rope {dtype} rotary {rd} == torch backend",
                same(rope.rotate(x, cos, sin, rd), torch_rope.rotate(x, cos, sin, rd)),
            )
        x = torch.randn(64, 2, 32, generator=gen).to(dtype)
        far_positions = torch.randint(0, 1 << 20, (64,), generator=gen)  # angles over many turns: all 4 quadrants
        for rd, theta in ((32, 1e6), (16, 10000.0), (32, 1e6 / 3)):  # 1e6 / 3: a theta with no exact fp32 value
            cos, sin = torch_rope.cos_sin(far_positions, rd, theta)
            check(
                f"rope {dtype} rotary {rd} theta {theta:g}, cos/sin computed in the kernel == torch backend's table",
                same(rope.rotate_at(x, far_positions, theta, rd), torch_rope.rotate(x, cos, sin, rd)),
            )


# (D, rows): a partial last block of 64 (1100, 200, 65), a row in two chunks of 64 blocks (5120), other non-powers of
# two (1536), and the production widths (4096, 2048, 128), where 1 / D is exact.
NORM_WIDTHS = ((1100, 128), (5120, 24), (200, 256), (1536, 64), (65, 256), (4096, 16), (2048, 32), (128, 256))
NORM_SEEDS = range(4)


def _rms_norm_dividing_by_d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch backend's rms_norm before it divided by a tensor: `sum / D` with D a Python int (eps 1e-6)."""
    x32 = x.float()
    r = 1.0 / sqrt32(blocked_sum(x32 * x32) / x.shape[-1] + 1e-6)
    return ((x32 * r[:, None]).to(x.dtype).float() * w.float()).to(x.dtype)


def norm_widths(gen: torch.Generator) -> None:
    """rms_norm over many seeds and widths == the torch backend as CUDA torch runs it (`CudaScalarDivision`: a
    tensor over a host scalar is a product with its reciprocal), the comparison that failed on the H200 at D = 1100.
    The twin: the torch formula of that run (`sum / D`), run the CUDA way, differs from the kernel at 1100 and 5120."""
    for dtype in (F16, torch.float32):
        twin_bad = {}
        for d, rows in NORM_WIDTHS:
            rows = rows if dtype == F16 else rows // 4  # an fp32 output shows a moved bit of r far more often
            bad = 0
            for seed in NORM_SEEDS:
                g = torch.Generator().manual_seed(seed)
                x, w = (torch.randn(rows, d, generator=g) * 3).to(dtype), torch.randn(d, generator=g).to(dtype)
                y = norm.rms_norm(x, w, 1e-6)
                with CudaScalarDivision():
                    ref, old = torch_norm.rms_norm(x, w, 1e-6), _rms_norm_dividing_by_d(x, w)
                bad += bit_mismatches(y, ref)
                twin_bad[d] = twin_bad.get(d, 0) + int(not same(y, old))
            what = f"D={d}, {len(NORM_SEEDS)} seeds x {rows} rows"
            check(f"rms_norm {dtype} {what} == torch backend as on CUDA ({bad} elements differ)", bad == 0)
        powers_of_two = twin_bad[4096] + twin_bad[2048] + twin_bad[128]
        check(
            f"rms_norm {dtype}: `sum / D` the CUDA way differs at 1100 and 5120, not at 2^k (twin: {twin_bad})",
            twin_bad[1100] > 0 and twin_bad[5120] > 0 and powers_of_two == 0,
        )


def qk_norm_rope(gen: torch.Generator) -> None:
    """The fused QK-norm + RoPE kernel == the two kernels it replaces (`rms_norm_heads` then `rotate_at`), in raw
    bits: head widths with a partial last block and dims past rotary_dim, head counts over several head blocks and
    odd ones, q heads out of a wider fused QKV read in place; and a token alone == the same token in a batch."""
    cases = (  # (tokens, q heads, k heads, head dim, rotary dim, theta)
        (5, 4, 2, 128, 128, 1e6),
        (3, 16, 4, 128, 128, 1e6),  # 20 heads: two head blocks, the second partial
        (7, 3, 1, 64, 64, 10000.0),
        (4, 2, 1, 200, 128, 1e6 / 3),  # 4 blocks of 64, the last partial; 72 dims past rotary_dim
    )
    for dtype in (F16, torch.float32):
        for t, hq, hk, d, rd, theta in cases:
            qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype)
            qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)  # a strided view, as the model's
            wq, wk = torch.randn(d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)
            pos = torch.randint(0, 1 << 20, (t,), generator=gen)
            fused = rope.qk_norm_rope(qk, wq, wk, hq, 1e-6, pos, theta, rd)
            unfused = rope.rotate_at(norm.rms_norm_heads(qk, wq, wk, hq, 1e-6), pos, theta, rd)
            what = f"{dtype} T {t} heads {hq}+{hk} d {d} rotary {rd}"
            check(f"qk_norm_rope {what} == rms_norm_heads then rope", same(fused, unfused))
            alone = rope.qk_norm_rope(qk[t - 1 : t], wq, wk, hq, 1e-6, pos[t - 1 : t], theta, rd)
            check(f"qk_norm_rope {what}: the last token alone == in the batch", same(alone, fused[t - 1 : t]))
            if dtype == F16 and rd == d:  # the native twin: the framework's norm and rope give other bits
                native = torch.cat(
                    [native_rms_norm(qk[:, :hq], wq, 1e-6), native_rms_norm(qk[:, hq:], wk, 1e-6)], dim=1
                )
                native = native_rope(native, pos, theta, rd)
                check(f"qk_norm_rope {what}: native norm + rope differ (twin)", not same(native, fused))


def angle_table(gen: torch.Generator) -> None:
    """RoPE's angle table (rows 0..TABLE_POSITIONS-1) == the torch backend's cos/sin bits; rope and QK-norm + RoPE at
    positions on both sides of its end, read from it or computed, == the computed path and the torch backend."""
    for rd, theta in ((32, 1e6), (24, 1e6 / 3)):  # 24: a half of 12 in a 16-wide block
        table = rope.angle_table(theta, rd, torch.device("cpu"))
        cos, sin = torch_rope.cos_sin(torch.arange(rope.TABLE_POSITIONS), rd, theta)
        check(
            f"angle table rotary {rd} theta {theta:g} == torch backend's cos, sin",
            same(table, torch.stack([cos, sin], 1)),
        )
        address = table.data_ptr()
        table.fill_(float("nan"))  # an engine's dropped memory
        rope.refill_angle_tables()
        check(
            f"angle table rotary {rd}: refilled in place == torch backend's cos, sin",
            table.data_ptr() == address and same(table, torch.stack([cos, sin], 1)),
        )
        pos = torch.tensor([0, 1, rope.TABLE_POSITIONS - 1, rope.TABLE_POSITIONS, 5000, 17, 1 << 19])
        x = (torch.randn(len(pos), 3, 32, generator=gen) * 3).to(F16)
        cos, sin = torch_rope.cos_sin(pos, rd, theta)
        reference = torch_rope.rotate(x, cos, sin, rd)
        check(f"rope rotary {rd} from the table == torch backend", same(rope.rotate_at(x, pos, theta, rd), reference))
        check(
            f"rope rotary {rd} computed == torch backend",
            same(rope.rotate_at(x, pos, theta, rd, use_table=False), reference),
        )
        wq, wk = torch.randn(32, generator=gen).to(F16), torch.randn(32, generator=gen).to(F16)
        fused = rope.qk_norm_rope(x, wq, wk, 2, 1e-6, pos, theta, rd)
        check(
            f"qk_norm_rope rotary {rd} from the table == computed",
            same(fused, rope.qk_norm_rope(x, wq, wk, 2, 1e-6, pos, theta, rd, use_table=False)),
        )
        normed = torch_norm.rms_norm_heads(x, wq, wk, 2, 1e-6)
        check(
            f"qk_norm_rope rotary {rd} from the table == torch backend",
            same(fused, torch_rope.rotate(normed, cos, sin, rd)),
        )


def gemms(gen: torch.Generator) -> None:
    for m, n, k in [(5, 70, 256), (70, 64, 512), (3, 20, 100)]:
        x, w = torch.randn(m, k, generator=gen).to(F16), torch.randn(n, k, generator=gen).to(F16)
        fused = gemm.matmul_fp32(x, w, schedule="fused")
        ref = x.double() @ w.double().T
        check(f"gemm {m}x{n}x{k} accuracy", float((fused.double() - ref).norm() / ref.norm()) < 1e-6)
        check(f"gemm {m}x{n}x{k} fused == split", same(fused, gemm.matmul_fp32(x, w, schedule="split")))
        check(f"gemm {m}x{n}x{k} row alone == in batch", same(gemm.matmul_fp32(x[1:2], w), fused[1:2]))
        if k % 8 == 0:  # row-parallel contract with canonical TP 2: two K groups; a TP2 shard holds one
            h = k // 2
            grouped = gemm.matmul_fp32(x, w, h, schedule="fused")
            split = gemm.matmul_fp32(x, w, h, schedule="split")
            check(f"gemm {m}x{n}x{k} 2 groups fused == split", same(grouped, split))
            parts = [gemm.matmul_fp32(x[:, i * h : (i + 1) * h], w[:, i * h : (i + 1) * h], h) for i in range(2)]
            check(f"gemm {m}x{n}x{k} TP2 shards == 2 groups", same(tree_sum(torch.stack(parts, -1)), grouped))
        b = torch.randn(n, generator=gen).to(F16)
        check(f"gemm {m}x{n}x{k} epilogue rounding", same(gemm.linear(x, w, b), (fused + b.float()).to(F16)))


def _paged_matches_packed(
    name: str, q, kc, vc, table, lens: list[int], cu, scale: float, packed, *, tail: int
) -> dict[str, torch.Tensor]:
    """Over three sequences in a paged cache: prefill and decode under both schedules, and a chunked prefill (rows
    30-70 of sequence 0 and the last `tail` rows of sequence 2) == the packed prefill's rows, bitwise. Returns the
    prefill output of each schedule."""
    seq_lens, last = torch.tensor(lens), cu[1:].long() - 1
    prefills = {}
    for schedule in ("split", "fused"):
        prefills[schedule] = attention.paged_attention(q, kc, vc, table, seq_lens, cu, scale, schedule=schedule)
        check(f"{name} prefill ({schedule}) == packed", same(prefills[schedule], packed))
        dec = attention.paged_attention(
            q[last], kc, vc, table, seq_lens, torch.arange(4, dtype=torch.int32), scale, schedule=schedule
        )
        check(f"{name} decode ({schedule}) == packed rows", same(dec, packed[last]))
    rows = torch.cat([torch.arange(30, 70), torch.arange(int(cu[3]) - tail, int(cu[3]))])
    chunks = torch.tensor([0, 40, 40 + tail], dtype=torch.int32)
    out = attention.paged_attention(q[rows], kc, vc, table[[0, 2]], torch.tensor([lens[0], lens[2]]), chunks, scale)
    check(f"{name} chunked prefill == packed rows", same(out, packed[rows]))
    return prefills


def attentions(gen: torch.Generator) -> None:
    heads, kv_heads, d, page = 4, 2, 32, 16
    lens = [70, 5, 40]
    cu = torch.tensor([0, 70, 75, 115], dtype=torch.int32)
    q = torch.randn(115, heads, d, generator=gen).to(F16)
    k, v = torch.randn(115, kv_heads, d, generator=gen).to(F16), torch.randn(115, kv_heads, d, generator=gen).to(F16)
    scale = d**-0.5
    saved = attention.SPLIT_CHUNKS
    attention.SPLIT_CHUNKS = 1  # splits of one chunk, so the short sequences exercise the split merge
    try:
        packed = attention.varlen_attention(q, k, v, cu, scale)
        rep = heads // kv_heads
        ref = []
        for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s = torch.einsum("qhd,khd->hqk", q[a:e].double(), k[a:e].double().repeat_interleave(rep, 1)) * scale
            s = s.masked_fill(torch.ones(e - a, e - a).triu(1).bool(), float("-inf"))
            ref.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:e].double().repeat_interleave(rep, 1)))
        ref = torch.cat(ref)
        check("attention accuracy", float((packed.double() - ref).norm() / ref.norm()) < 2e-3)
        for heavy_first in (False, True):  # program order: no bit may depend on it
            config = dict(attention.PREFILL, FLAT=not attention.PREFILL.get("FLAT", False), HEAVY_FIRST=heavy_first)
            check(
                f"attention FLAT/HEAVY_FIRST={heavy_first} == default",
                same(attention.varlen_attention(q, k, v, cu, scale, config=config), packed),
            )
        wide = torch.randn(115, 3 * kv_heads, d, generator=gen).to(F16)  # k, v as views of a fused projection
        wide[:, :kv_heads], wide[:, kv_heads : 2 * kv_heads] = k, v
        check(
            "attention TMA: the strided k, v views get descriptors (the TMA path runs)",
            None not in attention._descriptors(wide[:, :kv_heads], wide[:, kv_heads : 2 * kv_heads]),
        )
        pointer = attention.varlen_attention(q, k, v, cu, scale, config=dict(attention.PREFILL, TMA=False))
        check(
            "attention TMA descriptor loads (strided k, v) == pointer loads",
            same(
                attention.varlen_attention(
                    q,
                    wide[:, :kv_heads],
                    wide[:, kv_heads : 2 * kv_heads],
                    cu,
                    scale,
                    config=dict(attention.PREFILL, TMA=True),
                ),
                pointer,
            ),
        )
        check("attention default (TMA) == pointer loads", same(packed, pointer))
        check(
            "attention packed prefill (split, merged by the last split program) == fused",
            same(attention.varlen_attention(q, k, v, cu, scale, schedule="split"), packed),
        )
        blocks = torch.randperm(16, generator=gen)
        table = torch.stack([blocks[0:5], blocks[5:10], blocks[10:15]]).to(torch.int32)
        kc, vc = torch.randn(16, page, kv_heads, d, generator=gen).to(F16), torch.randn(16, page, kv_heads, d).to(F16)
        for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
            pos = torch.arange(n)
            slots = table[b, pos // page].long() * page + pos % page
            kc.view(-1, kv_heads, d)[slots], vc.view(-1, kv_heads, d)[slots] = k[a : a + n], v[a : a + n]
        _paged_matches_packed("attention paged", q, kc, vc, table, lens, cu, scale, packed, tail=20)
    finally:
        attention.SPLIT_CHUNKS = saved


def split_decode(gen: torch.Generator) -> None:
    """Decode at batch 1 over 5 splits: the split schedule's one launch (the last split program of a tile and kv
    head to arrive merges the partials) == the fused schedule bitwise, twice in a row (the arrival counters
    reused), and it leaves every arrival counter at 0. (The interpreter runs programs one after another: the
    arrival order is fixed here, races are not exercised.) fp32, so that a change of merge order shows."""
    heads, kv_heads, d, page, ctx = 4, 2, 32, 16, 300
    blocks = -(-ctx // page)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].view(1, -1).to(torch.int32)
    kc, vc = (torch.randn(blocks + 3, page, kv_heads, d, generator=gen) for _ in range(2))
    args = (
        torch.randn(1, heads, d, generator=gen),
        kc,
        vc,
        table,
        torch.tensor([ctx]),
        torch.tensor([0, 1], dtype=torch.int32),
        d**-0.5,
    )
    saved = attention.SPLIT_CHUNKS
    attention.SPLIT_CHUNKS = 1  # 5 splits of 64 keys
    try:
        fused = attention.paged_attention(*args, schedule="fused")
        for run in (1, 2):
            check(
                f"attention decode B=1, 5 splits, split schedule in one launch (run {run}) == fused",
                same(attention.paged_attention(*args, schedule="split"), fused),
            )
        check(
            "attention split schedule leaves its arrival counters at 0",
            len(attention._COUNTERS) > 0 and all(not c.any() for c in attention._COUNTERS.values()),
        )
    finally:
        attention.SPLIT_CHUNKS = saved


def paged_tma(gen: torch.Generator) -> None:
    """A paged cache of 64-token blocks (one chunk a block) is read through TMA descriptors, masked chunks too:
    prefill, decode and chunked prefill over it == packed prefill, and == its own pointer loads, bitwise, with NaN
    in every cache slot no sequence wrote (what a masked chunk's TMA box reads past the context). A 16-token
    cache gets no descriptors (pointer loads)."""
    heads, kv_heads, d, page = 4, 2, 32, attention.CHUNK
    lens = [70, 5, 130]
    cu = torch.tensor([0, 70, 75, 205], dtype=torch.int32)
    q = torch.randn(205, heads, d, generator=gen).to(F16)
    k, v = torch.randn(205, kv_heads, d, generator=gen).to(F16), torch.randn(205, kv_heads, d, generator=gen).to(F16)
    scale = d**-0.5
    packed = attention.varlen_attention(q, k, v, cu, scale)
    table = torch.randperm(9, generator=gen)[:9].view(3, 3).to(torch.int32)
    kc, vc = (torch.full((9, page, kv_heads, d), float("nan")).to(F16) for _ in range(2))
    for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        slots = table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
        kc.view(-1, kv_heads, d)[slots], vc.view(-1, kv_heads, d)[slots] = k[a : a + n], v[a : a + n]
    check("paged TMA: the last block of sequence 0 holds NaN past its context", bool(vc[table[0, 1], 6:].isnan().all()))
    check("paged TMA: a 64-token cache gets descriptors", None not in attention._descriptors(kc, vc, page))
    check(
        "paged TMA: a 16-token cache gets none",
        attention._descriptors(kc.view(36, 16, kv_heads, d), vc.view(36, 16, kv_heads, d), 16) == (None, None),
    )
    prefills = _paged_matches_packed("paged TMA", q, kc, vc, table, lens, cu, scale, packed, tail=30)
    pointer, seq_lens = dict(attention.PAGED, TMA=False), torch.tensor(lens)
    for schedule, out in prefills.items():
        ptr = attention._run(q, kc, vc, cu, seq_lens, table, page, scale, True, schedule, config=pointer)
        check(f"paged TMA prefill ({schedule}) == its pointer loads", same(out, ptr))
    last, decode_rows = cu[1:].long() - 1, torch.arange(4, dtype=torch.int32)
    flat = dict(attention.PAGED, FLAT=True)  # the fused schedule as one loop over chunks
    for rows, starts, name in ((last, decode_rows, "decode"), (torch.arange(205), cu, "prefill")):
        out = attention._run(q[rows], kc, vc, starts, seq_lens, table, page, scale, True, "fused", config=flat)
        check(f"paged TMA {name} FLAT == packed rows", same(out, packed[rows]))


def cp_attention(gen: torch.Generator) -> None:
    """Context parallelism under the Triton contract (`integrations/megatron/cp.py`): each rank's split
    partials, routed as the all-to-all would (a bit copy), folded on the query's rank == CP1 bitwise."""
    from rl_kernel.errors import StrictModeError
    from rl_kernel.integrations.megatron import cp as cpm

    heads, kv_heads, d = 2, 1, 16  # small: the interpreter runs every program in Python
    lens = [260, 130, 1]
    cu = torch.tensor([0, *lens]).cumsum(0)
    t = int(cu[-1])
    q = torch.randn(t, heads, d, generator=gen).to(F16)
    k, v = torch.randn(t, kv_heads, d, generator=gen).to(F16), torch.randn(t, kv_heads, d, generator=gen).to(F16)
    scale = d**-0.5
    saved = attention.SPLIT_CHUNKS
    attention.SPLIT_CHUNKS = 2  # splits of 128 keys, so short sequences span several splits and ranks
    try:
        ref = attention.varlen_attention(q, k, v, cu, scale)

        def run(cp: int, split_chunks: int | None = None) -> torch.Tensor:
            layout = cpm.TokenLayout(cu, cp, unit=128)
            sent = [
                cpm.triton_rank_partials(
                    q, k[layout.local_index(r)], v[layout.local_index(r)], layout, r, scale, split_chunks=split_chunks
                )
                for r in range(cp)
            ]
            out = torch.empty_like(q)
            for r in range(cp):  # what rank r receives: rows addressed to it, in source-rank order
                pay = torch.cat([p[m[:, 0] == r] for p, m in sent])
                meta = torch.cat([m[m[:, 0] == r] for _, m in sent])
                idx = layout.local_index(r)
                out[idx] = cpm.triton_fold(pay, meta, layout.positions[idx], q.dtype, split_chunks=split_chunks)
            return out

        for cp in (2, 3):  # CP3: a sequence's splits land on every rank
            check(f"attention CP{cp} (split partials + ordered fold) == CP1 varlen", same(run(cp), ref))
        twin = run(2, split_chunks=1)
        check("native twin: CP2 folding 64-key chunk partials != the split contract's bits", not same(twin, ref))
        try:
            cpm.triton_rank_partials(q, k, v, cpm.TokenLayout(cu, 2, unit=64), 0, scale)
            check("CP layout dealing 64-key units under Triton raises StrictModeError", False)
        except StrictModeError:
            check("CP layout dealing 64-key units under Triton raises StrictModeError", True)
    finally:
        attention.SPLIT_CHUNKS = saved


def logprobs(gen: torch.Generator) -> None:
    t, d, v, real = 37, 128, 300, 290
    h, w = torch.randn(t, d, generator=gen).to(F16), (torch.randn(v, d, generator=gen) * 0.2).to(F16)
    tg = torch.randint(0, real, (t,), generator=gen)
    temps = torch.rand(t, generator=gen, dtype=torch.float64) + 0.5
    out, _ = logprob.logprobs_and_lse(h, w, tg, temps, 0, real)
    z = (h.double() @ w.double().T)[:, :real] / temps.float().double()[:, None]
    ref = torch.log_softmax(z, -1).gather(1, tg[:, None]).squeeze(1)
    check("logprobs accuracy", float((out.double() - ref).abs().max()) < 1e-5)
    check(
        "logprobs rows alone == in batch",
        same(logprob.logprobs_and_lse(h[5:9], w, tg[5:9], temps[5:9], 0, real)[0], out[5:9]),
    )
    # the one autograd Function of rl_kernel.logprobs, over each backend's kernel module
    from rl_kernel.backends.torch import logprob as torch_logprob
    from rl_kernel.ops.logprob import StrictLogprobs

    g, runs = torch.randn(t, generator=gen), []
    for kernels in (logprob, torch_logprob):
        hg, wg = h.float().requires_grad_(), w.float().requires_grad_()
        lp = StrictLogprobs.apply(hg, wg, tg, temps, 0, real, None, kernels, torch.float32)
        (lp * g).sum().backward()
        runs.append((lp.detach(), hg.grad, wg.grad))
    check(
        "logprobs autograd forward == logprobs_and_lse",
        same(runs[0][0], logprob.logprobs_and_lse(h.float(), w.float(), tg, temps, 0, real)[0]),
    )
    check(
        "logprobs autograd grads: Triton == torch backend (1e-5)",
        all(float((a - b).abs().max()) < 1e-5 for a, b in zip(runs[0][1:], runs[1][1:])),
    )
    _entropy(gen, h, w, tg, temps, real, out, z)


def _entropy(gen, h, w, tg, temps, real, out, z) -> None:
    """The entropy from the logprob pass's own tiles (spread sums W per tile, rescaled in `_total_kernel`)."""
    from rl_kernel.backends.torch import logprob as torch_logprob
    from rl_kernel.ops.logprob import StrictLogprobs

    ent = torch.empty(h.shape[0])
    lp, _ = logprob.logprobs_and_lse(h, w, tg, temps, 0, real, entropy=ent)
    p = torch.softmax(z, -1)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    check("entropy beside the logprob: logprobs unchanged in bits", same(lp, out))
    check("entropy accuracy vs fp64 (1e-5)", float((ent.double() - ref).abs().max()) < 1e-5)
    part = torch.empty(4)
    logprob.logprobs_and_lse(h[5:9], w, tg[5:9], temps[5:9], 0, real, entropy=part)
    check("entropy rows alone == in batch", same(part, ent[5:9]))
    g, ge, runs = torch.randn(h.shape[0], generator=gen), torch.randn(h.shape[0], generator=gen), []
    for kernels in (logprob, torch_logprob):
        hg, wg = h.float().requires_grad_(), w.float().requires_grad_()
        lp, e = StrictLogprobs.apply(hg, wg, tg, temps, 0, real, None, kernels, torch.float32, True)
        ((lp * g).sum() + (e * ge).sum()).backward()
        runs.append((e.detach(), hg.grad, wg.grad))
    check("entropy: Triton == torch backend (1e-5)", float((runs[0][0] - runs[1][0]).abs().max()) < 1e-5)
    check(
        "entropy autograd grads: Triton == torch backend (1e-5)",
        all(float((a - b).abs().max()) < 1e-5 for a, b in zip(runs[0][1:], runs[1][1:])),
    )


def _slice_stats(logits, temps, tg, real, vocab_start=0, **options):
    """The cuBLASLt server's reduction: `_stats_kernel` over 256-column slices of precomputed fp32 logits of the
    vocab shard that starts at global column `vocab_start` (`real`: the global vocab size less vocab_start)."""
    t, v = logits.shape
    n_tiles = -(-v // logprob.VOCAB_TILE)
    m_t, s_t = torch.empty(t, n_tiles), torch.empty(t, n_tiles, dtype=torch.int64)
    z_t = torch.zeros(t)
    for c0 in range(0, v, 256):
        part = logits[:, c0 : c0 + 256].contiguous()
        logprob._stats_kernel[(-(-t // 32), 1)](
            part,
            temps.float(),
            tg,
            m_t,
            s_t,
            z_t,
            t,
            v,
            c0,
            part.shape[1],
            part.stride(0),
            vocab_start,
            vocab_start + real,
            n_tiles,
            BLOCK_M=32,
            BLOCK_N=256,
            VT=logprob.VOCAB_TILE,
            FIXED=float(1 << logprob.FIXED_POINT_BITS),
            LOG2E=logprob.LOG2E,
            RNI=False,
            **options,
        )
    return m_t, s_t, z_t


def logprob_slice_stats(gen: torch.Generator) -> None:
    t, v, real = 37, 700, 650  # the last slice is part-filled and holds the padding columns
    logits = torch.randn(t, v, generator=gen) * 4
    tg = torch.randint(0, real, (t,), generator=gen)
    tg[3] = 690  # a target in the padding columns: z stays 0, as in the fused kernel
    logits[5, tg[5]] = -0.0  # a -0 target logit: the fused kernel's sum gives +0
    for name, temps in (
        ("temperature 1", torch.ones(t, dtype=torch.float64)),
        ("mixed temperatures", torch.rand(t, generator=gen, dtype=torch.float64) + 0.5),
    ):
        ref = _slice_stats(logits, temps, tg, real, FAST_TEMP=False, TARGET_LOAD=False)
        for fast in (False, True):
            got = _slice_stats(logits, temps, tg, real, FAST_TEMP=fast, TARGET_LOAD=True)
            check(
                f"logprob slice stats, {name}: target read from the slice (fast temperature {fast}) == summed "
                "out of the block",
                all(same(a, b) for a, b in zip(got, ref)),
            )
    check("logprob slice stats: the -0 target logit gives +0", ref[2][5].view(torch.int32) == 0)
    spreads = []
    for target_load in (False, True):
        w_t = torch.empty(t, -(-v // logprob.VOCAB_TILE), dtype=torch.int64)
        _slice_stats(logits, temps, tg, real, FAST_TEMP=True, TARGET_LOAD=target_load, ew_ptr=w_t, ENTROPY=True)
        spreads.append(w_t)
    check("logprob slice stats: entropy spreads, target read == summed out of the block", same(*spreads))
    shard = 128  # a TP rank's shard from global column 128: targets before it belong to another rank
    tg_global = tg + shard
    tg_global[:6] = torch.arange(6) * 20  # columns 0..100: not this shard's
    ref = _slice_stats(logits, temps, tg_global, real, shard, FAST_TEMP=False, TARGET_LOAD=False)
    got = _slice_stats(logits, temps, tg_global, real, shard, FAST_TEMP=True, TARGET_LOAD=True)
    check(
        "logprob slice stats of a vocab shard (vocab_start 128): target read == summed out of the block",
        all(same(a, b) for a, b in zip(got, ref)) and bool((got[2][:6] == 0).all()) and bool((got[2][6:] != 0).any()),
    )


def _row_stats(h, w, temps, tg, real, logits_dtype):
    """The fused server's per-tile stats (m, S, target z) of all rows of h under `logits_dtype`."""
    n_tiles = -(-w.shape[0] // logprob.VOCAB_TILE)
    m_t, s_t, z_t = (
        torch.empty(h.shape[0], n_tiles),
        torch.empty(h.shape[0], n_tiles, dtype=torch.int64),
        torch.zeros(h.shape[0]),
    )
    logprob._tile_stats_of_rows(
        h, w, temps.float(), tg, m_t, s_t, z_t, 0, real, None, None, 256, logits_dtype=logits_dtype
    )
    return m_t, s_t, z_t


def logprob_bf16_logits(gen: torch.Generator) -> None:
    """The bf16 logit contract: the fused server rounds its fp32 tiles in registers, the cuBLASLt server reduces
    bf16 slices from the GEMM's epilogue; both must give the stats of the fp32 chain rounded once to bf16."""
    t, d, v, real = 37, 128, 700, 650
    h, w = torch.randn(t, d, generator=gen).to(F16), (torch.randn(v, d, generator=gen) * 0.3).to(F16)
    tg = torch.randint(0, real, (t,), generator=gen)
    temps = torch.rand(t, generator=gen, dtype=torch.float64) + 0.5
    chain = gemm.matmul_fp32(h, w)
    fused = _row_stats(h, w, temps, tg, real, torch.bfloat16)
    sliced = _slice_stats(chain.to(torch.bfloat16), temps, tg, real, FAST_TEMP=True, TARGET_LOAD=True)
    check(
        "logprob bf16 logits: fused server (rounded in registers) == stats of bf16 slices",
        all(same(a, b) for a, b in zip(fused, sliced)),
    )
    check(
        "logprob bf16 logits == the fp32 path over the chain rounded to bf16 (the rounding is the only change)",
        all(
            same(a, b)
            for a, b in zip(
                sliced,
                _slice_stats(chain.to(torch.bfloat16).float(), temps, tg, real, FAST_TEMP=True, TARGET_LOAD=True),
            )
        ),
    )
    fp32 = _row_stats(h, w, temps, tg, real, torch.float32)
    check("logprob bf16 logits: twin, the fp32 contract's stats differ", not same(fp32[1], fused[1]))
    out = logprob.logprobs_and_lse(h, w, tg, temps, 0, real, logits_dtype=torch.bfloat16)[0]
    z = chain[:, :real].to(torch.bfloat16).double() / temps.float().double()[:, None]
    ref = torch.log_softmax(z, -1).gather(1, tg[:, None]).squeeze(1)
    check(
        "logprob bf16 logits accuracy (against fp64 over the bf16 logits)",
        float((out.double() - ref).abs().max()) < 1e-5,
    )


def logprob_full_log_softmax(gen: torch.Generator) -> None:
    """The engine's full-vocab log-probs under the Triton contract: the entry of each target equals the trainer's
    logprob of it bit for bit, with fp32 and bf16 logits, mixed temperatures and padded vocab columns; a rank's
    shard must start on a vocab tile."""
    t, d, v, real = 37, 128, 700, 650
    h, w = torch.randn(t, d, generator=gen).to(F16), (torch.randn(v, d, generator=gen) * 0.3).to(F16)
    tg = torch.randint(0, real, (t,), generator=gen)
    temps = (torch.rand(t, generator=gen, dtype=torch.float64) + 0.5).index_fill_(0, torch.arange(10), 1.0)
    chain = gemm.matmul_fp32(h, w)
    for dtype in (torch.float32, torch.bfloat16):
        full = logprob.full_log_softmax(chain, temps, 0, real, logits_dtype=dtype)
        scored = logprob.logprobs_and_lse(h, w, tg, temps, 0, real, logits_dtype=dtype)[0]
        check(
            f"log_softmax (Triton, {dtype}) entries == logprobs of the targets",
            same(full.gather(1, tg[:, None]).squeeze(1), scored) and bool(torch.isinf(full[:, real:]).all()),
        )
    # the lse kernel's log64 against torch's, the same IEEE operations: totals from 2^40 (the least a row has) to
    # 2^58, powers of two and their neighbours among them
    from rl_kernel.backends.torch.numerics import log64 as torch_log64

    total = torch.cat(
        [
            (2.0 ** (40 + 18 * torch.rand(2000, generator=gen, dtype=torch.float64))).to(torch.int64),
            torch.tensor([1 << 40, (1 << 40) + 1, (1 << 41) - 1, 1 << 57, (1 << 53) + 1], dtype=torch.int64),
        ]
    )
    big_m = torch.randn(total.shape[0], generator=gen) * 30
    expected = big_m.to(torch.float64) + torch_log64(total.to(torch.float64) * (1.0 / (1 << logprob.FIXED_POINT_BITS)))
    check(
        "lse kernel (Triton log64) == torch's log64 of the same totals",
        same(logprob._lse(big_m, total.clone(), None), expected),
    )
    from rl_kernel.ops.logprob import native_log_softmax, native_logprobs

    native = native_log_softmax(chain, temps, 0, real, None).gather(1, tg[:, None]).squeeze(1)
    check(
        "log_softmax twin: native full-vocab log-probs != native logprobs of the targets (the pairing is not free)",
        not same(native, native_logprobs(h, w, tg, temps, 0, real, None)),
    )
    try:
        logprob.full_log_softmax(chain[:, 100:], temps, 100, real)
        check("log_softmax (Triton): a shard not on a vocab tile is refused", False)
    except Exception as e:  # noqa: BLE001 - the check is on the error's type and text
        check(
            "log_softmax (Triton): a shard not on a vocab tile is refused",
            type(e).__name__ == "StrictModeError" and "log_softmax" in str(e),
        )


# ---- 64-bit addressing: rows past 2^31 elements, without 2^31 elements of memory -----------------------------

FAR_STRIDE = (1 << 30) + 4096  # an int32 row stride (< 2^31) whose row 2 lies past 2^31 elements
FAR_SLOT = 4096  # each far view's rows occupy columns [slot * FAR_SLOT, (slot + 1) * FAR_SLOT) of every far row


def _far(base: torch.Tensor, slot: int, *shape: int) -> torch.Tensor:
    """A view [rows, *inner] of `base` whose row r starts at element r * FAR_STRIDE + slot * FAR_SLOT."""
    inner = torch.empty(shape[1:], device="meta").stride() if len(shape) > 1 else ()
    return base.as_strided(shape, (FAR_STRIDE, *inner), slot * FAR_SLOT)


def _far_copy(base: torch.Tensor, slot: int, src: torch.Tensor) -> torch.Tensor:
    view = _far(base, slot, *src.shape)
    view.copy_(src)
    return view


def far_offsets(gen: torch.Generator) -> None:
    """Each kernel launched on 3-row views whose row stride is an int32 (just over 2^30) but whose row 2 lies past
    2^31 elements of one fp16 storage: an address computed in int32 wraps there (the launch reads or writes far
    outside the tensor: a crash or wrong bits). The storage is 4 GB of address space of which only the rows
    written are backed by memory. Each result is compared bit for bit with the same kernel on contiguous copies."""
    from rl_kernel.backends.triton.numerics import LAUNCH

    base = torch.empty(2 * FAR_STRIDE + 16 * FAR_SLOT, dtype=F16)
    for r in range(3):
        base[r * FAR_STRIDE : r * FAR_STRIDE + 16 * FAR_SLOT].fill_(float("nan"))  # unwritten outputs show as NaN
    s = FAR_STRIDE

    x = _far_copy(base, 0, (torch.randn(3, 600, generator=gen) * 4).to(F16))
    out = _far(base, 1, 3, 300)
    activation._silu_and_mul_kernel[(3, 1)](x, out, 3, 300, s, s, BLOCK=1024, num_warps=4, **LAUNCH)
    check("far rows: silu_and_mul", same(out.clone(), activation.silu_and_mul(x.contiguous())))
    g = _far_copy(base, 2, torch.randn(3, 300, generator=gen).to(F16))
    dx = _far(base, 3, 3, 600)
    activation._silu_and_mul_backward_kernel[(3, 1)](x, g, dx, 300, s, s, s, BLOCK=1024, num_warps=4)
    check(
        "far rows: silu_and_mul backward",
        same(dx.clone(), activation.silu_and_mul_backward(x.contiguous(), g.contiguous())),
    )

    x = _far_copy(base, 4, (torch.randn(3, 200, generator=gen) * 3).to(F16))
    w = torch.randn(200, generator=gen).to(F16)
    check("far rows: rms_norm", same(norm.rms_norm(x, w, 1e-6), norm.rms_norm(x.contiguous(), w, 1e-6)))
    dy = _far_copy(base, 6, torch.randn(3, 200, generator=gen).to(F16))
    dx, dw = _far(base, 7, 3, 200), torch.empty(1, 200)
    norm._rms_norm_backward_kernel[(1,)](x, w, dy, dx, dw, 3, 200, 1e-6, s, s, s, BLOCK_T=4, BLOCK_D=256, num_warps=4)
    check(
        "far rows: rms_norm backward dx",
        same(dx.clone(), norm.rms_norm_backward(x.contiguous(), w, dy.contiguous(), 1e-6)[0]),
    )

    x = _far_copy(base, 8, torch.randn(3, 3, 32, generator=gen).to(F16))
    out = _far(base, 9, 3, 3, 32)
    cos, sin = torch_rope.cos_sin(torch.arange(3) * 1000, 32, 1e6)
    rope._rope_kernel[(3, 1)](
        x,
        cos,
        sin,
        None,
        out,
        3,
        s,
        32,
        s,
        32,
        cos.stride(0),
        cos,
        0,
        0,
        HALF=16,
        ROTARY=32,
        D=32,
        BLOCK_H=4,
        BLOCK_HALF=16,
        BLOCK_D=1,
        AT_POSITIONS=False,
        num_warps=4,
        **LAUNCH,
    )
    check("far rows: rope", same(out.clone(), rope.rotate(x.contiguous(), cos, sin, 32)))
    check(
        "far rows: rope at positions",
        same(rope.rotate_at(x, torch.arange(3) * 1000, 1e6, 32), rope.rotate(x.contiguous(), cos, sin, 32)),
    )

    x = _far_copy(base, 10, torch.randn(3, 256, generator=gen).to(F16))
    w = _far_copy(base, 11, torch.randn(3, 256, generator=gen).to(F16))  # weight rows (N) past 2^31 too
    out = _far(base, 12, 3, 3)
    gemm._fused_kernel[(1,)](
        x,
        w,
        out,
        out,
        3,
        3,
        s,
        s,
        s,
        128,
        HAS_BIAS=False,
        GROUPS=2,
        LEAVES=2,
        BLOCK_M=16,
        BLOCK_N=16,
        BLOCK_K=64,
        PRECISION="tf32",
        num_warps=4,
        **LAUNCH,
    )
    check(
        "far rows: gemm (2 K groups)",
        same(out.clone(), gemm.linear(x.contiguous(), w.contiguous(), None, F16, k_group=128)),
    )

    v, real = 300, 290
    logits = _far_copy(base, 13, (torch.randn(3, v, generator=gen) * 3).to(F16))
    temps, tg = torch.tensor([1.0, 0.7, 1.3]), torch.tensor([5, 289, 100])
    n_tiles = -(-v // logprob.VOCAB_TILE)
    launch = logprob._stats_launch()

    def stats(lg):
        m_t, s_t, z_t = torch.empty(3, n_tiles), torch.empty(3, n_tiles, dtype=torch.int64), torch.zeros(3)
        logprob._stats_kernel[(1, -(-v // launch["BLOCK_N"]))](
            lg, temps, tg, m_t, s_t, z_t, 3, v, 0, v, lg.stride(0), 0, real, n_tiles, **launch
        )
        return m_t, s_t, z_t

    check("far rows: logprob stats", all(same(a, b) for a, b in zip(stats(logits), stats(logits.contiguous()))))

    def dlogits(lg, dl):
        logprob._dlogits_kernel[(1, 2)](
            lg,
            dl,
            temps,
            torch.tensor([9.0, 8.5, 9.5]),
            torch.tensor([1.0, -2.0, 0.5]),
            tg,
            3,
            v,
            0,
            lg.stride(0),
            0,
            real,
            LOG2E=logprob.LOG2E,
            BLOCK_M=32,
            BLOCK_N=256,
            num_warps=4,
        )
        return dl.clone()

    check(
        "far rows: logprob dlogits",
        same(dlogits(logits, _far(base, 14, 3, v)), dlogits(logits.contiguous(), torch.empty(3, v, dtype=F16))),
    )
    far_paged_attention(base, gen)


def far_paged_attention(base: torch.Tensor, gen: torch.Generator) -> None:
    """Paged decode and chunked prefill whose sequences sit in the last blocks of k, v caches laid over all of
    `base` (block x block stride past 2^31 elements; k and v interleaved per token row, as one [.., 2, Hkv, d]
    cache), against the same sequences in a small cache."""
    heads, kv_heads, d, page = 4, 2, 32, 16
    row = 2 * kv_heads * d
    num_blocks = (base.numel() - row) // (page * row)
    big_k = base.as_strided((num_blocks, page, kv_heads, d), (page * row, row, d, 1), 0)
    big_v = base.as_strided((num_blocks, page, kv_heads, d), (page * row, row, d, 1), kv_heads * d)
    lens = [40, 3, 70]
    blocks = [-(-n // page) for n in lens]
    used = sum(blocks)
    local = torch.randperm(used, generator=gen).to(torch.int32)
    small_table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 0
    for b, nb in enumerate(blocks):
        small_table[b, :nb] = local[first : first + nb]
        first += nb
    big_table = num_blocks - 1 - small_table
    check(
        "far cache: its used blocks start past 2^31 elements",
        int(big_table.min()) * page * row > 2**31 and big_k.stride(0) * num_blocks <= base.numel(),
    )
    small_k = torch.randn(used + 1, page, kv_heads, d, generator=gen).to(F16)
    small_v = torch.randn(used + 1, page, kv_heads, d, generator=gen).to(F16)
    k = torch.randn(sum(lens), kv_heads, d, generator=gen).to(F16)
    v = torch.randn(sum(lens), kv_heads, d, generator=gen).to(F16)
    start = 0
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        for table, kc, vc in ((small_table, small_k, small_v), (big_table, big_k, big_v)):
            slots = table[b, pos // page].long() * page + pos % page
            kc.view(-1, kv_heads, d)[slots] = k[start : start + n]
            vc.view(-1, kv_heads, d)[slots] = v[start : start + n]
        start += n
    seq_lens = torch.tensor(lens)
    for name, q_lens, schedules in (
        ("decode", [1, 1, 1], ("fused", "split")),
        ("chunked prefill", [10, 3, 20], ("fused",)),
    ):
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(q_lens), heads, d, generator=gen).to(F16)
        for schedule in schedules:
            far = attention.paged_attention(q, big_k, big_v, big_table, seq_lens, qsl, d**-0.5, schedule=schedule)
            near = attention.paged_attention(
                q, small_k, small_v, small_table, seq_lens, qsl, d**-0.5, schedule=schedule
            )
            check(f"far cache: paged {name} ({schedule})", same(far, near))


def moes(gen: torch.Generator) -> None:
    """The MoE kernels: the router's picks and weights == the torch contract's (ties included), the grouped GEMM
    == a per-expert one-chain GEMM at every group size and tile, the combine == the torch contract's."""
    for experts, k, rows in ((8, 2, 37), (6, 3, 20), (128, 8, 17)):
        logits = torch.randn(rows, experts, generator=gen) * 3
        logits[:, 1] = logits[:, 0]  # ties: the lower id wins
        logits[0] = 0.25  # a row of equal logits
        for renorm in (True, False):
            w, ids = moe.route(logits, k, renorm)
            tw, tids = torch_moe.route(logits, k, renorm)
            check(f"moe route E={experts} k={k} renorm={renorm} ids == torch contract", torch.equal(ids, tids))
            check(f"moe route E={experts} k={k} renorm={renorm} weights == torch contract", same(w, tw))
    d, n = 96, 40
    w = torch.randn(4, n, d, generator=gen).to(F16)
    small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
    for counts in (
        [5, 0, 70, 1],
        [0, 0, 3, 0],
        [1, 1, 1, 1],
        [0, 0, 0, 0],
        [64, 0, 0, 1],
        [16, 17, 0, 15],
        [0, 33, 0, 0],
        [300, 0, 250, 1],  # >= 128 rows an expert: the prefill tile
    ):
        x = torch.randn(sum(counts), d, generator=gen).to(F16)
        on_device = torch.tensor(counts)  # the strict forward's form: a device tensor, no host read
        out = moe.grouped_linear(x, on_device, w, torch.float32)
        ref, start = [], 0
        for e, c in enumerate(counts):
            ref.append(gemm.matmul_fp32(x[start : start + c], w[e], schedule="fused"))
            start += c
        check(f"moe grouped gemm counts {counts} == per-expert gemm", same(out, torch.cat(ref)))
        check(
            f"moe grouped gemm counts {counts}: a list of counts == a device tensor",
            same(moe.grouped_linear(x, counts, w, torch.float32), out),
        )
        check(
            f"moe grouped gemm counts {counts}: the launch tile is the one its rows ask for",
            moe.tile_for(sum(counts), 4) is (moe.PREFILL_TILE if sum(counts) >= 512 else moe.TILE),
        )
        check(
            f"moe grouped gemm counts {counts}: tile moves no bit",
            same(moe.grouped_linear(x, on_device, w, torch.float32, tile=small), out),
        )
        slots = 3  # the rows read in place from tokens: row i = tokens[source[i] // slots]
        token = torch.randperm(sum(counts) + 2, generator=gen)[: sum(counts)]
        source = token * slots + torch.randint(0, slots, token.shape, generator=gen)
        tokens = torch.zeros(sum(counts) + 2, d).to(F16)
        tokens[token] = x
        check(
            f"moe grouped gemm counts {counts}: rows read through source == the gathered rows",
            same(moe.grouped_linear(tokens, on_device, w, torch.float32, source=source, slots=slots), out),
        )
    for experts, rows in ((4, 0), (4, 1), (8, 37), (128, 300), (128, 2048), (6, 5000)):
        ids = torch.randint(0, experts, (rows,), generator=gen)
        if rows > 100:
            ids[: rows // 2] = 3  # one crowded expert, others empty
        order, place, counts = moe.dispatch(ids, experts)
        want = torch.argsort(ids, stable=True)
        check(
            f"moe dispatch E={experts} R={rows} == stable sort, its inverse and the counts",
            torch.equal(order, want)
            and torch.equal(place[want], torch.arange(rows))
            and torch.equal(counts, torch.bincount(ids, minlength=experts))
            and order.dtype == place.dtype == counts.dtype == torch.int64,
        )
    gu, dn = torch.randn(3, 64, d, generator=gen).to(F16) * 0.1, torch.randn(3, d, 32, generator=gen).to(F16) * 0.1
    x = torch.randn(9, d, generator=gen).to(F16)
    got = moe.grouped_mlp(x, torch.tensor([4, 0, 5]), gu, dn)
    alone = moe.grouped_mlp(x[4:5], torch.tensor([0, 0, 1]), gu, dn)
    check("moe grouped mlp: a row alone == in its group", same(alone, got[4:5]))
    source = torch.tensor([8, 0, 5, 2, 7, 1, 3, 4, 6])
    check(
        "moe grouped mlp: rows read through source == the gathered rows",
        same(moe.grouped_mlp(x[source.argsort()], torch.tensor([4, 0, 5]), gu, dn, source=source), got),
    )
    y, wts = torch.randn(11, 3, 200, generator=gen), torch.rand(11, 3, generator=gen)
    for dtype in (F16, torch.float32):
        check(
            f"moe combine {dtype} == torch contract", same(moe.combine(y, wts, dtype), torch_moe.combine(y, wts, dtype))
        )
        place = torch.randperm(33, generator=gen)
        sorted_y = torch.empty(33, 200)
        sorted_y[place] = y.reshape(33, 200)
        check(
            f"moe combine {dtype}: slots read through place == the gathered slots",
            same(moe.combine(sorted_y, wts, dtype, place), moe.combine(y, wts, dtype)),
        )


def gumbel_sampling(gen: torch.Generator) -> None:
    """Gumbel-max sampling over vocabs of one tile, several tiles and a partial last tile, on a row subset: the
    tokens == the torch contract's on every decisive row (both logs are accurate fp32 logs, which may differ
    by ulps), the sampled rows one-hot with the token's log-prob bits, the other rows untouched; a NaN entry and
    an all -inf row as the torch contract treats them."""
    for vocab in (1000, 2 * sampling.BLOCK, 2 * sampling.BLOCK + 37):
        rows = 24
        lp = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 4, -1)
        lp[3, 50:] = float("-inf")  # a truncated row
        lp[5, vocab - 1] = float("nan")
        lp[7] = float("-inf")
        chosen = torch.tensor([r for r in range(rows) if r != 11])
        keys = row_keys(torch.randint(0, 2**62, (len(chosen),), generator=gen), torch.arange(len(chosen)) * 3)
        got, want = lp.clone(), lp.clone()
        tokens = sampling.sample_(got, keys, chosen)
        expect = torch_sampling.sample_(want, keys, chosen)
        decisive = torch_sampling.decisive(torch_sampling.scores(lp[chosen], keys))
        finite = got[chosen].isfinite() | got[chosen].isnan()
        check(
            f"gumbel sample V={vocab}: tokens == torch contract on {int(decisive.sum())}/{len(chosen)} decisive rows",
            torch.equal(tokens[decisive], expect[decisive]) and int(decisive.sum()) >= len(chosen) - 1,
        )
        check(
            f"gumbel sample V={vocab}: rows one-hot with the token's bits, row 11 untouched, NaN and -inf rows",
            torch.equal(bits(got[chosen][decisive]), bits(want[chosen][decisive]))
            and bool(finite[chosen != 7].sum(-1).eq(1).all())
            and torch.equal(bits(got[11]), bits(lp[11]))
            and int(tokens[5]) == vocab - 1
            and int(tokens[7]) == 0,
        )


PARTS = (
    moes,
    elementwise,
    norm_widths,
    qk_norm_rope,
    angle_table,
    gemms,
    attentions,
    split_decode,
    paged_tma,
    cp_attention,
    logprobs,
    logprob_slice_stats,
    logprob_bf16_logits,
    logprob_full_log_softmax,
    far_offsets,
    gumbel_sampling,
)


def main() -> None:
    """Run the parts named on the command line (all of them when none is), each from the same seed."""
    names = sys.argv[1:] or [p.__name__ for p in PARTS]
    unknown = set(names) - {p.__name__ for p in PARTS}
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; known: {[p.__name__ for p in PARTS]}")
    for part in PARTS:
        if part.__name__ in names:
            part(torch.Generator().manual_seed(0))
    print(f"INTERPRETER {'FAIL: ' + ', '.join(FAILED) if FAILED else 'PASS'}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
