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
