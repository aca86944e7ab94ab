"""The run's layout, checked against the cluster before any engine starts, and each engine's weight path.

`check_layout(cfg, node_gpus, model)` places the trainer (Megatron TP x CP ranks, one GPU each, a TP group
inside one node) and the rollout engines (`num_engines` x TP GPUs, each engine inside one node) on a
cluster described by its GPUs per node (`node_gpus`: what Ray reports, `ray_node_gpus()`), and checks:
every TP divides the model's attention heads, KV heads and MLP width; the GPUs exist; the weight
transport fits the placement (`ipc`: engines colocated on the trainer's GPUs, CUDA IPC inside a node;
`nccl`: engines on GPUs of their own; `object_store`: Ray's object store, the CPU transport). It
returns the placement; a layout that cannot run raises ConfigError naming what to change.

Roles across nodes (`ray.trainer_resource`, `ray.rollout_resource`): a custom node resource that marks
the nodes a role may run on (`ray start --resources='{"vime_rollout": 1}'`). `check_roles` refuses a
cluster whose marked nodes cannot hold the role (naming the resource and the numbers), on CPU and GPU,
before any engine starts; `check_layout` places GPU roles on their marked nodes only.

Weight path by locality (`weights.transport=auto`, the default; `engine_transports`): an engine on trainer
rank 0's node takes the fast local path, one on another node a network transport. On CPU: `object_store`
(Ray's shared-memory object store of the node: nothing crosses a network) locally, `gloo` (rl_kernel's
weight-push group: rank 0 broadcasts packed buckets over TCP between the nodes' addresses) remotely. On
GPUs: `ipc` for engines colocated on the trainer's GPUs, else `nccl`. Locality is decided by Ray node id,
never by whether a path happens to reach (nodes simulated on one host share /dev/shm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime.config.schema import CPU_TRANSPORTS, Transport, VimeConfig
from vime.errors import ConfigError

ROLE_MARK = 0.001  # what one bundle asks of its role's node resource: a node declaring 1 holds any number


@dataclass(frozen=True)
class Placement:
    """GPU ids (node, local index) per trainer rank and per rollout engine."""

    trainer: list[tuple[int, int]]
    engines: list[list[tuple[int, int]]]
    gpus_used: int


def ray_node_gpus(nodes: list[dict[str, Any]]) -> list[int]:
    """GPUs per alive node from `ray.nodes()` (each {"Alive": bool, "Resources": {"GPU": n, ...}})."""
    return [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)]


def ray_node_resources(nodes: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Total resources per alive node from `ray.nodes()`, in the order of `ray_node_gpus`."""
    return [dict(n.get("Resources", {})) for n in nodes if n.get("Alive", True)]


def _fail(what: str, fix: str) -> None:
    raise ConfigError(f"{what}: {fix}")


def check_model_tp(model: dict[str, Any], tp: int, side: str) -> None:
    """`tp` must split the heads, the KV heads and the MLP width of `model` (HF config.json keys) evenly; a
    Qwen3-MoE runs at tp 1 (expert parallelism 1)."""
    if (model.get("num_experts") or model.get("num_local_experts")) and tp > 1:
        _fail(f"{side}.tp={tp} with a Qwen3-MoE model", f"set {side}.tp=1: MoE layers run at tp 1 (docs/moe.md)")
    heads = model["num_attention_heads"]
    for key, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", model.get("num_key_value_heads", heads)),
        ("intermediate_size", model["intermediate_size"]),
    ):
        if n % tp:
            _fail(f"{side}.tp={tp} does not divide the model's {key}={n}", f"choose a {side}.tp that divides {key}")


def role_resources(cfg: VimeConfig) -> dict[str, str | None]:
    """The node resource that marks each role's nodes (None: any node). Colocated engines share the
    trainer's nodes, so they take the trainer's."""
    trainer = cfg.ray.trainer_resource
    return {"trainer": trainer, "rollout": trainer if cfg.weights.colocate else cfg.ray.rollout_resource}


def role_needs(cfg: VimeConfig) -> dict[str, tuple[int, dict[str, float]]]:
    """Bundles and the resources of one bundle, per role (`ray_spec`; colocated engines on GPUs live in the
    trainer's bundles: none of their own)."""
    groups = ray_spec(cfg).groups
    need = lambda role: (len(groups[role]), {k: v for k, v in groups[role][0].items() if k in ("CPU", "GPU")})  # noqa: E731
    return {"trainer": need("trainer"), "rollout": need("rollout") if groups.get("rollout") else (0, {})}


def check_roles(cfg: VimeConfig, nodes: list[dict[str, float]]) -> None:
    """Every role whose nodes are marked (`ray.trainer_resource` / `ray.rollout_resource`) finds alive nodes
    that declare the resource and hold its actors' CPUs and GPUs (totals, and one bundle inside one node),
    else a ConfigError naming what is missing. Roles marked alike share those nodes: their sum must fit.
    `nodes`: each alive node's total resources (`ray_node_resources`)."""
    marks, needs = role_resources(cfg), role_needs(cfg)
    for mark in dict.fromkeys(m for m in marks.values() if m):
        roles = [role for role, m in marks.items() if m == mark]
        who = " and ".join(roles)
        flag = f"ray start --resources='{{\"{mark}\": 1}}'"
        marked = [n for n in nodes if n.get(mark, 0) > 0]
        if not marked:
            _fail(
                f"no alive node of the cluster declares the resource '{mark}' that the {who} actors need",
                f"start the {who} nodes with {flag}, or unset ray.{roles[0]}_resource",
            )
        for key in ("CPU", "GPU"):
            want = sum(needs[role][0] * needs[role][1].get(key, 0.0) for role in roles)
            have = sum(n.get(key, 0.0) for n in marked)
            if want > have:
                _fail(
                    f"the {who} actors need {want:g} {key}s on the nodes that declare '{mark}', which have "
                    f"{have:g} ({len(marked)} node(s))",
                    f"add such nodes ({flag}) or lower the layout",
                )
            for role in roles:
                per = needs[role][1].get(key, 0.0)
                if per > max(n.get(key, 0.0) for n in marked):
                    _fail(
                        f"one {role} actor needs {per:g} {key}s on one node that declares '{mark}'; the largest "
                        f"has {max(n.get(key, 0.0) for n in marked):g}",
                        "lower ray.cpus_per_actor / ray.gpus_per_actor or the TP degree",
                    )


def check_layout(
    cfg: VimeConfig, node_gpus: list[int], model: dict[str, Any], node_resources: list[dict[str, float]] | None = None
) -> Placement:
    """Place the run on the cluster (`node_gpus`: GPUs per node; `node_resources`: each node's resources,
    for the role marks, see `check_roles`) or raise ConfigError; `model` is the HF config.json of the
    checkpoint (head counts)."""
    t, r, w = cfg.trainer, cfg.rollout, cfg.weights
    for side, tp in (("trainer", t.tp), ("rollout", r.tp)):
        check_model_tp(model, tp, side)
    if node_resources is not None:
        check_roles(cfg, node_resources)
    transport = Transport(w.transport)
    if cfg.device == "cpu":  # colocate: the engines on the trainer's nodes (no GPU to share)
        if transport not in CPU_TRANSPORTS:
            _fail(
                f"weights.transport={transport.value} on CPU",
                "use weights.transport=auto (object_store on the trainer's node, gloo to other nodes), "
                "object_store or gloo (IPC and NCCL move CUDA memory)",
            )
        return Placement([], [], 0)
    if transport in (Transport.object_store, Transport.gloo):
        _fail(
            f"weights.transport={transport.value} on GPUs", "use auto, ipc (colocated engines) or nccl (separate GPUs)"
        )
    if transport != Transport.auto and (transport == Transport.ipc) != w.colocate:
        _fail(
            f"weights.transport={transport.value} with colocate={w.colocate}",
            "CUDA IPC serves engines colocated on the trainer's GPUs (colocate=true); separate GPUs use nccl",
        )
    if not node_gpus or sum(node_gpus) == 0:
        _fail("the cluster reports no GPUs", "start Ray on GPU nodes (or run device=cpu)")
    need_t, need_r = t.tp * t.cp, r.num_engines * r.tp
    free = list(node_gpus)
    used = [0] * len(node_gpus)
    marks = role_resources(cfg)
    allowed = {
        role: [node_resources is None or not mark or node_resources[i].get(mark, 0) > 0 for i in range(len(node_gpus))]
        for role, mark in marks.items()
    }

    def take(n: int, what: str, fix: str, role: str = "trainer") -> list[tuple[int, int]]:
        for node, left in enumerate(free):
            if left >= n and allowed[role][node]:
                free[node] -= n
                got = [(node, used[node] + i) for i in range(n)]
                used[node] += n
                return got
        where = f" marked '{marks[role]}'" if node_resources is not None and marks[role] else ""
        _fail(f"{what} finds no node{where} with {n} free GPUs (GPUs per node {node_gpus}, free {free})", fix)
        raise AssertionError  # unreachable

    fix_t = "lower trainer.tp / trainer.cp or add GPUs"
    trainer = [g for _ in range(t.cp) for g in take(t.tp, f"a trainer TP group of {t.tp}", fix_t)]
    if w.colocate:
        if need_r != need_t:
            _fail(
                f"colocated engines use {r.num_engines} x TP{r.tp} = {need_r} GPUs, the trainer {need_t}",
                "colocated engines must cover exactly the trainer's GPUs: set rollout.num_engines x rollout.tp "
                "= trainer.tp x trainer.cp",
            )
        engines = [trainer[i * r.tp : (i + 1) * r.tp] for i in range(r.num_engines)]
        for i, e in enumerate(engines):
            if len({node for node, _ in e}) != 1:
                _fail(
                    f"colocated engine {i} spans nodes {sorted({n for n, _ in e})}",
                    "an engine's TP group (and CUDA IPC) stays inside one node: lower rollout.tp",
                )
        return Placement(trainer, engines, need_t)
    fix_r = "lower rollout.num_engines / rollout.tp, or add GPUs"
    engines = [take(r.tp, f"rollout engine {i} (TP{r.tp})", fix_r, "rollout") for i in range(r.num_engines)]
    return Placement(trainer, engines, need_t + need_r)


def read_config_json(model_path: str) -> dict[str, Any]:
    """The checkpoint's HF config.json."""
    import json
    from pathlib import Path

    return json.loads((Path(model_path) / "config.json").read_text())


def engine_transports(cfg: VimeConfig, trainer_node: str, engine_nodes: list[str]) -> list[Transport]:
    """The weight path of each engine, from the Ray node ids of trainer rank 0 and of the engines (module
    docstring): `weights.transport` itself when it is not `auto`. CUDA IPC cannot reach an engine on
    another node than the trainer rank whose GPU it shares: an explicit `ipc` is checked by `check_layout`
    (colocated engines cover exactly the trainer's GPUs, node by node)."""
    w = cfg.weights
    transport = Transport(w.transport)
    if transport != Transport.auto:
        return [transport] * len(engine_nodes)
    if cfg.device == "cuda":
        return [Transport.ipc if w.colocate else Transport.nccl] * len(engine_nodes)
    return [Transport.object_store if node == trainer_node else Transport.gloo for node in engine_nodes]


# ---- what is asked of Ray ------------------------------------------------------------------------------
# On GPUs every GPU is one bundle of its placement group ({"GPU": 1, "CPU": ray.cpus_per_actor}), and each
# actor or vLLM worker takes a fixed share of its bundle's GPU (a Ray fraction: Ray assigns the bundle's one
# GPU to every actor in it and counts the GPU once). Colocated (`weights.colocate=true`, the pattern of
# verl / slime): bundle j holds trainer rank j (half the GPU) and the vLLM TP worker of the engine that
# shares trainer TP group j's GPUs (VLLM_RAY_PER_WORKER_GPUS of vLLM's Ray executor, placed by
# VLLM_RAY_BUNDLE_INDICES), and the first GPU of each engine also the engine's own actor (its engine core
# and Ray executor: a tenth). Disaggregated: a trainer group and a rollout group, one GPU per bundle each.
# A TP1 engine runs its one worker in its own actor (vLLM's uniprocess executor): the actor takes the
# worker's share. vLLM's TP workers take no CPU (vLLM's own choice); the trainer rank and the engine actor
# share a colocated bundle's CPUs (half each).
COLOCATED_TRAINER_SHARE = 0.5  # a trainer rank's share of the GPU it shares with an engine's worker
COLOCATED_WORKER_SHARE = 0.4  # a vLLM TP worker's share there (TP > 1); alone on its GPU: 1 - ENGINE_GPU_SHARE
ENGINE_GPU_SHARE = 0.1  # the engine actor of a TP > 1 engine, on its worker 0's GPU


@dataclass(frozen=True)
class Shares:
    """What each actor asks of its bundle: GPUs (fractions of the bundle's one GPU) and CPUs."""

    trainer_gpus: float
    trainer_cpus: float
    engine_gpus: float  # the rollout actor; a TP1 engine's actor is its worker
    engine_cpus: float
    worker_gpus: float  # vLLM's VLLM_RAY_PER_WORKER_GPUS (TP > 1 on GPUs; 0 otherwise: no Ray workers)


@dataclass(frozen=True)
class RaySpec:
    """The placement groups asked of Ray ({group name: bundles}; "trainer", and "rollout" unless colocated on
    GPUs, where every bundle of "trainer" also holds an engine's worker) and the actors' shares."""

    groups: dict[str, list[dict[str, float]]]
    shares: Shares

    def totals(self) -> dict[str, float]:
        """CPUs and GPUs of all bundles together: what the run reserves of the cluster."""
        out: dict[str, float] = {}
        for bundles in self.groups.values():
            for b in bundles:
                for k, v in b.items():
                    if k in ("CPU", "GPU"):
                        out[k] = out.get(k, 0.0) + v
        return out


def gpu_colocated(cfg: VimeConfig) -> bool:
    """Rollout engines on the trainer's GPUs: one placement group, each GPU one bundle shared by a trainer rank
    and an engine's TP worker."""
    return cfg.device == "cuda" and cfg.weights.colocate


def ray_vllm_workers(cfg: VimeConfig) -> bool:
    """vLLM's TP workers are Ray actors of vLLM's Ray executor placed in the run's bundles (TP > 1 on GPUs);
    on CPU vLLM's mp executor starts them as processes of the engine's actor (its CPU platform has no Ray
    executor), and a TP1 engine runs its worker in its own actor."""
    return cfg.device == "cuda" and cfg.rollout.tp > 1


def ray_spec(cfg: VimeConfig) -> RaySpec:
    """The bundles of each placement group and the actors' shares (the comment above): the one description of
    what the run asks of Ray, used by the preflight's count, the role check and the driver."""
    c, marks = cfg.ray.cpus_per_actor, role_resources(cfg)
    mark = lambda role: {marks[role]: ROLE_MARK} if marks[role] else {}  # noqa: E731
    n_ranks, n_engines, tp = cfg.trainer.tp * cfg.trainer.cp, cfg.rollout.num_engines, cfg.rollout.tp
    if cfg.device != "cuda":  # one bundle per actor, CPUs only
        cpu = {
            "trainer": [{"CPU": c} | mark("trainer")] * n_ranks,
            "rollout": [{"CPU": c} | mark("rollout")] * n_engines,
        }
        return RaySpec(cpu, Shares(0.0, c, 0.0, c, 0.0))
    gpu = {"CPU": c, "GPU": 1.0}
    if cfg.weights.colocate:
        worker = COLOCATED_WORKER_SHARE if tp > 1 else 0.0
        engine = ENGINE_GPU_SHARE if tp > 1 else 1.0 - COLOCATED_TRAINER_SHARE  # TP1: the actor is the worker
        shares = Shares(COLOCATED_TRAINER_SHARE, c / 2, engine, c / 2, worker)
        return RaySpec({"trainer": [gpu | mark("trainer")] * n_ranks}, shares)
    worker = 1.0 - ENGINE_GPU_SHARE if tp > 1 else 0.0
    engine = ENGINE_GPU_SHARE if tp > 1 else 1.0
    return RaySpec(
        {"trainer": [gpu | mark("trainer")] * n_ranks, "rollout": [gpu | mark("rollout")] * (n_engines * tp)},
        Shares(1.0, c, engine, c, worker),
    )
