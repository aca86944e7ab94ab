"""The invariance matrix: its single-process cells (axes in `rl_kernel.selftest`), their raw-bit comparison
and the layout helpers the tests share (qkv, cu_seqlens, paged_cache, paged_step)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import rl_kernel as rk
from rl_kernel.bits import bits, max_abs_diff

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (expected, actual): must agree bit for bit
RowFn = Callable[[torch.Tensor], torch.Tensor]  # row index tensor of any shape -> outputs [*index.shape, ...]


@dataclasses.dataclass
class Outcome:
    passed: bool  # every compared element has the same bits
    max_abs_diff: float
    elements: int  # elements compared
    mismatches: int  # elements whose bits differ


def compare(pairs: Pairs) -> Outcome:
    passed, worst, total, bad = True, 0.0, 0, 0
    for expected, actual in pairs:
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            raise ValueError(
                f"layouts disagree: {tuple(expected.shape)} {expected.dtype} vs {tuple(actual.shape)} {actual.dtype}"
            )
        n_bad = int((bits(expected) != bits(actual)).sum())
        passed &= n_bad == 0
        worst = max(worst, max_abs_diff(expected, actual))
        total, bad = total + expected.numel(), bad + n_bad
    return Outcome(passed, worst, total, bad)


# --- layouts of one axis ------------------------------------------------------------------------------


def randn(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: str, scale: float = 1.0
) -> torch.Tensor:
    """Standard normal values (times `scale`) drawn on the CPU from `gen`, then cast and moved."""
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def batch_pairs(fn: RowFn, n_rows: int, gen: torch.Generator, sizes=(1, 2, 3, 5, 8, 13), probes: int = 3) -> Pairs:
    """A row computed alone vs the same row at a random position in batches of other rows."""
    full = fn(torch.arange(n_rows))
    pairs = []
    for i in torch.randperm(n_rows, generator=gen)[:probes].tolist():
        alone = fn(torch.tensor([i]))[0]
        pairs.append((alone, full[i]))
        for m in sizes:
            rows = torch.randint(n_rows, (m,), generator=gen)
            pos = int(torch.randint(m, (1,), generator=gen))
            rows[pos] = i
            pairs.append((alone, fn(rows)[pos]))
    return pairs


def padding_pairs(fn: RowFn, n_rows: int, gen: torch.Generator, batches=(3, 4), max_len: int = 5) -> Pairs:
    """Rows packed back to back vs the same rows in a padded [B, L] layout (padding slots hold other rows)."""
    pairs = []
    for batch in batches:
        lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
        padded = torch.randint(n_rows, (batch, max(lens)), generator=gen)
        packed = torch.cat([padded[b, :n] for b, n in enumerate(lens)])
        out = fn(padded)
        pairs.append((fn(packed), torch.cat([out[b, :n] for b, n in enumerate(lens)])))
    return pairs


def thread_pairs(fn: Callable[[], torch.Tensor]) -> Pairs:
    """The same call with 1 thread and with 2 (or the process default, if larger); threads restored."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(max(2, saved))
        many = fn()
    finally:
        torch.set_num_threads(saved)
    return [(one, many)]


# --- attention layouts --------------------------------------------------------------------------------


def qkv(
    gen: torch.Generator, tokens: int, dtype: torch.dtype, device: str, heads: int = 4, kv_heads: int = 2, dim: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        randn(gen, (tokens, heads, dim), dtype, device),
        randn(gen, (tokens, kv_heads, dim), dtype, device),
        randn(gen, (tokens, kv_heads, dim), dtype, device),
    )


def cu_seqlens(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def paged_cache(k: torch.Tensor, v: torch.Tensor, lens: list[int], page: int, gen: torch.Generator):
    """Write packed k, v of sequences `lens` into a paged cache of page size `page` whose physical blocks
    are shuffled across sequences (plus spare garbage blocks). Returns k_cache, v_cache, block_table."""
    blocks = [-(-n // page) for n in lens]
    total = sum(blocks) + 2
    physical = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    k_cache = torch.randn((total, page, *k.shape[1:]), generator=gen).to(k.dtype).to(k.device)  # garbage
    v_cache = torch.randn((total, page, *v.shape[1:]), generator=gen).to(v.dtype).to(v.device)
    start, used = 0, 0
    for b, n in enumerate(lens):
        table[b, : blocks[b]] = physical[used : used + blocks[b]]
        pos = torch.arange(n)
        slots = table[b, pos // page].to(torch.int64) * page + pos % page
        rk.write_kv_cache(k[start : start + n], v[start : start + n], k_cache, v_cache, slots.to(k.device))
        start, used = start + n, used + blocks[b]
    return k_cache, v_cache, table.to(k.device)


def paged_step(q, k_cache, v_cache, table, scale, steps: list[tuple[int, int, int]]) -> torch.Tensor:
    """One paged_attention call over a batch of (sequence, first, end) query ranges: the positions
    first..end-1 of those sequences, with context length end (chunked prefill when end - first > 1,
    decode when 1). `q` holds each sequence's queries [seq][len, H, d]."""
    device = k_cache.device
    queries = torch.cat([q[s][a:e] for s, a, e in steps])
    qsl = torch.tensor([0, *torch.tensor([e - a for _, a, e in steps]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([e for _, _, e in steps], dtype=torch.int32)
    rows = torch.tensor([s for s, _, _ in steps])
    return rk.paged_attention(
        queries, k_cache, v_cache, table[rows.to(device)], seq_lens.to(device), qsl.to(device), scale
    )


# --- the cells -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    op: str
    axis: str
    inputs: str
    check: Callable[[str, torch.Generator], Pairs]
    cpu_only: bool = False  # thread count is a CPU axis


def rowwise_cells() -> list[Cell]:
    f32, bf16 = torch.float32, torch.bfloat16

    def linear(dtype, rows=16, k=256, n=96):
        def make(device, gen):
            x, w = randn(gen, (rows, k), dtype, device), randn(gen, (n, k), dtype, device)
            return lambda idx: rk.linear(x[idx.to(device)], w)

        return make

    def norm(dtype, rows, d, residual=False):
        def make(device, gen):
            x, w = randn(gen, (rows, d), dtype, device, 2.0), randn(gen, (d,), dtype, device)
            r = randn(gen, (rows, d), dtype, device)
            if residual:
                return lambda idx: torch.stack(rk.rms_norm(x[idx.to(device)], w, 1e-6, r[idx.to(device)]), -2)
            return lambda idx: rk.rms_norm(x[idx.to(device)], w, 1e-6)

        return make

    def silu(dtype, rows=16, inter=256):
        def make(device, gen):
            x = randn(gen, (rows, 2 * inter), dtype, device, 3.0)
            return lambda idx: rk.silu_and_mul(x[idx.to(device)])

        return make

    def rope(dtype, rows=24, heads=4, dim=64):
        def make(device, gen):
            x = randn(gen, (rows, heads, dim), dtype, device)
            pos = torch.randint(0, 32768, (rows,), generator=gen).to(device)
            return lambda idx: rk.rope(x[idx.reshape(-1).to(device)], pos[idx.reshape(-1).to(device)], 1e6).reshape(
                *idx.shape, heads, dim
            )

        return make

    def logprobs(dtype, rows=16, d=64, vocab=500):
        def make(device, gen):
            h, w = randn(gen, (rows, d), dtype, device), randn(gen, (vocab, d), dtype, device)
            t = torch.randint(0, vocab, (rows,), generator=gen).to(device)
            return lambda idx: rk.logprobs(
                h[idx.reshape(-1).to(device)], w, t[idx.reshape(-1).to(device)], 0.7
            ).reshape(idx.shape)

        return make

    def moe(dtype, rows=16, d=128, experts=8, inter=64, k=2):
        def make(device, gen):
            x, router = randn(gen, (rows, d), dtype, device), randn(gen, (experts, d), dtype, device, 0.2)
            gate_up = randn(gen, (experts, 2 * inter, d), dtype, device, 0.1)
            down = randn(gen, (experts, d, inter), dtype, device, 0.1)

            def block(idx):
                rows_ = x[idx.reshape(-1).to(device)]
                out, ids = rk.moe(rows_, router, gate_up, down, k)
                return torch.cat([out.to(torch.float32), ids.to(torch.float32)], -1).reshape(*idx.shape, -1)

            return block

        return make

    def batch(make, rows):
        return lambda device, gen: batch_pairs(make(device, gen), rows, gen)

    def padding(make, rows):
        return lambda device, gen: padding_pairs(make(device, gen), rows, gen)

    def threads(make, rows, alone=False):
        def check(device, gen):
            fn = make(device, gen)
            if alone:  # each row its own call: a single wide row is what native splits over threads
                return thread_pairs(lambda: torch.cat([fn(torch.tensor([i])) for i in range(rows)]))
            return thread_pairs(lambda: fn(torch.arange(rows)))

        return check

    wide = 1 << 17  # one wide row: native reductions split it across threads, but not a batch of rows
    return [
        Cell("linear", "batch/position", "fp32 [<=16,256]x[96,256]", batch(linear(f32), 16)),
        Cell("linear", "batch/position", "bf16 [<=16,256]x[96,256]", batch(linear(bf16), 16)),
        Cell("linear", "padding/packing", "fp32 [B,L,256]x[96,256]", padding(linear(f32), 16)),
        Cell("linear", "threads", "fp32 [16,256]x[96,256]", threads(linear(f32), 16), cpu_only=True),
        Cell("rms_norm", "batch/position", "bf16 [<=16,1024]", batch(norm(bf16, 16, 1024), 16)),
        Cell(
            "rms_norm",
            "batch/position",
            f"fp32 [<=4,{wide}]",
            lambda d, g: batch_pairs(norm(f32, 4, wide)(d, g), 4, g, sizes=(2, 3), probes=2),
        ),
        Cell("rms_norm+residual", "batch/position", "bf16 [<=16,1024]", batch(norm(bf16, 16, 1024, True), 16)),
        Cell("rms_norm", "padding/packing", "bf16 [B,L,1024]", padding(norm(bf16, 16, 1024), 16)),
        Cell("rms_norm", "threads", f"fp32 4 x [1,{wide}]", threads(norm(f32, 4, wide), 4, alone=True), cpu_only=True),
        Cell("silu_and_mul", "batch/position", "bf16 [<=16,512]", batch(silu(bf16), 16)),
        Cell("silu_and_mul", "threads", "fp32 [16,512]", threads(silu(f32), 16), cpu_only=True),
        Cell("rope", "batch/position", "bf16 [<=24,4,64]", batch(rope(bf16), 24)),
        Cell("rope", "padding/packing", "bf16 [B*L,4,64]", padding(rope(bf16), 24)),
        Cell("rope", "threads", "fp32 [24,4,64]", threads(rope(f32), 24), cpu_only=True),
        Cell("logprobs", "batch/position", "fp32 [<=16,64]x[500,64]", batch(logprobs(f32), 16)),
        Cell("logprobs", "batch/position", "bf16 [<=16,64]x[500,64]", batch(logprobs(bf16), 16)),
        Cell("logprobs", "padding/packing", "fp32 [B*L,64]x[500,64]", padding(logprobs(f32), 16)),
        Cell("logprobs", "threads", "fp32 [16,64]x[500,64]", threads(logprobs(f32), 16), cpu_only=True),
        Cell("moe", "batch/position", "bf16 [<=16,128] E8 top-2 I64", batch(moe(bf16), 16)),
        Cell("moe", "batch/position", "fp32 [<=16,128] E8 top-2 I64", batch(moe(f32), 16)),
        Cell("moe", "threads", "fp32 [16,128] E8 top-2 I64", threads(moe(f32), 16), cpu_only=True),
    ]


SCALE = 32**-0.5


def attention_packing(device: str, gen: torch.Generator, dtype=torch.float32) -> Pairs:
    """Each sequence alone vs packed with the others, in a shuffled order."""
    lens = [37, 90, 5, 70]
    seqs = [qkv(gen, n, dtype, device) for n in lens]
    alone = [rk.attention_varlen(*s, cu_seqlens([n], device), SCALE) for s, n in zip(seqs, lens)]
    order = torch.randperm(len(lens), generator=gen).tolist()
    packed = rk.attention_varlen(
        *(torch.cat([seqs[i][j] for i in order]) for j in range(3)), cu_seqlens([lens[i] for i in order], device), SCALE
    )
    return list(zip([alone[i] for i in order], packed.split([lens[i] for i in order])))


def attention_padding(device: str, gen: torch.Generator, dtype=torch.float32) -> Pairs:
    """Packed sequences vs the same sequences right-padded to a common length L (padding = other tokens),
    then unpadded."""
    lens, width = [5, 40, 70, 20], 80
    q, k, v = (t.view(len(lens), width, *t.shape[1:]) for t in qkv(gen, len(lens) * width, dtype, device))
    padded = rk.attention_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens([width] * len(lens), device), SCALE
    ).view(q.shape)
    packed = rk.attention_varlen(
        *(torch.cat([t[b, :n] for b, n in enumerate(lens)]) for t in (q, k, v)), cu_seqlens(lens, device), SCALE
    )
    return [(packed, torch.cat([padded[b, :n] for b, n in enumerate(lens)]))]


def attention_prefill_decode(device: str, gen: torch.Generator, dtype=torch.float32) -> Pairs:
    """Full causal prefill (attention_varlen) vs paged decode one token at a time and chunked prefill
    at random boundaries, batched the way a continuous-batching engine mixes them."""
    lens = [150, 90]
    q, k, v = qkv(gen, sum(lens), dtype, device)
    ref = rk.attention_varlen(q, k, v, cu_seqlens(lens, device), SCALE).split(lens)
    k_cache, v_cache, table = paged_cache(k, v, lens, 16, gen)
    qs = q.split(lens)
    cuts = sorted(torch.randperm(lens[0] - 8, generator=gen)[:4].add(1).tolist())
    bounds = [0, *cuts, lens[0] - 6]
    pairs = []
    for a, e in zip(bounds[:-1], bounds[1:]):  # seq 0 chunked prefill, while seq 1 decodes
        j = int(torch.randint(lens[1], (1,), generator=gen))
        out = paged_step(qs, k_cache, v_cache, table, SCALE, [(0, a, e), (1, j, j + 1)])
        pairs += [(ref[0][a:e], out[: e - a]), (ref[1][j : j + 1], out[e - a :])]
    for j in range(lens[0] - 6, lens[0]):  # seq 0 decodes its last tokens alone
        pairs.append((ref[0][j : j + 1], paged_step(qs, k_cache, v_cache, table, SCALE, [(0, j, j + 1)])))
    return pairs


def attention_pages(device: str, gen: torch.Generator, dtype=torch.float32) -> Pairs:
    """Packed prefill (attention_varlen) vs paged prefill with page sizes 1, 3, 8, 16, 64 and block tables
    shuffled across sequences."""
    lens = [70, 33, 100]
    q, k, v = qkv(gen, sum(lens), dtype, device)
    ref = rk.attention_varlen(q, k, v, cu_seqlens(lens, device), SCALE)
    pairs = []
    for page in (1, 3, 8, 16, 64):
        k_cache, v_cache, table = paged_cache(k, v, lens, page, gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        pairs.append((ref, rk.paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens(lens, device), SCALE)))
    return pairs


def attention_threads(device: str, gen: torch.Generator) -> Pairs:
    lens = [100, 30]
    q, k, v = qkv(gen, sum(lens), torch.float32, device)
    return thread_pairs(lambda: rk.attention_varlen(q, k, v, cu_seqlens(lens, device), SCALE))


def attention_cells() -> list[Cell]:
    return [
        Cell("attention_varlen", "batch/packing", "fp32 lens 37,90,5,70 H4/2 d32", attention_packing),
        Cell("attention_varlen", "padding/packing", "fp32 lens 5,40,70,20 pad 80", attention_padding),
        Cell("paged_attention", "prefill/decode/chunked", "fp32 lens 150,90 page 16", attention_prefill_decode),
        Cell(
            "paged_attention",
            "prefill/decode/chunked",
            "bf16 lens 150,90 page 16",
            lambda d, g: attention_prefill_decode(d, g, torch.bfloat16),
        ),
        Cell("paged_attention", "page size/block order", "fp32 pages 1,3,8,16,64 shuffled", attention_pages),
        Cell("attention_varlen", "threads", "fp32 lens 100,30", attention_threads, cpu_only=True),
    ]


def backends_ran(records: list[dict]) -> str:
    """The strict backends among evidence `records`, comma-separated ('-' when none)."""
    return ",".join(sorted({r["backend"] for r in records if r["mode"] == "strict"})) or "-"


def run_cells(device: str = "cpu", seed: int = 0, ops: list[str] | None = None) -> list[dict]:
    """Every single-process cell (of `ops`, default all) in strict and native mode; one dict per cell (op,
    axis, inputs, backend, strict and native outcomes)."""
    rows = []
    for cell in rowwise_cells() + attention_cells():
        if (cell.cpu_only and device != "cpu") or (ops is not None and cell.op not in ops):
            continue
        row = {"op": cell.op, "axis": cell.axis, "inputs": cell.inputs}
        for name in ("strict", "native"):
            with rk.mode(name), rk.evidence.recording() as ran:
                outcome = compare(cell.check(device, torch.Generator().manual_seed(seed)))
            row[name] = dataclasses.asdict(outcome)
            if name == "strict":
                row["backend"] = backends_ran(ran)
        rows.append(row)
    return rows


def _cell_text(o: dict) -> str:
    return f"{'PASS' if o['passed'] else 'FAIL'} {o['max_abs_diff']:<9.3g}"


def format_table(rows: list[dict]) -> str:
    head = f"{'op':20s} {'axis':32s} {'inputs':34s} {'backend':12s} {'strict (max|diff|)':19s} native (max|diff|)"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['op']:20s} {r['axis']:32s} {r['inputs']:34s} {r['backend']:12s} "
            f"{_cell_text(r['strict']):19s} {_cell_text(r['native'])}"
        )
    return "\n".join(lines)


def format_contracts() -> str:
    return "\n".join(f"  {c.id:40s} {c.fingerprint}" for c in rk.contracts.all_contracts().values())
