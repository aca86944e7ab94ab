"""The run's GPU layout, checked against the cluster before any engine starts.

`check_layout(cfg, node_gpus, model)` places the trainer (Megatron TP x CP ranks, one GPU each, a TP group
inside one node) and the rollout engines (`num_engines` x TP GPUs, each engine inside one node) on a
cluster described by its GPUs per node (`node_gpus`: what Ray reports, `ray_node_gpus()`), and checks:
every TP divides the model's attention heads, KV heads and MLP width; the GPUs exist; the weight
transport fits the placement (`ipc`: engines colocated on the trainer's GPUs, CUDA IPC inside a node;
`nccl`: engines on GPUs of their own; `object_store`: Ray's object store, the CPU transport). It
returns the placement; a layout that cannot run raises ConfigError naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from vime.errors import ConfigError

if TYPE_CHECKING:
    from vime.config import VimeConfig


class Transport(StrEnum):
    object_store = "object_store"  # Ray's object store (CPU runs; the trainer's rank 0 exports buckets)
    ipc = "ipc"                    # CUDA IPC handles (vLLM `ipc` / rl_kernel.models.weight_transfer): colocated
    nccl = "nccl"                  # NCCL broadcast from the trainer's rank 0 (vLLM `nccl`): separate GPUs


@dataclass
class WeightsConfig:
    transport: Transport = Transport.object_store
    colocate: bool = False         # rollout engines on the trainer's GPUs (time-shared; needs transport=ipc)
    bucket_bytes: int = 1 << 30    # packed bucket size (vLLM's default packed buffer: 1 GiB)


@dataclass(frozen=True)
class Placement:
    """GPU ids (node, local index) per trainer rank and per rollout engine."""

    trainer: list[tuple[int, int]]
    engines: list[list[tuple[int, int]]]
    gpus_used: int


def ray_node_gpus(nodes: list[dict[str, Any]]) -> list[int]:
    """GPUs per alive node from `ray.nodes()` (each {"Alive": bool, "Resources": {"GPU": n, ...}})."""
    return [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)]


def _fail(what: str, fix: str) -> None:
    raise ConfigError(f"{what}: {fix}")


def check_model_tp(model: dict[str, Any], tp: int, side: str) -> None:
    """`tp` must split the heads, the KV heads and the MLP width of `model` (HF config.json keys) evenly."""
    heads = model["num_attention_heads"]
    for key, n in (("num_attention_heads", heads), ("num_key_value_heads", model.get("num_key_value_heads", heads)),
                   ("intermediate_size", model["intermediate_size"])):
        if n % tp:
            _fail(f"{side}.tp={tp} does not divide the model's {key}={n}",
                  f"choose a {side}.tp that divides {key}")


def check_layout(cfg: VimeConfig, node_gpus: list[int], model: dict[str, Any]) -> Placement:
    """Place the run on the cluster (`node_gpus`: GPUs per node) or raise ConfigError; `model` is the HF
    config.json of the checkpoint (head counts)."""
    t, r, w = cfg.trainer, cfg.rollout, cfg.weights
    for side, tp in (("trainer", t.tp), ("rollout", r.tp)):
        check_model_tp(model, tp, side)
    transport = Transport(w.transport)
    if cfg.device == "cpu":
        if transport != Transport.object_store or w.colocate:
            _fail(f"weights.transport={transport.value}, colocate={w.colocate} on CPU",
                  "use weights.transport=object_store, colocate=false (IPC and NCCL move CUDA memory)")
        return Placement([], [], 0)
    if transport == Transport.object_store:
        _fail("weights.transport=object_store on GPUs", "use ipc (colocated engines) or nccl (separate GPUs)")
    if (transport == Transport.ipc) != w.colocate:
        _fail(f"weights.transport={transport.value} with colocate={w.colocate}",
              "CUDA IPC serves engines colocated on the trainer's GPUs (colocate=true); separate GPUs use nccl")
    if not node_gpus or sum(node_gpus) == 0:
        _fail("the cluster reports no GPUs", "start Ray on GPU nodes (or run device=cpu)")
    need_t, need_r = t.tp * t.cp, r.num_engines * r.tp
    free = list(node_gpus)
    used = [0] * len(node_gpus)

    def take(n: int, what: str, fix: str) -> list[tuple[int, int]]:
        for node, left in enumerate(free):
            if left >= n:
                free[node] -= n
                got = [(node, used[node] + i) for i in range(n)]
                used[node] += n
                return got
        _fail(f"{what} finds no node with {n} free GPUs (GPUs per node {node_gpus}, free {free})", fix)
        raise AssertionError  # unreachable

    fix_t = "lower trainer.tp / trainer.cp or add GPUs"
    trainer = [g for _ in range(t.cp) for g in take(t.tp, f"a trainer TP group of {t.tp}", fix_t)]
    if w.colocate:
        if need_r != need_t:
            _fail(f"colocated engines use {r.num_engines} x TP{r.tp} = {need_r} GPUs, the trainer {need_t}",
                  "colocated engines must cover exactly the trainer's GPUs: set rollout.num_engines x rollout.tp "
                  "= trainer.tp x trainer.cp")
        engines = [trainer[i * r.tp:(i + 1) * r.tp] for i in range(r.num_engines)]
        for i, e in enumerate(engines):
            if len({node for node, _ in e}) != 1:
                _fail(f"colocated engine {i} spans nodes {sorted({n for n, _ in e})}",
                      "an engine's TP group (and CUDA IPC) stays inside one node: lower rollout.tp")
        return Placement(trainer, engines, need_t)
    fix_r = "lower rollout.num_engines / rollout.tp, or add GPUs"
    engines = [take(r.tp, f"rollout engine {i} (TP{r.tp})", fix_r) for i in range(r.num_engines)]
    return Placement(trainer, engines, need_t + need_r)


def read_config_json(model_path: str) -> dict[str, Any]:
    """The checkpoint's HF config.json."""
    import json
    from pathlib import Path
    return json.loads((Path(model_path) / "config.json").read_text())
