"""`plan=true`: the run's placement shown, without an engine, a model's weights or CUDA.

The driver runs every check that needs no engine (config, checkpoint headers, lengths, layout, GPU memory
against `plan_gpu_gib`, Ray resources), reserves the placement groups (vime.cluster.groups) and then calls
`write_plan`: light stand-in actors take each trainer rank's and each engine's place with the real actors'
options, and each engine's stand-in starts its TP workers' stand-ins the way vLLM's Ray executor does
(RayExecutorV2, vLLM 0.32: from inside the engine's actor, into `ray.util.get_current_placement_group()`, at
the bundles VLLM_RAY_BUNDLE_INDICES names, VLLM_RAY_PER_WORKER_GPUS of a GPU each, Ray leaving
CUDA_VISIBLE_DEVICES to vLLM). Every stand-in reports what Ray gave it: its node, `ray.get_gpu_ids()` and
CUDA_VISIBLE_DEVICES. A worker's device is then derived as vLLM derives it (CUDA_VISIBLE_DEVICES = the
sorted GPU ids of the engine's workers on that node, device = its local rank there) and must be the GPU Ray
gave the worker's bundle. A GPU holding two trainer ranks or two vLLM workers, or a worker whose device is
not its bundle's GPU, is refused (ConfigError). Works on CPU with a local Ray that declares GPUs
(`ray.num_gpus=8`): Ray hands out fake GPU ids and sets CUDA_VISIBLE_DEVICES as on a GPU node.

Output: a table (role, rank or engine/worker, node, GPU, CUDA_VISIBLE_DEVICES) and the memory plan per GPU
on the console; `<output_dir>/plan.json` = {"gpus": distinct GPUs used, "actors": [{"role", "rank", "engine",
"worker", "node", "gpu"}], "memory_gib_per_gpu": {...}}; `<output_dir>/plan_actors.json` the same actors with
what each stand-in saw (Ray's GPU ids, CUDA_VISIBLE_DEVICES, bundle, vLLM's local rank).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.errors import ConfigError

log = logging.getLogger("vime")
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class Where:
    """A stand-in actor: where Ray put it."""

    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node": ray.util.get_node_ip_address(),
            "ray_gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            # the run's own environment (Ray merges an actor's env_vars with the job's): set in every actor
            "rl_kernel_canonical_tp": os.environ.get("RL_KERNEL_CANONICAL_TP"),
        }


class EngineStandIn(Where):
    """A rollout engine's stand-in: with vLLM's Ray executor (its environment names the bundles) it starts its
    TP workers' stand-ins as RayExecutorV2 starts its workers and derives each one's device as vLLM does."""

    def workers(self) -> list[dict[str, Any]]:
        indices = os.environ.get("VLLM_RAY_BUNDLE_INDICES")
        if not indices:
            return []
        bundles = [int(b) for b in indices.split(",")]
        share = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise ConfigError(
                "plan: the engine's actor sees no placement group (vLLM's Ray executor would make one of its own): "
                "its scheduling strategy must capture child tasks"
            )
        actors = [
            ray.remote(Where)
            .options(
                num_cpus=0,
                num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                runtime_env={"env_vars": {NOSET_CUDA: "1"}},
            )
            .remote()
            for b in bundles
        ]
        found = ray.get([a.where.remote() for a in actors])
        for a in actors:
            ray.kill(a)
        return vllm_devices(found, bundles)


def vllm_devices(found: list[dict[str, Any]], bundles: list[int]) -> list[dict[str, Any]]:
    """Each worker (rank order) with the device vLLM's RayExecutorV2 gives it: `local_rank` its index among the
    engine's workers on its node, CUDA_VISIBLE_DEVICES the sorted GPU ids of those workers, its device the
    `local_rank`-th of them (vllm/v1/executor/ray_executor_v2.py, `_init_executor` steps 5-6)."""
    ranks, gpus = defaultdict(list), defaultdict(list)
    for rank, f in enumerate(found):
        ranks[f["node_id"]].append(rank)
        gpus[f["node_id"]].extend(f["ray_gpu_ids"])
    out = []
    for rank, (f, b) in enumerate(zip(found, bundles)):
        local, assigned = ranks[f["node_id"]].index(rank), sorted(gpus[f["node_id"]])
        out.append(
            f
            | {
                "bundle": b,
                "local_rank": local,
                "vllm_cuda_visible_devices": ",".join(map(str, assigned)),
                "vllm_gpu": assigned[local],
            }
        )
    return out


def _gpu(seen: dict[str, Any]) -> int | None:
    ids = seen["ray_gpu_ids"]
    return ids[0] if ids else None


def place_stand_ins(groups) -> list[dict[str, Any]]:
    """Every actor's and vLLM worker's record: role, rank / engine / worker, node, gpu, and what it saw."""
    cfg = groups.cfg
    trainers = [ray.remote(Where).options(**groups.trainer_options(r)).remote() for r in range(len(groups.trainer))]
    engines = []
    for i in range(len(groups.engines)):
        env = groups.engine_env(i)
        opts = groups.engine_options(i) | ({"runtime_env": {"env_vars": env}} if env else {})
        engines.append(ray.remote(EngineStandIn).options(**opts).remote())
    seen_t = ray.get([t.where.remote() for t in trainers])
    seen_e = ray.get([e.where.remote() for e in engines])
    workers = ray.get([e.workers.remote() for e in engines])
    for a in trainers + engines:
        ray.kill(a)
    rows = [_row("trainer", s, rank=r) for r, s in enumerate(seen_t)]
    for i, (engine, ws) in enumerate(zip(seen_e, workers)):
        if not ws:  # the engine's actor is its only process (CPU, TP1): it is worker 0
            rows.append(_row("rollout", engine, engine=i, worker=0, bundle=groups.engine_bundle(i)))
            continue
        rows.append(_row("rollout", engine, engine=i, bundle=groups.engine_bundle(i)))
        for w, seen in enumerate(ws):
            if seen["vllm_gpu"] != _gpu(seen):
                raise ConfigError(
                    f"plan: vLLM would run engine {i}'s worker {w} on GPU {seen['vllm_gpu']} of node {seen['node']} "
                    f"(CUDA_VISIBLE_DEVICES={seen['vllm_cuda_visible_devices']}, local rank {seen['local_rank']}), "
                    f"but Ray gave its bundle {seen['bundle']} GPU {_gpu(seen)}: the engine's bundles are not in "
                    "GPU order (vime.cluster.groups)"
                )
            rows.append(_row("rollout", seen, engine=i, worker=w, gpu=seen["vllm_gpu"]))
    if cfg.device == "cuda":
        check_sharing(rows)
    return rows


def _row(role: str, seen: dict[str, Any], rank=None, engine=None, worker=None, gpu=None, **more) -> dict[str, Any]:
    return {
        "role": role,
        "rank": rank,
        "engine": engine,
        "worker": worker,
        "node": seen["node"],
        "gpu": gpu if gpu is not None else _gpu(seen),
        "seen": {k: v for k, v in seen.items() if k not in ("node",)} | more,
    }


def check_sharing(rows: list[dict[str, Any]]) -> None:
    """No GPU holds two trainer ranks (NCCL refuses two ranks of one world on one GPU) or two vLLM workers, and
    every trainer rank and worker has a GPU."""
    on: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["role"] == "rollout" and row["worker"] is None:
            continue  # the engine's own actor (TP > 1): its workers hold the GPUs
        trainer = row["role"] == "trainer"
        who = f"trainer rank {row['rank']}" if trainer else f"engine {row['engine']} worker {row['worker']}"
        if row["gpu"] is None:
            raise ConfigError(f"plan: Ray gave {who} no GPU: the bundles need GPUs (vime.config.layout.ray_spec)")
        on[(row["node"], row["gpu"])][row["role"]].append(who)
    for (node, gpu), roles in on.items():
        for role, who in roles.items():
            if len(who) > 1:
                raise ConfigError(f"plan: GPU {gpu} of node {node} holds {' and '.join(who)}: one {role} per GPU")


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The placement as console lines: role, rank or engine/worker, node, GPU, CUDA_VISIBLE_DEVICES."""
    head = f"{'role':8} {'rank/engine.worker':18} {'node':16} {'gpu':>4}  CUDA_VISIBLE_DEVICES"
    lines = [head]
    for r in rows:
        worker = "-" if r["worker"] is None else r["worker"]
        who = str(r["rank"]) if r["role"] == "trainer" else f"{r['engine']}.{worker}"
        seen = r["seen"]
        cvd = seen.get("vllm_cuda_visible_devices", seen["cuda_visible_devices"])
        gpu = "-" if r["gpu"] is None else r["gpu"]
        lines.append(f"{r['role']:8} {who:18} {r['node']:16} {gpu:>4}  {cvd}")
    return lines


def write_plan(cfg, groups, model_path: str, output_dir: Path) -> dict[str, Any]:
    """Place the stand-ins, print the table and the memory plan, write plan.json (module docstring)."""
    from vime.config import preflight
    from vime.config.layout import read_config_json

    rows = place_stand_ins(groups)
    memory = {}
    if cfg.device == "cuda":
        plan = preflight.gpu_memory_plan(cfg, read_config_json(model_path), cfg.plan_gpu_gib * 2**30)
        memory = {k: round(v / 2**30, 2) for k, v in plan.items()}
    used = {(r["node"], r["gpu"]) for r in rows if r["gpu"] is not None}
    out = {
        "gpus": len(used),
        "actors": [{k: r[k] for k in ("role", "rank", "engine", "worker", "node", "gpu")} for r in rows],
        "memory_gib_per_gpu": memory,
    }
    output_dir = Path(output_dir)
    (output_dir / "plan.json").write_text(json.dumps(out, indent=1) + "\n")
    (output_dir / "plan_actors.json").write_text(json.dumps(rows, indent=1) + "\n")
    for line in table(rows):
        log.info("plan: %s", line)
    if memory:
        log.info("plan: memory per GPU (GiB): %s", ", ".join(f"{k} {v:g}" for k, v in memory.items()))
    where = output_dir / "plan.json"
    log.info("plan: %d GPU(s), %d actor(s); written to %s (no engine started)", len(used), len(rows), where)
    return out
