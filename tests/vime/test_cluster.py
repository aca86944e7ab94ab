"""`vime.train` beyond one machine, on a Ray cluster simulated on this host (`ray.cluster_utils.Cluster`:
every node its own raylet, object store and address on loopback: 127.0.0.3, 127.0.0.4, ...).

- Pure logic: each engine's weight path by locality (Ray node ids, never by what /dev/shm reaches), the
  role checks that refuse a cluster before any engine starts, naming what is missing.
- Real sockets: the stores of the trainer's world and of the weight-push group listen on the node's
  address only (torch's own TCPStore server listens on every interface), and a gloo world of two
  "nodes" (127.0.0.2, 127.0.0.3) forms over them.
- Real actors across nodes: a trainer rank on node A pushes a trained version to one engine on A (Ray's
  object store: shared memory) and one on node B (gloo over TCP), in one sync; both then score bit for bit
  as the trainer does, and did not before (the push moved weights).
- The real job (slow; vLLM + Megatron): trainer on the head node, two vLLM engines on a rollout node, strict,
  0 mismatches every step, weights over gloo (asserted per step), its native twin mismatching; the rollout
  node is lost mid-run (its raylet and every process of it killed) and the engines restart on the rollout
  node that remains, the step redone as if nothing happened.
- Opt-in (`-m cluster`, minutes): `plan=true` of the disaggregated tp2x4 preset on two nodes of 8 fake GPUs
  (16 GPUs, none shared, as Ray assigns them); a rollout node lost with no capacity left stops the run cleanly with the
  resume command; a lost trainer node stops it the same way and `resume=` on a fresh trainer node finishes
  it with 0 mismatches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl_kernel.bits import bit_mismatches
from vime.cluster import placement
from vime.config.layout import check_layout, check_roles, engine_transports, ray_node_gpus, role_resources
from vime.config.schema import Transport, VimeConfig, to_object, validate
from vime.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TRAIN_ENV = {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
QWEN3_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288, "vocab_size": 151936}


# ---- pure logic ------------------------------------------------------------------------------------------


def _cfg(compose_cfg, *overrides: str) -> VimeConfig:
    return validate(to_object(compose_cfg(*overrides)))


def test_weight_paths_follow_the_engines_nodes_not_shared_memory(compose_cfg):
    cpu = _cfg(compose_cfg)
    assert cpu.weights.transport == Transport.auto
    assert engine_transports(cpu, "A", ["A", "B", "A"]) == [
        Transport.object_store,
        Transport.gloo,
        Transport.object_store,
    ]
    assert engine_transports(cpu, "A", ["A"]) == [Transport.object_store]  # one node: today's path
    forced = _cfg(compose_cfg, "weights.transport=object_store")
    assert engine_transports(forced, "A", ["B"]) == [Transport.object_store]  # an explicit path is kept
    gpu = _cfg(compose_cfg, "+experiment=qwen3_8b_grpo", "model.path=/ckpt", "weights.transport=auto")
    assert engine_transports(gpu, "A", ["A", "B"]) == [Transport.ipc] * 2  # colocated: on its trainer GPUs' node
    apart = _cfg(compose_cfg, "+experiment=qwen3_8b_grpo_tp2x4", "model.path=/ckpt", "weights.transport=auto")
    assert engine_transports(apart, "A", ["A", "B"]) == [Transport.nccl] * 2


def _node(cpus: float, gpus: float = 0, **marks: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus, **marks}


@pytest.mark.parametrize(
    "overrides, nodes, message",
    [
        ((), [_node(4), _node(4, vime_trainer=1)], "no alive node of the cluster declares the resource 'vime_rollout'"),
        (
            ("rollout.num_engines=3",),
            [_node(2, vime_trainer=1), _node(2, vime_rollout=1)],
            r"the rollout actors need 3 CPUs on the nodes that declare 'vime_rollout', which have 2 \(1 node",
        ),
        (
            ("ray.cpus_per_actor=3",),
            [_node(4, vime_trainer=1), _node(2, vime_rollout=1), _node(2, vime_rollout=1)],
            "one rollout actor needs 3 CPUs on one node that declares 'vime_rollout'; the largest has 2",
        ),
        (
            ("weights.colocate=true", "ray.rollout_resource=null", "rollout.num_engines=2"),
            [_node(2, vime_trainer=1), _node(8, vime_rollout=1)],
            "the trainer and rollout actors need 3 CPUs on the nodes that declare 'vime_trainer', which have 2",
        ),
    ],
)
def test_a_cluster_that_cannot_hold_a_role_is_refused_naming_what_is_missing(compose_cfg, overrides, nodes, message):
    cfg = _cfg(compose_cfg, "+placement=disaggregated", *overrides)
    with pytest.raises(ConfigError, match=message):
        check_roles(cfg, nodes)


def test_gpu_roles_are_placed_on_their_marked_nodes(compose_cfg):
    cfg = _cfg(
        compose_cfg,
        "+experiment=qwen3_8b_grpo_tp2x4",
        "+placement=disaggregated",
        "model.path=/ckpt",
        "ray.address=auto",
    )
    nodes = [_node(64, 8, vime_rollout=1), _node(64, 8, vime_trainer=1)]  # the rollout node listed first
    plan = check_layout(cfg, ray_node_gpus([{"Resources": n} for n in nodes]), QWEN3_8B, nodes)
    assert {n for n, _ in plan.trainer} == {1} and {n for e in plan.engines for n, _ in e} == {0}
    with pytest.raises(
        ConfigError, match="the rollout actors need 8 GPUs on the nodes that declare 'vime_rollout', which have 2"
    ):
        check_layout(cfg, [8, 2], QWEN3_8B, [_node(64, 8, vime_trainer=1), _node(64, 2, vime_rollout=1)])
    assert role_resources(cfg) == {"trainer": "vime_trainer", "rollout": "vime_rollout"}


def test_role_marks_need_a_cluster_and_colocation_shares_the_trainers_nodes(compose_cfg):
    with pytest.raises(ConfigError, match="ray.trainer_resource without ray.address"):
        _cfg(compose_cfg, "ray.trainer_resource=vime_trainer")
    with pytest.raises(ConfigError, match="colocated engines run on the trainer's nodes"):
        _cfg(compose_cfg, "+placement=colocated", "ray.rollout_resource=vime_rollout")
    colocated = _cfg(compose_cfg, "+placement=colocated")
    assert role_resources(colocated) == {"trainer": "vime_trainer", "rollout": "vime_trainer"}
    assert placement.bundle(colocated.ray, 0.0, "vime_trainer") == {"CPU": 1.0, "vime_trainer": 0.001}


# ---- real sockets ----------------------------------------------------------------------------------------


def _listening(port: int) -> set[str]:
    import psutil

    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_a_store_listens_on_the_node_address_only():
    """torch's TCPStore server on port 0 listens on every interface; `placement.tcp_store` serves it from a
    socket bound to the node's address. Twin: the plain store really does listen on all interfaces."""
    import datetime

    import torch.distributed as dist

    listen = placement.listen_socket("127.0.0.3")
    port = listen.getsockname()[1]
    server = placement.tcp_store("127.0.0.3", port, 2, listen, timeout_s=30)
    client = placement.tcp_store("127.0.0.3", port, 2, timeout_s=30)
    client.set("k", "v")
    assert server.get("k") == b"v" and _listening(port) == {"127.0.0.3"}
    plain = dist.TCPStore("127.0.0.3", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    assert _listening(plain.port) & {"0.0.0.0", "::"}, _listening(plain.port)
    assert placement.node_interface("127.0.0.3") == "lo"  # inside lo's 127.0.0.0/8


RANK = """
import os, sys, torch, torch.distributed as dist
os.environ.pop("GLOO_SOCKET_IFNAME", None)
import ray
ray.util.get_node_ip_address = lambda: sys.argv[1]  # this rank's "node address"
from vime.cluster import placement
rank, host, port = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
listen = placement.listen_socket(host) if rank == 0 else None
if listen is not None:
    print("PORT", listen.getsockname()[1], flush=True)
    port = listen.getsockname()[1]
else:
    port = int(sys.stdin.readline())
store = placement.trainer_store(placement.tcp_url(host, port), rank, 2, listen)
print("IFACE", placement.bind_node_interface(), flush=True)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
t = torch.full((1,), float(rank + 1))
dist.all_reduce(t)
print("SUM", t.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.cluster
def test_a_trainer_world_of_two_nodes_forms_over_the_node_addresses():
    """Two ranks as on two nodes (127.0.0.2 and 127.0.0.3): rank 0 serves the store from its node address,
    rank 1 joins it there, and both put gloo on the interface of their node address (`lo` here)."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    env.pop("GLOO_SOCKET_IFNAME", None)
    r0 = subprocess.Popen(
        [sys.executable, "-c", RANK, "127.0.0.2", "0", "127.0.0.2", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
    )
    port = r0.stdout.readline().split()[1]
    r1 = subprocess.Popen(
        [sys.executable, "-c", RANK, "127.0.0.3", "1", "127.0.0.2", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
    )
    out1, err1 = r1.communicate(port + "\n", timeout=120)
    out0, err0 = r0.communicate(timeout=120)
    assert r0.returncode == 0 and r1.returncode == 0, err0[-2000:] + err1[-2000:]
    for out in (out0, out1):
        assert "IFACE lo" in out and "SUM 3.0" in out, out


# ---- a simulated cluster ---------------------------------------------------------------------------------


def _patient_get_node(get_node, wait_s: float = 300.0):
    """Ray waits a fixed 30 s for a starting node to register with the GCS (and 5 s for a starting GCS), too
    short on a loaded 2-core machine: a `get_node` that keeps asking for `wait_s` before it gives up."""
    import ray

    def patient(*args, **kwargs):
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return get_node(*args, **kwargs)
            except (RuntimeError, ray.exceptions.RaySystemError):  # not registered yet; the GCS not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    return patient


def add_node(cluster, **args):
    """`cluster.add_node(**args)`, waiting as long as a loaded machine needs (`_patient_get_node`)."""
    import ray._private.services as services

    get_node = services.get_node
    services.get_node = _patient_get_node(get_node)
    try:
        return cluster.add_node(**args)
    finally:
        services.get_node = get_node


def _cluster(head: dict, nodes: dict[str, dict]):
    """A Ray cluster on this host: the head node (`head`: its ray start arguments; the driver attaches
    to it) and named nodes on loopback addresses; returns (cluster, {name: node})."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    add_node(cluster, include_dashboard=False, **head)
    return cluster, {name: add_node(cluster, **args) for name, args in nodes.items()}


def _node_ids() -> dict[str, str]:
    """{node address: node id} of the alive nodes (the test process is connected)."""
    return {a: n for n, a in placement.alive_nodes().items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head node = node A (the trainer's: `vime_trainer`, 2 CPUs, the host's address), rollout nodes B
    (127.0.0.3) and C (127.0.0.4), 2 CPUs each; the test process is connected as a driver."""

    yield from _connected(
        {"num_cpus": 2, "resources": {"vime_trainer": 1}},
        {
            "B": {"num_cpus": 2, "resources": {"vime_rollout": 1}, "node_ip_address": "127.0.0.3"},
            "C": {"num_cpus": 2, "resources": {"vime_rollout": 1}, "node_ip_address": "127.0.0.4"},
        },
    )


def _connected(head: dict, workers: dict):
    """A simulated cluster (`_cluster`) with this process connected as its driver, torn down after."""
    import ray

    c, nodes = _cluster(head, workers)
    try:
        ray.init(address=c.address, log_to_driver=False)
        yield SimpleNamespace(cluster=c, nodes=nodes, address=c.address)
    finally:
        ray.shutdown()
        c.shutdown()


def _actor_on(cls, node_id: str, *args):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(cls)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        .remote(*args)
    )


def _mismatches(a: list[list[float]], b) -> int:
    return sum(bit_mismatches(torch.tensor(x, dtype=torch.float32), y.logprobs) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.cluster
def test_one_sync_serves_a_local_and_a_remote_engine_each_over_its_path(cluster, tiny_qwen3_path):
    """A reference trainer rank on node A; engine 0 on node A, engine 1 on node B. The weight paths come
    from the nodes (object_store on A, gloo to B); one sync serves both, each engine acknowledges the
    version, and both score the trained version bit for bit as the trainer does (and did not before)."""
    import ray

    import rl_kernel as rk
    from vime.config.schema import Mode, RolloutBackend, RolloutConfig, TrainerBackend, TrainerConfig
    from vime.loop.timeline import Timeline
    from vime.rollout.actor import RolloutWorker
    from vime.trainer.actor import TrainerWorker
    from vime.weights.sync import sync_weights

    ids = _node_ids()
    node_a = ray.get_runtime_context().get_node_id()  # the test process is attached to the head: node A
    node_b = ids["127.0.0.3"]
    strict = {b: "strict" for b in rk.BOUNDARIES}
    rcfg = RolloutConfig(engine=RolloutBackend.reference, mode=Mode.strict)
    tcfg = TrainerConfig(engine=TrainerBackend.reference, mode=Mode.strict, lr=1e-2)
    cfg = VimeConfig()
    paths = engine_transports(cfg, node_a, [node_a, node_b])
    assert paths == [Transport.object_store, Transport.gloo]
    engines = [
        _actor_on(RolloutWorker, n, i, rcfg, str(tiny_qwen3_path), "bfloat16", "cpu", strict, 0, str(p))
        for i, (n, p) in enumerate(zip((node_a, node_b), paths))
    ]
    trainer = _actor_on(TrainerWorker, node_a, 0, 1, tcfg, str(tiny_qwen3_path), "bfloat16", "cpu", strict, 0, 0.0, 0.2)
    try:
        ray.get(trainer.start.remote("file:///unused"))
        where = ray.get([e.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for e in engines])
        assert where == [node_a, node_b]
        prompts = [(g, [3 + g, 7, 11 + g, 5]) for g in range(2)]
        samples = ray.get(engines[0].generate.remote(prompts, 4, 6, 1.0, [], 0))
        for i, s in enumerate(samples):
            s.advantage = 1.0 if i % 2 else -1.0
        before = ray.get(engines[1].rescore.remote(samples))
        assert ray.get(trainer.train_step.remote(samples))["version"] == 1
        timeline = Timeline(num_engines=2)
        timeline.trained()
        stats = sync_weights(
            [trainer], engines, 1, 1 << 20, timeline, lambda refs, what, names: ray.get(refs), paths, "reference"
        )
        assert stats["sync_transports"] == ["object_store", "gloo"] and stats["sync_bytes"] > 0
        assert timeline.engine_versions == [1, 1]
        trained = ray.get(trainer.score.remote(samples))
        for engine in engines:
            assert _mismatches(ray.get(engine.rescore.remote(samples)), trained) == 0
        assert _mismatches(before, trained) > 0  # twin: the remote engine's scores before the push differ
    finally:
        for a in (*engines, trainer):
            ray.kill(a)


def _rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _train(out: Path, address: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vime.train",
            "+placement=disaggregated",
            f"ray.address={address}",
            f"output_dir={out}",
            *overrides,
        ],
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_rows(proc: subprocess.Popen, metrics: Path, n: int, timeout_s: float = 1800) -> None:
    """Until the run has written `n` metrics rows (asserted), while it runs."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline and len(_rows(metrics)) < n:
        time.sleep(0.2)
    assert proc.poll() is None and len(_rows(metrics)) >= n, (proc.poll(), len(_rows(metrics)))


def _engine_node(name: str) -> str:
    """The node id of the live actor named `name` (GCS actor table)."""
    import ray._private.state as state

    found = [a["Address"]["NodeID"] for a in state.actors().values() if a.get("Name") == name and a["State"] == "ALIVE"]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.megatron
def test_two_node_run_strict_over_gloo_survives_the_loss_of_its_rollout_node(cluster, tmp_path):
    """The real job on the simulated cluster (`+placement=disaggregated`): Megatron on node A, two vLLM engines
    on a rollout node, `compare=native` (the native twin runs first, same placement). Once the strict run
    has written step 1, the rollout node that holds its engines is removed (its raylet and all its processes
    killed). The engines restart on the rollout node that remains; every strict step has 0 mismatches on
    every token and got its weights over gloo (the cross-node path) on both engines; the native twin
    mismatches on every step."""
    import ray

    out = tmp_path / "run"
    proc = _train(
        out,
        cluster.address,
        "rollout.num_engines=2",
        "steps=4",
        "checkpoint.every=1",
        "compare=native",
        "ray.restart_wait_s=120",
    )
    try:
        _wait_rows(proc, out / "metrics.jsonl", 2)
        engine_node = _engine_node("rollout-0")
        assert _engine_node("rollout-1") == engine_node  # both engines on one rollout node (PACK)
        trainer_node = _engine_node("trainer-0")
        assert trainer_node == ray.get_runtime_context().get_node_id() != engine_node  # trainer on node A
        lost = next(name for name, n in cluster.nodes.items() if n.node_id == engine_node)
        cluster.cluster.remove_node(cluster.nodes.pop(lost))
        text, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, text[-8000:]
    remaining = next(iter(cluster.nodes.values()))
    assert (
        f"placement: trainer rank 0 on node {placement.node_address(trainer_node)}; rollout engine 0 on node "
        f"{placement.node_address(engine_node)} (weights over gloo)" in text
    ), text[-8000:]
    for i in (0, 1):
        assert f"rollout engine {i} moves to node {remaining.node_ip_address} (weights over gloo)" in text
    assert "Traceback" not in text, text[-8000:]
    rows, native = _rows(out / "metrics.jsonl"), _rows(out / "native" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(4)) and [r["step"] for r in native] == list(range(4))
    assert all(r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0 and r["tokens"] > 0 for r in rows), rows
    assert all(r["sync_transports"] == ["gloo", "gloo"] for r in rows + native)
    assert rows[0]["engine_restarts"] == 0 and rows[-1]["engine_restarts"] == 2, [r["engine_restarts"] for r in rows]
    assert all(r["mismatch_count"] > 0 for r in native), [r["mismatch_count"] for r in native]


# ---- opt-in: `pytest -m cluster` ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def opt_cluster():
    """Opt-in (`-m cluster`): a head node without CPUs (the driver's), trainer node A (127.0.0.2) and rollout
    node B (127.0.0.3, one engine's CPU); the test process is connected."""

    yield from _connected(
        {"num_cpus": 0},
        {
            "A": {"num_cpus": 1, "resources": {"vime_trainer": 1}, "node_ip_address": "127.0.0.2"},
            "B": {"num_cpus": 1, "resources": {"vime_rollout": 1}, "node_ip_address": "127.0.0.3"},
        },
    )


def _resume(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vime.train", f"resume={out}"],
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )


def _lose_after_step(proc: subprocess.Popen, out: Path, cluster, name: str, step: int) -> str:
    """Remove node `name` once the run has written step `step`; the run's output."""
    try:
        _wait_rows(proc, out / "metrics.jsonl", step + 1)
        cluster.cluster.remove_node(cluster.nodes.pop(name))
        return proc.communicate(timeout=1800)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _all_strict_zero(rows: list[dict]) -> bool:
    return all(r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0 and r["tokens"] > 0 for r in rows)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.megatron
def test_a_lost_rollout_node_without_capacity_left_stops_the_run_and_resume_finishes_it(opt_cluster, tmp_path):
    out = tmp_path / "no_capacity"
    proc = _train(out, opt_cluster.address, "steps=4", "checkpoint.every=1", "ray.restart_wait_s=10")
    text = _lose_after_step(proc, out, opt_cluster, "B", 0)
    assert proc.returncode == 1, text[-6000:]
    assert (
        "EngineDiedError: rollout engine 0 died, its node 127.0.0.3 is gone, and no alive node took its bundle "
        "{'CPU': 1.0, 'vime_rollout': 0.001} within ray.restart_wait_s=10 s"
        in text
        and "(a node must declare 'vime_rollout'); add capacity to the cluster and resume" in text
    ), text[-6000:]
    assert f"with: python -m vime.train resume={out}" in text and "Traceback" not in text, text[-6000:]
    opt_cluster.nodes["B2"] = add_node(
        opt_cluster.cluster, num_cpus=1, resources={"vime_rollout": 1}, node_ip_address="127.0.0.4"
    )
    done = _resume(out)
    assert done.returncode == 0, done.stdout[-6000:]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and _all_strict_zero(rows), rows


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.megatron
def test_a_lost_trainer_node_stops_the_run_and_resume_on_a_new_one_finishes_it(opt_cluster, tmp_path):
    out = tmp_path / "trainer_lost"
    proc = _train(out, opt_cluster.address, "steps=4", "checkpoint.every=1")
    text = _lose_after_step(proc, out, opt_cluster, "A", 1)
    assert proc.returncode == 1, text[-6000:]
    assert "EngineDiedError: trainer rank 0 died during" in text and "Traceback" not in text, text[-6000:]
    assert f"with: python -m vime.train resume={out}" in text, text[-6000:]
    opt_cluster.nodes["A2"] = add_node(
        opt_cluster.cluster, num_cpus=1, resources={"vime_trainer": 1}, node_ip_address="127.0.0.5"
    )
    done = _resume(out)
    assert done.returncode == 0, done.stdout[-6000:]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and _all_strict_zero(rows), rows
    assert "placement: trainer rank 0 on node 127.0.0.5" in done.stdout, done.stdout[-6000:]


@pytest.mark.cluster  # opt-in with the other simulated-cluster runs (about 1-2.5 min): CI keeps the colocated plan
@pytest.mark.slow
def test_plan_of_the_disaggregated_preset_uses_16_gpus_of_two_nodes_none_shared(tmp_path):
    """`+experiment=qwen3_8b_grpo_tp2x4 +placement=disaggregated plan=true` on a simulated cluster of two nodes
    declaring 8 GPUs each (the trainer's, the head, and a rollout node): Ray puts the 8 trainer ranks on the
    trainer node's 8 GPUs and the 4 TP2 engines' 8 vLLM workers on the rollout node's 8 GPUs, no GPU shared
    (what each stand-in's ray.get_gpu_ids() says), each engine's workers on 2 distinct GPUs of one node."""
    from collections import Counter

    from rl_kernel.models.tiny import make_tiny_qwen3
    from tests.vime.test_layout import _on_gpus, _plan

    c, _ = _cluster(
        {"num_cpus": 64, "num_gpus": 8, "resources": {"vime_trainer": 1}},
        {"B": {"num_cpus": 64, "num_gpus": 8, "resources": {"vime_rollout": 1}, "node_ip_address": "127.0.0.3"}},
    )
    try:
        ckpt = make_tiny_qwen3(tmp_path / "ckpt", num_heads=8, num_kv_heads=4, hidden_size=64, head_dim=32)
        over = ("+experiment=qwen3_8b_grpo_tp2x4", "+placement=disaggregated", f"model.path={ckpt}")
        plan = _plan(tmp_path / "out", *over, f"ray.address={c.address}", env={"QWEN3_8B_PATH": str(ckpt)})
    finally:
        c.shutdown()
    on = _on_gpus(plan)
    assert plan["gpus"] == len(on) == 16
    assert all(len(v["trainer"]) + len(v["worker"]) == 1 for v in on.values()), dict(on)  # none shared
    trainer_nodes = {node for (node, _), v in on.items() if v["trainer"]}
    worker_nodes = {node for (node, _), v in on.items() if v["worker"]}
    assert worker_nodes == {"127.0.0.3"} and len(trainer_nodes) == 1 and trainer_nodes != worker_nodes
    engines = Counter(v["worker"][0][0] for v in on.values() if v["worker"])
    assert engines == {0: 2, 1: 2, 2: 2, 3: 2}
