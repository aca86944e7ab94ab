"""The GPU presets checked against a Ray cluster description on CPU (`vime.config.layout.check_layout`): a layout
that cannot run fails before any engine starts."""

from __future__ import annotations

import pytest

from vime.config.layout import check_layout, ray_node_gpus
from vime.config.schema import to_object, validate
from vime.errors import ConfigError

ONE = ("rollout.num_engines=1", "rollout.max_num_seqs=512")  # one engine, still room for a step's samples
QWEN3_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288, "vocab_size": 151936}


def _node(gpus: int, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": 64.0, "GPU": float(gpus)}}


def _preset(compose_cfg, name: str, *overrides: str):
    return validate(to_object(compose_cfg(f"+experiment={name}", "model.path=/ckpt/Qwen3-8B", *overrides)))


def test_seed_preset_colocated_on_one_node(compose_cfg):
    cfg = _preset(compose_cfg, "qwen3_8b_grpo")
    plan = check_layout(cfg, ray_node_gpus([_node(8)]), QWEN3_8B)
    assert plan.gpus_used == 8 and len(plan.trainer) == 8 and len(plan.engines) == 2
    assert plan.engines == [plan.trainer[:4], plan.trainer[4:]]  # each TP4 engine on one trainer TP group
    second = _preset(compose_cfg, "qwen3_8b_grpo", "weights.colocate=false", "weights.transport=nccl")
    plan = check_layout(second, ray_node_gpus([_node(8), _node(8)]), QWEN3_8B)
    assert {n for e in plan.engines for n, _ in e} == {1} and plan.gpus_used == 16


def test_tp2x4_preset_on_a_second_node(compose_cfg):
    cfg = _preset(compose_cfg, "qwen3_8b_grpo_tp2x4")
    assert (cfg.rollout.num_engines, cfg.rollout.tp, cfg.weights.transport) == (4, 2, "nccl")
    plan = check_layout(cfg, ray_node_gpus([_node(8), _node(8), _node(0, alive=False)]), QWEN3_8B)
    assert {n for n, _ in plan.trainer} == {0} and all(len(e) == 2 and e[0][0] == 1 for e in plan.engines)


@pytest.mark.parametrize(
    "preset, overrides, nodes, model, message",
    [
        ("qwen3_8b_grpo", (), [8 - 1], QWEN3_8B, "no node with 4 free GPUs"),  # 7 GPUs: the second TP group lacks one
        ("qwen3_8b_grpo_tp2x4", (), [8], QWEN3_8B, "rollout engine 0"),  # engines need a second node
        (
            "qwen3_8b_grpo",
            (),
            [4, 4],
            QWEN3_8B | {"num_attention_heads": 30},
            "does not divide the model's num_attention_heads=30",
        ),
        (
            "qwen3_8b_grpo_tp2x4",
            ("rollout.tp=8", *ONE),
            [8, 8],
            QWEN3_8B | {"num_key_value_heads": 4},
            "rollout.tp=8 does not divide the model's num_key_value_heads=4",
        ),
        ("qwen3_8b_grpo", ONE, [8], QWEN3_8B, "must cover exactly the trainer's GPUs"),
        ("qwen3_8b_grpo", ("weights.transport=nccl",), [8], QWEN3_8B, "CUDA IPC serves engines colocated"),
        ("qwen3_8b_grpo_tp2x4", ("weights.transport=object_store",), [8, 8], QWEN3_8B, "object_store on GPUs"),
        ("qwen3_8b_grpo", (), [0], QWEN3_8B, "no GPUs"),
        ("qwen3_8b_grpo", ("trainer.cp=1", *ONE), [2, 2], QWEN3_8B, "trainer TP group of 4"),
    ],
)
def test_layouts_that_cannot_run_fail_before_any_engine(compose_cfg, preset, overrides, nodes, model, message):
    cfg = _preset(compose_cfg, preset, *overrides)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, nodes, model)


def test_cpu_default_uses_the_object_store(compose_cfg):
    cfg = validate(to_object(compose_cfg()))
    assert check_layout(cfg, [], QWEN3_8B).gpus_used == 0
    with pytest.raises(ConfigError, match="on CPU"):
        check_layout(validate(to_object(compose_cfg("weights.transport=ipc"))), [], QWEN3_8B)


# ---- what is asked of Ray (vime.config.layout.ray_spec) and what Ray grants (plan=true) ----------------------


def test_seed_preset_asks_ray_for_its_8_gpus_once(compose_cfg):
    """One bundle per GPU: the colocated seed layout reserves 8 GPUs (the old count, a bundle per trainer rank and
    one of TP GPUs per engine, asked for 16), and the preflight counts exactly what the driver reserves."""
    from vime.config import preflight
    from vime.config.layout import ray_spec

    cfg = _preset(compose_cfg, "qwen3_8b_grpo", "ray.address=null", "ray.num_gpus=8", "ray.num_cpus=160")
    spec = ray_spec(cfg)
    assert list(spec.groups) == ["trainer"] and len(spec.groups["trainer"]) == 8
    assert all(b["GPU"] == 1.0 for b in spec.groups["trainer"])
    assert spec.totals() == preflight.required_resources(cfg) == {"CPU": 64.0, "GPU": 8.0}
    s = spec.shares  # a trainer rank, an engine's worker and (on its worker 0's GPU) the engine's actor
    assert s.trainer_gpus + s.worker_gpus + s.engine_gpus <= 1.0 and s.trainer_cpus + s.engine_cpus == 8
    preflight.check_local_resources(cfg)
    seven = _preset(compose_cfg, "qwen3_8b_grpo", "ray.address=null", "ray.num_gpus=7", "ray.num_cpus=160")
    with pytest.raises(ConfigError, match=r"needs 8 GPUs \(has 7\)"):
        preflight.check_local_resources(seven)


def test_disaggregated_layouts_keep_separate_groups(compose_cfg):
    from vime.config.layout import ray_spec

    spec = ray_spec(_preset(compose_cfg, "qwen3_8b_grpo_tp2x4"))
    assert [len(b) for b in spec.groups.values()] == [8, 8] and spec.totals()["GPU"] == 16
    assert spec.shares.trainer_gpus == 1.0 and spec.shares.worker_gpus + spec.shares.engine_gpus == 1.0


def _seen(node: str, gpu: int) -> dict:
    return {"node_id": node, "node": node, "ray_gpu_ids": [gpu], "cuda_visible_devices": None}


def test_vllm_devices_follow_the_sorted_gpu_ids_of_the_engines_node():
    """vLLM's Ray executor gives worker r the local_rank-th of its node's sorted GPU ids: bundles in GPU order
    keep each worker on its own bundle's GPU; bundles out of order would not (the plan refuses that)."""
    from vime.cluster.plan import vllm_devices

    ordered = vllm_devices([_seen("A", g) for g in (4, 5, 6, 7)], [4, 5, 6, 7])
    assert [w["vllm_gpu"] for w in ordered] == [4, 5, 6, 7] and ordered[0]["vllm_cuda_visible_devices"] == "4,5,6,7"
    shuffled = vllm_devices([_seen("A", g) for g in (5, 4, 6, 7)], [1, 0, 2, 3])
    assert [w["vllm_gpu"] for w in shuffled] == [4, 5, 6, 7] != [w["ray_gpu_ids"][0] for w in shuffled]


def test_the_plan_refuses_two_trainer_ranks_on_one_gpu():
    """What the old `ray.gpus_per_actor=0.5` layout got from Ray: trainer ranks 0 and 1 on GPU 0."""
    from vime.cluster.plan import check_sharing

    def row(role: str, gpu: int, **k) -> dict:
        return {"role": role, "node": "A", "gpu": gpu, "rank": None, "engine": None, "worker": None} | k

    good = [row("trainer", g, rank=g) for g in range(2)] + [row("rollout", g, engine=0, worker=g) for g in range(2)]
    check_sharing(good + [row("rollout", 0, engine=0)])  # the engine's own actor beside its worker 0
    with pytest.raises(ConfigError, match="GPU 0 of node A holds trainer rank 0 and trainer rank 1"):
        check_sharing([row("trainer", 0, rank=0), row("trainer", 0, rank=1)])
    with pytest.raises(ConfigError, match="engine 0 worker 1 and engine 1 worker 0"):
        check_sharing([row("rollout", 3, engine=0, worker=1), row("rollout", 3, engine=1, worker=0)])


QWEN3_8B_CONFIG = QWEN3_8B | {"hidden_size": 4096, "num_hidden_layers": 36, "head_dim": 128}
H200_BYTES = 143771 * 2**20


def test_memory_plan_counts_the_reference_policy_push_buffers_and_vllm(compose_cfg):
    from vime.config import preflight

    cfg = _preset(compose_cfg, "qwen3_8b_grpo")
    plan = preflight.gpu_memory_plan(cfg, QWEN3_8B_CONFIG, H200_BYTES)
    params = preflight.qwen3_parameters(QWEN3_8B_CONFIG)
    assert plan["trainer_state"] == 18 / 4 * params  # TP4 shards; CP2 ranks hold whole copies of their shard
    assert cfg.algo.kl_coef > 0 and plan["reference_policy"] == 6 / 4 * params
    assert plan["push_buffers"] == 2 * params and plan["vllm"] == cfg.rollout.gpu_memory_utilization * H200_BYTES
    assert plan["need"] == sum(v for k, v in plan.items() if k not in ("need", "gpu", "free"))
    preflight.check_gpu_memory(cfg, QWEN3_8B_CONFIG, H200_BYTES)
    no_kl = _preset(compose_cfg, "qwen3_8b_grpo", "algo.kl_coef=0")
    assert preflight.gpu_memory_plan(no_kl, QWEN3_8B_CONFIG, H200_BYTES)["reference_policy"] == 0


def test_memory_refusal_names_the_value_to_change_in_one_line(compose_cfg):
    from vime.config import preflight

    big = _preset(compose_cfg, "qwen3_8b_grpo", "rollout.gpu_memory_utilization=0.8")
    with pytest.raises(ConfigError) as info:
        preflight.check_gpu_memory(big, QWEN3_8B_CONFIG, H200_BYTES)
    msg = str(info.value)
    assert "\n" not in msg and "KL reference policy (algo.kl_coef=0.001)" in msg and "push buffers" in msg
    util = float(msg.split("set rollout.gpu_memory_utilization <= ")[1].split(";")[0])
    fits = _preset(compose_cfg, "qwen3_8b_grpo", f"rollout.gpu_memory_utilization={util}")
    preflight.check_gpu_memory(fits, QWEN3_8B_CONFIG, H200_BYTES)  # the named value is enough


def _plan(out, *overrides: str, env: dict | None = None) -> dict:
    """`python -m vime.train ... plan=true` (must exit 0): its plan.json, and the stand-ins' records."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "vime.train", *overrides, "plan=true", f"output_dir={out}"]
    run_env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"} | (env or {})
    proc = subprocess.run(cmd, cwd=repo, env=run_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no engine started" in proc.stdout + proc.stderr
    plan = json.loads((Path(out) / "plan.json").read_text())
    plan["seen"] = json.loads((Path(out) / "plan_actors.json").read_text())
    return plan


def _on_gpus(plan: dict) -> dict[tuple, dict[str, list]]:
    """{(node, GPU): {"trainer": [ranks], "worker": [(engine, worker)]}} from what Ray gave each stand-in."""
    from collections import defaultdict

    on: dict = defaultdict(lambda: {"trainer": [], "worker": []})
    for a, seen in zip(plan["actors"], plan["seen"]):
        assert {k: seen[k] for k in a} == a  # plan.json is the records' summary
        if a["role"] != "rollout" or a["worker"] is None:  # vime's actors (vLLM's workers get vLLM's env)
            assert seen["seen"]["rl_kernel_canonical_tp"] is not None, seen  # the job's env beside its own
        ray_gpu = seen["seen"]["ray_gpu_ids"]
        assert len(ray_gpu) == 1 and ray_gpu[0] == a["gpu"]  # the GPU Ray assigned, not layout arithmetic
        if a["role"] == "trainer":
            assert seen["seen"]["cuda_visible_devices"] == str(a["gpu"])  # what the trainer's torch would see
            on[(a["node"], a["gpu"])]["trainer"].append(a["rank"])
        elif a["worker"] is not None:
            visible = seen["seen"]["vllm_cuda_visible_devices"].split(",")
            assert visible[seen["seen"]["local_rank"]] == str(a["gpu"])  # the device vLLM picks is Ray's GPU
            on[(a["node"], a["gpu"])]["worker"].append((a["engine"], a["worker"]))
    return on


@pytest.mark.slow
def test_plan_places_the_seed_preset_on_8_gpus_each_one_trainer_rank_and_one_worker(tmp_path):
    """The seed command with plan=true on CPU, a local Ray declaring 8 GPUs and a tiny 8-head / 4-KV-head
    checkpoint: Ray's own answers (each stand-in's ray.get_gpu_ids() and CUDA_VISIBLE_DEVICES) put exactly one
    trainer rank and one vLLM worker on every GPU, each engine's 4 workers on one trainer TP group's 4 GPUs."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    ckpt = make_tiny_qwen3(tmp_path / "ckpt", num_heads=8, num_kv_heads=4, hidden_size=64, head_dim=32)
    over = ("+experiment=qwen3_8b_grpo", f"model.path={ckpt}", "ray.address=null", "ray.num_gpus=8", "ray.num_cpus=160")
    plan = _plan(tmp_path / "out", *over, env={"QWEN3_8B_PATH": str(ckpt)})
    on = _on_gpus(plan)
    assert plan["gpus"] == len(on) == 8
    assert all(len(v["trainer"]) == 1 and len(v["worker"]) == 1 for v in on.values()), dict(on)
    rank_gpu = {v["trainer"][0]: gpu for gpu, v in on.items()}
    for engine in (0, 1):
        gpus = [gpu for gpu, v in on.items() if v["worker"][0][0] == engine]
        assert len(set(gpus)) == 4 and set(gpus) == {rank_gpu[r] for r in range(4 * engine, 4 * engine + 4)}
    assert plan["memory_gib_per_gpu"]["gpu"] == 139.8 and plan["memory_gib_per_gpu"]["free"] > 0


def test_a_sharded_checkpoint_whose_index_names_a_missing_file_is_refused(tmp_path):
    import json
    import shutil

    from rl_kernel.models.tiny import make_tiny_qwen3
    from vime.config import preflight
    from vime.errors import DataError

    ckpt = make_tiny_qwen3(tmp_path / "ckpt", num_layers=1)
    shutil.move(ckpt / "model.safetensors", ckpt / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(DataError, match=r"names 1 file\(s\) not in .*model-00002-of-00002.safetensors"):
        preflight.check_checkpoint(ckpt)
    weight_map["b"] = weight_map["a"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    preflight.check_checkpoint(ckpt)
