"""A standing gloo world for the expert-parallel MoE checks: W spawned ranks that stay up and run case after case
(so a hypothesis test pays the process start once, not per example).

The parent sends each rank its share of a case (its tokens, its expert slice, the whole router weight) and gets
back what the rank computed by `rl_kernel.ops.moe_parallel.moe_expert_parallel` in the case's mode (and, with
`grad_out`, the gradients of sum(out * grad_out)). Cases are plain dicts of CPU tensors.
"""

from __future__ import annotations

import os
import queue
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rl_kernel as rk
from rl_kernel.ops.moe_parallel import moe_expert_parallel
from rl_kernel.selftest.ranks import free_port

Case = dict[str, Any]


def run_case(case: Case) -> dict[str, torch.Tensor]:
    """This rank's (out, ids) of the case's share, and gradients when the case carries `grad_out`."""
    params = [case[n].clone() for n in ("x", "router", "gate_up", "down")]
    backward = "grad_out" in case
    if backward:
        for p in params:
            p.requires_grad_(True)
    with rk.mode(case.get("mode", "strict")):
        out, ids = moe_expert_parallel(*params, case["top_k"], case.get("renormalize", True))
        if backward:
            (out.to(torch.float32) * case["grad_out"]).sum().backward()
    result = {"out": out.detach(), "ids": ids}
    if backward:
        result.update({f"grad_{n}": p.grad for n, p in zip(("x", "router", "gate_up", "down"), params)})
    return result


def _serve(rank: int, world: int, port: int, inbox, outbox) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        while (case := inbox.get()) is not None:
            try:
                outbox.put(("ok", run_case(case)))
            except Exception as e:  # the parent raises it; the world may be unusable after, so the rank ends
                outbox.put(("error", f"{type(e).__name__}: {e}"))
                break
    finally:
        dist.destroy_process_group()


class EPWorld:
    """W gloo ranks serving `run_case`; use as a context manager (the ranks end on exit)."""

    def __init__(self, world: int, timeout_s: float = 120.0):
        self.world, self.timeout_s = world, timeout_s
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, port, self.inboxes[r], self.outboxes[r]), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, shares: list[Case]) -> list[dict[str, torch.Tensor]]:
        """Run one case: shares[r] goes to rank r; returns each rank's result, rank order."""
        for inbox, share in zip(self.inboxes, shares, strict=True):
            inbox.put(share)
        results = []
        for r, outbox in enumerate(self.outboxes):
            try:
                status, value = outbox.get(timeout=self.timeout_s)
            except queue.Empty:
                raise RuntimeError(f"expert-parallel rank {r} gave no result in {self.timeout_s:g} s") from None
            if status != "ok":
                raise RuntimeError(f"expert-parallel rank {r}: {value}")
            results.append(value)
        return results

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()

    def __enter__(self) -> EPWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shares(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tokens: list[int],
    top_k: int,
    mode: str = "strict",
    grad_out: torch.Tensor | None = None,
) -> list[Case]:
    """Split a one-rank case over len(tokens) ranks: rank r gets tokens[r] consecutive tokens of x (and of
    grad_out) and the r-th contiguous slice of the experts."""
    world, local = len(tokens), gate_up.shape[0] // len(tokens)
    starts = [sum(tokens[:r]) for r in range(world)]
    out = []
    for r in range(world):
        rows = slice(starts[r], starts[r] + tokens[r])
        experts = slice(r * local, (r + 1) * local)
        case = dict(x=x[rows], router=router, gate_up=gate_up[experts], down=down[experts], top_k=top_k, mode=mode)
        if grad_out is not None:
            case["grad_out"] = grad_out[rows]
        out.append(case)
    return out
