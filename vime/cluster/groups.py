"""The run's placement groups on the Ray cluster and where each actor, and each vLLM TP worker, goes in them.

`make_groups(cfg, layout)` reserves the bundles `vime.config.layout.ray_spec` describes (on GPUs one bundle
per GPU), asks Ray which node and which GPU each bundle got (a short probe task per GPU bundle: Ray promises
neither that bundle order follows nodes nor GPU ids), and orders them by (node, GPU): trainer rank r takes
the r-th, so a trainer TP group is consecutive GPUs of one node. The rollout engines follow
`check_layout`'s placement (`layout`): colocated, engine i's worker w sits in the bundle of the trainer
rank whose GPU the layout gives it (trainer TP group i's GPUs); disaggregated, engine i takes the i-th run
of `rollout.tp` bundles of the rollout group in the same order. A TP group or an engine that Ray placed
across nodes is refused (ConfigError) before any actor starts.

A TP > 1 vLLM engine on GPUs runs vLLM's Ray executor (RayExecutorV2 in vLLM 0.32): its actor sits in its
worker 0's bundle and captures its child actors into the run's placement group; `engine_env` tells vLLM
which bundles its workers take (VLLM_RAY_BUNDLE_INDICES, in worker-rank order) and what share of each GPU
(VLLM_RAY_PER_WORKER_GPUS). `worker_options` are the options vLLM's executor gives worker w
(vllm/v1/executor/ray_executor_v2.py): the plan's stand-ins are started with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.cluster import placement
from vime.config.layout import Placement, RaySpec, ray_spec, ray_vllm_workers
from vime.config.schema import VimeConfig
from vime.errors import ConfigError

PROBE_GPUS = 0.01  # what a probe task takes of a bundle's GPU to learn its id
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"  # vLLM's Ray workers: vLLM sets the devices itself


@dataclass(frozen=True)
class Slot:
    """One bundle: its placement group, index, Ray node id and the GPU id Ray gave it (None: a CPU bundle)."""

    pg: PlacementGroup
    bundle: int
    node: str | None
    gpu: int | None


@dataclass
class Groups:
    """The reserved groups and each actor's slot: `trainer[r]` for trainer rank r, `engines[i][w]` for engine
    i's TP worker w (one slot per engine where its actor is its only process: CPU, or TP1)."""

    cfg: VimeConfig
    spec: RaySpec
    pgs: dict[str, PlacementGroup]
    trainer: list[Slot]
    engines: list[list[Slot]] = field(default_factory=list)

    @property
    def rollout_pg(self) -> PlacementGroup:
        return self.engines[0][0].pg

    def engine_bundle(self, i: int) -> int:
        """The bundle of engine i's actor (its worker 0's)."""
        return self.engines[i][0].bundle

    def trainer_options(self, r: int) -> dict[str, Any]:
        s = self.spec.shares
        return {
            "num_cpus": s.trainer_cpus,
            "num_gpus": s.trainer_gpus,
            "scheduling_strategy": placement.in_group(self.trainer[r].pg, self.trainer[r].bundle),
        }

    def engine_options(self, i: int) -> dict[str, Any]:
        """The rollout actor of engine i: in its worker 0's bundle; with vLLM's Ray executor it captures the
        workers vLLM starts into the run's group (vLLM takes `ray.util.get_current_placement_group()`)."""
        s, slot = self.spec.shares, self.engines[i][0]
        return {
            "num_cpus": s.engine_cpus,
            "num_gpus": s.engine_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=slot.pg,
                placement_group_bundle_index=slot.bundle,
                placement_group_capture_child_tasks=ray_vllm_workers(self.cfg),
            ),
        }

    def engine_env(self, i: int) -> dict[str, str]:
        """Environment of engine i's actor that places vLLM's Ray workers ({} without them)."""
        if not ray_vllm_workers(self.cfg):
            return {}
        return {
            "VLLM_RAY_BUNDLE_INDICES": ",".join(str(w.bundle) for w in self.engines[i]),
            "VLLM_RAY_PER_WORKER_GPUS": f"{self.spec.shares.worker_gpus:g}",
        }

    def worker_options(self, i: int, w: int) -> dict[str, Any]:
        """What vLLM's RayExecutorV2 asks of Ray for engine i's worker w (`_get_actor_resource_kwargs`, its
        scheduling strategy and runtime env: Ray leaves CUDA_VISIBLE_DEVICES to vLLM)."""
        slot = self.engines[i][w]
        return {
            "num_cpus": 0,
            "num_gpus": self.spec.shares.worker_gpus,
            "scheduling_strategy": placement.in_group(slot.pg, slot.bundle),
            "runtime_env": {"env_vars": {NOSET_CUDA: "1"}},
        }

    def remove(self) -> None:
        for pg in self.pgs.values():
            ray.util.remove_placement_group(pg)


@ray.remote(num_cpus=0)
def _probe() -> tuple[str, list]:
    return ray.get_runtime_context().get_node_id(), list(ray.get_gpu_ids())


def probe(pg: PlacementGroup) -> list[tuple[str | None, int | None]]:
    """(node id, GPU id) of every bundle of `pg`, as Ray placed it (GPU None: a bundle without GPUs)."""
    nodes = placement.bundle_nodes(pg)
    refs = {
        i: _probe.options(num_gpus=PROBE_GPUS, scheduling_strategy=placement.in_group(pg, i)).remote()
        for i, b in enumerate(pg.bundle_specs)
        if b.get("GPU")
    }
    got = dict(zip(refs, ray.get(list(refs.values()))))
    return [(got[i][0], int(got[i][1][0])) if i in got else (nodes[i], None) for i in range(len(nodes))]


def _ordered(pg: PlacementGroup) -> list[Slot]:
    """The bundles of `pg` as slots, ordered by (node, GPU) (CPU bundles keep their order)."""
    found = probe(pg)
    slots = [Slot(pg, i, node, gpu) for i, (node, gpu) in enumerate(found)]
    if all(s.gpu is None for s in slots):
        return slots
    return sorted(slots, key=lambda s: (str(s.node), s.gpu))


def _one_node(slots: list[Slot], what: str, fix: str) -> None:
    nodes = sorted({placement.node_address(s.node) for s in slots})
    if len(nodes) > 1:
        raise ConfigError(f"Ray placed {what} across nodes {nodes}: {fix}")


def make_groups(cfg: VimeConfig, layout: Placement) -> Groups:
    """Reserve the run's bundles (`ray_spec`) and give every trainer rank and engine worker its slot
    (module docstring); ConfigError when Ray cannot hold them or split a TP group over nodes."""
    spec = ray_spec(cfg)
    pgs = {name: placement.make_group(name, bundles) for name, bundles in spec.groups.items()}
    trainer = _ordered(pgs["trainer"])
    t, r = cfg.trainer, cfg.rollout
    fix = "give each node a multiple of the TP degree in GPUs, or lower trainer.tp / rollout.tp"
    if cfg.device == "cuda":
        for g in range(t.cp):
            _one_node(trainer[g * t.tp : (g + 1) * t.tp], f"trainer TP group {g}", fix)
    if "rollout" not in pgs:  # colocated on GPUs: each engine worker in its trainer rank's bundle
        engines = [[trainer[layout.trainer.index(gpu)] for gpu in gpus] for gpus in layout.engines]
    elif cfg.device == "cuda":
        bundles = _ordered(pgs["rollout"])
        engines = [bundles[i * r.tp : (i + 1) * r.tp] for i in range(r.num_engines)]
    else:
        engines = [[s] for s in _ordered(pgs["rollout"])]
    if cfg.device == "cuda":
        for i, e in enumerate(engines):
            _one_node(e, f"rollout engine {i}'s TP workers", fix)
    if cfg.device == "cuda" and r.tp == 1:
        engines = [e[:1] for e in engines]
    return Groups(cfg, spec, pgs, trainer, engines)
