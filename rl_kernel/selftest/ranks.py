"""The rank harness: the sharded cells, computed on real spawned ranks (gloo on CPU, NCCL on CUDA) from the
same inputs on every rank: logprobs sharded over the vocab vs unsharded, a row-parallel linear sharded over
K vs unsharded, the collective's all-reduce vs the rank-order tree it promises."""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rl_kernel as rk
from rl_kernel.ops.truncation import Truncation
from rl_kernel.selftest.matrix import Pairs, backends_ran, compare, randn

VOCAB, VOCAB_PADDED, TP_K = 500, 512, 512


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a spawned world's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_inputs(world: int, device: str) -> dict[str, torch.Tensor]:
    """The same inputs on every rank (one seed)."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "h": randn(gen, (12, 64), torch.float32, device),
        "w": randn(gen, (VOCAB_PADDED, 64), torch.float32, device),
        "targets": torch.randint(0, VOCAB, (12,), generator=gen).to(device),
        "temps": (torch.rand(12, generator=gen) + 0.5).to(device),
        "x": randn(gen, (6, TP_K), torch.bfloat16, device),
        "wk": randn(gen, (48, TP_K), torch.bfloat16, device),
        "bias": randn(gen, (48,), torch.bfloat16, device),
        "parts": randn(gen, (world, 1000), torch.float32, device, 100.0),
    }


def rank_outputs(rank: int, world: int, device: str) -> dict[str, torch.Tensor | str | None]:
    """Per rank: logprobs sharded over the vocab and unsharded; row-parallel linear sharded over K and
    unsharded; the all-reduce of this rank's part (twice); the error of a misaligned K shard."""
    inp = _dist_inputs(world, device)
    group = dist.group.WORLD
    rk.set_canonical_tp(world)  # the widest TP of this "deployment" (the triton GEMM contract's K groups)
    vl, kl = VOCAB_PADDED // world, TP_K // world
    out: dict[str, torch.Tensor | str | None] = {
        "logprobs/full": rk.logprobs(inp["h"], inp["w"], inp["targets"], inp["temps"], vocab_size=VOCAB),
        "logprobs/sharded": rk.logprobs(
            inp["h"], inp["w"][rank * vl : (rank + 1) * vl], inp["targets"], inp["temps"], vocab_size=VOCAB, group=group
        ),
        "row_parallel/full": rk.row_parallel_linear(inp["x"], inp["wk"], None, inp["bias"]),
        "row_parallel/sharded": rk.row_parallel_linear(
            inp["x"][:, rank * kl : (rank + 1) * kl], inp["wk"][:, rank * kl : (rank + 1) * kl], group, inp["bias"]
        ),
        "all_reduce/parts": inp["parts"],
        "all_reduce/out": rk.all_reduce(inp["parts"][rank], group),
        "all_reduce/again": rk.all_reduce(inp["parts"][rank], group),
        "misaligned_error": None,
    }
    out |= device_gather_outputs(rank, world, inp)
    # exact top-k / top-p (the support gathered over the vocab ranks) and the entropy (an order-free int64 sum)
    # (even rows score their most likely token, always kept; odd rows a random one, mostly outside: -inf)
    trunc = Truncation(top_k=100, top_p=0.95)
    top = (inp["h"] @ inp["w"][:VOCAB].T).argmax(-1)
    targets = torch.where(torch.arange(12, device=top.device) % 2 == 0, top, inp["targets"])
    for key, kwargs in (("truncated", {"truncation": trunc}), ("entropy", {})):
        full = rk.logprobs(inp["h"], inp["w"], targets, inp["temps"], vocab_size=VOCAB, with_entropy=True, **kwargs)
        sharded = rk.logprobs(
            inp["h"],
            inp["w"][rank * vl : (rank + 1) * vl],
            targets,
            inp["temps"],
            vocab_size=VOCAB,
            group=group,
            with_entropy=True,
            **kwargs,
        )
        out[f"{key}/full"], out[f"{key}/full_entropy"] = full
        out[f"{key}/sharded"], out[f"{key}/sharded_entropy"] = sharded
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


def _concat_gather(group: dist.ProcessGroup):
    """A device communicator's all-gather as vLLM's `GroupCoordinator.all_gather(t, dim=0)` gives it (a
    concatenation along dim 0, rank order), over its own transport calls: the stand-in of the CUDA path's
    NCCL communicator on gloo ranks."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=0)

    return gather


def device_gather_outputs(rank: int, world: int, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The row-parallel linear and the all-reduce again, their partials gathered through a registered device
    gather (`rl_kernel.ops.collective.use_gather`, the strict vLLM model's path on CUDA) on a group of its own."""
    from rl_kernel.ops.collective import use_gather

    group = dist.new_group(list(range(world)))
    use_gather(group, _concat_gather(group))
    kl = TP_K // world
    try:
        return {
            "row_parallel/device_gather": rk.row_parallel_linear(
                inp["x"][:, rank * kl : (rank + 1) * kl], inp["wk"][:, rank * kl : (rank + 1) * kl], group, inp["bias"]
            ),
            "all_reduce/device_gather": rk.all_reduce(inp["parts"][rank], group),
        }
    finally:
        use_gather(group, None)


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
                results[name] = {
                    key: v.cpu() if isinstance(v, torch.Tensor) else v
                    for key, v in rank_outputs(rank, world, device).items()
                }
            results[name]["evidence"] = list(ran)
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, device: str = "cpu") -> list[dict[str, dict]]:
    """Run `rank_outputs` on `world` spawned ranks (gloo on CPU, nccl on CUDA); returns, per rank,
    {"strict": outputs, "native": outputs} with tensors on the CPU."""
    backend = "gloo" if device == "cpu" else "nccl"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out")
        mp.spawn(_dist_worker, args=(world, free_port(), backend, device, path), nprocs=world, join=True)
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
            cells.append(
                (
                    op,
                    f"{axis} tp{world}",
                    inputs,
                    backends_ran([r for r in ran if r["op"] in contract_ops]),
                    {m: by_mode[m][op] for m in by_mode},
                )
            )
    return cells


DIST_OPS = ("logprobs", "row_parallel_linear", "all_reduce")


def run_rank_cells(device: str = "cpu", ops: list[str] | None = None) -> list[dict]:
    """The sharded cells (of `ops`, default all) over 2 and 4 ranks (as many as there are GPUs on CUDA), one
    dict per cell as `rl_kernel.selftest.matrix.run_cells` gives."""
    if ops is not None and not any(op in ops for op in DIST_OPS):
        return []
    worlds = [w for w in (2, 4) if device == "cpu" or w <= torch.cuda.device_count()]
    return [
        {
            "op": op,
            "axis": axis,
            "inputs": inputs,
            "backend": backend,
            **{m: dataclasses.asdict(compare(p)) for m, p in by_mode.items()},
        }
        for op, axis, inputs, backend, by_mode in _dist_cells({w: run_distributed(w, device) for w in worlds})
        if ops is None or op in ops
    ]
