"""Check, on this machine, that rl_kernel's strict ops give the same bits in every layout.

    python -m rl_kernel.selftest [--device cpu|cuda] [--json PATH] [--accuracy]

Each cell computes the same logical outputs of one op in two layouts of one invariance axis (a row
alone vs inside batches of other sizes and positions; packed vs padded; prefill vs decode vs chunked
prefill; paged KV with other page sizes and shuffled block tables; 1 vs 2 threads; vocab or K
sharded over gloo ranks) and compares their raw bit patterns on every element, once in strict mode
and once in native mode. The exit code is 1 when any strict cell differs. Native cells that differ
are expected (the framework's kernels do not promise invariance) and are shown, not judged.
`--accuracy` also prints each op's error against an fp64 reference (the table in docs/accuracy.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
            raise ValueError(f"layouts disagree: {tuple(expected.shape)} {expected.dtype} vs "
                             f"{tuple(actual.shape)} {actual.dtype}")
        n_bad = int((bits(expected) != bits(actual)).sum())
        passed &= n_bad == 0
        worst = max(worst, max_abs_diff(expected, actual))
        total, bad = total + expected.numel(), bad + n_bad
    return Outcome(passed, worst, total, bad)


# --- layouts of one axis ------------------------------------------------------------------------------

def _randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: str, scale: float = 1.0):
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

def qkv(gen: torch.Generator, tokens: int, dtype: torch.dtype, device: str, heads: int = 4, kv_heads: int = 2,
        dim: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_randn(gen, (tokens, heads, dim), dtype, device), _randn(gen, (tokens, kv_heads, dim), dtype, device),
            _randn(gen, (tokens, kv_heads, dim), dtype, device))


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
    return rk.paged_attention(queries, k_cache, v_cache, table[rows.to(device)], seq_lens.to(device),
                              qsl.to(device), scale)


# --- the cells -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Cell:
    op: str
    axis: str
    inputs: str
    check: Callable[[str, torch.Generator], Pairs]
    cpu_only: bool = False  # thread count is a CPU axis


def _rowwise_cells() -> list[Cell]:
    f32, bf16 = torch.float32, torch.bfloat16

    def linear(dtype, rows=16, k=256, n=96):
        def make(device, gen):
            x, w = _randn(gen, (rows, k), dtype, device), _randn(gen, (n, k), dtype, device)
            return lambda idx: rk.linear(x[idx.to(device)], w)
        return make

    def norm(dtype, rows, d, residual=False):
        def make(device, gen):
            x, w = _randn(gen, (rows, d), dtype, device, 2.0), _randn(gen, (d,), dtype, device)
            r = _randn(gen, (rows, d), dtype, device)
            if residual:
                return lambda idx: torch.stack(rk.rms_norm(x[idx.to(device)], w, 1e-6, r[idx.to(device)]), -2)
            return lambda idx: rk.rms_norm(x[idx.to(device)], w, 1e-6)
        return make

    def silu(dtype, rows=16, inter=256):
        def make(device, gen):
            x = _randn(gen, (rows, 2 * inter), dtype, device, 3.0)
            return lambda idx: rk.silu_and_mul(x[idx.to(device)])
        return make

    def rope(dtype, rows=24, heads=4, dim=64):
        def make(device, gen):
            x = _randn(gen, (rows, heads, dim), dtype, device)
            pos = torch.randint(0, 32768, (rows,), generator=gen).to(device)
            return lambda idx: rk.rope(x[idx.reshape(-1).to(device)], pos[idx.reshape(-1).to(device)],
                                       1e6).reshape(*idx.shape, heads, dim)
        return make

    def logprobs(dtype, rows=16, d=64, vocab=500):
        def make(device, gen):
            h, w = _randn(gen, (rows, d), dtype, device), _randn(gen, (vocab, d), dtype, device)
            t = torch.randint(0, vocab, (rows,), generator=gen).to(device)
            return lambda idx: rk.logprobs(h[idx.reshape(-1).to(device)], w, t[idx.reshape(-1).to(device)],
                                           0.7).reshape(idx.shape)
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
        Cell("rms_norm", "batch/position", f"fp32 [<=4,{wide}]", lambda d, g: batch_pairs(
            norm(f32, 4, wide)(d, g), 4, g, sizes=(2, 3), probes=2)),
        Cell("rms_norm+residual", "batch/position", "bf16 [<=16,1024]", batch(norm(bf16, 16, 1024, True), 16)),
        Cell("rms_norm", "padding/packing", "bf16 [B,L,1024]", padding(norm(bf16, 16, 1024), 16)),
        Cell("rms_norm", "threads", f"fp32 4 x [1,{wide}]", threads(norm(f32, 4, wide), 4, alone=True),
             cpu_only=True),
        Cell("silu_and_mul", "batch/position", "bf16 [<=16,512]", batch(silu(bf16), 16)),
        Cell("silu_and_mul", "threads", "fp32 [16,512]", threads(silu(f32), 16), cpu_only=True),
        Cell("rope", "batch/position", "bf16 [<=24,4,64]", batch(rope(bf16), 24)),
        Cell("rope", "padding/packing", "bf16 [B*L,4,64]", padding(rope(bf16), 24)),
        Cell("rope", "threads", "fp32 [24,4,64]", threads(rope(f32), 24), cpu_only=True),
        Cell("logprobs", "batch/position", "fp32 [<=16,64]x[500,64]", batch(logprobs(f32), 16)),
        Cell("logprobs", "batch/position", "bf16 [<=16,64]x[500,64]", batch(logprobs(bf16), 16)),
        Cell("logprobs", "padding/packing", "fp32 [B*L,64]x[500,64]", padding(logprobs(f32), 16)),
        Cell("logprobs", "threads", "fp32 [16,64]x[500,64]", threads(logprobs(f32), 16), cpu_only=True),
    ]


SCALE = 32**-0.5


def attention_packing(device: str, gen: torch.Generator, dtype=torch.float32) -> Pairs:
    """Each sequence alone vs packed with the others, in a shuffled order."""
    lens = [37, 90, 5, 70]
    seqs = [qkv(gen, n, dtype, device) for n in lens]
    alone = [rk.attention_varlen(*s, cu_seqlens([n], device), SCALE) for s, n in zip(seqs, lens)]
    order = torch.randperm(len(lens), generator=gen).tolist()
    packed = rk.attention_varlen(*(torch.cat([seqs[i][j] for i in order]) for j in range(3)),
                                 cu_seqlens([lens[i] for i in order], device), SCALE)
    return list(zip([alone[i] for i in order], packed.split([lens[i] for i in order])))


def attention_padding(device: str, gen: torch.Generator, dtype=torch.float32) -> Pairs:
    """Packed sequences vs the same sequences right-padded to a common length L (padding = other tokens),
    then unpadded."""
    lens, width = [5, 40, 70, 20], 80
    q, k, v = (t.view(len(lens), width, *t.shape[1:]) for t in qkv(gen, len(lens) * width, dtype, device))
    padded = rk.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                 cu_seqlens([width] * len(lens), device), SCALE).view(q.shape)
    packed = rk.attention_varlen(*(torch.cat([t[b, :n] for b, n in enumerate(lens)]) for t in (q, k, v)),
                                 cu_seqlens(lens, device), SCALE)
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


def _attention_cells() -> list[Cell]:
    return [
        Cell("attention_varlen", "batch/packing", "fp32 lens 37,90,5,70 H4/2 d32", attention_packing),
        Cell("attention_varlen", "padding/packing", "fp32 lens 5,40,70,20 pad 80", attention_padding),
        Cell("paged_attention", "prefill/decode/chunked", "fp32 lens 150,90 page 16", attention_prefill_decode),
        Cell("paged_attention", "prefill/decode/chunked", "bf16 lens 150,90 page 16",
             lambda d, g: attention_prefill_decode(d, g, torch.bfloat16)),
        Cell("paged_attention", "page size/block order", "fp32 pages 1,3,8,16,64 shuffled", attention_pages),
        Cell("attention_varlen", "threads", "fp32 lens 100,30", attention_threads, cpu_only=True),
    ]


# --- sharding over real gloo / nccl ranks ---------------------------------------------------------------

VOCAB, VOCAB_PADDED, TP_K = 500, 512, 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_inputs(world: int, device: str) -> dict[str, torch.Tensor]:
    """The same inputs on every rank (one seed)."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "h": _randn(gen, (12, 64), torch.float32, device), "w": _randn(gen, (VOCAB_PADDED, 64), torch.float32, device),
        "targets": torch.randint(0, VOCAB, (12,), generator=gen).to(device),
        "temps": (torch.rand(12, generator=gen) + 0.5).to(device),
        "x": _randn(gen, (6, TP_K), torch.bfloat16, device), "wk": _randn(gen, (48, TP_K), torch.bfloat16, device),
        "bias": _randn(gen, (48,), torch.bfloat16, device),
        "parts": _randn(gen, (world, 1000), torch.float32, device, 100.0),
    }


def _dist_outputs(rank: int, world: int, device: str) -> dict[str, torch.Tensor | str | None]:
    """Per rank: logprobs sharded over the vocab and unsharded; row-parallel linear sharded over K and
    unsharded; the all-reduce of this rank's part (twice); the error of a misaligned K shard."""
    inp = _dist_inputs(world, device)
    group = dist.group.WORLD
    rk.set_canonical_tp(world)  # the widest TP of this "deployment" (the triton GEMM contract's K groups)
    vl, kl = VOCAB_PADDED // world, TP_K // world
    out: dict[str, torch.Tensor | str | None] = {
        "logprobs/full": rk.logprobs(inp["h"], inp["w"], inp["targets"], inp["temps"], vocab_size=VOCAB),
        "logprobs/sharded": rk.logprobs(inp["h"], inp["w"][rank * vl : (rank + 1) * vl], inp["targets"],
                                        inp["temps"], vocab_size=VOCAB, group=group),
        "row_parallel/full": rk.row_parallel_linear(inp["x"], inp["wk"], None, inp["bias"]),
        "row_parallel/sharded": rk.row_parallel_linear(inp["x"][:, rank * kl : (rank + 1) * kl],
                                                       inp["wk"][:, rank * kl : (rank + 1) * kl], group, inp["bias"]),
        "all_reduce/parts": inp["parts"],
        "all_reduce/out": rk.all_reduce(inp["parts"][rank], group),
        "all_reduce/again": rk.all_reduce(inp["parts"][rank], group),
        "misaligned_error": None,
    }
    if rk.get_mode("gemm") == "strict" and world > 1:
        # a shard that would split a K group: K = 12 is one torch-contract group; canonical TP 1 < tp on triton
        k = 12
        x, w = torch.ones(2, k, device=device), torch.ones(4, k, device=device)
        s = k // world
        rk.set_canonical_tp(1)
        try:
            rk.row_parallel_linear(x[:, rank * s : (rank + 1) * s], w[:, rank * s : (rank + 1) * s], group)
        except rk.StrictModeError as e:
            out["misaligned_error"] = f"{e.op}|{e.backend}|{e.reason}"
        finally:
            rk.set_canonical_tp(world)
    return out


def _dist_worker(rank: int, world: int, port: int, backend: str, device: str, path: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        results = {}
        for name in ("strict", "native"):
            with rk.mode(name), rk.evidence.recording() as ran:
                results[name] = {key: v.cpu() if isinstance(v, torch.Tensor) else v
                                 for key, v in _dist_outputs(rank, world, device).items()}
            results[name]["evidence"] = list(ran)
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, device: str = "cpu") -> list[dict[str, dict]]:
    """Run `_dist_outputs` on `world` spawned ranks (gloo on CPU, nccl on CUDA); returns, per rank,
    {"strict": outputs, "native": outputs} with tensors on the CPU."""
    backend = "gloo" if device == "cpu" else "nccl"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out")
        mp.spawn(_dist_worker, args=(world, _free_port(), backend, device, path), nprocs=world, join=True)
        return [torch.load(f"{path}.rank{r}") for r in range(world)]


def tree_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """((p0 + p1) + (p2 + p3)) ...: the sum over dim 0 the collective contract promises, written out."""
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def _dist_cells(results: dict[int, list[dict]]) -> list[tuple[str, str, str, str, dict[str, Pairs]]]:
    """(op, axis, inputs, strict backends that ran, {mode: pairs}) per distributed cell."""
    cells = []
    for world, ranks in results.items():
        by_mode = {}
        for name in ("strict", "native"):
            outs = [r[name] for r in ranks]
            ref = tree_in_rank_order(outs[0]["all_reduce/parts"])
            by_mode[name] = {
                "logprobs": [(o["logprobs/full"], o["logprobs/sharded"]) for o in outs],
                "row_parallel_linear": [(o["row_parallel/full"], o["row_parallel/sharded"]) for o in outs],
                "all_reduce": [(ref, o["all_reduce/out"]) for o in outs]
                + [(o["all_reduce/out"], o["all_reduce/again"]) for o in outs],
            }
        ran = ranks[0]["strict"]["evidence"]
        for op, axis, inputs, contract_ops in (
            ("logprobs", "vocab sharding", f"fp32 [12,64]x[{VOCAB_PADDED},64] V={VOCAB} T/row", ("logprobs",)),
            ("row_parallel_linear", "K sharding", f"bf16 [6,{TP_K}]x[48,{TP_K}]+bias", ("gemm", "all_reduce")),
            ("all_reduce", "ranks vs rank-order tree", "fp32 [1000] per rank", ("all_reduce",)),
        ):
            cells.append((op, f"{axis} tp{world}", inputs, _backends_ran([r for r in ran if r["op"] in contract_ops]),
                          {m: by_mode[m][op] for m in by_mode}))
    return cells


# --- running and reporting --------------------------------------------------------------------------------

def _backends_ran(records: list[dict]) -> str:
    return ",".join(sorted({r["backend"] for r in records if r["mode"] == "strict"})) or "-"


DIST_OPS = ("logprobs", "row_parallel_linear", "all_reduce")


def run_matrix(
    device: str = "cpu", seed: int = 0, distributed: bool = True, ops: list[str] | None = None,
) -> list[dict]:
    """Every cell (of `ops`, default all) in strict and native mode; one dict per cell (op, axis, inputs,
    backend, strict, native outcomes)."""
    rows = []
    for cell in _rowwise_cells() + _attention_cells():
        if (cell.cpu_only and device != "cpu") or (ops is not None and cell.op not in ops):
            continue
        row = {"op": cell.op, "axis": cell.axis, "inputs": cell.inputs}
        for name in ("strict", "native"):
            with rk.mode(name), rk.evidence.recording() as ran:
                outcome = compare(cell.check(device, torch.Generator().manual_seed(seed)))
            row[name] = dataclasses.asdict(outcome)
            if name == "strict":
                row["backend"] = _backends_ran(ran)
        rows.append(row)
    if distributed and (ops is None or any(op in ops for op in DIST_OPS)):
        worlds = [w for w in (2, 4) if device == "cpu" or w <= torch.cuda.device_count()]
        for op, axis, inputs, backend, by_mode in _dist_cells({w: run_distributed(w, device) for w in worlds}):
            if ops is not None and op not in ops:
                continue
            rows.append({"op": op, "axis": axis, "inputs": inputs, "backend": backend,
                         **{m: dataclasses.asdict(compare(p)) for m, p in by_mode.items()}})
    return rows


def _cell_text(o: dict) -> str:
    return f"{'PASS' if o['passed'] else 'FAIL'} {o['max_abs_diff']:<9.3g}"


def format_table(rows: list[dict]) -> str:
    head = f"{'op':20s} {'axis':32s} {'inputs':34s} {'backend':12s} {'strict (max|diff|)':19s} native (max|diff|)"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:20s} {r['axis']:32s} {r['inputs']:34s} {r['backend']:12s} "
                     f"{_cell_text(r['strict']):19s} {_cell_text(r['native'])}")
    return "\n".join(lines)


def format_contracts() -> str:
    return "\n".join(f"  {c.id:40s} {c.fingerprint}" for c in rk.contracts.all_contracts().values())


# --- accuracy against fp64 ---------------------------------------------------------------------------------

def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (x in fp64); the smallest normal spacing at 0 and below."""
    info = torch.finfo(dtype)
    _, e = torch.frexp(x.abs().clamp_min(info.tiny))  # |x| = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(x, info.eps), e - 1)


def error_stats(y: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Errors of y against the fp64 `ref`: max |y - ref|; that over max |ref|; and the max error in units
    of the last place of y's dtype, over the elements with |ref| >= max |ref| / 256 (below that, an
    output is the result of cancellation and its ulp says nothing of the op; its error is in max_abs)."""
    err = (y.double() - ref).abs()
    scale = ref.abs().max()
    big = ref.abs() >= scale / 256
    return {"max_abs": float(err.max()), "max_rel": float(err.max() / scale),
            "max_ulp": float((err / ulp(ref, y.dtype))[big].max())}


def _ref_attention(q, k, v, lens, scale):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        rep = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        start += n
    return torch.cat(outs)


def _ref_rope(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = pos.double().unsqueeze(-1) * inv
    c, s = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def accuracy_cases(gen: torch.Generator, device: str = "cpu") -> dict[str, tuple[Callable, torch.Tensor]]:
    """op -> (call of the op, its fp64 reference from the same bf16 inputs)."""
    bf16 = torch.bfloat16

    def r(*shape, scale=1.0):
        return _randn(gen, shape, bf16, device, scale)

    x, w, b = r(64, 1024), r(256, 1024, scale=0.05), r(256)
    xn, wn, res = r(64, 1024, scale=2.0), r(1024), r(64, 1024)
    xs = r(64, 512, scale=3.0)
    xr, pos = r(64, 8, 128), torch.randint(0, 32768, (64,), generator=gen).to(device)
    lens = [100, 37, 64]
    q, k, v = r(sum(lens), 8, 64), r(sum(lens), 2, 64), r(sum(lens), 2, 64)
    h, wl = r(64, 256), r(2048, 256, scale=0.2)
    tg = torch.randint(0, 2000, (64,), generator=gen).to(device)
    s64 = (xn.double() + res.double()).to(bf16)  # the residual sum is rounded once, then normalised

    def rms_ref(t):
        t = t.double()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * wn.double()

    g, u = xs.double()[:, :256], xs.double()[:, 256:]
    logits = (h.double() @ wl.double()[:2000].T) / 0.8
    return {
        "linear (+bias)": (lambda: rk.linear(x, w, b), x.double() @ w.double().T + b.double()),
        "rms_norm": (lambda: rk.rms_norm(xn, wn, 1e-6), rms_ref(xn)),
        "rms_norm+residual": (lambda: rk.rms_norm(xn, wn, 1e-6, res)[0], rms_ref(s64)),
        "silu_and_mul": (lambda: rk.silu_and_mul(xs), g / (1 + torch.exp(-g)) * u),
        "rope": (lambda: rk.rope(xr, pos, 1e6), _ref_rope(xr, pos, 1e6)),
        "attention_varlen": (lambda: rk.attention_varlen(q, k, v, cu_seqlens(lens, device), 0.125),
                             _ref_attention(q, k, v, lens, 0.125)),
        "logprobs (fp32 out)": (lambda: rk.logprobs(h, wl, tg, 0.8, vocab_size=2000),
                                logits.log_softmax(-1).gather(-1, tg.unsqueeze(-1)).squeeze(-1)),
    }


def measure_accuracy(device: str = "cpu", seed: int = 0) -> list[dict]:
    """Per op, error statistics of strict and native against fp64 (bf16 inputs, bf16 outputs except logprobs)."""
    rows = []
    for op, (call, ref) in accuracy_cases(torch.Generator().manual_seed(seed), device).items():
        row = {"op": op}
        for name in ("strict", "native"):
            with rk.mode(name):
                row[name] = error_stats(call().cpu(), ref.cpu())
        rows.append(row)
    return rows


def format_accuracy(rows: list[dict]) -> str:
    lines = ["| op | strict max abs | strict max ulp | native max abs | native max ulp |", "|---|---|---|---|---|"]
    for r in rows:
        s, n = r["strict"], r["native"]
        lines.append(f"| {r['op']} | {s['max_abs']:.3g} | {s['max_ulp']:.3g} | "
                     f"{n['max_abs']:.3g} | {n['max_ulp']:.3g} |")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_kernel.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--accuracy", action="store_true", help="also measure errors against fp64")
    parser.add_argument("--no-distributed", action="store_true", help="skip the cells that spawn ranks")
    parser.add_argument("--ops", help="comma-separated ops to check (default: all), e.g. linear,rope")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")

    start = time.time()
    print(f"rl_kernel selftest  device={args.device}  backend={rk.get_backend()}  torch={torch.__version__}  "
          f"threads={torch.get_num_threads()}")
    print("contracts (id, fingerprint):")
    print(format_contracts())
    ops = args.ops.split(",") if args.ops else None
    rows = run_matrix(args.device, distributed=not args.no_distributed, ops=ops)
    if not rows:
        parser.error(f"--ops {args.ops}: no such op in the matrix")
    print()
    print(format_table(rows))
    accuracy = measure_accuracy(args.device) if args.accuracy else None
    if accuracy:
        print()
        print(format_accuracy(accuracy))
    strict_fail = [r for r in rows if not r["strict"]["passed"]]
    native_fail = [r for r in rows if not r["native"]["passed"]]
    elapsed = time.time() - start
    print(f"\n{'OK' if not strict_fail else 'FAILED'}: strict bit-identical in {len(rows) - len(strict_fail)}/"
          f"{len(rows)} cells; native differs in {len(native_fail)}/{len(rows)} (expected where the framework's "
          f"kernels are not invariant); {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "backend": rk.get_backend(), "torch": torch.__version__,
                       "contracts": {c.id: c.fingerprint for c in rk.contracts.all_contracts().values()},
                       "cells": rows, "accuracy": accuracy, "strict_failures": len(strict_fail),
                       "native_failures": len(native_fail), "seconds": elapsed}, f, indent=2)
    return 1 if strict_fail else 0


if __name__ == "__main__":
    sys.exit(main())
