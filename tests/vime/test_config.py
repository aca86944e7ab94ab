"""Config composition and validation: Hydra structured configs reject malformed input with clear errors."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from vime.config.schema import Mode, RolloutBackend, TrainerBackend, side_modes, to_object, validate
from vime.errors import ConfigError


def test_default_config_is_the_cpu_tiny_run(compose_cfg):
    cfg = validate(to_object(compose_cfg()))
    assert cfg.device == "cpu" and cfg.model.path is None
    assert cfg.rollout.engine == RolloutBackend.vllm and cfg.trainer.engine == TrainerBackend.megatron
    assert cfg.rollout.mode == Mode.strict and cfg.trainer.mode == Mode.strict
    assert cfg.wandb.mode == "offline"
    assert cfg.algo.group_size >= 2


def test_overrides_and_boundary_modes(compose_cfg):
    cfg = validate(
        to_object(
            compose_cfg(
                "rollout.mode=native", "trainer.mode=native", "steps=2", "+rollout.boundary_modes.attention=strict"
            )
        )
    )
    assert cfg.steps == 2
    modes = side_modes(cfg.rollout.mode, cfg.rollout.boundary_modes)
    assert modes["attention"] == "strict" and modes["gemm"] == "native"


def test_experiment_overlay_needs_a_model_path(compose_cfg, monkeypatch):
    monkeypatch.delenv("QWEN3_8B_PATH", raising=False)
    dcfg = compose_cfg("+experiment=qwen3_8b_grpo")
    with pytest.raises(ConfigError, match="cannot resolve model.path.*QWEN3_8B_PATH"):
        to_object(dcfg)
    cfg = validate(to_object(compose_cfg("+experiment=qwen3_8b_grpo", "model.path=/ckpt/Qwen3-8B")))
    assert (cfg.device, cfg.trainer.tp, cfg.trainer.cp, cfg.rollout.num_engines, cfg.rollout.tp) == ("cuda", 4, 2, 2, 4)
    assert (cfg.weights.transport, cfg.weights.colocate) == ("ipc", True)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.mode=bogus", "expected one of"),
        ("steps=many", "steps"),
        ("no_such_key=1", "no_such_key"),
        ("trainer.engine=deepspeed", "expected one of"),
    ],
)
def test_malformed_overrides_are_rejected(compose_cfg, override, message):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(override)
    assert message in str(info.value) + str(info.value.__cause__)


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.group_size=1", "group_size"),
        ("algo.temperature=0", "temperature"),
        ("trainer.tp=3", "TP must divide 8"),
        ("steps=0", "steps"),
        ("+trainer.boundary_modes.softmax=native", "unknown boundaries"),
        ("algo.prompts_per_step=64", "max_num_seqs"),
        ("trainer.lr=-1", "lr"),
        (
            "rollout.compile=true",
            "rollout.compile=true with rollout.enforce_eager=true; set rollout.enforce_eager=false",
        ),
    ],
)
def test_values_that_cannot_run_are_rejected(compose_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        validate(to_object(compose_cfg(override)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.top_p=0"], "algo.top_p=0.0; use 0 < top_p <= 1"),
        (["algo.top_p=1.5"], "algo.top_p=1.5"),
        (["algo.top_k=-2"], "algo.top_k=-2"),
        (["algo.min_p=1.0"], "algo.min_p=1.0"),
        (["algo.min_p=-0.1"], "algo.min_p=-0.1"),
        (["algo.entropy_coef=-1"], "algo.entropy_coef=-1"),
        (["algo.top_p=0.9", "rollout.engine=reference"], "rollout.engine=reference"),
        (["algo.top_k=20", "algo.max_staleness=1", "algo.correction=tis"], "max_staleness=1"),
    ],
)
def test_bad_truncation_and_entropy_values_are_one_line_at_start_up(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", "\\.").replace("+", "\\+")) as info:
        validate(to_object(compose_cfg(*overrides)))
    assert "\n" not in str(info.value)


def test_truncation_keys_reach_the_config(compose_cfg):
    from vime.loop.truncation import truncation

    cfg = validate(to_object(compose_cfg("algo.top_p=0.9", "algo.top_k=20", "algo.entropy_coef=0.01")))
    assert truncation(cfg).active and (truncation(cfg).top_k, truncation(cfg).top_p) == (20, 0.9)
    assert not truncation(validate(to_object(compose_cfg()))).active


def test_rollout_compile_is_refused_where_it_cannot_run(compose_cfg):
    compiled = ("rollout.compile=true", "rollout.enforce_eager=false")
    assert validate(to_object(compose_cfg(*compiled))).rollout.compile
    with pytest.raises(ConfigError, match=r"rollout.engine=reference; compile is vLLM's"):
        validate(to_object(compose_cfg(*compiled, "rollout.engine=reference")))
