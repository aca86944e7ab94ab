"""The vLLM-on-H200 preset (`+experiment=h200_vllm`) checked on CPU: it composes and validates with vLLM rollout
on CUDA, sleep mode and the IPC transport; the GPU memory check admits what fits beside vLLM's share and refuses
what does not with the number of layers that would fit; sleep mode is refused where vLLM has none."""

from __future__ import annotations

import pytest

from tests.vime.test_gpu_preset import _hf_config
from vime.config import preflight
from vime.config.layout import check_layout
from vime.config.schema import Mode, RolloutBackend, TrainerBackend, to_object, validate
from vime.errors import ConfigError

PRESET = "+experiment=h200_vllm"
H200_BYTES = 143771 * 2**20
QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_vllm_preset_composes_with_vllm_rollout_sleep_and_ipc(compose_cfg):
    cfg = validate(to_object(compose_cfg(PRESET, "output_dir=/tmp/x")))
    assert cfg.device == "cuda" and cfg.steps >= 5 and cfg.fail_on_mismatch
    assert cfg.rollout.engine == RolloutBackend.vllm and cfg.trainer.engine == TrainerBackend.megatron
    assert cfg.rollout.mode == cfg.trainer.mode == Mode.strict
    assert cfg.rollout.sleep_level == 1 and not cfg.rollout.enforce_eager
    assert str(cfg.weights.transport) == "ipc" and cfg.weights.colocate
    assert check_layout(cfg, [1], _hf_config(cfg)).gpus_used == 1
    preflight.check_local_resources(cfg)


def test_qwen3_parameter_count_matches_qwen3_8b():
    assert preflight.qwen3_parameters(QWEN3_8B) == 8_190_735_360


def test_gpu_memory_check_names_the_layers_that_fit(compose_cfg):
    cfg = validate(to_object(compose_cfg(PRESET, "output_dir=/tmp/x")))
    preflight.check_gpu_memory(cfg, QWEN3_8B | {"num_hidden_layers": 16}, H200_BYTES)
    with pytest.raises(ConfigError, match=r"36 layers .* use at most 2[0-9] layers \(model.tiny.num_layers=2[0-9]\)"):
        preflight.check_gpu_memory(cfg, QWEN3_8B, H200_BYTES)
    tp8 = validate(to_object(compose_cfg(PRESET, "output_dir=/tmp/x", "trainer.tp=8", "ray.num_gpus=8")))
    preflight.check_gpu_memory(tp8, QWEN3_8B, H200_BYTES)  # an eighth of the state per rank


def test_gpu_memory_check_counts_the_kept_weight_versions_on_the_device(compose_cfg):
    """Asynchronous runs keep max_staleness + 1 full bf16 copies of the weights on each trainer rank (4 B more per
    parameter at lag 1): fewer layers fit, and the error names `trainer.kept_on=host`, which costs no GPU memory."""
    async_ = (PRESET, "output_dir=/tmp/x", "rollout.sleep_level=0", "algo.max_staleness=1", "algo.correction=tis")
    on_device = validate(to_object(compose_cfg(*async_)))
    on_host = validate(to_object(compose_cfg(*async_, "trainer.kept_on=host")))
    assert preflight.kept_bytes_per_parameter(on_device) == 4 and preflight.kept_bytes_per_parameter(on_host) == 0

    def fit(cfg) -> int:
        with pytest.raises(ConfigError) as info:
            preflight.check_gpu_memory(cfg, QWEN3_8B, H200_BYTES)
        assert "\n" not in str(info.value)
        return int(str(info.value).split("model.tiny.num_layers=")[1].split(")")[0])

    sync = validate(to_object(compose_cfg(PRESET, "output_dir=/tmp/x", "rollout.sleep_level=0")))
    assert fit(on_device) < fit(on_host) == fit(sync)
    with pytest.raises(ConfigError, match="4 B for 2 kept weight versions.*trainer.kept_on=host"):
        preflight.check_gpu_memory(on_device, QWEN3_8B, H200_BYTES)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("rollout.sleep_level=3",), "use 0 \\(never sleep\\), 1"),
        (("device=cpu", "rollout.sleep_level=1"), "sleep mode is vLLM's, on CUDA"),
        (("rollout.engine=reference", "rollout.sleep_level=1"), "sleep mode is vLLM's, on CUDA"),
    ],
)
def test_sleep_level_is_refused_where_it_cannot_run(compose_cfg, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(to_object(compose_cfg(PRESET, "output_dir=/tmp/x", *overrides)))
